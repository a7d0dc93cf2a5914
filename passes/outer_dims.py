"""Sums and means over leading and trailing dimensions at once (ATen graph, first passes).

BatchNorm reduces an [N, C, *S] tensor over every dimension but the channels: its statistics,
``var_mean(x, [0, 2, 3])``, and in the backward its weight and bias gradients,
``sum(g * xhat, [0, 2, 3])``. Kernels reduce over the last dimension only, so these stayed on
ATen, each behind a kernel that wrote its input out for it. Each becomes two reductions,

    x [*L, *K, *T]  ->  sum(T) [*L, *K]  (fp32)  ->  sum(L) [*K]  (/ count for a mean)
                    ->  x's dtype  (-> view [1..., *K, 1...] for keepdim)

the first over the trailing dims, which trailing_dims makes a row kernel over rows of prod(T)
elements (contiguous for NCHW, C apart for channels-last) that takes x's producers with it;
the second over the leading dims of that small fp32 result, which column_sums makes a sum of
rows. Eager's reduction accumulates in fp32 and rounds once; so does this. Sums and means of
float inputs other than fp64, static sizes, no ``dtype=``, the trailing dims a view of one.

Where the kept dims lie innermost in memory (channels-last: [N, C, H, W] with C at stride 1),
rows over the trailing dims would lie C apart and be long, so a program would hold few of them
and read runs of a few bytes. There the reduction is one over the leading dims of the view
[N, H, W, C] (contiguous), which column_sums makes a split sum of rows of C side by side:

    x [N, C, H, W] (channels-last)  ->  permute [N, H, W, C]  ->  sum([0, 1, 2])  ->  column_sums
"""
from __future__ import annotations

import math

import torch

from ..decompositions import lead_and_trail, reduced_last
from .pad_gemm import emit
from .shapes import mergeable
from .trailing_dims import reduced, unfit

aten = torch.ops.aten
prims = torch.ops.prims


def _outer(node):
    """(x, a, b, why) where ``node`` sums or averages a float tensor ``x`` over its first a
    dimensions and its dimensions b.. (0 < a < b < rank): ``why`` is None where the rewrite
    applies, else why not; None where ``node`` is no such reduction."""
    x = reduced(node)
    if x is None or node.target not in (aten.sum.dim_IntList, aten.mean.dim):
        return None
    split = lead_and_trail(x.dim(), node.args[1])
    if split is None:
        return None
    a, b = len(split[0]), split[1][0]
    why = unfit(node, x)
    if why is None and not mergeable(x, b, x.dim()):
        why = "the trailing reduced dims are no view of one dimension (their strides)"
    return x, a, b, why


def why_left(node):
    """Why a sum or mean over leading and trailing dimensions still in the graph was not
    rewritten (dump's reason for an op left on ATen), or None where ``node`` is no such
    reduction."""
    found = _outer(node)
    return None if found is None else \
        f"reduction over leading and trailing dims: {found[3] or 'not rewritten'}"


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s sums and means over leading and trailing dimensions, in place; how
    many."""
    done = 0
    for node in list(gm.graph.nodes):
        found = _outer(node)
        if found is None or found[3] is not None:
            continue
        x, a, b, _ = found
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        with gm.graph.inserting_before(node):
            reduced = list(range(a)) + list(range(b, x.dim()))
            if reduced_last(x, reduced, list(range(a, b))) is not None:
                out = _over_columns(gm, node, x, reduced, list(range(a, b)))
            else:
                out = _over_rows(gm, node, x, a, b)
            if keepdim:
                out = emit(gm, aten.view.default,
                           (out, [1] * a + list(x.shape[a:b]) + [1] * (x.dim() - b)), x.fake_mode)
        out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        done += 1
    return done


def _over_columns(gm, node, x, reduced, kept):
    """Channels-last: the sum or mean over the leading dims of the contiguous view
    [*reduced, *kept], which column_sums rewrites."""
    view = emit(gm, aten.permute.default, (node.args[0], reduced + kept), x.fake_mode)
    return emit(gm, node.target, (view, list(range(len(reduced)))), x.fake_mode)


def _over_rows(gm, node, x, a, b):
    """An fp32 sum over the trailing dims, then one over the leading dims, in x's dtype."""
    mode, src = x.fake_mode, node.args[0]
    if x.dtype != torch.float32:
        src = emit(gm, prims.convert_element_type.default, (src, torch.float32), mode)
    inner = emit(gm, aten.sum.dim_IntList, (src, list(range(b, x.dim()))), mode)
    if math.prod(x.shape[:a]) == 1:     # leading dims of size 1: nothing to add
        out = emit(gm, aten.view.default, (inner, list(x.shape[a:b])), mode)
    else:
        out = emit(gm, aten.sum.dim_IntList, (inner, list(range(a))), mode)
    if node.target is aten.mean.dim:
        out = emit(gm, aten.div.Tensor, (out, math.prod(x.shape[:a] + x.shape[b:])), mode)
    if x.dtype != torch.float32:
        out = emit(gm, prims.convert_element_type.default, (out, x.dtype), mode)
    return out
