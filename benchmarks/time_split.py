"""Where a pattern's time goes, per backend: do_bench's median taken apart. (GPU)

    python benchmarks/time_split.py --cases rmsnorm_fp8:16384:4096 add_rmsnorm:64:4096 ...
        [--rounds 5] [--backends eager inductor fusion] [--out split.json]

For each case (PATTERN:ROWS:N, inputs as fusion_compiler.patterns.make_args makes them) and
backend, besides the do_bench median (the measure of record):
  call      wall time per call, many calls back to back (benchmarks/timing.call_us): the host's
            launch path and the kernels together, what a launch-bound model sees
  kernel    the kernels' own device time per call after do_bench's L2 flush (profiler)
  lead      from the flush's end to the call's first kernel start, on the GPU (profiler)
  span      from the flush's end to the call's last kernel end: what do_bench's events can
            see at best
  graph     do_bench of the call captured in a CUDA graph: do_bench's method with the host's
            launch path taken out (one graph launch instead)
  gcall     the GPU's own time per call, many captured calls back to back (no flush)
Reference rows per case size: a copy moving the case's bytes (half read, half written) and a
one-element add, which shows the fixed cost of do_bench's method on this machine. (The copy's
graph columns do not compare: a captured ``copy_`` is a memcpy node, which took 1.45-1.51x the
time of the same copy launched as a kernel on the H200, session 17.)
do_bench and call times are taken in ``--rounds`` turns over the backends, every other turn in
reverse order (the least counts, all are printed); the profiler runs after all of them, since a
profiler session slows the host path of the calls after it (BENCHMARKS.md, session 8).
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")     # before torch is imported

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patterns import copy_bandwidth  # noqa: E402
from timing import call_us, graph_times, kernel_times  # noqa: E402

from fusion_compiler import patterns as P  # noqa: E402
from fusion_compiler.bench import in_turn  # noqa: E402

bf = torch.bfloat16


def parse_case(text):
    name, rows, n = text.split(":")
    return name, int(rows), int(n)


def make(name, rows, n):
    if name == "softmax_scale":
        return (torch.randn(rows, n, device="cuda", dtype=bf),)
    return P.make_args(name, rows, n, bf, "cuda")


def references(nbytes):
    """(label, fn, args) of the reference rows for a case moving ``nbytes``."""
    half = max(nbytes // 4, 1)                      # bf16 elements per side
    a = torch.randn(half, device="cuda", dtype=bf)
    b = torch.empty_like(a)
    one = torch.zeros(1, device="cuda")
    return [("copy", lambda: b.copy_(a), ()), ("1-element add", lambda: one.add_(1), ())]


def summary(rows_out) -> None:
    """One line per case: Inductor / fusion by each measure (do_bench and call: least of the
    rounds), and which of them fusion trails by more than 0.05 us."""
    names = ("do_bench", "kernel", "call", "graph", "gcall")
    print(f"\n{'case':32s} " + " ".join(f"{n + ' I / F':>16s}" for n in names))
    for row in rows_out:
        i, f = row["results"]["inductor"], row["results"]["fusion"]
        pairs = [(min(i["do_bench_us"]), min(f["do_bench_us"])), (i["kernel_us"], f["kernel_us"]),
                 (min(i["call_us"]), min(f["call_us"])), (i["graph_us"], f["graph_us"]),
                 (i["graph_call_us"], f["graph_call_us"])]
        behind = [name for name, (x, y) in zip(names, pairs) if y > x + 0.05]
        print(f"{row['case']:32s} " + " ".join(f"{x:8.2f} / {y:6.2f}" for x, y in pairs)
              + (f"   fusion behind: {', '.join(behind)}" if behind else ""), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", type=parse_case, required=True)
    ap.add_argument("--backends", nargs="+", default=["eager", "inductor", "fusion"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth (1 GiB copy, do_bench) {bw / 1e12:.2f} TB/s", flush=True)
    rows_out, timed = [], []
    for name, rows, n in a.cases:
        args = make(name, rows, n)
        fn = P.PATTERNS[name]
        nbytes = P.floor_bytes(name, args, fn(*args))
        floor_us = nbytes / bw * 1e6
        torch._dynamo.reset()
        entries = []
        for backend in a.backends:
            f = fn if backend == "eager" else torch.compile(fn, backend=backend)
            f(*args)
            entries.append((backend, f, args))
        entries += references(nbytes)
        results = {label: {"do_bench_us": [], "call_us": []} for label, _, _ in entries}
        for r in range(a.rounds):
            for label, f, fargs in in_turn(entries, r):
                results[label]["do_bench_us"].append(
                    1e3 * do_bench(lambda: f(*fargs), warmup=25, rep=100, return_mode="median"))
                results[label]["call_us"].append(call_us(f, fargs))
        case = f"{name}:{rows}:{n}"
        rows_out.append({"case": case, "bytes": nbytes, "floor_us": floor_us, "results": results})
        timed.append((case, entries, results))
    for case, entries, results in timed:
        for label, f, fargs in entries:
            results[label].update(graph_times(f, fargs))
    for case, entries, results in timed:             # the profiler last (see the docstring)
        for label, f, fargs in entries:
            results[label].update(kernel_times(f, fargs))
    for row in rows_out:
        print(f"\n{row['case']}: {row['bytes'] / 1e6:.1f} MB, floor {row['floor_us']:.1f} us "
              f"(least of {a.rounds} rounds; all rounds after '|')", flush=True)
        print(f"  {'':14s} {'do_bench':>9s} {'%floor':>6s} {'call':>8s} {'kernel':>8s} "
              f"{'lead':>6s} {'span':>8s} {'graph':>8s} {'gcall':>8s} {'kernels':>7s}")
        for label, r in row["results"].items():
            db, cl = min(r["do_bench_us"]), min(r["call_us"])
            print(f"  {label:14s} {db:9.1f} {100 * row['floor_us'] / db:5.0f}% {cl:8.1f} "
                  f"{r['kernel_us']:8.1f} {r['lead_us']:6.1f} {r['span_us']:8.1f} "
                  f"{r['graph_us']:8.2f} {r['graph_call_us']:8.2f} "
                  f"{r['kernels']:7d}  | do_bench "
                  + "/".join(f"{t:.1f}" for t in r["do_bench_us"]) + "  call "
                  + "/".join(f"{t:.1f}" for t in r["call_us"]), flush=True)
    if {"inductor", "fusion"} <= set(a.backends):
        summary(rows_out)
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_TBps": bw / 1e12, "cases": rows_out}, indent=1))


if __name__ == "__main__":
    main()
