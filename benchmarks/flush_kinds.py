"""What do_bench's L2 flush costs the call it times, by kind of flush (GPU).

    python benchmarks/flush_kinds.py [--rounds N] [--reps N]

do_bench zeroes a 256 MB buffer before each call: L2 is left full of dirty lines, and their
write-back to HBM lands in the timed call as the call's own reads evict them. This times
calls like do_bench does (an event pair around each, the median) after four flushes: do_bench's
zero_; a read of the same buffer (L2 left holding clean lines); the zero_ followed by the read
(the dirty lines written back before the call starts); none. The calls: the dynamic FP8 pattern
(16384 x 4096, bf16 in, fp8 out) by fusion and by Inductor, eager's plain ``x.to(fp8)`` of the
same bytes, and the 1 GiB copy whose bandwidth sets every pattern's HBM floor. Prints the
median and the 10% quantile, us.

Session 28 (H200): the fusion kernel read 54.2 us after do_bench's flush and 49.6 after a clean
one; the 1 GiB copy 505.6 against 502.4; Inductor's kernel, which leaves bandwidth idle,
116.6 against 115.9.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import FLUSH_BYTES, clean_flush, flushed_times  # noqa: E402

from fusion_compiler import patterns as P  # noqa: E402


def timed(fn, flush, reps):
    """(median, 10% quantile) in us of ``fn()`` between two events, each call after ``flush()``."""
    times = sorted(t * 1e3 for t in flushed_times(fn, flush, reps))
    return statistics.median(times), times[len(times) // 10]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    cache = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    clean = clean_flush(cache)
    flushes = {"dirty (do_bench's zero_)": cache.zero_, "clean (a read of 256 MB)": clean,
               "dirty, then clean": lambda: (cache.zero_(), clean()), "none": lambda: None}
    x = torch.randn(16384, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    fused = torch.compile(P.rmsnorm_dynamic_fp8, backend="fusion")
    fused(x, w)
    inductor = torch.compile(P.rmsnorm_dynamic_fp8)
    inductor(x, w)
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    q = torch.empty(16384, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    calls = {"fusion dynamic FP8": lambda: fused(x, w),
             "inductor dynamic FP8": lambda: inductor(x, w),
             "eager x.to(fp8), same bytes": lambda: q.copy_(x),
             "copy 1 GiB": lambda: dst.copy_(src)}
    for r in range(a.rounds):
        for name, fn in calls.items():
            for flush_name, flush in flushes.items():
                median, q10 = timed(fn, flush, a.reps)
                print(f"{r} {name:28s} {flush_name:26s} median {median:8.2f} us  q10 {q10:8.2f} us",
                      flush=True)


if __name__ == "__main__":
    main()
