"""The decomposition table aot_autograd applies before the passes see the graph.

Start from PyTorch's core ATen decompositions, then break the composite memory-bound ops into
pointwise ops and last-dim reductions the code generator fuses:

    native_layer_norm (+ backward)   -> mean, var (mean, then squared deviations), rsqrt, mul, add
    gelu, silu, sigmoid/tanh backward -> pointwise (computed in fp32 for bf16/fp16 inputs)
    _softmax, _log_softmax (+ backward) -> amax, sub, exp, sum, div
    split, split_with_sizes           -> slices (views)
    var_mean.correction, var.correction -> our form below: mean, then squared deviations (no prims)
    linalg_vector_norm (2-norm)       -> sqrt of a sum of squares (fp32 for bf16/fp16)
    native_group_norm                 -> our form below: statistics over the last dim of an
                                         [N, groups, C/groups * HxW] view, the output in place

GEMMs (baddbmm too, which the core table would turn into an fp32 bmm), attention
(scaled_dot_product_attention), an embedding's gradient (embedding_dense_backward, which the
core table would turn into a slow index_put) and everything else stay as they are.
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import get_decompositions

from .codegen.triton_lib import interpreting
from .config import Config

try:
    # PyTorch's list of core ATen decompositions. core_aten_decompositions() adds to it an
    # entry for each CompositeImplicitAutograd op of every namespace (for torch.export, which may
    # keep some): 0.05-0.1 s of every cold compile on the CPU, though tracing decomposes those
    # ops just the same without an entry (the example models' forward and backward graphs are
    # identical either way: session 15)
    from torch._decomp import _core_aten_decompositions_post_autograd as _core
except ImportError:     # an older or newer torch: the public table
    from torch._decomp import core_aten_decompositions as _core

aten = torch.ops.aten

_EXTRA = [
    "native_layer_norm", "native_layer_norm_backward", "gelu", "gelu_backward", "_softmax",
    "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "silu",
    "silu_backward", "sigmoid_backward", "tanh_backward", "threshold_backward", "split.Tensor",
    "split_with_sizes", "hardtanh", "leaky_relu", "mish", "softplus", "elu", "hardsigmoid",
    "hardswish",
]


def _ops(names):
    out = []
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        out.append(getattr(packet, overload) if overload else packet)
    return out


def var_mean_correction(x, dim=None, *, correction=None, keepdim=False):
    """var_mean as mean, then the mean of squared deviations (ATen's two-pass result)."""
    dims = list(range(x.ndim)) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    n = 1
    for d in dims:
        n = n * x.shape[d]
    correction = 1 if correction is None else correction
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.mean(xf, dims, keepdim=True)
    var = torch.sum((xf - mean) * (xf - mean), dims, keepdim=keepdim) / max(n - correction, 0)
    if not keepdim:
        mean = torch.squeeze(mean, dims)
    return var.to(x.dtype), mean.to(x.dtype)


def var_correction(x, dim=None, *, correction=None, keepdim=False):
    """var (and std, whose core decomposition is a var's sqrt) as var_mean's form above."""
    return var_mean_correction(x, dim, correction=correction, keepdim=keepdim)[0]


def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """The 2-norm of float rows (``F.normalize``, a cosine similarity) as the square root of a
    sum of squares, in fp32 for bf16/fp16 as ATen's kernel accumulates, rounded once. Other
    orders, ``dtype=``, complex or integer inputs and norms over every dimension keep ATen's
    op (NotImplemented: traced as it is)."""
    if (ord != 2 or dtype is not None or dim is None or not x.dtype.is_floating_point
            or x.dtype == torch.float64 or x.dim() == 0):
        return NotImplemented
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return NotImplemented
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return torch.sqrt(torch.sum(xf * xf, dims, keepdim=keepdim)).to(x.dtype)


def native_group_norm(x, weight, bias, n, c, hxw, groups, eps):
    """GroupNorm as one row reduction over x viewed [N, groups, C/groups * HxW]: the mean, then
    the variance (fp32 for bf16/fp16; a looped kernel takes both in one pass, codegen/
    row_loops.py's Welford update), the output computed on those rows (weight
    and bias broadcast to them by channel) and viewed back to x's shape, rounded to x's dtype
    once, as ATen's kernel rounds it; in x's memory format, as ATen gives it. The generated row
    kernel computes each row's statistics and its elements (a UNet's GroupNorm + SiLU is one
    kernel); the weight's and bias's broadcast to the rows is index arithmetic there (a
    reshape of an expand, which ATen alone would copy). ``(out, mean, rstd)``, mean and rstd
    [N, groups] in x's dtype, as ATen returns them. On the CPU, where no kernel runs unless
    Triton's interpreter does, ATen's own kernel is kept (NotImplemented: traced as it is),
    except where kernels are made to be shown (``emit_sources``: `dump`, as on a GPU)."""
    if x.dim() < 2 or c % groups:
        return NotImplemented
    if x.device.type == "cpu" and not interpreting() and not Config.from_env().emit_sources:
        return NotImplemented
    acc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    cpg = c // groups
    rows = acc.reshape(n, groups, cpg * hxw)
    mean = torch.mean(rows, [-1], keepdim=True)
    var = torch.mean((rows - mean) * (rows - mean), [-1], keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (rows - mean) * rstd

    def per_channel(v):
        return v.view(1, groups, cpg, 1).expand(n, groups, cpg, hxw).reshape(n, groups, cpg * hxw)
    if weight is not None:
        out = out * per_channel(weight)
    if bias is not None:
        out = out + per_channel(bias)
    out = out.view(x.shape).to(x.dtype)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if fmt is not None and x.is_contiguous(memory_format=fmt) and not x.is_contiguous():
        out = out.contiguous(memory_format=fmt)
    return out, mean.view(n, groups).to(x.dtype), rstd.view(n, groups).to(x.dtype)


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    # attention stays one ATen op (FlashAttention / memory-efficient kernels on the GPU); so
    # does baddbmm, a GEMM whose epilogue adds the bias (BLOOM's ALiBi scores): the core
    # decomposition upcasts bf16 operands to an fp32 bmm, several times slower than cuBLAS's
    # bf16 baddbmm, which accumulates in fp32 and rounds once, as eager does. An embedding's
    # gradient stays ATen's embedding_dense_backward too: the core decomposition makes it an
    # index_put with accumulation, whose sort-based CUDA kernel serializes on repeated indices
    # (BERT's token types, all 0: 2755 us for the three embeddings of a 16 x 256 training step
    # on the H200, session 26), where ATen's embedding kernel reduces each index's segment
    table = {op: fn for op, fn in _core().items()
             if "scaled_dot_product" not in str(op) and op.overloadpacket is not aten.baddbmm
             and op.overloadpacket is not aten.embedding_dense_backward}
    table.update(get_decompositions(_ops(_EXTRA)))
    table[aten.var_mean.correction] = var_mean_correction
    table[aten.var.correction] = var_correction
    table[aten.linalg_vector_norm.default] = linalg_vector_norm
    table[aten.native_group_norm.default] = native_group_norm
    return table


def full_table() -> dict:
    """Every decomposition of the backend (built once per process: 6 ms on the CPU); not to
    be changed by the caller."""
    return _table()


def decomposition_table(deferred=()) -> dict:
    """The table aot_autograd lowers with: the full table less the ``deferred`` ops, which
    passes/late_decompose.py decomposes after the trace."""
    table = dict(_table())
    for op in deferred:
        table.pop(op, None)
    return table
