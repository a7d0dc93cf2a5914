"""Generate pass: one Triton kernel module per legal group, through the on-disk cache.

Writes ``ctx.launchers`` (group id -> launcher function) and ``ctx.kernels`` (what was built).
A group that cannot be generated (its error says why) stays on ATen.
"""
from __future__ import annotations

import torch

from ..codegen.render import generate
from .partition import symbols_available


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for g in ctx.groups:
        if g.ir is None:
            continue
        device = g.outputs[0].meta["fc_tensor"].device
        runs = device.type != "cpu" or ctx.run_on_cpu
        if not runs and not ctx.config.emit_sources:
            g.error = "CPU tensors run on ATen (TRITON_INTERPRET=1 runs kernels on the CPU)"
            continue
        if not symbols_available(g, placeholders):
            g.error = "a size symbol is not readable from the graph inputs"
            continue
        hints = {k: ctx.size_hints.get(s, 1) for s, k in zip(g.graph_symbols, g.ir.symbols)}
        title = label(g)
        # everything the source depends on besides the IR goes into the key
        key = g.ir.key(*ctx.cache.salt(), title, str(ctx.config.max_persistent_block))
        module = ctx.cache.load(key, lambda: generate(g.ir, hints, title,
                                                      ctx.config.max_persistent_block))
        module.DEVICE = device
        if runs:
            ctx.launchers[g.id] = module.launch
        ctx.kernels.append({"group": g.id, "key": key, "label": title, "path": module.__file__,
                            "ops": [str(n.target) for n in g.members], "runs": runs})
    return gm


def label(group) -> str:
    """Short name of what a group computes, from its ops."""
    targets = {str(n.target).split(".")[1] for n in group.members}
    if "amax" in targets and "exp" in targets:
        return "softmax"
    if "mean" in targets or "sum" in targets or "amax" in targets:
        return "row reduction"
    return "pointwise"
