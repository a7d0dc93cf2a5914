"""Backends on one model, round by round, with where each one's GPU time goes (GPU).

    python benchmarks/backend_rounds.py TARGET ROUNDS [BACKEND ...]
    python benchmarks/backend_rounds.py examples/llama.py:bench_4x1024 12 \
        inductor fusion fusion-nogqa

BACKEND: eager, inductor, fusion, or fusion-nogqa (fusion with ``grouped_attention`` off), by
default inductor and fusion. Interleaved do_bench rounds as ``bench`` times them (three input
sets in turn, L2 flushed), each also back to back (20 calls between two events), each pair of
backends paired round by round; then one profiled call per backend, in order and in reverse
order (a drift of the GPU's clock shows as an order effect): GPU time in GEMMs, attention and
the rest, with the rest's six largest kernels. Session 40: Llama 4 x 1024's GEMMs read 4.80 ms
in one profile and 4.60 in the next for the same Inductor code, and its do_bench rounds spread
6.0-7.4 ms, while eager's stayed within 9.6-9.8.
"""
import collections
import statistics
import sys
import time

import torch
from triton.testing import do_bench

from fusion_compiler.bench import in_turn
from fusion_compiler.targets import load_factory

target, rounds = sys.argv[1], int(sys.argv[2])
fac = load_factory(target)[0]
torch.manual_seed(0)
model, _ = fac(device="cuda", dtype=torch.bfloat16)
fresh = [fac(device="cuda", dtype=torch.bfloat16)[1] for _ in range(3)]
backends = sys.argv[3:] or ["inductor", "fusion"]
fns = {}
with torch.no_grad():
    for b in backends:
        if b == "eager":
            f = model
        elif b == "fusion-nogqa":
            f = torch.compile(model, backend="fusion", options={"grouped_attention": False})
        else:
            f = torch.compile(model, backend=b)
        t0 = time.perf_counter()
        f(*fresh[0])
        torch.cuda.synchronize()
        print(f"{b}: first call {time.perf_counter() - t0:.1f} s", flush=True)
        fns[b] = f
    for b in backends:
        fns[b](*fresh[1])           # every backend's guards hit before timing


def call_of(f):
    it = iter(range(1 << 30))
    def call():
        with torch.no_grad():
            return f(*fresh[next(it) % 3])
    return call


calls = {b: call_of(f) for b, f in fns.items()}


def b2b(call, n=20):
    call()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        call()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def cat(name):
    n = name.lower()
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "sm90_xmma" in n:
        return "gemm"
    if "sdpa" in n or "fmha" in n or "flash" in n or ("attention" in n and "triton" not in n):
        return "attention"
    return "other"


def profile(call):
    from torch.profiler import ProfilerActivity, profile as prof_
    call()
    torch.cuda.synchronize()
    with prof_(activities=[ProfilerActivity.CUDA]) as p:
        call()
        torch.cuda.synchronize()
    sums, names = collections.Counter(), collections.Counter()
    for ev in p.events():
        if ev.device_type.name == "CUDA":
            sums[cat(ev.name)] += ev.device_time_total
            if cat(ev.name) == "other":
                names[ev.name[:60]] += ev.device_time_total
    print("    " + "; ".join(f"{n} {t:.1f}" for n, t in names.most_common(6)))
    return sums


db, bb = collections.defaultdict(list), collections.defaultdict(list)
for r in range(rounds):
    for b, c in in_turn(calls.items(), r):
        db[b].append(do_bench(c, warmup=5, rep=40, return_mode="median") * 1e3)
        bb[b].append(b2b(c) * 1e3)
for b in backends:
    print(f"{b:9s} do_bench median of {rounds} rounds {statistics.median(db[b]):8.1f} us "
          f"(rounds {' '.join(f'{x:.0f}' for x in db[b])}); back to back "
          f"{statistics.median(bb[b]):8.1f} us", flush=True)
for i, a in enumerate(backends):
    for b in backends[i + 1:]:
        d = [x - y for x, y in zip(db[b], db[a])]
        print(f"paired {b} - {a}: median {statistics.median(d):.1f} us, {b} faster in "
              f"{sum(x < 0 for x in d)} of {len(d)}")
order = list(calls.items())
for label, seq in (("forward", order), ("reverse", order[::-1])):
    for b, c in seq:
        s = profile(c)
        cats = "  ".join(f"{k} {v:8.1f}" for k, v in sorted(s.items()))
        print(f"profile ({label}) {b:9s} {cats}  total {sum(s.values()):8.1f} us", flush=True)
