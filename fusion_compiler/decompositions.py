"""The decomposition table aot_autograd applies before the passes see the graph.

Start from PyTorch's core ATen decompositions, then break the composite memory-bound ops into
pointwise ops and last-dim reductions the code generator fuses:

    native_layer_norm (+ backward)   -> mean, var (mean, then squared deviations), rsqrt, mul, add
    gelu, silu, sigmoid/tanh backward -> pointwise (computed in fp32 for bf16/fp16 inputs)
    _softmax, _log_softmax (+ backward) -> amax, sub, exp, sum, div
    split, split_with_sizes           -> slices (views)
    var_mean.correction, var.correction -> our form below: mean, then squared deviations (no prims)
    linalg_vector_norm (2-norm)       -> sqrt of a sum of squares (fp32 for bf16/fp16)
    repeat                            -> a reshape of an expand (index arithmetic)
    max_pool2d_with_indices (+ backward) -> strided slices of the padded input, maximum and
                                         where (max_pool.py): two bytes an output value kept
    slice_backward, slice_scatter     -> constant_pad_nd (spread with a step), cat, where
                                         (slices.py): no zeros written, no scatter kernel
    scatter (one index per line)      -> where(arange == index): cross entropy's one-hot
    slice/select/diagonal/as_strided_scatter into a base whose elements share memory
                                      -> the scatter into a contiguous clone (slices.py)
    constant_pad_nd with negative pads -> slice (the crop), then the pad: a pad's backward
    native_group_norm                 -> our form below: statistics over the last dim of an
                                         [N, groups, C/groups * HxW] view, the output in place
    batch norm (training, eval)       -> PyTorch's: var_mean over [0, 2, ...] (in fp32), then
                                         pointwise; passes/outer_dims.py makes the statistics
                                         row kernels

GEMMs (baddbmm too, which the core table would turn into an fp32 bmm), attention
(scaled_dot_product_attention), an embedding's gradient (embedding_dense_backward, which the
core table would turn into a slow index_put) and everything else stay as they are.
"""
from __future__ import annotations

import functools
import math

import torch
from torch._decomp import get_decompositions

from . import max_pool, slices
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


