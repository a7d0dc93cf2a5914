"""How a training graph is split into forward and backward: aot_autograd's min-cut
partitioner, told which ops this compiler's kernels compute, and with the saved values made
from constants alone made in the backward instead.

The min-cut partitioner saves a forward value for the backward, or recomputes it there,
choosing the cut that saves the fewest bytes; it recomputes only ops on its list of ops
Inductor fuses (``get_default_op_list``). ``cumsum``, which the kernels here compute (a scan
in a row kernel), is not on it, so the partitioner saved a cumsum's output however large:
Mamba2's segment sum, a cumsum over the chunk of a [heads, chunks, 256, 256] expansion of a
[heads, chunks, 256] input. ``partition`` adds it to the list while it runs: in transformers
5.17's Mamba2 (one layer, 1 x 1024, bf16) the forward saves 140.9 MB, not 174.3 MB, and the
fused kernels' estimate falls from 619 to 588 us. ``constant_pad_nd`` is left off, though the
kernels compute it too (Mamba2's fp32 pads of x, B and C would not be saved either: 90.4 MB):
on the list, it let the partitioner recompute a max pool's window maxima in the backward
(the -inf pad before them was all that stopped it), each input element's four windows of
nine values, where the forward saves each maximum's position in two bytes (max_pool.py).

The partitioner can still save values made from constants alone: Mamba2's segment-sum masks
(``tril`` of aranges, four a layer) are saved with either list. The forward then writes each
mask in a kernel of its own (``constant_fold`` keeps no graph output, and the kernels reading
it have other shapes), and the backward reads it back. ``recompute_constants`` moves each such
saved value into the backward, where its readers compute it from their index or
``constant_fold`` makes it at compile time:

    forward:  arange, arange -> sub -> le -> [mask] --output--> saved ... backward reads it
    after:    forward reads the mask in its kernels; the backward makes it from its own aranges

A saved value moves when every op that makes it is pure (``constant_fold.is_pure``: not
mutable, not random, no uninitialized memory) and reads no forward input (a size read from
an input is an input: dynamic shapes keep the value saved), is not also a user output, and
the backward names it exactly once among its inputs. Anything else is left as the partitioner
chose. Only the min-cut partitioner is used so (``backward_recompute``): the default
partition saves what eager autograd saves, by choice.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch._functorch import partitioners
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .passes.constant_fold import is_pure
from .passes.late_decompose import ancestors

log = logging.getLogger("fusion_compiler")
aten = torch.ops.aten

# ops the kernels compute, memory-bound like the pointwise ops, that aot_autograd's list lacks
# (not constant_pad_nd: see above)
RECOMPUTABLE = (aten.cumsum,)


def partition(joint: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
    """The min-cut partition, with ``RECOMPUTABLE`` on its list and the saved values made from
    constants made in the backward."""
    with _recomputable(RECOMPUTABLE):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs,
                                                     num_fwd_outputs=num_fwd_outputs, **kwargs)
    moved = recompute_constants(fw, bw, num_fwd_outputs)
    if moved:
        log.info("fusion-compiler: %d saved values made from constants alone are made in the "
                 "backward instead: %s", len(moved), ", ".join(moved))
    return fw, bw


@contextlib.contextmanager
def _recomputable(ops):
    """aot_autograd's op list with ``ops`` on it as recomputable and fusible, while inside.
    (The partitioner reads the list from its module on each call; a torch without the
    function keeps its own list.)"""
    original = getattr(partitioners, "get_default_op_list", None)
    if original is None:
        yield
        return

    def op_list():
        types = original()
        for op in ops:
            types.recomputable_ops.add(op)
            types.fusible_ops.add(op)
        return types
    partitioners.get_default_op_list = op_list
    try:
        yield
    finally:
        partitioners.get_default_op_list = original


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
    needed = ancestors(moving)
    fw_graph = next(iter(moving)).graph
    copies, anchor = {}, list(bw.graph.find_nodes(op="placeholder"))[-1]
    for node in fw_graph.nodes:         # forward order, each copy after the one before
        if node in needed:
            with bw.graph.inserting_after(anchor):
                copies[node] = anchor = bw.graph.node_copy(node, lambda a: copies[a])
    for value, placeholder in moving.items():
        placeholder.replace_all_uses_with(copies[value])
        bw.graph.erase_node(placeholder)
