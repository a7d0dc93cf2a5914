"""Launch settings shared by every generated launcher: block sizes, warps, looped or not.

One place decides them (Liger-Kernel's ``calculate_settings`` idea), so tuning them tunes every
kernel. They depend on sizes known only at run time, and are cheap: a few integer operations.
"""
from __future__ import annotations

import functools
import types

import torch
from triton import knobs

from .triton_lib import INTERPRET

LOOPED_RBLOCK = 2048        # columns per loop step of a looped row kernel
ROW_ELEMS = 2048            # elements a persistent row program aims to hold (rows x RBLOCK);
                            # softmax rows of 1024 on the H200: 2 rows, 4 warps 101% of the
                            # floor, 4 rows, 8 warps 98%
POINTWISE_BLOCK = 2048      # bias+GELU 16384 x 11008 on the H200: 91% of the floor at 1024, 97%


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _warps(elems: int) -> int:
    """Warps of a row program holding ``elems`` (a power of two) elements. 4096 on 4 warps, not
    8: rows of 4096 on the H200 (16384 rows, do_bench, same run) ran add+RMSNorm at 96.0% of
    the floor against 94.2%, RMSNorm+FP8 89.4 / 88.1, dynamic FP8 84.2 / 81.5
    (benchmarks/variants.py)."""
    if elems >= 32768:
        return 32
    if elems >= 8192:
        return 16
    if elems >= 512:
        return 4
    return 2


@functools.lru_cache(maxsize=1024)
def row_settings(rows: int, n: int, max_persistent_block: int):
    """(XBLOCK, RBLOCK, looped, num_warps) for a row kernel over ``rows`` rows of ``n``."""
    rblock = _next_pow2(max(n, 1))
    if rblock > max_persistent_block:
        return 1, LOOPED_RBLOCK, True, 8
    xblock = min(_next_pow2(rows), max(1, ROW_ELEMS // rblock))
    return xblock, rblock, False, _warps(xblock * rblock)


@functools.lru_cache(maxsize=1024)
def pointwise_settings(numel: int):
    """(BLOCK, num_warps) for a pointwise kernel over ``numel`` elements."""
    block = min(POINTWISE_BLOCK, _next_pow2(numel))
    return block, max(1, min(4, block // 128))


# ---------------------------------------------------------------------------------- lean launches
# Triton's `kernel[grid](...)` binds and specializes every argument on each call (microseconds
# each, the whole cost of a small kernel). A generated launcher goes through it once per
# specialization and then calls the compiled kernel directly; its key refines Triton's own:
# 16-byte alignment of each input pointer, % 16 and == 1 of each specialized integer, the
# constexprs, the warps, 64-bit indexing, the device. Not in the interpreter, and not while
# Triton launch hooks are set (a profiler such as proton must see every launch).
LEAN = not INTERPRET and torch.cuda.is_available()
current_device = torch._C._cuda_getDevice if LEAN else (lambda: 0)
raw_stream = torch._C._cuda_getCurrentRawStream if LEAN else None
# Outputs on the current GPU are allocated by the C++ fast path Inductor's wrappers use too
# (torch.empty_strided parses its arguments and the device on every call: microseconds a launch)
empty_cuda = getattr(torch._C._dynamo.guards, "_empty_strided_cuda", None) if LEAN else None
FAST_ALLOC = empty_cuda is not None


def remember(table: dict, key: tuple, kernel) -> None:
    """Keep ``kernel`` (what ``kernel[grid](...)`` returned) for direct relaunches under ``key``,
    as ``direct_entry`` makes it."""
    rt = knobs.runtime
    if (LEAN and kernel is not None and getattr(kernel, "function", None) is not None
            and not _hooked(rt.launch_enter_hook) and not _hooked(rt.launch_exit_hook)):
        table[key] = direct_entry(kernel)


def direct_entry(kernel) -> tuple:
    """``(launch, function, cooperative, pdl, metadata, kernel)``; a launcher relaunches with
    ``e[0](grid, 1, 1, stream, e[1], e[2], e[3], None, None, e[4], None, None, None, *args)``,
    Triton's C launch function's own arguments. Where the kernel needs no scratch memory and
    its launcher is that C function, ``e[0]`` is it: the Python of ``CompiledKernel.run`` and
    ``CudaLauncher.__call__`` (two frames and two scratch checks on every launch) is skipped.
    Otherwise ``e[0]`` goes through them, as Triton's own launches do."""
    launcher = kernel.run                       # a property: loads the kernel if need be
    c_launch = getattr(launcher, "launch", None)
    if (isinstance(c_launch, types.BuiltinFunctionType)
            and getattr(launcher, "global_scratch_size", 1) == 0
            and getattr(launcher, "profile_scratch_size", 1) == 0):
        return (c_launch, kernel.function, bool(launcher.launch_cooperative_grid),
                bool(launcher.launch_pdl), kernel.packed_metadata, kernel)

    def through_triton(gx, gy, gz, stream, function, _cooperative, _pdl, _gscratch, _pscratch,
                       *rest):
        kernel.run(gx, gy, gz, stream, function, *rest)
    return (through_triton, kernel.function, False, False, kernel.packed_metadata, kernel)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None, or (Triton 3.5+) an empty HookChain, is not."""
    return hook is not None and bool(getattr(hook, "calls", True))
