"""Rows of a table picked by an index tensor are a gather a kernel can do (ATen graph, first passes).

``table[idx]`` (``aten.index.Tensor(table, [idx])``) with one integer index tensor on the first
dimension of a 2-d table picks rows, as ``embedding(table, idx)`` does, except that a negative
index counts from the end. Swin's relative position bias is one
(``bias_table[position_index]``, then a permute and a copy into the attention mask): on ATen an
index kernel and a copy per block. Here it becomes

    embedding(table, where(idx < 0, idx + rows, idx))

which the fusion pass takes as a gather (``classify``), joining the kernel that reads it. An
index outside [-rows, rows) stays an error: the gather asserts its index (codegen ``_index``),
as eager's index does.

One integer index tensor on another dimension, or of a tensor of another rank
(``x[:, cols]``, ``x[..., idx]``: ``index.Tensor(x, [None, ..., idx])``), picks along that
dimension, and becomes

    index_select(x, d, where(idx < 0, idx + n, idx).view(-1)).view(x[:d] + idx + x[d+1:])

the same values in the same dims (one advanced index keeps its place). Left alone: boolean
masks, several index tensors, symbolic sizes along the picked dimension.
"""
from __future__ import annotations

import logging

import torch

from .pad_gemm import _val, emit

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")


def wrap_negative(gm, idx, n: int, mode) -> list:
    """The nodes of ``where(idx < 0, idx + n, idx)`` (an index counting from the end, as
    ATen's), emitted at the graph's insertion point; the last is the wrapped index."""
    negative = emit(gm, aten.lt.Scalar, (idx, 0), mode)
    wrapped = emit(gm, aten.add.Tensor, (idx, n), mode)
    return [negative, wrapped, emit(gm, aten.where.self, (negative, wrapped, idx), mode)]


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s row picks in place; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor \
                or len(node.args) != 2 or node.kwargs:
            continue
        table, indices = node.args
        if not isinstance(indices, (list, tuple)):
            continue
        tensors = [k for k, i in enumerate(indices) if i is not None]
        if len(tensors) != 1 or not isinstance(indices[tensors[0]], torch.fx.Node):
            continue
        d, idx = tensors[0], indices[tensors[0]]
        out, t, i = _val(node), _val(table), _val(idx)
        if out is None or t is None or i is None or d >= t.dim() \
                or i.dtype not in (torch.int32, torch.int64) or not isinstance(t.shape[d], int) \
                or i.device != t.device:
            continue
        embedding = d == 0 and t.dim() == 2
        if not embedding and not all(isinstance(s, int) for s in (*t.shape, *i.shape)):
            continue                    # the view back would have symbolic sizes
        mode = out.fake_mode
        with gm.graph.inserting_before(node):
            made = wrap_negative(gm, idx, t.shape[d], mode)
            where = made[-1]
            if embedding:
                made.append(emit(gm, aten.embedding.default, (table, where), mode))
            else:
                flat = emit(gm, aten.reshape.default, (where, [-1]), mode)
                picked = emit(gm, aten.index_select.default, (table, d, flat), mode)
                shape = [*t.shape[:d], *i.shape, *t.shape[d + 1:]]
                made += [flat, picked, emit(gm, aten.view.default, (picked, shape), mode)]
        rows, got = made[-1], made[-1].meta["val"]
        if (got.shape, got.stride(), got.dtype) != (out.shape, out.stride(), out.dtype):
            for n in reversed(made):
                gm.graph.erase_node(n)
            continue
        node.replace_all_uses_with(rows)
        gm.graph.erase_node(node)
        done += 1
    if done:
        log.info("fusion-compiler: %d picks by an index tensor made gathers", done)
    return done
