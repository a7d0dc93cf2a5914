"""Sums over leading dimensions as sums over the last dimension (ATen graph, first passes).

A training graph sums gradients over the tokens: a Linear's bias gradient ``sum(g, [0])``, a
norm's weight gradient ``sum(g * xhat, [0, 1])``. Kernels reduce over the last dimension only,
so these stayed on ATen, each behind a kernel that wrote its input out for it (GPT-2 8 x 512:
99 of them, 1252 us of a training step on the H200, session 26). Here each becomes

    x [R, *C]  ->  view [S, R/S, *C]  ->  permute [S, *C, R/S]  ->  sum(-1, fp32)  [S, *C]
               ->  permute [*C, S]    ->  sum(-1)  [*C]  ->  x's dtype

a split reduction, as Inductor's: the first sum is a row kernel over S x C rows of R/S
elements lying C apart, consecutive rows side by side (strided rows: a program reads a run of
columns), which takes the producers of x with it, and x itself where the graph needs it (stored
where the permuted view reads each element: ``row_outputs.pulled``); its S partial sums a column
stay in fp32, and the second, small sum adds them. S splits the rows into chunks of about
``decompositions.CHUNK`` so the first kernel has programs for every SM. Rows that allow no split (fewer
than 2 x ``CHUNK``, or an odd count) take one sum.

A mean over leading dims (BatchNorm1d's statistics over [N, C]) is the same sum divided by
the rows' count in fp32. Eager's CUDA sum accumulates in fp32 and rounds once; so do these.

A reduction over every dim (``sum()``, ``mean()``, ``amax``: a loss's sum, a per-tensor
amax) is one over the last dim of its input viewed as one row in memory order (``_full``,
``_flatten``): a row kernel with the input's producers, split across programs where the row
is long, where the code generator, which reduces over the last dim only, left it to ATen.
"""
from __future__ import annotations

import math

import torch

from ..decompositions import splits
from ..slices import dense_order
from .pad_gemm import _val, contiguous, emit
from .shapes import mergeable

aten = torch.ops.aten

# node.meta key of the sums made here: "partials", "total" or "sum" (unsplit); dump's labels
MARK = "fc_column_sum"


def _leading(node):
    """(x, k, why) where ``node`` is a plain sum of a float tensor ``x`` over its first k
    dimensions (k < rank): ``why`` is None where the rewrite applies (static sizes, the k
    dimensions mergeable into one, at least two rows and two columns), else why not; None where
    ``node`` is no such sum."""
    if node.op != "call_function" or node.target not in (aten.sum.dim_IntList, aten.mean.dim) \
            or node.kwargs.get("dtype") is not None or len(node.args) < 2:
        return None
    x, dims = _val(node.args[0]), node.args[1]
    if x is None or not x.dtype.is_floating_point or x.dim() < 2 or dims is None \
            or x.dtype == torch.float64:
        return None
    dims = sorted(d % x.dim() for d in ([dims] if isinstance(dims, int) else dims))
    k = len(dims)
    if dims != list(range(k)) or k in (0, x.dim()):     # an empty list sums every dim
        return None
    why = None
    if not all(isinstance(s, int) for s in (*x.shape, *x.stride())):
        why = "symbolic sizes (dynamic shapes)"
    elif not mergeable(x, 0, k):
        why = "the summed dims are no view of one dimension (their strides)"
    elif math.prod(x.shape[:k]) < 2 or math.prod(x.shape[k:]) < 2:
        why = "a single row or column"
    return x, k, why


def why_left(node, enabled: bool):
    """Why a sum over leading dimensions or a full reduction still in the graph was not
    rewritten (dump's reason for an op left on ATen), or None where ``node`` is neither."""
    full = _full(node)
    if full is not None:
        if not enabled:
            return "full reduction: column sums are off (FUSION_COMPILER_COLUMN_SUMS=0)"
        return f"full reduction: {full[1] or 'not rewritten'}"
    found = _leading(node)
    if found is None:
        return None
    if not enabled:
        return ("sum or mean over leading dims: column sums are off "
                "(FUSION_COMPILER_COLUMN_SUMS=0)")
    return f"sum or mean over leading dims: {found[2] or 'not rewritten'}"


# full reductions -> the op that reduces the flat view's last dim
FULL = {aten.sum.dim_IntList: aten.sum.dim_IntList, aten.sum.default: aten.sum.dim_IntList,
        aten.mean.dim: aten.mean.dim, aten.mean.default: aten.mean.dim,
        aten.amax.default: aten.amax.default, aten.amin.default: aten.amin.default}


def _full(node):
    """(x, why, order) where ``node`` reduces a float tensor ``x`` (not fp64, no ``dtype=``) over
    every dim (an empty dim list, or all of them; a 1-d input only by an empty list: over its
    one dim it is a row already): a loss's ``sum()``, a per-tensor ``amax``. ``why`` is None
    where the rewrite applies (static sizes, at least two elements, memory without gaps or
    overlaps), else why not; ``order`` the permutation that makes ``x`` contiguous
    (``slices.dense_order``, None where none does); None where ``node`` is no such reduction."""
    if node.op != "call_function" or node.target not in FULL or node.kwargs.get("dtype"):
        return None
    x = _val(node.args[0])
    if x is None or x.dim() == 0 or not x.dtype.is_floating_point or x.dtype == torch.float64:
        return None
    if node.target in (aten.sum.default, aten.mean.default):
        if len(node.args) > 1:
            return None
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if dims and (x.dim() == 1 or sorted(d % x.dim() for d in dims) != list(range(x.dim()))):
            return None
    why, order = None, dense_order(x)
    if not all(type(v) is int for v in (*x.shape, *x.stride())):
        why = "symbolic sizes (dynamic shapes)"
    elif math.prod(x.shape) < 2:
        why = "a single element"
    elif order is None:
        why = "its input has gaps or overlaps in memory (a strided slice, an expand): no flat view"
    return x, why, order


