"""Cumsums over a dimension other than the last as cumsums over the last (ATen graph, first
passes).

Kernels scan along their rows only (``codegen/lower.py``'s ``_scan``). Mamba2's chunked scan
(transformers' PyTorch path, the one torch.compile traces for Mamba2, Bamba, Granite 4 and
Nemotron-H) sums each chunk's decays with ``cumsum(dim=-2)`` of a [b, h, c, l, l] tensor that an
expand and a mask make; the cumsum stayed on ATen, and the masked expand was written out for it.
Each such cumsum becomes

    x [*L, C, *T]  ->  permute [*L, *T, C]  ->  cumsum(-1)  ->  permute back  ->  clone

a row kernel over rows of C elements lying prod(T) apart, consecutive rows side by side
(strided rows, as middle_dims' reductions), which takes the producers of x with it, and its
readers: what has another shape than the rows is evaluated and stored at the index its views
pull the rows to (``codegen/row_outputs.py``). The clone gives the result ATen's contiguous
layout. Where the permuted rows have the result's own shape (a square transposition: Mamba2's
[l, l] blocks) they take a leading dim of 1 (``trailing_dims.rows_of``, as middle_dims' rows
do), which the scan's result drops again: else its readers went to a kernel of their own (on
an H100, Mamba2's segment sum of [4, 32, 4, 256] decays took 209 us in two kernels that way,
against 287 us with ATen's cumsum and Inductor's 51 us in one).

Only where the rows read well as strided rows (``middle_dims``' rule: the scanned dim at stride
1, or runs of at least ``RUN`` consecutive rows side by side), the input has static sizes and
elements, the scan is not fp64, and ATen's result is contiguous; else ATen's cumsum stays, and
``why_left`` says why.
"""
from __future__ import annotations

import torch

from .middle_dims import RUN, _as_rows
from .pad_gemm import _val, contiguous, emit
from .trailing_dims import rows_of

aten = torch.ops.aten


def _scan(node):
    """(x, d, why) where ``node`` is a cumsum over dim d of ``x``, not the last: ``why`` is None
    where the rewrite applies, else why not; None where ``node`` is no such cumsum."""
    if node.op != "call_function" or node.target is not aten.cumsum.default:
        return None
    x, out = _val(node.args[0]), node.meta.get("val")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if x is None or out is None or not isinstance(dim, int) or x.dim() < 2 \
            or dim % x.dim() == x.dim() - 1:
        return None
    d = dim % x.dim()
    if not all(type(s) is int for s in (*x.shape, *x.stride())):
        why = "symbolic sizes (dynamic shapes)"
    elif x.numel() == 0:
        why = "no elements"
    elif torch.float64 in (x.dtype, out.dtype):
        why = "fp64 cumsums stay on ATen"
    elif not out.is_contiguous():
        why = "ATen's result is not contiguous (its input's layout)"
    elif not _as_rows(x, d):
        why = f"its rows lie side by side in runs under {RUN} elements"
    else:
        why = None
    return x, d, why


def why_left(node):
    """Why a cumsum over a dim other than the last still in the graph was not rewritten (dump's
    reason for an op left on ATen), or None where ``node`` is no such cumsum."""
    found = _scan(node)
    return None if found is None else f"cumsum over dim {found[1]}: {found[2] or 'not rewritten'}"


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s cumsums over a dim other than the last, in place; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        found = _scan(node)
        if found is None or found[2] is not None:
            continue
        x, d, _ = found
        order = [i for i in range(x.dim()) if i != d] + [d]
        back = sorted(range(x.dim()), key=order.__getitem__)
        mode = x.fake_mode
        with gm.graph.inserting_before(node):
            rows = rows_of(gm, node.args[0], aten.permute.default, order, mode)
            scan = gm.graph.call_function(aten.cumsum.default, (rows, -1),
                                          {k: v for k, v in node.kwargs.items() if k != "dim"})
            with mode:
                scan.meta["val"] = aten.cumsum.default(rows.meta["val"], -1, **scan.kwargs)
            if rows.target is aten.unsqueeze.default:       # rows_of's leading dim of 1
                scan = emit(gm, aten.squeeze.dim, (scan, 0), mode)
            out = contiguous(gm, emit(gm, aten.permute.default, (scan, back), mode))
        out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        done += 1
    return done
