"""Broadcast products summed over a shared dim (an einsum written out) as batched GEMMs, and
sums over dims of size 1 as copies (ATen graph, first passes).

transformers' Mamba2 path (the PyTorch one torch.compile traces: Mamba2, Bamba, Granite 4
hybrid, Falcon-H1, Zamba2, Nemotron-H) writes its chunked scan's contractions as products of
broadcast operands summed over one dim:

    G = (C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(dim=-1)     # [b, c, l, s, h]

which is, per (b, c, h), a [l, n] @ [n, s] matrix product. Eager writes the whole product out
(35 GB for Mamba2 at 4 x 1024 tokens); a fused reduction kernel does not, but reads both
operands again for every output element: 3.1 ms for this one on an H100, where cuBLAS's bmm
takes tens of microseconds. Such a sum becomes

    a -> permute [batch, M, K] (a copy where that is not a view)  \\
                                                                    bmm -> [batch, M, N]
    b -> permute [batch, K, N] (a copy where that is not a view)  /

viewed and permuted back to the sum's dims, a clone giving ATen's contiguous layout. The
backward of such a sum is two more (dC sums dG times B over s): autograd writes those operands'
broadcasts out as ``expand`` calls, looked through here (transformers 5.17's Mamba2 backward:
14.9 ms a layer on an H100 as fused reductions). Each dim of
the product is a batch dim (both operands span it), an M dim (only ``a``; ``b`` broadcast), an
N dim (only ``b``) or a K dim (summed; both span it). The copies and the clone are pointwise:
they fuse with the operands' producers and the sum's readers.

Only where the sum over broadcast operands is a real matrix product (M, N and K each at least
``MIN_DIM`` elements: a product by a vector is a reduction that reads each operand once, fused
as it is), the operands are fp32, with matmuls in full fp32 (``torch.get_float32_matmul_precision()
== "highest"``: with TF32 allowed a bmm would round the operands to 10-bit mantissas, where the
sum of products does not), static sizes, the product read by the sum alone, no dtype argument,
no summed dim broadcast in an operand. bf16/fp16 stay: eager rounds each product to the dtype
before summing, a bmm does not. Else the product and sum stay as they are (a fused reduction).

The same code sums over a dim of size 1 (``M = (G[..., None] * L[..., None]).sum(-1)``): each
output element is its one input element plus 0.0 (ATen's -0.0 sums to +0.0), a copy in the
sum's layout that fuses with the product (``column_sums.as_copy``), where a reduction kernel
took a row of one element a program lane.
"""
from __future__ import annotations

import math

import torch

from .column_sums import as_copy
from .fast_calls import CHAIN_VIEWS
from .pad_gemm import _val, contiguous, emit

aten = torch.ops.aten

MIN_DIM = 16        # elements of each of M, N and K (products of their dims)


def _plan(node):
    """(a, b, dims, why) where ``node`` sums a product of broadcast operands that is a matrix
    product: dims maps each kind ("batch", "m", "n", "k") to its dims of the product, in order;
    ``why`` is None where the rewrite applies, else why the sum stays a fused reduction
    (module docstring). None where it is no matrix product."""
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList \
            or len(node.args) < 2 or not node.args[1]:
        return None                 # (no dims: a sum of every element)
    prod = node.args[0]
    if not isinstance(prod, torch.fx.Node) or prod.target is not aten.mul.Tensor or prod.kwargs:
        return None
    a, b = (_unexpanded(x) for x in prod.args)
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    va, vb, vp, out = _val(a), _val(b), _val(prod), node.meta.get("val")
    if any(not isinstance(v, torch.Tensor) for v in (va, vb, vp, out)):
        return None
    if not all(type(s) is int for v in (va, vb, out) for s in (*v.shape, *v.stride())):
        return None
    rank = vp.dim()
    if va.dim() > rank or vb.dim() > rank or rank == 0:
        return None
    summed = {d % rank for d in node.args[1]}
    sa = (1,) * (rank - va.dim()) + tuple(va.shape)
    sb = (1,) * (rank - vb.dim()) + tuple(vb.shape)
    dims = {"batch": [], "m": [], "n": [], "k": []}
    for d, n in enumerate(vp.shape):
        if n == 1:
            continue
        if d in summed:
            if sa[d] != n or sb[d] != n:
                return None         # a summed dim broadcast in an operand
            dims["k"].append(d)
        elif sa[d] == n and sb[d] == n:
            dims["batch"].append(d)
        elif sa[d] == n:
            dims["m"].append(d)
        else:
            dims["n"].append(d)
    if any(math.prod(vp.shape[d] for d in dims[kind]) < MIN_DIM for kind in "mnk"):
        return None
    return a, b, dims, _kept(node, prod, va, vb, vp, out)


