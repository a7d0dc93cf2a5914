"""Pad GEMMs whose leading dimensions break cuBLAS's 16-byte alignment (ATen graph, first pass).

cuBLAS's tensor-core kernels need every matrix's row stride at a multiple of 16 bytes. GPT-2's
LM head, ``[4096, 768] @ [768, 50257]`` in bf16, writes rows of 50257 elements: cuBLAS falls back
to an sm75-era kernel at 94 TFLOP/s, 3356 us, where the same GEMM with 50264 columns takes
508 us (H200, 2026-11-30, BENCHMARKS.md; Inductor's pad_mm exists for the same reason).
Padding with zeros changes no value of the result:

    mm(a[M, K], b[K, N])   ->   c = mm(pad(a)[M, K'], pad(b)[K', N'])[:, :N].clone()

K' and N' are K and N rounded up to 16 bytes; the K padding multiplies zeros by zeros. The clone
gives the result the layout the traced graph promised its users (contiguous [M, N]), so no
later pass or kernel sees a changed stride. A transposed weight (``t(w)``, a Linear's) is padded
before its transpose, a contiguous copy of w. ``addmm``'s bias is padded with zeros too.

A column-major a, the transpose of a contiguous [K, M], has its columns M elements apart: the
LM head's weight gradient in training, ``t(grad_logits)[50257, 4096] @ h[4096, 768]`` (2190 us
per GPT-2 8 x 512 step in that sm75-era kernel, H200, session 26). Its source is padded along
M before the transpose, and the first M rows of the result are cut off, a contiguous view: no
clone. ``mm(pad(a)[M', K], b)[:M]``.

Where the result only leaves the graph (through views: GPT-2's logits), there is no clone: the
caller gets the cut view, rows N' apart. Its values and stride order are eager's; only the row
stride differs, and ``is_contiguous()`` is False. Inductor returns the same (its outputs keep
eager's stride order, not its strides); the clone would cost a full read and write of the
result (GPT-2 8 x 512: 823 MB, about 195 us on the H200, 7% of the model's GPU time).

The padding costs copies: a, b and the result, read and written. It is done when the cost model
says the faster GEMM pays for them: an unaligned GEMM runs at least 2.5x slower (2.6x for
N = 30522, 6.6x for N = 50257 on the H200), so padding pays when 1.5x the aligned GEMM's time
exceeds the copies' time and launches.
"""
from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from .shapes import meta_of_layout, static_layout

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")

