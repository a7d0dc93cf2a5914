"""Does a torch.profiler session slow the calls after it? (GPU; BENCHMARKS.md, session 8.)

    python benchmarks/profiler_effect.py examples/gpt2.py:bench_8x512 fusion|inductor|none

Times one compiled model (``none``: eager) three ways: the do_bench median, 50 calls back to
back, and the host time of one call after a sync; then runs one profiled call (bench's kernel
count) and times it the same three ways again. Run each backend in a process of its own.
"""
import sys
import time

import torch
from triton.testing import do_bench

from fusion_compiler.bench import kernels_per_call
from fusion_compiler.targets import load_factory


def main() -> int:
    target, backend = sys.argv[1], sys.argv[2]
    model, inputs = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
    f = model if backend == "none" else torch.compile(model, backend=backend)

    def call():
        with torch.no_grad():
            return f(*inputs)

    def back_to_back(n=50):
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            call()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    def host_of_one(n=20):
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        return sorted(times)[n // 2] * 1e3

    call()
    torch.cuda.synchronize()
    for label in ("before", "after a profiler session"):
        if label != "before":
            with torch.no_grad():
                print("kernels per call", kernels_per_call(lambda *a: f(*a), inputs))
        print(f"{backend} {label}: do_bench "
              f"{do_bench(call, warmup=25, rep=100, return_mode='median'):.3f} ms, back to back "
              f"{back_to_back():.3f} ms, host of one call {host_of_one():.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
