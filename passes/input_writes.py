"""Kernels write a buffer's new value into the buffer (partitioned graph, after inplace).

The backend asks aot_autograd to keep mutations of graph inputs that need no gradient in the
graph (``keep_inference_input_mutations``): a BatchNorm's running statistics and its
``num_batches_tracked`` end a training forward graph as ``copy_(buffer, new value)``, where
before aot_autograd's runtime wrapper copied each after the graph (ResNet-50: 159 copies a
training step, each a launch and a Python call). Each such copy goes where the new value is
an output of a kernel that reads the buffer and may write that output over it (the launcher's
``inplace``: the buffer read elementwise at the output's address, before its stores; BN's
running mean is ``momentum * mean + (1 - momentum) * running_mean`` in the kernel that
combines the batch's statistics): the kernel is handed the buffer as that output (``r{p}``),
and the copy is dropped. Only where:

- ``copy_(dst, src)``: dst a graph input, src one output of a launcher call, read by the copy
  alone;
- the launcher writes that output over its argument dst whenever it is given it
  (``launch.always_inplace``: not a row kernel whose looped form, which reads its rows more
  than once, may run instead);
- no other argument of the call is dst or may share its memory, and nothing after the call
  but the copy reads dst or a value that may share its memory.

Anything else keeps its ``copy_`` (an ATen op in the graph).
"""
from __future__ import annotations

import operator

import torch

from .inplace import _may_alias

aten = torch.ops.aten


def _sharing(dst) -> set:
    """``dst`` and the values that may share its memory (views of it, and views of those)."""
    found, stack = {dst}, [dst]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in found and _may_alias(u) and u.target is not aten.copy_.default:
                found.add(u)
                stack.append(u)
    return found


def run(graph: torch.fx.Graph) -> list:
    """Drop the copies into graph inputs that the kernels computing their values can make
    themselves; returns them, as (the kernel's group id, the output's position, the input's
    name)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    done = []
    for copy in nodes:
        if copy.op != "call_function" or copy.target is not aten.copy_.default \
                or len(copy.args) != 2 or copy.kwargs:
            continue
        dst, src = copy.args
        if not isinstance(dst, torch.fx.Node) or dst.op != "placeholder" \
                or not isinstance(src, torch.fx.Node) or src.target is not operator.getitem \
                or list(src.users) != [copy]:
            continue
        call, p = src.args
        launch = call.target
        inplace = getattr(launch, "inplace", None) or {}
        if p not in inplace or not getattr(launch, "always_inplace", False) \
                or f"r{p}" in call.kwargs:
            continue
        j = inplace[p]
        if j >= len(call.args) or call.args[j] is not dst:
            continue
        sharing = _sharing(dst)
        if sum(1 for a in call.args if a in sharing) != 1:
            continue            # dst reaches the kernel through another argument too
        here = position[call]
        if any(position[u] > here for n in sharing for u in n.users if u is not copy):
            continue            # read after the kernel: its old value is still needed
        call.kwargs = {**call.kwargs, f"r{p}": dst}
        copy.replace_all_uses_with(dst)
        graph.erase_node(copy)
        graph.erase_node(src)       # the copy was its one reader
        done.append((call.meta.get("fc_launcher"), p, dst.name))
    return done