def _kept(node, prod, va, vb, vp, out):
    """Why the matrix product ``node`` sums stays a fused reduction; None where it may not."""
    if node.kwargs.get("dtype") is not None:
        return f"summed in {node.kwargs['dtype']}"
    if len(prod.users) != 1:
        return "the product is read by more than the sum"
    dtypes = {str(v.dtype).removeprefix("torch.") for v in (va, vb, vp, out)}
    if dtypes != {"float32"}:
        return (f"{'/'.join(sorted(dtypes))}, not fp32: eager rounds each product before the "
                "sum, a bmm would not")
    if torch.get_float32_matmul_precision() != "highest":
        return ("TF32 matmuls allowed (torch.get_float32_matmul_precision() is "
                f"{torch.get_float32_matmul_precision()!r}): a bmm would round the operands")
    return None


def _unexpanded(x):
    """``x`` less the ``expand`` calls it went through: autograd's backward of a broadcast
    product writes the broadcast out (``expand(dy, ...)``), where the forward let ``mul``
    broadcast. The expand's input broadcasts the same way (its sizes of 1, or fewer dims)."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function" \
            and x.target is aten.expand.default and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x


def _unit_sum(node) -> bool:
    """Whether ``node`` sums a float tensor over dims of size 1 only, in its own dtype: each
    output element is its one input element (Mamba2's ``M = (G[..., None] * L[..., None])
    .sum(-1)``: a row kernel over 33.5M rows of one element took 608 us on an H100)."""
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList \
            or len(node.args) < 2 or not node.args[1] or node.kwargs.get("dtype") is not None:
        return False
    x, out = _val(node.args[0]), node.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) \
            or not x.dtype.is_floating_point or out.dtype != x.dtype or x.dim() == 0:
        return False
    return all(type(x.shape[d]) is int and x.shape[d] == 1 for d in node.args[1])


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s summed broadcast products that are matrix products as bmm calls, and
    its sums over dims of size 1 as copies, in place; each bmm named in
    ``ctx.contractions``, each matrix product left a fused reduction in
    ``ctx.contractions_kept`` with the reason. How many were rewritten."""
    done = 0
    copies: dict = {}               # (root, layout) -> its contiguous copy made here
    for node in list(gm.graph.nodes):
        if _unit_sum(node):
            rank = _val(node.args[0]).dim()
            as_copy(gm, node, sorted({d % rank for d in node.args[1]}))
            done += 1
            continue
        found = _plan(node)
        if found is None:
            continue
        a, b, dims, why = found
        prod = node.args[0]
        vp = _val(prod)
        shape = tuple(vp.shape)
        size = {kind: math.prod(shape[d] for d in ds) for kind, ds in dims.items()}
        if why is not None:
            ctx.contractions_kept.append(
                (node.name, size["batch"], size["m"], size["k"], size["n"], why))
            continue
        mode = vp.fake_mode
        with gm.graph.inserting_before(node):
            left = _operand(gm, a, shape, dims["batch"] + dims["m"] + dims["k"],
                            [size["batch"], size["m"], size["k"]], mode, copies)
            right = _operand(gm, b, shape, dims["batch"] + dims["k"] + dims["n"],
                             [size["batch"], size["k"], size["n"]], mode, copies)
            mm = emit(gm, aten.bmm.default, (left, right), mode)
            kept = dims["batch"] + dims["m"] + dims["n"]
            out = emit(gm, aten.view.default, (mm, [shape[d] for d in kept]), mode)
            order = sorted(range(len(kept)), key=kept.__getitem__)
            if order != list(range(len(kept))):
                out = emit(gm, aten.permute.default, (out, order), mode)
            want = node.meta["val"]
            ones = _ones(node, shape)
            for d in ones:          # the sum's sizes of 1: the product's, keepdim's
                out = emit(gm, aten.unsqueeze.default, (out, d), mode)
            if out.meta["val"].stride() != want.stride():
                out = contiguous(gm, out)       # ATen's layout
        out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
        node.replace_all_uses_with(out)
        read = prod.args
        gm.graph.erase_node(node)
        gm.graph.erase_node(prod)
        for x in read:              # the expands it read, now read by nothing
            while isinstance(x, torch.fx.Node) and x.target is aten.expand.default \
                    and not x.users:
                gm.graph.erase_node(x)
                x = x.args[0]
        ctx.contractions.append((node.name, size["batch"], size["m"], size["k"], size["n"]))
        done += 1
    return done