ALIGN_BYTES = 16
UNALIGNED_SLOWDOWN = 2.5        # the least measured slowdown of an unaligned GEMM (see above)
MATMUL_TO_VECTOR = 16           # calibrate's fp32 vector peak is the bf16 matmul rate / 16
PADDED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRANSPOSES = (aten.t.default, aten.permute.default)
# views that keep the rows' stride (a split or merge of leading dimensions, never of the rows)
OUTPUT_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _val(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _static(value) -> bool:
    return all(isinstance(s, int) for s in value.shape)


# ops whose value ``emit`` takes from the meta kernel directly, for static layouts: the fake
# mode's dispatch costs 0.3-0.5 ms a call, and column_sums emits about 540 of these for GPT-2's
# training graphs (0.3 s of its 0.9 s analysis under cProfile, CPU)
META_OPS = frozenset({aten.view.default, aten.permute.default, aten.sum.dim_IntList,
                      torch.ops.prims.convert_element_type.default})


def emit(gm, op, args, mode):
    """A call of ``op`` on ``args`` added to ``gm``, with its value in ``mode``."""
    node = gm.graph.call_function(op, args)
    values = [_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
    value = _meta_value(op, values, mode) if op in META_OPS else None
    if value is None:
        with mode:
            value = op(*values)
    node.meta["val"] = value
    return node


def contiguous(gm, x):
    """A contiguous copy of ``x`` (``clone(memory_format=torch.contiguous_format)``: ATen's
    layout for what a permute or a squeeze left strided), with its value."""
    node = gm.graph.call_function(aten.clone.default, (x,),
                                  {"memory_format": torch.contiguous_format})
    with _val(x).fake_mode:
        node.meta["val"] = aten.clone.default(_val(x), memory_format=torch.contiguous_format)
    return node


def _meta_value(op, values, mode):
    """``op``'s value on ``values`` from its meta kernel, as a fake tensor of ``mode``; None
    where a value has a symbolic size (a meta tensor cannot) or is not a tensor of ``mode``."""
    tensor = values[0]
    layout = static_layout(tensor)
    if layout is None or getattr(tensor, "fake_mode", None) is not mode:
        return None
    rest = [x for v in values[1:] for x in (v if isinstance(v, (list, tuple)) else [v])]
    if not all(type(n) is int for n in rest if not isinstance(n, torch.dtype)):
        return None
    with unset_fake_temporarily():     # a cold compile runs inside aot_autograd's fake mode
        return FakeTensor(mode, op(meta_of_layout(*layout[:4]), *values[1:]), tensor.device)


def _pad(gm, node, pads, mode):
    """``node`` padded with zeros: ``pads`` as constant_pad_nd takes them (last dim first). A 2-D
    transpose of a contiguous tensor is padded before the transpose."""
    src = node.args[0] if node.op == "call_function" and node.target in TRANSPOSES else None
    if src is not None and _val(src) is not None and _val(src).dim() == 2 \
            and _val(src).is_contiguous() and (node.target == aten.t.default
                                                or list(node.args[1]) == [1, 0]):
        swapped = [pads[2], pads[3], pads[0], pads[1]]
        return emit(gm, aten.t.default, (emit(gm, aten.constant_pad_nd.default,
                                                (src, swapped), mode),), mode)
    return emit(gm, aten.constant_pad_nd.default, (node, pads), mode)


def _only_leaves(node) -> bool:
    """Whether ``node``'s value reaches nothing but the graph's output, through views that
    leave its last dimension whole."""
    for user in node.users:
        if user.op == "output":
            continue
        if user.op != "call_function" or user.target not in OUTPUT_VIEWS \
                or _val(user) is None or _val(node) is None \
                or _val(user).shape[-1] != _val(node).shape[-1] or not _only_leaves(user):
            return False
    return True


def _restride(node):
    """Fix the recorded strides of the views between a cut GEMM result and the output."""
    for user in node.users:
        if user.op == "call_function":
            with _val(node).fake_mode:
                user.meta["val"] = user.target(_val(node), *user.args[1:])
            _restride(user)


def worth_padding(m, k, n, pad_k, pad_n, itemsize, profile, pad_m=0) -> bool:
    """Whether the copies of padding cost less than the time an aligned GEMM saves."""
    gemm = 2 * m * n * k / (profile.peak_flops * MATMUL_TO_VECTOR)
    copied = (m * k * bool(pad_k or pad_m) + k * n * bool(pad_k or pad_n)
              + m * n * bool(pad_n)) * itemsize * 2                      # read + written
    copies = copied / profile.hbm_bandwidth + 3 * profile.launch_overhead
    return (UNALIGNED_SLOWDOWN - 1) * gemm > copies


def run(gm: torch.fx.GraphModule, ctx, devices=("cuda",)) -> int:
    """Pad the GEMMs on ``devices`` worth it; how many were padded."""
    padded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        bias, a, b = (None, *node.args) if node.target == aten.mm.default else node.args[:3]
        out, va, vb = _val(node), _val(a), _val(b)
        if out is None or va is None or vb is None or out.device.type not in devices \
                or out.dtype not in PADDED_DTYPES or not (_static(va) and _static(vb)) \
                or node.kwargs:                          # addmm's beta/alpha: left alone
            continue
        (m, k), n = va.shape, vb.shape[1]
        if bias is not None and (_val(bias) is None or _val(bias).shape[-1] != n):
            continue                                     # a bias broadcast along columns
        align = ALIGN_BYTES // out.element_size()
        pad_k, pad_n = -k % align, -n % align
        # a column-major a (the transpose of a contiguous [K, M]: a weight gradient's t(grad))
        # has rows M apart: M is its leading dimension
        pad_m = -m % align if m > 1 and va.stride() == (1, m) else 0
        if not (pad_k or pad_n or pad_m) or not worth_padding(
                m, k, n, pad_k, pad_n, out.element_size(), ctx.profile, pad_m):
            continue
        mode = out.fake_mode
        with gm.graph.inserting_before(node):
            pa = _pad(gm, a, [0, pad_k, 0, pad_m], mode) if pad_k or pad_m else a
            pb = _pad(gm, b, [0, pad_n, 0, pad_k], mode) if pad_k or pad_n else b
            if bias is None:
                wide = emit(gm, aten.mm.default, (pa, pb), mode)
            else:
                pbias = emit(gm, aten.constant_pad_nd.default, (bias, [0, pad_n]), mode) \
                    if pad_n else bias
                wide = emit(gm, aten.addmm.default, (pbias, pa, pb), mode)
            # the padded rows cut off: the first M rows of a contiguous result are contiguous
            result = emit(gm, aten.slice.Tensor, (wide, 0, 0, m), mode) if pad_m else wide
            leaves = False
            if pad_n:
                cut = emit(gm, aten.slice.Tensor, (result, 1, 0, n), mode)
                leaves = _only_leaves(node)
                result = cut if leaves else emit(gm, aten.clone.default, (cut,), mode)
        node.replace_all_uses_with(result)
        if leaves:
            _restride(result)
        gm.graph.erase_node(node)
        for old in (a, b):          # a transpose the padded copy bypasses
            if isinstance(old, torch.fx.Node) and not old.users and old.target in TRANSPOSES:
                gm.graph.erase_node(old)
        padded += 1
        log.info("fusion-compiler: padded GEMM [%d, %d] @ [%d, %d] to [%d, %d] @ [%d, %d] "
                 "(16-byte aligned rows for cuBLAS)",
                 m, k, k, n, m + pad_m, k + pad_k, k + pad_k, n + pad_n)
    return padded