# batch norm's forms: F.batch_norm traces to one of them by mode, device and torch version.
# Their backward (native_batch_norm_backward, cudnn_batch_norm_backward) is in the core table
_BATCH_NORM = [
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit.no_stats",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update",
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


CHUNK = 128     # rows a partial sum over leading dims covers (passes/column_sums.py)


def splits(rows: int) -> int:
    """How many chunks ``rows`` rows are summed in, each to a partial sum: a power of two that
    divides ``rows`` with chunks of at least ``CHUNK`` rows (1: one sum). Here for the AOT
    cache's namespace, as ``lead_and_trail``."""
    s = 1
    while rows % (2 * s) == 0 and rows // (2 * s) >= CHUNK:
        s *= 2
    return s


def reduced_last(x, reduced: list, kept: list):
    """``x`` permuted to [*reduced, *kept] where that view is contiguous (a channels-last
    tensor's N, H, W before its C), else None."""
    if not kept or math.prod(x.shape[d] for d in kept) < 2:
        return None
    view = x.permute(reduced + kept)
    return view if view.is_contiguous() else None


def lead_and_trail(nd: int, dims) -> tuple | None:
    """(lead, trail) where ``dims`` are the first dims of a rank-``nd`` tensor and its last
    ones, some kept between them (BatchNorm's [0], [2, 3] of [N, C, H, W]); else None. Here,
    not in passes/outer_dims.py, which uses it too: the AOT cache's namespace hashes this
    folder's sources, and the ATen graphs it keeps depend on it."""
    dims = sorted({d % nd for d in dims}) if nd else []
    a = next((i for i, d in enumerate(dims) if d != i), len(dims))
    b = nd - (len(dims) - a)
    if a == 0 or a == len(dims) or dims[a:] != list(range(b, nd)) or b <= a:
        return None
    return dims[:a], dims[a:]


def var_mean_correction(x, dim=None, *, correction=None, keepdim=False):
    """var_mean as mean, then the mean of squared deviations (ATen's two-pass result).

    Over leading and trailing dims at once (BatchNorm's statistics) in Chan's parallel form:
    each row of the trailing dims' elements has its mean m_i and its sum of squared
    deviations M2_i, one row kernel that reads x once; then over the leading dims the mean
    is the mean of the m_i (rows of equal length) and M2 = sum(M2_i + t * (m_i - mean)^2),
    with t elements a row: small sums over [L, C] (passes/column_sums.py).

    Where the kept dims lie innermost in memory (channels-last BatchNorm), a channel's values
    over the trailing dims lie C apart, and a row kernel holding whole rows holds few
    channels, so it reads runs of a few bytes (4x slower on ResNet-50's statistics, session
    46). There the reduced dims are one dimension of R values a column: its chunks of R / S
    (``splits``) are the rows, consecutive channels side by side, and the chunks' means and
    M2 combine over S as above."""
    dims = list(range(x.ndim)) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    n = 1
    for d in dims:
        n = n * x.shape[d]
    correction = 1 if correction is None else correction
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    static = all(isinstance(s, int) for s in x.shape)
    split = lead_and_trail(x.dim(), dims) if static else None
    if split is None:
        mean = torch.mean(xf, dims, keepdim=True)
        m2 = torch.sum((xf - mean) * (xf - mean), dims, keepdim=keepdim)
    else:
        lead, trail = split
        kept = [d for d in range(x.dim()) if d not in lead and d not in trail]
        columns = reduced_last(xf, lead + trail, kept)
        if columns is not None:     # [S, kept, R / S]: rows C apart, channels side by side
            s, width = splits(n), math.prod(x.shape[d] for d in kept)
            xf = columns.reshape(s, n // s, width).permute(0, 2, 1)
            lead, trail = [0], [2]
        rows = math.prod(xf.shape[d] for d in lead)
        row_mean = torch.mean(xf, trail, keepdim=True)
        dev = xf - row_mean
        row_m2 = torch.sum(dev * dev, trail, keepdim=True)
        if rows == 1:       # a sum over dims of size 1 is the value itself
            mean, m2 = row_mean, row_m2
        else:
            mean = torch.sum(row_mean, lead, keepdim=True) / rows
            spread = row_mean - mean
            m2 = torch.sum(row_m2 + (n // rows) * (spread * spread), lead, keepdim=True)
        if columns is not None:     # back to x's dims: kept in place, the reduced of size 1
            shape = [x.shape[d] if d in kept else 1 for d in range(x.dim())]
            mean, m2 = mean.reshape(shape), m2.reshape(shape)
        if not keepdim:
            m2 = torch.squeeze(m2, dims)
    var = m2 / max(n - correction, 0)
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


def _kernels_run(x) -> bool:
    """Whether ops on ``x`` become kernels: not on the CPU, where none runs unless Triton's
    interpreter does, except where kernels are made to be shown (``emit_sources``: `dump`, as
    on a GPU). A composite op decomposed there would run op by op on ATen."""
    return x.device.type != "cpu" or interpreting() or Config.from_env().emit_sources


def repeat(x, repeats):
    """``x.repeat(*repeats)`` as a reshape of an expand: along each dimension element i is x's
    element i % size, index arithmetic in the kernel that reads it, where ATen's repeat is a
    copy kernel of its own (InstanceNorm repeats its weight and bias for each sample). Fewer
    repeats than dims and empty results keep ATen's op (its error, its empty tensor).

    The result is a new contiguous tensor, as ATen's: a copy of the expand, then a view. A
    reshape alone returns a view where the repeated dims merge (repeats of 1, or of a size-1
    dim), with the input's strides (WavLM views its repeated position bias, a permuted tensor,
    and that view failed) and aliasing the input."""
    repeats = list(repeats)
    if len(repeats) < x.dim() or any(isinstance(r, int) and r == 0 for r in repeats):
        return NotImplemented
    shape = [1] * (len(repeats) - x.dim()) + list(x.shape)
    tiled = x.reshape([v for s in shape for v in (1, s)])
    tiled = tiled.expand([v for r, s in zip(repeats, shape) for v in (r, s)])
    tiled = aten.clone(tiled, memory_format=torch.contiguous_format)
    return tiled.view([r * s for r, s in zip(repeats, shape)])


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
    if not _kernels_run(x):
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


def _on_kernels(decomposition):
    """``decomposition`` where its ops become kernels (``_kernels_run``), else ATen's own op
    (NotImplemented: traced as it is)."""
    @functools.wraps(decomposition)
    def decompose(x, *args, **kwargs):
        return decomposition(x, *args, **kwargs) if _kernels_run(x) else NotImplemented
    return decompose


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    # attention stays one ATen op (FlashAttention / memory-efficient kernels on the GPU); so
    # does baddbmm, a GEMM whose epilogue adds the bias (BLOOM's ALiBi scores): the core
    # decomposition upcasts bf16 operands to an fp32 bmm, several times slower than cuBLAS's
    # bf16 baddbmm, which accumulates in fp32 and rounds once, as eager does. An embedding's
    # gradient stays ATen's embedding_dense_backward too: the core decomposition makes it an
    # index_put with accumulation, whose sort-based CUDA kernel serializes on repeated indices
    # (BERT's token types, all 0: 2755 us for the three embeddings of a 16 x 256 training step
    # on the H200, session 26), where ATen's embedding kernel reduces each index's segment.
    # ``_unsafe_view`` stays itself (the core table makes it a ``view``): its result is no view
    # to autograd, and a graph output made by it (a matmul's of a 3-d input) must not become
    # one, or an in-place write into it after the graph fails (fast_calls keeps it there)
    table = {op: fn for op, fn in _core().items()
             if "scaled_dot_product" not in str(op) and op.overloadpacket is not aten.baddbmm
             and op.overloadpacket is not aten.embedding_dense_backward
             and op is not aten._unsafe_view.default}
    table.update(get_decompositions(_ops(_EXTRA)))
    table[aten.var_mean.correction] = var_mean_correction
    table[aten.var.correction] = var_correction
    table[aten.linalg_vector_norm.default] = linalg_vector_norm
    table[aten.native_group_norm.default] = native_group_norm
    table[aten.repeat.default] = repeat
    table.update({op: _on_kernels(fn) for op, fn in get_decompositions(_ops(_BATCH_NORM)).items()})
    table[aten.max_pool2d_with_indices.default] = _on_kernels(max_pool.max_pool2d_with_indices)
    table[aten.max_pool2d_with_indices_backward.default] = _on_kernels(
        max_pool.max_pool2d_with_indices_backward)
    table[aten.slice_backward.default] = _on_kernels(slices.slice_backward)
    table[aten.slice_scatter.default] = slices.into_a_copy(aten.slice_scatter.default,
                                                           _on_kernels(slices.slice_scatter))
    # a base whose elements share memory is scattered into a contiguous copy (slices.py)
    for op in (aten.select_scatter.default, aten.diagonal_scatter.default,
               aten.as_strided_scatter.default):
        table[op] = slices.into_a_copy(op, table.get(op))
    table[aten.scatter.value] = _on_kernels(slices.scatter_value)
    table[aten.scatter.src] = _on_kernels(slices.scatter_src)
    table[aten.constant_pad_nd.default] = _on_kernels(slices.constant_pad_nd)
    return table


def full_table() -> dict:
    """Every decomposition of the backend (built once per process: 6 ms on the CPU); not to
    be changed by the caller."""
    return _table()


def decomposition_table(deferred=(), max_pool=True) -> dict:
    """The table aot_autograd lowers with: the full table less the ``deferred`` ops, which
    passes/late_decompose.py decomposes after the trace, and less max pooling's unless
    ``max_pool`` (``config.max_pool``)."""
    table = dict(_table())
    for op in deferred:
        table.pop(op, None)
    if not max_pool:
        table.pop(aten.max_pool2d_with_indices.default, None)
        table.pop(aten.max_pool2d_with_indices_backward.default, None)
    return table
