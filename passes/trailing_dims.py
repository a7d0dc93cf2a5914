"""Reductions over several trailing dimensions as reductions over one (ATen graph, first passes).

Kernels reduce over the last dimension only. A reduction over the last k >= 2 dimensions whose
strides let them merge into one (``view`` is legal) is rewritten as

    x [*L, *T]  ->  view [*L, prod(T)]  ->  op(-1)  [*L]  (-> view [*L, 1...] for keepdim)

so it becomes a row kernel. ConvNeXt's global pooling, ``mean(x, [-2, -1])`` of a
channels-last [N, C, H, W], is one: rows of H x W elements lying C apart (strided rows), which
stayed on ATen behind the residual add that wrote x (Hugging Face ConvNeXt-T, H200: an ATen
reduce kernel of 7.3 us where Inductor fuses add, mean and the LayerNorm after it).
Sums, means, amax and amin; float inputs other than fp64, static sizes, no ``dtype=``.
"""
from __future__ import annotations

import math

import torch

from .pad_gemm import _val, emit
from .shapes import mergeable

aten = torch.ops.aten

OPS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)


def reduced(node):
    """The float tensor (not fp64) a sum, mean, amax or amin ``node`` reduces over a list of
    dims, or None."""
    if node.op != "call_function" or node.target not in OPS or len(node.args) < 2:
        return None
    x = _val(node.args[0])
    if x is None or not x.dtype.is_floating_point or x.dtype == torch.float64 \
            or not isinstance(node.args[1], (list, tuple)):
        return None
    return x


def unfit(node, x):
    """Why reduction ``node`` of ``x`` is rewritten over no dims: ``dtype=``, symbolic sizes,
    no elements; None where none of them holds."""
    if node.kwargs.get("dtype") is not None:
        return "dtype= given"
    if not all(isinstance(s, int) for s in (*x.shape, *x.stride())):
        return "symbolic sizes (dynamic shapes)"     # not read: a data-dependent one cannot be
    if x.numel() == 0:
        return "no elements"
    return None


def rows_of(gm, src, layout_op, layout_arg, mode):
    """``layout_op(src, layout_arg)`` (a view or a permute of ``src``) added to ``gm``: the rows
    a row kernel reduces or scans. Where a permute gives them ``src``'s own shape (a square
    transposition: a channels-first LayerNorm over [N, C, C, C], Mamba2's [l, l] blocks) they
    take a leading dim of 1. A row kernel evaluates what has its rows' shape at the rows' own
    index, and what has another shape at the index its views pull the rows to
    (``codegen/row_outputs.py``: ``alongside``): ``src``'s readers would be evaluated at the
    rows' index, read the reduction at another row than its own, and go to a kernel of their
    own (a channels-first LayerNorm over [2, 16, 16, 16]: two kernels, [2, 16, 8, 8]: one)."""
    rows = emit(gm, layout_op, (src, layout_arg), mode)
    if list(rows.meta["val"].shape) == list(_val(src).shape):
        rows = emit(gm, aten.unsqueeze.default, (rows, 0), mode)
    return rows


def as_rows(gm, node, layout_op, layout_arg) -> None:
    """Replace reduction ``node`` by the same reduction over the last dimension of
    ``rows_of(x, ...)`` (a view or a permute of its input), viewed as ``node``'s result where
    its shape differs (dims kept, or of size 1)."""
    shape = list(node.meta["val"].shape)
    mode = _val(node.args[0]).fake_mode
    with gm.graph.inserting_before(node):
        rows = rows_of(gm, node.args[0], layout_op, layout_arg, mode)
        out = emit(gm, node.target, (rows, [-1]), mode)
        if list(out.meta["val"].shape) != shape:
            out = emit(gm, aten.view.default, (out, shape), mode)
    out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _trailing(node):
    """(x, k, why) where ``node`` reduces a float tensor ``x`` over its last k >= 2 dimensions
    (all of them only where it keeps some, all of size 1): ``why`` is None where the rewrite
    applies, else why not; None where ``node`` is no such reduction. Dims of size 1 it keeps
    count as reduced (a sum over one element): ``x.sum(0)`` of an [n, 1] tensor is a sum over
    both, its result viewed back to [1]."""
    x = reduced(node)
    if x is None:
        return None
    nd = x.dim()
    if nd < 2:
        return None
    dims = {d % nd for d in node.args[1]}
    if not dims or len(dims) == nd or dims == {nd - 1}:
        return None                 # every dim, or the last: one row, or a row already
    dims |= {d for d in range(min(dims), nd) if x.shape[d] == 1}
    k = len(dims)
    if k < 2 or sorted(dims) != list(range(nd - k, nd)):
        return None
    why = unfit(node, x)
    if why is None and not mergeable(x, nd - k, nd):
        why = "the reduced dims are no view of one dimension (their strides)"
    return x, k, why


def why_left(node):
    """Why a reduction over several trailing dimensions still in the graph was not rewritten
    (dump's reason for an op left on ATen), or None where ``node`` is no such reduction."""
    found = _trailing(node)
    return None if found is None else f"reduction over trailing dims: {found[2] or 'not rewritten'}"


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s reductions over several mergeable trailing dimensions, in place; how
    many."""
    done = 0
    for node in list(gm.graph.nodes):
        found = _trailing(node)
        if found is None or found[2] is not None:
            continue
        x, k, _ = found
        lead = list(x.shape[:-k])
        as_rows(gm, node, aten.view.default, lead + [math.prod(x.shape[-k:])])
        done += 1
    return done
