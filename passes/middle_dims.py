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
1; else ATen's reduction, which picks its own order, stays. Sums, means, amax and amin of
float inputs other than fp64, static sizes, no ``dtype=``; the first dimension is
``column_sums``'s, the last needs nothing.
"""
from __future__ import annotations

import math

import torch

from .trailing_dims import as_rows, reduced, unfit

aten = torch.ops.aten

RUN = 16    # fewest elements of consecutive rows side by side (the dims after the reduced one)


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
    if why is None and x.stride(d) != 1 and (x.stride(-1) != 1
                                             or math.prod(x.shape[d + 1:]) < RUN):
        why = f"its rows lie side by side in runs under {RUN} elements"
    return x, d, why


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
        as_rows(gm, node, aten.permute.default, [i for i in range(x.dim()) if i != d] + [d])
        done += 1
    return done
