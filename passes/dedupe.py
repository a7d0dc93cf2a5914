"""Identical computations computed once (common subexpressions of the ATen graph).

T5 applies its attention mask to the shared position bias in every layer: twelve ``where``
nodes of the same inputs, each copied by a ``clone`` for attention. Fused as siblings, the
twelve copies were written by one kernel and alive at once (BERT-size batches: 300 MB against
25 MB). Here a call of a pure ATen op (``constant_fold.is_pure``: not mutable, not random, not
an uninitialized allocation) whose target and arguments equal an earlier one's is replaced by
that one, in graph order, so chains of duplicates fold from their roots.

Left alone: a node that is a graph output or aliases one (``constant_fold.reaches_output``):
two outputs would be one tensor, and a caller writing to one would change the other; and one
that an op writing to its arguments reads.
"""
from __future__ import annotations

import logging

import torch

from .constant_fold import reaches_output, graph_outputs, is_pure

log = logging.getLogger("fusion_compiler")


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Replace duplicate pure computations of ``gm`` in place (the log says how many)."""
    outputs = graph_outputs(gm)
    seen: dict = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_pure(node.target):
            continue
        first, key = duplicate_of(node, seen, outputs)
        if first is None:
            if key is not None:
                seen.setdefault(key, node)
            continue
        node.replace_all_uses_with(first)
        gm.graph.erase_node(node)
        removed += 1
    if removed:
        log.info("fusion-compiler: %d duplicate computations removed", removed)
    return gm


def duplicate_of(node, seen: dict, outputs: set):
    """(the earlier node in ``seen`` (key -> node) that ``node``, a call of a pure op, may be
    replaced by, or None; ``node``'s key, None where it has none)."""
    key = _key(node)
    first = None if key is None else seen.get(key)
    if first is None or reaches_output(node, outputs) or reaches_output(first, outputs) \
            or _written(node) or _written(first):
        return None, key
    return first, key


def _written(node) -> bool:
    """Whether an op that mutates an argument reads ``node`` (functionalized graphs have none
    but the copies into mutated inputs; two readers must then not share one tensor)."""
    return any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable
               for u in node.users)


def _key(node):
    """A hashable form of the call, or None where an argument has no exact, hashable form."""
    try:
        key = (node.target, _freeze(node.args), _freeze(node.kwargs))
        hash(key)
    except TypeError:
        return None
    return key


def _freeze(value):
    if isinstance(value, torch.fx.Node):
        return ("node", value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", value, str(value))      # 0.0 and -0.0 differ; NaN never equals itself
    if isinstance(value, (bool, int, str, type(None), torch.dtype, torch.device,
                          torch.layout, torch.memory_format)):
        return (type(value).__name__, value)
    raise TypeError(f"no exact key for {type(value).__name__}")
