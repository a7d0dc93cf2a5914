"""Classify every ATen node into a small set of kinds (the TVM `OpPatternKind` idea).

The table is the single place that says which ops the compiler understands. Anything not in it
is OPAQUE and runs on ATen: the classifier never guesses.

Writes ``node.meta["fc_kind"]`` (an ``OpKind``) on every node.
"""
from __future__ import annotations

import enum
import operator

import torch

from .shapes import TensorInfo

aten = torch.ops.aten
prims = torch.ops.prims


class OpKind(enum.Enum):
    POINTWISE = "pointwise"    # elementwise, same-shape or broadcasting operands
    BROADCAST = "broadcast"    # expand: index arithmetic that repeats data
    VIEW = "view"              # injective and free: reshape, permute, slice ... (no data of its own)
    INJECTIVE = "injective"    # injective but materialises data (cat): index arithmetic in a kernel
    REDUCTION = "reduction"    # reduction over dimensions
    OPAQUE = "opaque"          # GEMM, attention, anything else: stays on ATen


ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_POINTWISE = [
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode,
    aten.div.Scalar_mode, aten.remainder.Tensor, aten.remainder.Scalar,
    aten.neg.default, aten.abs.default, aten.exp.default, aten.exp2.default, aten.expm1.default,
    aten.log.default, aten.log2.default, aten.log1p.default, aten.sqrt.default,
    aten.rsqrt.default, aten.reciprocal.default, aten.sin.default, aten.cos.default,
    aten.tanh.default, aten.sigmoid.default, aten.erf.default, aten.relu.default,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
    aten.maximum.default, aten.minimum.default, aten.where.self,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
    aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.logical_not.default, aten.logical_and.default,
    aten.logical_or.default, aten.bitwise_not.default, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.sign.default, aten.floor.default, aten.ceil.default,
    aten.trunc.default, aten.isnan.default, aten.isinf.default, aten.masked_fill.Scalar,
    aten.clone.default, aten._to_copy.default, prims.convert_element_type.default,
    aten.copy.default, aten.lerp.Scalar, aten.fill.Scalar,
    aten.full_like.default,     # a constant: reads only its input's shape (groups.tensor_args)
    aten.scalar_tensor.default,     # a 0-dim constant (`where(c, x, -inf)` on CUDA)
    aten.full.default,  # a constant, where a kernel reads it (_read_by_kernels); else ATen's
    *ARANGES,   # ditto, of integers: a value of the kernel's index (a mask's row, column)
]
_VIEW = [
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.slice.Tensor, aten.select.int, aten.alias.default,
    aten.as_strided.default, aten.detach.default,
]
SCANS = (aten.cumsum.default,)     # reductions whose results are per element: prefix sums
_REDUCTION = [aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.any.dim, *SCANS]

OP_KINDS: dict = {
    **{op: OpKind.POINTWISE for op in _POINTWISE},
    **{op: OpKind.VIEW for op in _VIEW},
    **{op: OpKind.REDUCTION for op in _REDUCTION},
    aten.expand.default: OpKind.BROADCAST,
    aten.cat.default: OpKind.INJECTIVE,
    aten.constant_pad_nd.default: OpKind.INJECTIVE,
    aten.embedding.default: OpKind.INJECTIVE,     # a gather: rows of a table by index
    aten.gather.default: OpKind.INJECTIVE,        # a gather along one dimension
    aten.index_select.default: OpKind.INJECTIVE,  # a gather along one dimension, 1-d index
    aten.roll.default: OpKind.INJECTIVE,          # a rotation: index arithmetic
    aten.flip.default: OpKind.INJECTIVE,          # a reversal: index arithmetic
}
GATHERS = (aten.embedding.default, aten.gather.default,    # checked by _is_plain_gather
           aten.index_select.default)

# Tensor dtypes a generated kernel can load, compute on and store.
KERNEL_DTYPES = {
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
}

# Symbolic-int arithmetic that dynamo leaves in graphs: evaluated by sympy, never a kernel.
SYMINT_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
              operator.neg, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default}


def is_host_scalar(info: TensorInfo) -> bool:
    """A 0-dim CPU tensor: ATen lets it join GPU ops; a kernel takes its value as an argument."""
    return info.device.type == "cpu" and info.ndim == 0


def _sizes_known(info: TensorInfo, hints: dict) -> bool:
    """False for sizes that depend on data (unbacked symbols: nonzero, masks): no hint to plan
    with, and no input to read them from at run time."""
    return all(sym in hints for sym in info.free_symbols)


