"""Does Triton compile on parallel threads? 16 distinct kernels, a fresh Triton cache (GPU).

    python benchmarks/thread_compile.py

The numbers behind codegen/precompile.py's thread pool: the same 16 compiles one after
another, then on 4, 8 and 16 threads, and through Triton's AsyncCompileMode on 8.
"""
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime._async_compile import AsyncCompileMode  # noqa: E402


@triton.jit
def _rmsnorm(x, w, y, N, C: tl.constexpr, RBLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, RBLOCK)
    m = cols < N
    v = tl.load(x + row * N + cols, mask=m, other=0.).to(tl.float32)
    s = tl.sum(v * v, 0) / N
    r = v * tl.math.rsqrt(s + C * 1e-6) * tl.load(w + cols, mask=m).to(tl.float32)
    tl.store(y + row * N + cols, r.to(y.dtype.element_ty), mask=m)


def warm(c):
    """One compile: each constant C is a new specialization."""
    _rmsnorm.warmup(torch.bfloat16, torch.bfloat16, torch.bfloat16, 4096, C=c, RBLOCK=4096,
                    grid=(1,), num_warps=8)


def main():
    torch.cuda.init()
    warm(0)             # the first compile pays for imports and the driver
    n = 16
    t = time.perf_counter()
    for c in range(1, n + 1):
        warm(c)
    res = {"serial_s": time.perf_counter() - t}
    for threads in (4, 8, 16):
        base = 1000 * threads
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(warm, range(base, base + n)))
        res[f"threads{threads}_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as ex, AsyncCompileMode(ex):
        for c in range(50000, 50000 + n):
            warm(c)
    res["async8_s"] = time.perf_counter() - t
    print(n, "kernels", {a: round(b, 3) for a, b in res.items()})


if __name__ == "__main__":
    main()
