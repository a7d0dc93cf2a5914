"""Rows of a table picked by an index tensor are a gather a kernel can do (ATen graph, first passes).

``table[idx]`` (``aten.index.Tensor(table, [idx])``) with one integer index tensor on the first
dimension of a 2-d table picks rows, as ``embedding(table, idx)`` does, except that a negative
index counts from the end. Swin's relative position bias is one
(``bias_table[position_index]``, then a permute and a copy into the attention mask): on ATen an
index kernel and a copy per block. Here it becomes

    embedding(table, where(idx < 0, idx + rows, idx))

which the fusion pass takes as a gather (``classify``), joining the kernel that reads it. An
index outside [-rows, rows) stays an error: the gather asserts its index (codegen ``_index``),
as eager's index does. Left alone: boolean masks, several index tensors, an index on another
dimension, tables of another rank, symbolic row counts.
"""
from __future__ import annotations

import logging

import torch

from .pad_gemm import _val, emit

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s row picks in place; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor \
                or len(node.args) != 2 or node.kwargs:
            continue
        table, indices = node.args
        if not isinstance(indices, (list, tuple)) or len(indices) != 1 \
                or not isinstance(indices[0], torch.fx.Node):
            continue
        (idx,) = indices
        out, t, i = _val(node), _val(table), _val(idx)
        if out is None or t is None or i is None or t.dim() != 2 \
                or i.dtype not in (torch.int32, torch.int64) or not isinstance(t.shape[0], int) \
                or i.device != t.device:
            continue
        mode = out.fake_mode
        with gm.graph.inserting_before(node):
            negative = emit(gm, aten.lt.Scalar, (idx, 0), mode)
            wrapped = emit(gm, aten.add.Tensor, (idx, t.shape[0]), mode)
            where = emit(gm, aten.where.self, (negative, wrapped, idx), mode)
            rows = emit(gm, aten.embedding.default, (table, where), mode)
        got = rows.meta["val"]
        if (got.shape, got.stride(), got.dtype) != (out.shape, out.stride(), out.dtype):
            for n in (rows, where, wrapped, negative):
                gm.graph.erase_node(n)
            continue
        node.replace_all_uses_with(rows)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
        log.info("fusion-compiler: %d row picks by index made gathers", done)
    return done
