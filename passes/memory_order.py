"""Reductions over dims out of memory order as over the same dims in it (ATen graph, first passes).

outer_dims, column_sums and trailing_dims rewrite a reduction over leading dims, trailing dims
or both into row kernels, where the reduced dims merge into one by their strides. A tensor
whose dims lie in memory in another order than its shape's fails that test though its elements
are dense. Mamba's depthwise convolution in training is one: the weight's gradient sums the
tap products [N, L, C] over batch and time, and the products lie time-innermost (strides
[C * L, 1, L]: ATen's layout for the causal slice's zero-padded gradient), so the five sums a
layer stayed on ATen behind a kernel that wrote the products for them. Here such a reduction
becomes the same one over the input viewed in memory order,

    x [N, L, C] (strides [C*L, 1, L])  ->  permute [N, C, L] (contiguous)  ->  sum([0, 2])

which outer_dims then makes a row kernel over L with the products' producers, then a small
sum over N. Only where the kept dims keep their order (the result is the same tensor, no
transpose after) and one of those passes takes the new form: else the graph is left as it was.
Reductions over two dims or more of a dense tensor, not over every dim (column_sums's full
reductions read any order already), float inputs other than fp64, static sizes, no
``dtype=``.
"""
from __future__ import annotations

import torch

from ..slices import dense_order
from . import column_sums, outer_dims, trailing_dims
from .pad_gemm import emit
from .trailing_dims import reduced, unfit

aten = torch.ops.aten


def _rewritable(node) -> bool:
    """Whether one of the passes after this one rewrites reduction ``node`` as it stands."""
    for found in (outer_dims._outer(node), column_sums._leading(node),
                  trailing_dims._trailing(node)):
        if found is not None and found[-1] is None:
            return True
    return False


def _candidate(node):
    """(x, order, dims) where ``node`` reduces a dense float tensor ``x`` over two dims or
    more, not all, out of its memory order ``order`` (a permutation that makes ``x``
    contiguous), the kept dims in that order as in ``x``'s, and no pass after this one
    rewrites it as it stands; ``dims`` the reduced dims' places in that order. Else None."""
    x = reduced(node)
    if x is None or x.dim() < 3 or unfit(node, x) is not None:    # two reduced dims, one kept
        return None
    nd = x.dim()
    dims = {d % nd for d in node.args[1]}
    if len(dims) < 2 or len(dims) == nd or x.is_contiguous():
        return None
    order = dense_order(x)
    if order is None or [d for d in order if d not in dims] != sorted(set(range(nd)) - dims) \
            or _rewritable(node):
        return None
    return x, order, sorted(order.index(d) for d in dims)


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s reductions over dims out of memory order, in place; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        found = _candidate(node)
        if found is None:
            continue
        x, order, dims = found
        mode = x.fake_mode
        with gm.graph.inserting_before(node):
            view = emit(gm, aten.permute.default, (node.args[0], order), mode)
            out = emit(gm, node.target, (view, dims), mode)
        if not _rewritable(out):        # no pass takes it either way: left as it was
            gm.graph.erase_node(out)
            gm.graph.erase_node(view)
            continue
        if list(out.meta["val"].shape) != list(node.meta["val"].shape):   # keepdim
            with gm.graph.inserting_after(out):
                shaped = emit(gm, aten.view.default, (out, list(node.meta["val"].shape)), mode)
            out = shaped
        out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        done += 1
    return done
