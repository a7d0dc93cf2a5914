"""Run one anchor pattern's fused kernel a few times, for Nsight Compute to profile. (GPU)

    ncu -k regex:persistent -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy \\
        python benchmarks/ncu_pattern.py rmsnorm_dynamic_fp8 16384 4096

The device image has ncu (/usr/local/cuda/bin) and no nsys (BENCHMARKS.md, session 16). ncu
locks the SM clock at its base (1.47 GHz on the H200): read its ratios, not its durations.
``-k`` picks the kernel by name: ``persistent`` / ``looped`` (row kernels), ``pointwise``.
"""
import argparse

import torch

from fusion_compiler import patterns as P


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pattern", choices=sorted(set(P.PATTERNS) - {"rope"}))  # make_args: no rope
    ap.add_argument("rows", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    args = P.make_args(a.pattern, a.rows, a.n, torch.bfloat16, "cuda")
    f = torch.compile(P.PATTERNS[a.pattern], backend="fusion")
    for _ in range(a.calls):
        f(*args)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
