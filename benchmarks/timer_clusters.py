"""Why one kernel's do_bench readings fall into two clusters (GPU)

    python benchmarks/timer_clusters.py [--out clusters.json]

The dynamic FP8 kernel at 16384 x 4096 (about 53 us) reads either about 52.7-53.3 us or about
1.5 us more, so do_bench's median moves by up to 3 points of the floor with the clusters'
shares (session 18). This times it, Inductor's kernel and eager's ``x.to(float8)`` (the same
bytes: 128 MiB read, 64 MiB written, nothing computed) in one loop per setting: do_bench
itself, an L2 flush before each call as do_bench does, the flush and then 25 us of GPU sleep,
no flush. For each: median, mean, the 10% quantile, the share of readings more than 0.75 us
above it (``upper``), how often a reading falls on the same side as the one before
(``lag1_same``), the first 100 as a string (u: upper), and the period in time, from each
call's start on the GPU, at which the upper readings recur most regularly (``period_us``,
with its strength from 0 to 1). A pattern that every kernel shows, eager's included, is the
machine's, not a kernel's. Without a flush the host can fall behind a 50 us kernel, and a
reading then holds host time too: fusion's read 50.8 us in one run and 73.4 in another on the
same kernel (session 18).
"""
import argparse
import json
import os
import statistics

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")     # before torch is imported

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fusion_compiler import patterns as P  # noqa: E402

FLUSH = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")   # do_bench's own


def timed_loop(f, n=1500, flush=True, sleep_cycles=0):
    """Per call: (start on the GPU relative to the first call's, duration), both in us."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for _ in range(20):
        f()
    for i in range(n):
        if flush:
            FLUSH.zero_()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        starts[i].record()
        f()
        ends[i].record()
    torch.cuda.synchronize()
    return ([starts[0].elapsed_time(s) * 1e3 for s in starts],
            [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def period(at, upper):
    """The period (us) at which ``upper`` recurs most regularly over the times ``at``, and how
    regularly (1: every upper reading at one phase)."""
    t = torch.tensor(at, dtype=torch.float64)
    u = torch.tensor(upper, dtype=torch.float64)
    u = u - u.mean()
    periods = torch.arange(40, 4000, 2, dtype=torch.float64)
    phase = 2 * torch.pi * t[None, :] / periods[:, None]
    strength = torch.hypot((u * torch.cos(phase)).sum(1), (u * torch.sin(phase)).sum(1))
    strength = strength / u.abs().sum().clamp(min=1e-9)
    i = int(strength.argmax())
    return float(periods[i]), round(float(strength[i]), 3)


def describe(durations, at=None) -> dict:
    q10 = sorted(durations)[len(durations) // 10]
    upper = [1.0 if d > q10 + 0.75 else 0.0 for d in durations]
    out = {"median_us": round(statistics.median(durations), 2),
           "mean_us": round(statistics.fmean(durations), 2), "q10_us": round(q10, 2),
           "upper": round(statistics.fmean(upper), 3),
           "lag1_same": round(statistics.fmean(float(a == b) for a, b in zip(upper, upper[1:])), 3),
           "first": "".join("u" if u else "." for u in upper[:100])}
    if at is not None:
        out["period_us"], out["period_strength"] = period(at, upper)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    fusion = torch.compile(P.rmsnorm_dynamic_fp8, backend="fusion")
    fusion(x, w)
    torch._dynamo.reset()
    inductor = torch.compile(P.rmsnorm_dynamic_fp8)
    inductor(x, w)
    calls = {"fusion": lambda: fusion(x, w), "inductor": lambda: inductor(x, w),
             "eager x.to(fp8)": lambda: x.to(torch.float8_e4m3fn)}
    settings = {"flush": {}, "flush, 25 us sleep": {"sleep_cycles": 50000},
                "no flush": {"flush": False}}
    results = {}
    for name, f in calls.items():
        d = describe([t * 1e3 for t in do_bench(f, warmup=25, rep=200, return_mode="all")])
        results[f"{name} / do_bench"] = d
        for label, kw in settings.items():
            results[f"{name} / {label}"] = describe(*reversed(timed_loop(f, **kw)))
        for label in ("do_bench", *settings):
            d = results[f"{name} / {label}"]
            print(f"{name:16s} {label:20s} " + "  ".join(
                f"{k} {v}" for k, v in d.items() if k != "first"), flush=True)
            print(f"    {d['first']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
