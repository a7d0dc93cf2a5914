"""Training graphs: values made from constants alone are made again in the backward, not saved.

aot_autograd's min-cut partitioner saves a forward value for the backward when recomputing it
would not fuse there by its own rules (``materialized in backward``: a reader it deems
unfusible, such as a ``cumsum``). A mask made of aranges (Mamba2's segment sum builds
``tril(ones(256, 256))`` and ``~tril(...)`` masks, four a layer) is then a forward output:
the forward must write it, in a kernel of its own (``constant_fold`` keeps no output, and
a kernel reading it cannot also write a tensor of another shape), and the backward reads it
back. Made in the backward instead, it is what the fused kernels compute from their index
there, or what ``constant_fold`` computes once at compile time; in the forward it joins its
readers, and nothing is kept alive between the two graphs.

    forward:  arange, arange -> sub -> le -> [mask] --output--> saved ... backward reads it
    after:    forward reads the mask in its kernels; the backward makes it from its own aranges

A saved value moves when every op that makes it is pure (``constant_fold.is_pure``: not
mutable, not random, no uninitialized memory) and reads no forward input (a size read from
an input is an input: dynamic shapes keep the value saved), is not also a user output, and
the backward names it exactly once among its inputs. Anything else is left as the partitioner
chose. Only the min-cut partitioner is wrapped (``backward_recompute``): the default partition
saves what eager autograd saves, by choice.
"""
from __future__ import annotations

import logging

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .passes.constant_fold import is_pure

log = logging.getLogger("fusion_compiler")


def partition(joint: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
    """The min-cut partition, with the saved values made from constants made in the backward."""
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs,
                                                 num_fwd_outputs=num_fwd_outputs, **kwargs)
    moved = recompute_constants(fw, bw, num_fwd_outputs)
    if moved:
        log.info("fusion-compiler: %d saved values made from constants alone are made in the "
                 "backward instead: %s", len(moved), ", ".join(moved))
    return fw, bw


def recompute_constants(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                        num_fwd_outputs: int) -> list[str]:
    """Move each saved value of ``fw`` made from constants alone into ``bw``; their names."""
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    user_outputs = set(outs[:num_fwd_outputs])
    inputs = {}
    for node in bw.graph.find_nodes(op="placeholder"):
        inputs.setdefault(node.name, []).append(node)
    movable = set()
    for node in fw.graph.nodes:     # topological: a node's inputs are judged before it
        if node.op == "call_function" and is_pure(node.target) \
                and isinstance(node.meta.get("val"), torch.Tensor) \
                and all(a in movable for a in node.all_input_nodes):
            movable.add(node)
    kept, moving = outs[:num_fwd_outputs], {}
    for value in outs[num_fwd_outputs:]:
        readers = inputs.get(getattr(value, "name", None), [])
        if value in movable and value not in user_outputs and outs.count(value) == 1 \
                and len(readers) == 1:
            moving[value] = readers[0]
        else:
            kept.append(value)
    if not moving:
        return []
    _make_in_backward(moving, bw)
    output.args = (tuple(kept),) + tuple(output.args[1:])
    fw.graph.eliminate_dead_code()
    fw.recompile()
    bw.graph.lint()
    bw.recompile()
    return [value.name for value in moving]


def _make_in_backward(moving: dict, bw: torch.fx.GraphModule) -> None:
    """Copy the ops that make each forward value of ``moving`` into ``bw`` (ops shared by
    several values once), and read the copy where its placeholder was."""
    needed, stack = set(), list(moving)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    fw_graph = next(iter(moving)).graph
    copies, anchor = {}, list(bw.graph.find_nodes(op="placeholder"))[-1]
    for node in fw_graph.nodes:         # forward order, each copy after the one before
        if node in needed:
            with bw.graph.inserting_after(anchor):
                copies[node] = anchor = bw.graph.node_copy(node, lambda a: copies[a])
    for value, placeholder in moving.items():
        placeholder.replace_all_uses_with(copies[value])
        bw.graph.erase_node(placeholder)
