"""Reductions over one middle dimension as reductions over the last (ATen graph, first passes).

Kernels reduce over the last dimension only. A LayerNorm over the channels of an NCHW tensor
written out, as the ConvNeXt repository's and Segment Anything's ``LayerNorm2d`` are,

    u = x.mean(1, keepdim=True); s = (x - u).pow(2).mean(1, keepdim=True)

left both means on ATen and the ops around them in two pointwise kernels (six ops, four
launches). Each such reduction becomes

    x [*L, C, *T]  ->  permute [*L, *T, C]  ->  op(-1)  [*L, *T]  (-> view [*L, 1, *T] for keepdim)

a row kernel over rows of C elements lying prod(T) apart, consecutive rows side by side
(strided rows, as a LayerNorm over a permuted NCHW tensor: a program reads a run of rows in
vectors), which takes the producers of x with it. Only where those runs are long enough to
read in vectors (``RUN`` elements of T at stride 1), or the reduced dimension itself has stride
1. Else, where the reduced dimension has at most ``UNROLL`` elements, the reduction is its
slices combined elementwise, a pointwise op over the output in any layout:

    x [*L, k, *T]  ->  select(x, d, 0) + ... + select(x, d, k - 1)  (fp32 for bf16/fp16)

(maximum/minimum for amax/amin, which propagate NaN as they do). Gemma 2's eager attention
needs it: the gradient of the keys repeated over query groups is a sum over the group dim
(2 of them) of a bmm's transposed output, whose last dim has stride 512. Else ATen's
reduction, which picks its own order, stays. Sums, means, amax and amin of float inputs other
than fp64, static sizes, no ``dtype=``; the first dimension is ``column_sums``'s, the last
needs nothing.
"""
from __future__ import annotations

import math

import torch

from .pad_gemm import contiguous, emit
from .trailing_dims import as_rows, reduced, unfit

aten = torch.ops.aten
prims = torch.ops.prims

RUN = 16    # fewest elements of consecutive rows side by side (the dims after the reduced one)
UNROLL = 8  # most elements of a reduced dim whose slices are combined elementwise instead
COMBINE = {aten.sum.dim_IntList: aten.add.Tensor, aten.mean.dim: aten.add.Tensor,
           aten.amax.default: aten.maximum.default, aten.amin.default: aten.minimum.default}


def _middle(node):
    """(x, d, why) where ``node`` reduces a float tensor ``x`` over its dimension d alone, not
    the first nor the last: ``why`` is None where the rewrite applies, else why not; None
    where ``node`` is no such reduction."""
    x = reduced(node)
    if x is None or len(node.args[1]) != 1 or x.dim() < 3:
        return None
    d = node.args[1][0] % x.dim()
    if d in (0, x.dim() - 1):
        return None
    why = unfit(node, x)
    if why is None and not _as_rows(x, d) and x.shape[d] > UNROLL:
        why = (f"its rows lie side by side in runs under {RUN} elements, and it reduces over "
               f"more than {UNROLL}")
    if why is None and not _as_rows(x, d) and not node.meta["val"].is_contiguous():
        why = "its result is not contiguous"
    return x, d, why


def _as_rows(x, d) -> bool:
    """Whether rows of dim d of ``x`` read well as strided rows: the reduced dim at stride 1,
    or consecutive rows side by side in runs of ``RUN`` elements or more."""
    return x.stride(d) == 1 or (x.stride(-1) == 1 and math.prod(x.shape[d + 1:]) >= RUN)


def _unrolled(gm, node, x, d) -> None:
    """Replace ``node`` by its k slices along dim d combined elementwise (in fp32 for a sum or
    mean of bf16/fp16), divided by k for a mean, viewed as ``node``'s result."""
    mode, src, k = x.fake_mode, node.args[0], x.shape[d]
    summing = COMBINE[node.target] is aten.add.Tensor
    wide = summing and x.dtype != torch.float32
    with gm.graph.inserting_before(node):
        parts = []
        for i in range(k):
            part = emit(gm, aten.select.int, (src, d, i), mode)
            if wide:
                part = emit(gm, prims.convert_element_type.default, (part, torch.float32), mode)
            parts.append(part)
        out = parts[0]
        for part in parts[1:]:
            out = emit(gm, COMBINE[node.target], (out, part), mode)
        if node.target is aten.mean.dim:
            out = emit(gm, aten.div.Tensor, (out, k), mode)
        if wide:
            out = emit(gm, prims.convert_element_type.default, (out, x.dtype), mode)
        # in the reduction's layout, contiguous (``_middle``), not the slices': a graph's
        # output keeps the trace's strides, which the backward reads a saved value by (a
        # fuzzer's find: [4, 3, 5] of strides (1, 4, 12), its mean over dim 1 returned and
        # saved for a product's gradient, (1, 20, 4) against (5, 5, 1): a wrong gradient).
        # Also a new tensor where one slice is all there is, not a view
        out = contiguous(gm, out)
        shape = list(node.meta["val"].shape)
        if list(out.meta["val"].shape) != shape:
            out = emit(gm, aten.view.default, (out, shape), mode)
    out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def why_left(node):
    """Why a reduction over one middle dimension still in the graph was not rewritten (dump's
    reason for an op left on ATen), or None where ``node`` is no such reduction."""
    found = _middle(node)
    return None if found is None else f"reduction over a middle dim: {found[2] or 'not rewritten'}"


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s reductions over one middle dimension, in place; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        found = _middle(node)
        if found is None or found[2] is not None:
            continue
        x, d, _ = found
        if _as_rows(x, d):
            as_rows(gm, node, aten.permute.default, [i for i in range(x.dim()) if i != d] + [d])
        else:
            _unrolled(gm, node, x, d)
        done += 1
    return done
