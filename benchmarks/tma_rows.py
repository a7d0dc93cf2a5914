"""A hypothesis, not a code-generator output: row kernels that load their rows through the
Hopper tensor memory accelerator (TMA) instead of per-thread vector loads.

A TMA load is one instruction per box, issued by one thread; the row lands in shared memory
and costs no registers while in flight. With a persistent grid and Triton's software pipeliner
(``tl.range(..., num_stages=STAGES)``) each program has its next rows in flight in shared
memory while it reduces the current one: the overlap that the register-held prefetch variants
(``variants.prefetch``, ``variants.persistent``) tried and lost to register pressure. The
arithmetic is the generated kernels' (``fl`` helpers), so the outputs are bit-equal to them.

``benchmarks/variants.py`` times each as a variant of the generated kernel (``tma ...``); the
constants below are rewritten per variant. ``launch`` has the generated module's interface.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusion_compiler.codegen import triton_lib as fl

STAGES = 2          # rows in flight per program (1: no pipelining)
PER_SM = 0          # programs per SM of a persistent grid; 0: one program per row block
TMA_STORE = False   # the quantized row stored through TMA as well
WARPS = 4
XBLOCK = 1          # rows per program step (softmax)


@triton.jit
def _fp8_kernel(x_desc, w_ptr, s_ptr, q_ptr, q_desc, R, N: tl.constexpr,
                STAGES: tl.constexpr, TMA_STORE: tl.constexpr):
    cols = tl.arange(0, N)[None, :]
    for row in tl.range(tl.program_id(0), R, tl.num_programs(0), num_stages=STAGES):
        x = x_desc.load([row, 0]).to(tl.float32)
        ss = tl.sum(x * x, axis=1)[:, None]
        rstd = fl.rsqrt(ss / (N * 1.0) + 1e-06)
        w = tl.load(w_ptr + cols).to(tl.float32)   # per row, from L1, as the generated kernel
        y = fl.convert_bf16(fl.convert_bf16(x * rstd) * w)
        amax = fl.row_max(tl.abs(y), 1)[:, None]
        s = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) / 448.0
        k = fl.div_scale(s)
        q = fl.store_fp8e4m3(fl.div_shared(y, k, fl.div_recip(s, k)), True)
        if TMA_STORE:
            q_desc.store([row, 0], q)
        else:
            tl.store(q_ptr + row * N + cols, q)
        tl.store(s_ptr + row + tl.arange(0, 1)[:, None], s)


@triton.jit
def _softmax_kernel(x_desc, y_desc, y_ptr, R, N: tl.constexpr, XBLOCK: tl.constexpr,
                    STAGES: tl.constexpr, TMA_STORE: tl.constexpr):
    cols = tl.arange(0, N)[None, :]
    for row0 in tl.range(tl.program_id(0) * XBLOCK, R, tl.num_programs(0) * XBLOCK,
                         num_stages=STAGES):
        x = x_desc.load([row0, 0]).to(tl.float32) * 0.125
        m = fl.row_max(x, 1)[:, None]
        e = tl.exp(x - m)
        t = tl.sum(e, axis=1)[:, None]
        k = fl.div_scale(t)
        y = fl.convert_bf16(fl.div_shared(e, k, fl.div_recip(t, k)))
        if TMA_STORE:
            y_desc.store([row0, 0], y.to(tl.bfloat16))
        else:
            rows = row0 + tl.arange(0, XBLOCK)[:, None]
            tl.store(y_ptr + rows * N + cols, y.to(tl.bfloat16))


def _grid(blocks):
    if PER_SM:
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return (min(blocks, PER_SM * sms),)
    return (blocks,)


def launch(DEVICE, *ins):
    if len(ins) == 2:                       # RMSNorm + dynamic FP8: (x, w) -> (scale, q)
        x, w = ins
        rows, n = x.shape
        s = torch.empty((rows, 1), dtype=torch.float32, device=DEVICE)
        q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=DEVICE)
        _fp8_kernel[_grid(rows)](TensorDescriptor.from_tensor(x, [1, n]), w, s, q,
                                 TensorDescriptor.from_tensor(q, [1, n]), rows, N=n,
                                 STAGES=STAGES, TMA_STORE=TMA_STORE, num_warps=WARPS)
        return s, q
    (x,) = ins                              # softmax over the last dim of 1024
    n = x.shape[-1]
    x2 = x.view(-1, n)
    y = torch.empty_like(x)
    y2 = y.view(-1, n)
    rows = x2.shape[0]
    _softmax_kernel[_grid(rows // XBLOCK)](
        TensorDescriptor.from_tensor(x2, [XBLOCK, n]), TensorDescriptor.from_tensor(y2, [XBLOCK, n]),
        y2, rows, N=n, XBLOCK=XBLOCK, STAGES=STAGES, TMA_STORE=TMA_STORE, num_warps=WARPS)
    return y
