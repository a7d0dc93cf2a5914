"""A rotation by a constant index is a roll, which a kernel does by index arithmetic (ATen
graph, first passes, after constant_fold).

``torch.roll`` has no ATen kernel in the graphs aot_autograd hands us: its decomposition
(``torch._refs.roll``) picks along each rolled dimension with ``index_select(x, d,
fmod(arange(n) + k, n))``, one dimension at a time. constant_fold computes the index once,
so the graph holds ``index_select(x, d, <constant>)``: before this pass and the gathers by
index_select, Swin's shifted windows were four ATen kernels a shifted block (Swin-T at batch
32 on the H200: 20 kernels, about 400 us of a 3.7 ms call, BENCHMARKS.md). A gather would
load the index; where the constant is that rotation,

    index_select(x, d, (arange(n) + k) % n)   ->   roll(x, [(n - k) % n], [d])

the same values (``roll``'s output at i is x at (i - shift) mod n), which the fusion pass takes
as index arithmetic (``classify``): read at the rotated index by a kernel that reads it, or
stored there by the row kernel that computes x (codegen ``layout_chain``), which a gather
cannot be. Any other index, one computed at run time (symbolic sizes) stays an index_select,
a gather that loads its index.
"""
from __future__ import annotations

import logging

import torch

from .pad_gemm import _val, emit

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")


def rotation(index: torch.Tensor, n: int) -> int | None:
    """k if ``index`` is ``(arange(n) + k) % n``, else None."""
    if index.dim() != 1 or index.numel() != n or n == 0 \
            or index.dtype not in (torch.int32, torch.int64):
        return None
    with torch.utils._python_dispatch._disable_current_modes():     # a real tensor
        got = index.to("cpu", torch.int64)
        k = int(got[0]) % n
        expected = torch.remainder(torch.arange(n, dtype=torch.int64) + k, n)
        return k if torch.equal(got, expected) else None


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s rotations by a constant index as rolls, in place; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_select.default \
                or len(node.args) != 3 or node.kwargs:
            continue
        src, dim, idx = node.args
        if not isinstance(idx, torch.fx.Node) or idx.op != "get_attr" or not isinstance(dim, int):
            continue
        x, out = _val(src), _val(node)
        index = getattr(gm, idx.target, None)
        if x is None or out is None or not isinstance(index, torch.Tensor) or x.dim() == 0:
            continue
        dim = dim % x.dim()
        n = x.shape[dim]
        if not isinstance(n, int):
            continue
        k = rotation(index, n)
        if k is None:
            continue
        with gm.graph.inserting_before(node):
            roll = emit(gm, aten.roll.default, (src, [(n - k) % n], [dim]), out.fake_mode)
        got = roll.meta["val"]
        if (got.shape, got.stride(), got.dtype) != (out.shape, out.stride(), out.dtype):
            gm.graph.erase_node(roll)
            continue
        node.replace_all_uses_with(roll)
        gm.graph.erase_node(node)
        if not idx.users:           # the folded index: no longer needed
            gm.graph.erase_node(idx)
            delattr(gm, idx.target)
        done += 1
    if done:
        log.info("fusion-compiler: %d constant rotations made rolls", done)
    return done
