"""Time the anchor patterns on the GPU: eager vs Inductor vs fusion, against the HBM floor.

    python benchmarks/patterns.py [--rows 16384 512 64 1] [--rounds N] [--out results.json]

Same definitions and sizes as shared/anchors.py (bf16, 16384 x 4096; SwiGLU and bias+GELU at
16384 x 11008; softmax at 256 x 4096 x 1024). Medians of triton.testing.do_bench. Below 4096
rows a call takes microseconds and the host's state moves a median by 2-5x (session 7, timed
one backend after another: Inductor's add+RMSNorm at 1 row 78.6 us, at 64 rows 11.0 us), so
there the three backends are timed in turns, ``--rounds`` times (default 3), and the least
median counts. That did not cure everything: in turns too, the first cases of a run read
20-115 us for every backend, eager included, for about a minute (sessions 7 and 8). That is
Inductor's pool of compile worker processes starting (one per CPU core, each importing torch)
beside the timing; Inductor compiles in this process instead here
(TORCHINDUCTOR_COMPILE_THREADS=1): the kernels it makes are the same. From 4096 rows the
backends are timed in two turns, the second in reverse order, and the least median counts: a
backend timed right after eager's long run read up to 2 points of the floor low (session 17).
``--clean-flush`` adds each backend's median with a flush that leaves L2 clean (and the copy
bandwidth so measured): do_bench's zero_ leaves it full of dirty lines, whose write-back lands
in the timed call and costs a kernel at the bandwidth limit most (timing.clean_flush_ms).
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")     # before torch is imported

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fusion_compiler import patterns as P  # noqa: E402  (the backend: by its entry point)
from fusion_compiler.bench import in_turn  # noqa: E402
from timing import clean_flush_ms  # noqa: E402

bf = torch.bfloat16
M, H, I = 16384, 4096, 11008


def cases(m):
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, dtype=bf)  # noqa: E731
    return {
        "add_rmsnorm": (P.add_rmsnorm, lambda: (r(m, H), r(m, H), r(H)), 4 * m * H * 2 + H * 2),
        "add_layernorm": (P.add_layernorm, lambda: (r(m, H), r(m, H), r(H), r(H)), 4 * m * H * 2),
        "swiglu": (P.swiglu, lambda: (r(m, I), r(m, I)), 3 * m * I * 2),
        "bias_gelu": (P.bias_gelu, lambda: (r(m, I), r(I)), 2 * m * I * 2),
        "rmsnorm_fp8": (P.rmsnorm_fp8, lambda: (r(m, H), r(H), torch.tensor(0.05, device=dev)), m * H * 3),
        "rmsnorm_dynamic_fp8": (P.rmsnorm_dynamic_fp8, lambda: (r(m, H), r(H)), m * H * 3 + m * 4),
        "dequant_add": (P.dequant_add, lambda: (torch.randint(-127, 127, (m, H), dtype=torch.int8, device=dev), r(H), r(m, H)), m * H * 5),
        "softmax_scale": (P.softmax_scale, lambda: (r(m // 64, 4096, 1024),), 2 * (m // 64) * 4096 * 1024 * 2),
    }


def copy_bandwidth():
    a = torch.empty(1 << 29, dtype=bf, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 2 / (ms * 1e-3)


def busy(seconds):
    """Keep the GPU busy for ``seconds`` (bf16 matmuls) before timing: small cases timed right
    after the start read 2-5x slow (sessions 7-9), for every backend alike."""
    a = torch.randn(8192, 8192, device="cuda", dtype=bf)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def bench(fn, args, rep=200):
    """do_bench's median and mean. The median is the measure; the mean is beside it because at
    about 50 us the readings of one kernel form two clusters about 1.5 us apart (the FP8
    kernels, session 18), so a median jumps by up to 3 points of the floor as the clusters'
    shares shift, while the mean moves smoothly."""
    times = do_bench(lambda: fn(*args), warmup=25, rep=rep, return_mode="all")
    return statistics.median(times), statistics.fmean(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[M])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="timing turns below 4096 rows (from 4096: two)")
    ap.add_argument("--clean-flush", action="store_true",
                    help="also time each backend after a flush that leaves L2 clean")
    ap.add_argument("--busy", type=float, default=0.0,
                    help="seconds of GPU work before each case's timing (default 0)")
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_TBps": bw / 1e12, "patterns": {}}
    if a.clean_flush:
        src = torch.empty(1 << 29, dtype=bf, device="cuda").normal_()
        dst = torch.empty_like(src)
        clean_bw = 2 * src.numel() * 2 / (clean_flush_ms(lambda: dst.copy_(src), reps=100) * 1e-3)
        results["copy_clean_flush_TBps"] = clean_bw / 1e12
        print(f"copy bandwidth, clean flush {clean_bw / 1e12:.2f} TB/s", flush=True)
        del src, dst
    for m in a.rows:
        for name, (fn, mk, nbytes) in cases(m).items():
            if a.only and name not in a.only:
                continue
            args = mk()
            floor = nbytes / bw * 1e3
            row = {"rows": m, "floor_ms": floor}
            compiled = {}
            torch._dynamo.reset()     # then one cache entry per backend, told apart by guards
            for backend in ("eager", "inductor", "fusion"):
                f = fn if backend == "eager" else torch.compile(fn, backend=backend)
                t0 = time.time()
                f(*args)
                torch.cuda.synchronize()
                row[f"{backend}_first_call_s"] = time.time() - t0
                compiled[backend] = f
            rounds = 2 if m >= 4096 else a.rounds
            busy(a.busy)
            for r in range(rounds):            # in turns: host noise spread over all three
                for backend, f in in_turn(compiled.items(), r):
                    ms, mean = bench(f, args, rep=200 if m >= 4096 else 100)
                    row.setdefault(f"{backend}_rounds_ms", []).append(ms)
                    row.setdefault(f"{backend}_rounds_mean_ms", []).append(mean)
            for backend in compiled:
                row[f"{backend}_ms"] = min(row[f"{backend}_rounds_ms"])
                row[f"{backend}_frac_floor"] = floor / row[f"{backend}_ms"]
                row[f"{backend}_mean_ms"] = min(row[f"{backend}_rounds_mean_ms"])
            if a.clean_flush:
                for r in range(2):
                    for backend, f in in_turn(compiled.items(), r):
                        row.setdefault(f"{backend}_clean_rounds_ms", []).append(
                            clean_flush_ms(lambda f=f: f(*args)))
                print("    clean flush (us, % of the floor): " + "  ".join(
                    f"{b} {min(row[f'{b}_clean_rounds_ms']) * 1e3:.1f} "
                    f"({floor / min(row[f'{b}_clean_rounds_ms']):.1%})" for b in compiled),
                      flush=True)
            results["patterns"][f"{name}@{m}"] = row
            if rounds > 1:
                print("    rounds (us): " + "  ".join(
                    f"{b} " + "/".join(f"{t * 1e3:.1f}" for t in row[f"{b}_rounds_ms"])
                    for b in compiled), flush=True)
                print("    least mean (us): " + "  ".join(
                    f"{b} {row[f'{b}_mean_ms'] * 1e3:.2f} ({floor / row[f'{b}_mean_ms']:.1%})"
                    for b in compiled), flush=True)
            print(f"{name:22s} rows={m:6d} floor {floor*1e3:8.1f}us  eager {row['eager_ms']*1e3:8.1f}us "
                  f"({row['eager_frac_floor']:.0%})  inductor {row['inductor_ms']*1e3:8.1f}us "
                  f"({row['inductor_frac_floor']:.1%})  fusion {row['fusion_ms']*1e3:8.1f}us "
                  f"({row['fusion_frac_floor']:.1%})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
