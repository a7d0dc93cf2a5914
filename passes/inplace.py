"""Kernels write over inputs that die with them: the memory a call needs, as Inductor's.

A kernel's output takes a fresh allocation while its inputs are still alive, so at the MLP of
ConvNeXt-T (32 x 224, H200) the 74 MB GEMM output and the GELU's 74 MB output were both live:
the call's own tensors peaked at 166 MB against Inductor's 111. Where the graph has no use of
an input after the kernel, the kernel may write an output over it instead
(``codegen/launcher.py`` says which outputs could: ``inplace_outputs`` of a pointwise kernel,
same dtype, read only elementwise at the output's layout or through a reshape, both
contiguous; ``row_inplace_outputs`` of a persistent row kernel, each load of the input at the
output's address and before its stores: a norm's sum and output over the GEMM outputs it
adds, a softmax over its scores). This pass, on the partitioned graph, hands such an input to
the launcher as ``r{p}`` where it is dead after the call:

- values that may share memory are taken together: a node with what it may alias (a view, an
  op whose schema says it aliases or is unknown here, a getitem of an ATen op's tuple) and
  nodes whose fake values share a storage;
- no value of the input's class is a graph input, a parameter or a buffer (placeholder,
  get_attr), made from no input (a factory such as ``full``: ``fast_calls`` keeps it as a
  buffer after this pass), a graph output, or used by a node after the call;
- the call takes that class through no other argument.

The liveness is static, by graph order, as FX's generated code frees a value after its last
use; an input without a fake value keeps its allocation.
"""
from __future__ import annotations

import operator

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def run(graph: torch.fx.Graph) -> list:
    """Give each launcher call the dead inputs it may write over; returns them, as (the
    kernel's group id, the output's position, the input node's name)."""
    nodes = list(graph.nodes)
    if not any(getattr(n.target, "inplace", None) for n in nodes if n.op == "call_function"):
        return []
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    # values that may share memory, as classes: a node that may alias its inputs with them,
    # nodes whose fake values share a storage with each other
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(a, b):
        parent[find(a)] = find(b)

    by_storage = {}
    for n in nodes:
        if _may_alias(n):
            for a in n.all_input_nodes:
                union(n, a)
        key = _storage(n)
        if key is not None:
            if key in by_storage:
                union(n, by_storage[key])
            by_storage.setdefault(key, n)
    last, kept = {}, set()
    for n in nodes:
        c = find(n)
        if n.op in ("placeholder", "get_attr") or (n.op == "call_function"
                                                    and not n.all_input_nodes):
            # the caller's tensors, parameters, buffers, and values made from nothing
            # (fast_calls makes a factory's a buffer, after this pass): never written
            kept.add(c)
        used = max((end if u.op == "output" else position[u] for u in n.users), default=-1)
        last[c] = max(last.get(c, -1), used)
    reused = []
    for call in nodes:
        inplace = getattr(call.target, "inplace", None) if call.op == "call_function" else None
        if not inplace:
            continue
        here = position[call]
        classes = [find(a) if isinstance(a, torch.fx.Node) else None for a in call.args]
        given = {}
        for p, j in inplace.items():
            c = classes[j]
            if (c is None or c in kept or last[c] != here or classes.count(c) != 1
                    or c in given.values() or _storage(call.args[j]) is None):
                continue
            given[p] = c
        if given:
            call.kwargs = {**call.kwargs, **{f"r{p}": call.args[inplace[p]] for p in given}}
            reused += [(call.meta.get("fc_launcher"), p, call.args[inplace[p]].name)
                       for p in given]
    return reused


def _storage(n):
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return StorageWeakRef(v.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


# returns a view though its schema says nothing of it
_UNSAFE_VIEWS = {torch.ops.aten._unsafe_view.default}


def _may_alias(n) -> bool:
    """Whether ``n``'s value may share memory with one of its inputs: anything but a launcher
    call, its outputs, and ATen ops whose schema returns a tensor of its own."""
    if n.op != "call_function":
        return False
    if getattr(n.target, "inplace", None) is not None:
        return False            # a launcher call: its outputs are fresh, or dead inputs'
    if n.target is operator.getitem and getattr(n.args[0].target, "inplace", None) is not None:
        return False
    op = n.target
    if not isinstance(op, torch._ops.OpOverload) or op.is_view or op in _UNSAFE_VIEWS:
        return True
    schema = op._schema
    return (any(a.alias_info is not None for a in schema.arguments)
            or any(r.alias_info is not None for r in schema.returns))