def _flatten(gm, node, x, order) -> None:
    """Full reduction ``node`` of ``x`` made one over the last dim of ``x`` viewed as one row in
    memory order ``order`` (any order reduces the same elements): a row kernel with its
    producers, split across programs where the row is long (launch.split_settings), where it
    stayed on ATen ("reduction not over the last dimension")."""
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    mode = x.fake_mode
    with gm.graph.inserting_before(node):
        t = node.args[0]
        if order != list(range(x.dim())):
            t = emit(gm, aten.permute.default, (t, order), mode)
        t = emit(gm, aten.view.default, (t, [math.prod(x.shape)]), mode)
        out = emit(gm, FULL[node.target], (t, [-1]), mode)
        if keepdim:
            out = emit(gm, aten.view.default, (out, [1] * x.dim()), mode)
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _one_row(x, k: int) -> bool:
    """Whether the first ``k`` dims of ``x`` are static and all of size 1."""
    return all(isinstance(d, int) and d == 1 for d in x.shape[:k])


def as_copy(gm, node, dims: list) -> None:
    """Sum (or mean) ``node`` over ``dims`` of its input, all of size 1, made the copy it is:
    ``x + 0.0`` (ATen's sum adds to a zero, so -0.0 sums to +0.0; any other value, NaN
    included, is itself), contiguous as the sum's output, at its shape. A pointwise op that
    joins its producer's kernel, where the sum stayed on ATen (a fuzzer's find:
    ``x.sum(0, keepdim=True)`` of a [1, 3] input), or took a row kernel over rows of one
    element (Mamba2's ``(G[..., None] * L[..., None]).sum(-1)``, passes/contractions.py)."""
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    mode = _val(node.args[0]).fake_mode
    with gm.graph.inserting_before(node):
        t = emit(gm, aten.squeeze.dims, (node.args[0], sorted(dims)), mode)
        t = emit(gm, aten.add.Tensor, (t, 0.0), mode)
        copy = contiguous(gm, t)
        if keepdim:
            copy = emit(gm, aten.view.default, (copy, list(node.meta["val"].shape)), mode)
    copy.meta.update({key: v for key, v in node.meta.items() if key != "val"})
    node.replace_all_uses_with(copy)
    gm.graph.erase_node(node)


def _in_fp32(node, rows, mode) -> None:
    """Make sum ``node`` of ``rows`` keep its result in fp32: sum(..., dtype=fp32) as a
    kernel."""
    node.kwargs = {"dtype": torch.float32}
    with mode:
        node.meta["val"] = aten.sum.dim_IntList(_val(rows), [-1], dtype=torch.float32)


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s sums (and means) over leading dimensions, in place; how many."""
    if not ctx.config.column_sums:
        return 0
    done = 0
    for node in list(gm.graph.nodes):
        full = _full(node)
        if full is not None:
            if full[1] is None:
                _flatten(gm, node, full[0], full[2])
                done += 1
            continue
        found = _leading(node)
        if found is not None and _one_row(found[0], found[1]):
            as_copy(gm, node, list(range(found[1])))
            done += 1
            continue
        if found is None or found[2] is not None:
            continue
        x, k, _ = found
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        rows, rest = math.prod(x.shape[:k]), list(x.shape[k:])
        s, mode, n = splits(rows), x.fake_mode, len(rest)
        mean, low = node.target is aten.mean.dim, x.dtype != torch.float32
        src = node.args[0]
        with gm.graph.inserting_before(node):
            if s == 1:          # [R, *C] -> [*C, R]: one sum
                t = emit(gm, aten.view.default, (src, [rows] + rest), mode) if k > 1 else src
                t = emit(gm, aten.permute.default, (t, list(range(1, n + 1)) + [0]), mode)
                total = emit(gm, aten.sum.dim_IntList, (t, [-1]), mode)
                total.meta[MARK] = "sum"
                if mean and low:    # divided in fp32, then rounded once
                    _in_fp32(total, t, mode)
            else:
                t = emit(gm, aten.view.default, (src, [s, rows // s] + rest), mode)
                t = emit(gm, aten.permute.default, (t, [0] + list(range(2, n + 2)) + [1]), mode)
                part = emit(gm, aten.sum.dim_IntList, (t, [-1]), mode)
                part.meta[MARK] = "partials"
                if low:     # the partials stay fp32
                    _in_fp32(part, t, mode)
                t = emit(gm, aten.permute.default, (part, list(range(1, n + 1)) + [0]), mode)
                total = emit(gm, aten.sum.dim_IntList, (t, [-1]), mode)
                total.meta[MARK] = "total"
            if mean:
                total = emit(gm, aten.div.Tensor, (total, rows), mode)
            if low and (mean or s > 1):
                total = emit(gm, torch.ops.prims.convert_element_type.default,
                             (total, x.dtype), mode)
            if keepdim:
                total = emit(gm, aten.view.default, (total, [1] * k + rest), mode)
        total.meta.update({k2: v for k2, v in node.meta.items() if k2 not in ("val",)})
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
        done += 1
    return done