def _operand(gm, x, shape, order, sizes, mode, copies):
    """``x`` (broadcast to ``shape``) as a [batch, rows, cols] tensor: its dims ``order`` first,
    its broadcast dims (sizes of 1) after them, permuted there and merged; copied contiguous
    where that is not a view. A copy of the same elements in the same order as one made
    before (``copies``: the backward's contractions read a forward operand again, each through
    its own views) is that one."""
    v = _val(x)
    full = (1,) * (len(shape) - v.dim()) + tuple(v.shape)
    made = []
    if v.dim() < len(shape):
        x = emit(gm, aten.view.default, (x, list(full)), mode)
        made.append(x)
    rest = [d for d in range(len(shape)) if d not in order]     # its sizes of 1
    perm = order + rest
    if perm != list(range(len(shape))):
        x = emit(gm, aten.permute.default, (x, perm), mode)
        made.append(x)
    if not _viewable(_val(x), sizes):
        key = _layout_key(x)
        if key in copies:
            for n in reversed(made):
                gm.graph.erase_node(n)
            x = copies[key]
        else:
            x = copies[key] = contiguous(gm, x)
    return emit(gm, aten.view.default, (x, sizes), mode)


def _layout_key(x):
    """What ``x``'s elements are, in its order: the node whose storage it views (through
    view ops) and its sizes, strides (but at sizes of 1) and offset there."""
    v = _val(x)
    root = x
    while root.op == "call_function" and root.target in CHAIN_VIEWS:
        root = root.args[0]
    strides = tuple(st if n != 1 else 0 for n, st in zip(v.shape, v.stride()))  # any at 1
    return root, tuple(v.shape), strides, v.storage_offset()


def _viewable(v, sizes) -> bool:
    """Whether ``v`` (a fake tensor) can be viewed as ``sizes``."""
    with v.fake_mode:
        try:
            v.view(sizes)
        except (RuntimeError, ValueError):
            return False
    return True


def _ones(node, shape) -> list:
    """The positions of the sum's sizes of 1 in its result (the product's dims of size 1 that
    are not summed, and the summed dims where it keeps them), in increasing order."""
    rank = len(shape)
    summed = {d % rank for d in node.args[1]}
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    ones, pos = [], 0
    for d, n in enumerate(shape):
        if d in summed and not keepdim:
            continue
        if d in summed or n == 1:
            ones.append(pos)
        pos += 1
    return ones
