"""A hypothesis, not a code-generator output: RMSNorm + dynamic per-row FP8 quant written by hand
in Gluon (Triton's explicit-layout language) with two block barriers per row instead of the five
that Triton's lowering of the generated kernel's two cross-warp reductions has (sm_90 SASS, CPU).

Each of the row's ``WARPS`` warps reduces its contiguous quarter of the row with shuffles alone,
writes its partial to shared memory, one barrier, and every thread reads all the partials; the
two reductions use separate shared buffers, so the second needs no barrier before its write.
The arithmetic is the generated kernel's (``patterns.rmsnorm_dynamic_fp8``: x * rstd rounded to
bf16, times the weight rounded to bf16, the amax, the scale amax / 448, y / scale as div.full.f32
computes it for a scale in the normal range, a saturating e4m3 conversion), except that the amax
does not propagate NaN. ``benchmarks/variants.py`` times it as a variant of the generated kernel
(``gluon, two barriers``): if it wins, the code generator would need a Gluon path for row kernels.
``launch`` has the generated module's interface.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _rows_kernel(x_ptr, w_ptr, s_ptr, q_ptr, N: gl.constexpr, WARPS: gl.constexpr):
    C: gl.constexpr = N // WARPS
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    ALL: gl.constexpr = gl.BlockedLayout([WARPS], [32], [WARPS], [0])    # every thread: all
    S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    row = gl.program_id(0).to(gl.int64)
    wi = gl.arange(0, WARPS, layout=gl.SliceLayout(1, L))
    ci = gl.arange(0, C, layout=gl.SliceLayout(0, L))
    offs = gl.expand_dims(wi, 1) * C + gl.expand_dims(ci, 0)
    sum_parts = gl.allocate_shared_memory(gl.float32, [WARPS], S)
    max_parts = gl.allocate_shared_memory(gl.float32, [WARPS], S)

    x = gl.load(x_ptr + row * N + offs).to(gl.float32)
    sum_parts.store(gl.sum(x * x, axis=1))
    gl.thread_barrier()
    ss = gl.sum(sum_parts.load(ALL), axis=0)
    rstd = gl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=f,f",
                                     [ss / N + 1e-06], dtype=gl.float32, is_pure=True, pack=1)
    w = gl.load(w_ptr + offs).to(gl.float32)
    y = ((x * rstd).to(gl.bfloat16).to(gl.float32) * w).to(gl.bfloat16).to(gl.float32)

    max_parts.store(gl.max(gl.abs(y), axis=1))
    gl.thread_barrier()
    amax = gl.max(max_parts.load(ALL), axis=0)
    s = gl.maximum(amax, 1e-12) / 448.0
    r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s],
                                  dtype=gl.float32, is_pure=True, pack=1)
    gl.store(q_ptr + row * N + offs, (y * r).to(gl.float8e4nv))
    gl.store(s_ptr + row + wi * 0, gl.full([WARPS], 0.0, gl.float32, gl.SliceLayout(1, L)) + s,
             mask=wi == 0)


def launch(DEVICE, x, w):
    rows, n = x.shape
    s = torch.empty((rows, 1), dtype=torch.float32, device=DEVICE)
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=DEVICE)
    _rows_kernel[(rows,)](x, w, s, q, N=n, WARPS=4, num_warps=4)
    return s, q
