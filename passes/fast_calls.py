"""The ATen ops left in a compiled graph, called through torch's direct bindings.

A call through an ``OpOverload`` (``torch.ops.aten.mm.default(a, b)``) goes through Python
dispatch of the overload object: 1.2-1.6 us more per call than ``torch.mm(a, b)`` on the
development CPU. A Llama decoder's inference graph keeps ~210 such calls (views, permutes,
GEMMs) beside its 49 kernels, and every one runs on each step, so the launch-bound cases pay
it in full. The direct bindings reach the same ATen kernels: the results are the same tensors.

Only ops whose direct binding takes the same positional arguments are mapped, and only calls
without keyword arguments the binding would not accept. Runs last, after the report has named
the ops (reports and `dump` show ATen names).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

# overload -> (direct callable, keyword arguments it accepts)
FAST = {
    aten.view.default: (torch.Tensor.view, ()),
    aten._unsafe_view.default: (torch.Tensor.view, ()),
    aten.permute.default: (torch.permute, ()),
    aten.t.default: (torch.t, ()),
    aten.transpose.int: (torch.transpose, ()),
    aten.unsqueeze.default: (torch.unsqueeze, ()),
    aten.squeeze.dim: (torch.squeeze, ()),
    aten.expand.default: (torch.Tensor.expand, ()),
    aten.mm.default: (torch.mm, ()),
    aten.bmm.default: (torch.bmm, ()),
    aten.addmm.default: (torch.addmm, ("beta", "alpha")),
    aten.clone.default: (torch.clone, ("memory_format",)),
    aten.embedding.default: (torch.embedding, ()),
}


def run(gm: torch.fx.GraphModule) -> int:
    """Swap the eligible call targets of ``gm`` in place; how many were swapped."""
    swapped = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in FAST:
            continue
        fn, allowed = FAST[node.target]
        if set(node.kwargs) <= set(allowed):
            node.target = fn
            swapped += 1
    if swapped:
        gm.recompile()
    return swapped