def kind_of(node: torch.fx.Node, hints: dict) -> OpKind:
    """Kind of one node: the table's entry when every tensor it touches is kernel-friendly."""
    if node.op != "call_function":
        return OpKind.OPAQUE
    kind = OP_KINDS.get(node.target, OpKind.OPAQUE)
    if kind is OpKind.OPAQUE:
        return kind
    info = node.meta.get("fc_tensor")
    if not isinstance(info, TensorInfo) or info.dtype not in KERNEL_DTYPES:
        return OpKind.OPAQUE
    if not _sizes_known(info, hints):
        return OpKind.OPAQUE
    for arg in node.all_input_nodes:
        arg_info = arg.meta.get("fc_tensor")
        if arg_info is None:
            if not isinstance(arg.meta.get("val"), torch.SymInt):
                return OpKind.OPAQUE
        elif arg_info.dtype not in KERNEL_DTYPES or not _sizes_known(arg_info, hints):
            return OpKind.OPAQUE
        elif arg_info.device != info.device and not is_host_scalar(arg_info):
            return OpKind.OPAQUE
    if node.target in SCANS:
        if not _is_last_dim_scan(node, info):
            return OpKind.OPAQUE
    elif kind is OpKind.REDUCTION and not _is_last_dim_reduction(node, info):
        return OpKind.OPAQUE
    if node.target in GATHERS and not _is_plain_gather(node):
        return OpKind.OPAQUE
    if node.target is aten.full.default and not _read_by_kernels(node, info.device):
        return OpKind.OPAQUE
    if node.target in ARANGES and (info.dtype.is_floating_point
                                   or not all(type(a) is int for a in node.args)
                                   or not _read_by_kernels(node, info.device)):
        return OpKind.OPAQUE        # float aranges: ATen's own rounding of start + i * step
    return kind


def _read_by_kernels(node: torch.fx.Node, device) -> bool:
    """Whether an op a kernel can compute, on ``device`` (``node``'s), reads ``node`` (through
    views): there a constant is a literal of the kernel. One that only ATen ops read (SDPA's
    mask), or only ops on another device (a CPU scalar beside CUDA tensors), stays a ``full``,
    which fast_calls makes once and keeps (constant_fold.factories), not a kernel of its own
    writing it on every call."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        kind = OP_KINDS.get(user.target, OpKind.OPAQUE)
        if kind is OpKind.VIEW or kind is OpKind.BROADCAST:
            stack.extend(user.users)
        elif kind is not OpKind.OPAQUE:
            info = user.meta.get("fc_tensor")
            if isinstance(info, TensorInfo) and info.device == device:
                return True
    return False


def _is_plain_gather(node: torch.fx.Node) -> bool:
    """``embedding(table, idx)`` of a 2-d table by int32/int64 indices, ``gather(src, dim,
    idx)`` by int64 indices of src's rank, or ``index_select(src, dim, idx)`` by a 1-d
    int32/int64 index; the other arguments (padding_idx, scale_grad_by_freq, sparse,
    sparse_grad) change no forward value."""
    ints = (torch.int32, torch.int64)
    if node.target is aten.embedding.default:
        (src, idx), dim, dtypes = node.args[:2], 0, ints
    else:
        (src, dim, idx), dtypes = node.args[:3], (
            ints if node.target is aten.index_select.default else (torch.int64,))
    if not isinstance(dim, int) or not isinstance(src, torch.fx.Node) \
            or not isinstance(idx, torch.fx.Node):
        return False
    s, i = src.meta.get("fc_tensor"), idx.meta.get("fc_tensor")
    if s is None or i is None or i.dtype not in dtypes or is_host_scalar(i):
        return False
    if node.target is aten.embedding.default:
        return s.ndim == 2
    if node.target is aten.index_select.default:
        return s.ndim >= 1 and i.ndim == 1
    return s.ndim == i.ndim >= 1


def _is_last_dim_reduction(node: torch.fx.Node, info: TensorInfo) -> bool:
    """Only reductions over exactly the last dimension are generated (of a float tensor; `any`
    of a bool one); the rest stay on ATen."""
    src = node.args[0].meta["fc_tensor"]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or src.ndim == 0:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(dims) != 1 or dims[0] % src.ndim != src.ndim - 1:
        return False
    if node.kwargs.get("dtype") not in (None, torch.float32):
        return False            # fp32 partial sums of a split column sum (column_sums.py)
    if node.target == aten.any.dim:
        return src.dtype == torch.bool     # any over a mask (safe softmax's fully-masked rows)
    return src.dtype.is_floating_point


SCAN_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64}


def _is_last_dim_scan(node: torch.fx.Node, info: TensorInfo) -> bool:
    """A cumsum is generated over the last dimension of a tensor of at least one dim, into
    fp32/fp16/bf16 or int32/int64 (``dtype=`` or ATen's: int64 for integer and bool inputs);
    fp64 and other dims stay on ATen. (Rows longer than ``SCAN_BLOCK`` are refused by the
    lowering, which knows the row's length.)"""
    src = node.args[0].meta["fc_tensor"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dim, int) or src.ndim == 0 or dim % src.ndim != src.ndim - 1:
        return False
    return info.dtype in SCAN_DTYPES and src.dtype != torch.float64


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Write ``fc_kind`` on every node."""
    for node in gm.graph.nodes:
        node.meta["fc_kind"] = kind_of(node, ctx.size_hints)
    return gm
