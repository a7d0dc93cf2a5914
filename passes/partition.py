"""Partition pass: rewrite the ATen graph so each fused group is one call to its launcher.

Groups are placed in a topological order of the graph of groups and remaining ATen nodes (the
fuse pass keeps it acyclic); within that order the original node order breaks ties, so ATen ops
keep their relative order. Views read only by kernels disappear (they became index arithmetic);
size symbols a kernel needs are read from the graph's inputs (``sym_size``/``sym_stride``).
"""
from __future__ import annotations

import operator

import networkx as nx
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from . import inplace, input_writes
from .groups import TRANSPARENT

aten = torch.ops.aten


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """New GraphModule with one launcher call per group in ``ctx.launchers``."""
    groups = [g for g in ctx.groups if g.id in ctx.launchers]
    if not groups:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # an op that a kernel recomputes but that also belongs to a group left on ATen is computed
    # on ATen as well: that copy is the one ATen users read
    on_aten = {n for g in ctx.groups if g.id not in ctx.launchers for n in g.members}
    group_of = {n: g for g in groups for n in g.members if n not in on_aten}
    unit = lambda n: group_of[n].id if n in group_of else n  # noqa: E731
    dag = nx.DiGraph()
    first = {}
    for n in gm.graph.nodes:
        u = unit(n)
        dag.add_node(u)
        first[u] = min(first.get(u, order[n]), order[n])
        if n in group_of:
            continue    # a kernel depends on what it loads, not on the views it inlined
        for a in n.all_input_nodes:
            if unit(a) != u:
                dag.add_edge(unit(a), u)
    for g in groups:
        for a in g.inputs:
            dag.add_edge(unit(a), g.id)

    graph = torch.fx.Graph()
    env, sym_nodes = {}, {}
    ranges = ctx.config.profile_ranges
    by_id = {g.id: g for g in groups}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for u in nx.lexicographical_topological_sort(dag, key=lambda u: first[u]):
        if u in by_id:
            g = by_id[u]
            syms = [_symbol_node(s, graph, env, placeholders, sym_nodes) for s in g.graph_symbols]
            opened = _open_range(graph, g) if ranges else None
            call = graph.call_function(ctx.launchers[g.id], tuple(env[a] for a in g.inputs) + tuple(syms))
            call.meta["fc_launcher"] = g.id
            if opened is not None:
                _close_range(graph, opened)
            for k, o in enumerate(g.outputs):
                env[o] = graph.call_function(operator.getitem, (call, k))
                env[o].meta = dict(o.meta)
        elif u.meta.get("fc_kind") in TRANSPARENT and any(a not in env for a in u.all_input_nodes):
            continue    # a view of a value that lives only inside a kernel: inlined there
        else:
            env[u] = graph.node_copy(u, lambda a: env[a])
    for n in reversed(list(graph.nodes)):
        if not n.users and n.op == "call_function" and n.meta.get("fc_kind") in TRANSPARENT:
            graph.erase_node(n)
    ctx.inplace = inplace.run(graph)       # kernels write over inputs that die with them
    ctx.input_writes = input_writes.run(graph)     # and buffers' new values into them
    return _LazyGraphModule(gm, graph)     # its code compiled once, by the backend


def _open_range(graph, group):
    """A profiler range ``fc#<id> <label>`` opened before ``group``'s launch: its handle."""
    from .generate import label     # generate imports this module
    node = graph.call_function(torch.ops.profiler._record_function_enter_new.default,
                               (f"fc#{group.id} {label(group)}", None))
    node.meta["fc_profile_range"] = group.id
    return node


def _close_range(graph, handle) -> None:
    """The range of ``handle`` closed (after the launch it surrounds)."""
    node = graph.call_function(torch.ops.profiler._record_function_exit._RecordFunction,
                               (handle,))
    node.meta["fc_profile_range"] = handle.meta["fc_profile_range"]


def _symbol_node(sym, graph, env, placeholders, cache):
    """Node that yields the value of size symbol ``sym`` at run time."""
    if sym in cache:
        return cache[sym]
    for ph in placeholders:
        if ph.meta.get("fc_symint") == sym:
            cache[sym] = env[ph]
            return env[ph]
    for ph in placeholders:
        info = ph.meta.get("fc_tensor")
        if info is None:
            continue
        for attr, values, op in (("size", info.shape, aten.sym_size.int),
                                 ("stride", info.stride, aten.sym_stride.int)):
            for d, v in enumerate(values):
                if v == sym:
                    node = graph.call_function(op, (env[ph], d))
                    cache[sym] = node
                    return node
    raise LookupError(f"size symbol {sym} is not the size or stride of any graph input")


def readable_symbols(placeholders) -> set:
    """The size symbols the graph's inputs give at run time: symbolic inputs, and the sizes and
    strides of its tensor inputs."""
    known = set()
    for ph in placeholders:
        if "fc_symint" in ph.meta:
            known.add(ph.meta["fc_symint"])
        info = ph.meta.get("fc_tensor")
        if info is not None:
            known.update(info.shape)
            known.update(info.stride)
    return known
