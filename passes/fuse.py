"""Fuse pass: priority fusion of producer -> consumer groups, scored by the cost model.

Note on the algorithm (XLA's priority fusion, simplified):

    every data node (pointwise, cat, reduction) starts as its own group
    views and expands are transparent: they join whichever groups read through them
    repeat (a priority queue):
        candidates = producer -> consumer edges between groups
                     and "recompute P in each of its consumers C1..Ck" (P without reduction,
                     read by groups only: P is never written)
        score(P, C) = time(P) + time(C) - time(P u C)      (cost_model.kernel_cost)
        score(P, C1..Ck) = time(P) + sum time(Ci) - sum time(Ci u P)
        take the best positive candidate that is legal, merge, re-score the new group's edges
        (once, a candidate is put back behind a candidate beside it that it would make a
        cycle of, where that one saves more bytes and at least half its time: ``_blocks``)
    until no positive legal candidate is left
    then: siblings reading one tensor, with no path between them, merged (horizontal fusion),
          and small groups of one shape that read graph inputs alone (batch counters)

Legality is separate from profitability: a merge is refused when it would make a cycle in the
graph of groups (a path P -> X -> C through another group or an ATen op), when the group would
exceed ``max_group_ops``, or when the code generator cannot make one kernel of it (its lowering
raises NotFusable: iteration spaces that do not match, unsupported ops or dtypes). Every
decision, taken or refused, is recorded in ``ctx.decisions`` with its numbers and reason.

Writes ``node.meta["fc_group"]`` (group id) on every node in a group; the groups themselves are
in ``ctx.groups``, the cost of each data node run alone in ``ctx.unfused_cost``.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict

import networkx as nx
import torch

from ..codegen.kernel_ir import NotFusable, build_kernel_ir
from . import decision_cache, recompute
from .groups import FusionGroup, GraphView, analyze, charge_parts, read_across_the_grain
from .legality import check_legal
from .shapes import hint


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Group the data nodes of ``gm``; record every decision (or restore them from the
    decision cache when this very graph was fused before: see decision_cache.py)."""
    key = decision_cache.graph_key(gm, ctx)
    cached = decision_cache.load(gm, ctx, key)
    if cached is not None:
        return _restore(gm, ctx, *cached)
    gm = _search(gm, ctx)
    decision_cache.store(ctx, key, ctx.groups, ctx.recomputed_anywhere, ctx.decisions)
    return gm


def _restore(gm, ctx, specs, recomputed_anywhere, decisions, unfused):
    """The groups of an earlier search, analysed again on this graph (no lowering: legality
    was established when they were found; the code generator lowers them again if it must),
    and the stored cost of each data node run alone."""
    view = GraphView(gm, ctx.size_hints)
    ctx.unfused_cost.update(unfused)
    view.recomputed_anywhere = set(recomputed_anywhere)
    groups = {s["id"]: FusionGroup(s["id"], frozenset(s["members"]),
                                   recomputed=frozenset(s["recomputed"]),
                                   extra_outputs=frozenset(s["extra_outputs"])) for s in specs}
    view.groups = groups
    for s in specs:
        g = analyze(groups[s["id"]], view, ctx)
        if s["error"]:
            g.error = s["error"]
        else:
            g.ir, g.graph_symbols = build_kernel_ir(g.nodes, g.inputs, g.outputs)
            charge_parts(g, view, ctx)
        for n in g.members:
            n.meta["fc_group"] = g.id
    ctx.decisions.extend(decisions)
    ctx.recomputed_anywhere = set(recomputed_anywhere)
    ctx.groups = sorted(groups.values(), key=lambda g: view.order[g.nodes[-1]])
    return gm


def _search(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    view = GraphView(gm, ctx.size_hints)
    data = [n for n in gm.graph.nodes if view.is_data(n)]
    group_of, groups = {}, {}
    view.groups = groups
    for i, n in enumerate(data):
        groups[i] = analyze(FusionGroup(i, frozenset([n])), view, ctx)
        group_of[n] = i
        ctx.unfused_cost[n] = groups[i].cost     # each op as its own kernel: the baseline
    unit = _unit_graph(gm, view, group_of)
    succ, pred = defaultdict(set), defaultdict(set)     # producer -> consumer groups
    for m in data:
        for src in view.sources(m, set()):
            p, c = group_of.get(src), group_of[m]
            if p is not None and p != c:
                succ[p].add(c)
                pred[c].add(p)
    heap, refused, seq, tried_recompute = [], set(), itertools.count(), set()
    # merge candidates as scored: (p, c) -> (time saved, bytes saved); and those put back
    # once behind a candidate they would have made a cycle of (_blocks), with their score
    scores, deferred = {}, {}

    def push(p, c):
        merged = analyze(FusionGroup(-1, groups[p].members | groups[c].members,
                                     recomputed=groups[p].recomputed | groups[c].recomputed),
                         view, ctx)
        score = groups[p].cost.time + groups[c].cost.time - merged.cost.time
        strided, why = read_across_the_grain(groups[p], groups[c], view, ctx.size_hints)
        score -= strided
        if score <= 0:
            ctx.decisions.append(_decision(groups[p], groups[c], merged, score, False,
                                           f"unprofitable: {why or 'fused time is not lower'}"))
            return
        scores[(p, c)] = (score, groups[p].cost.bytes + groups[c].cost.bytes - merged.cost.bytes)
        heapq.heappush(heap, (-score, next(seq), (p, c), merged))

    def push_recompute(p):
        key = (p, frozenset(succ[p]))
        if key in tried_recompute:
            return
        tried_recompute.add(key)
        cand = recompute.candidate(groups, p, succ[p], view, ctx)
        if cand is not None:
            heapq.heappush(heap, (-cand[0], next(seq), (p, tuple(sorted(succ[p]))), cand[1]))

    for p in list(succ):
        for c in sorted(succ[p]):
            push(p, c)
        push_recompute(p)
    next_id = len(data)
    while heap:
        neg_score, _, key, merged = heapq.heappop(heap)
        p, c = key
        if isinstance(c, tuple):     # recompute p inside each of its consumer groups c
            if p not in groups or any(x not in groups for x in c) or set(c) != succ[p]:
                continue
            next_id, new_ids = recompute.apply(p, c, merged, groups, group_of, succ, pred, unit,
                                               next_id, ctx, -neg_score, view)
            for m in new_ids:
                for x in succ[m]:
                    push(m, x)
                for x in pred[m]:
                    push(x, m)
                    push_recompute(x)
                push_recompute(m)   # one that loads nothing may be computed again in turn
            continue
        if p not in groups or c not in groups or (p, c) in refused:
            continue    # a group merged since this candidate was scored
        score = deferred.get((p, c), -neg_score)
        try:
            if _makes_cycle(unit, p, c):
                raise NotFusable("cycle: another path leads from producer to consumer")
            check_legal(merged, view, ctx)
        except NotFusable as exc:
            refused.add((p, c))
            ctx.decisions.append(_decision(groups[p], groups[c], merged, score, False, str(exc)))
            continue
        if (p, c) not in deferred:
            lost = _blocks(unit, p, c, scores, groups, succ, pred, refused)
            if lost:
                # taken now, this merge would make a cycle of one that saves more bytes (a
                # chunk's mean and its squared deviations, both reading x, against one of them
                # with a term that reads the batch's mean): that one is tried first
                deferred[(p, c)] = score
                heapq.heappush(heap, (-max(score - lost, 1e-12), next(seq), (p, c), merged))
                continue
        ctx.decisions.append(_decision(groups[p], groups[c], merged, score, True, "fused"))
        m = merged.id = next_id
        next_id += 1
        for n in merged.members:
            group_of[n] = m
        _merge_units(unit, (p, c), m)
        if unit.has_edge(m, m):
            unit.remove_edge(m, m)
        del groups[p], groups[c]
        groups[m] = merged
        succ[m] = (succ.pop(p) | succ.pop(c, set())) - {p, c}
        pred[m] = (pred.pop(p, set()) | pred.pop(c)) - {p, c}
        for x in succ[m]:
            pred[x] = (pred[x] - {p, c}) | {m}
            push(m, x)
        for x in pred[m]:
            succ[x] = (succ[x] - {p, c}) | {m}
            push(x, m)
            push_recompute(x)
        push_recompute(m)
    _horizontal(groups, group_of, unit, view, ctx, next_id)
    recompute.expose_inputs(groups, view, ctx)
    for g in groups.values():
        if g.ir is None:
            try:
                check_legal(g, view, ctx)
                charge_parts(g, view, ctx)
            except NotFusable as exc:
                g.error = str(exc)
        for n in g.members:
            n.meta["fc_group"] = g.id
    ctx.groups = sorted(groups.values(), key=lambda g: view.order[g.nodes[-1]])
    ctx.recomputed_anywhere = set(view.recomputed_anywhere)
    return gm


def _horizontal(groups, group_of, unit, view, ctx, next_id):
    """Merge sibling groups (no path between them) that read the same tensor, read results of
    one kernel (the totals of a split column sum's partials: passes/column_sums.py) or feed the
    same op into one kernel when the model says it saves time: one launch is saved, and a shared
    tensor is read once.
    Pointwise siblings of different shapes become a multi-part kernel (codegen/multipart.py),
    where each part loads what it reads: scored again once legality shows that."""
    rejected = set()        # pairs that do not pay or cannot be one kernel
    scored = {}             # pair -> (score, merged): groups never change once made
    order = {}              # unit -> topological position; made again after each merge
    alone = {}              # group id -> _graph_inputs_only's shape (groups never change)

    def independent(a, b) -> bool:
        """No path can lead into a group that reads graph inputs alone."""
        return alone[a] is not None and alone[b] is not None

    def reaches(a, b) -> bool:
        if not order:
            order.update((u, i) for i, u in enumerate(nx.topological_sort(unit)))
        return _reaches(unit, order, a, b) or _reaches(unit, order, b, a)

    while True:
        # siblings: groups that read one tensor or results of one group, and groups whose
        # results one op reads (q-norm and k-norm feeding attention: they share no input, but
        # each costs a launch)
        families = defaultdict(set)
        for gid, g in groups.items():
            if gid not in alone:
                alone[gid] = _graph_inputs_only(g, ctx.size_hints)
            if alone[gid] is not None:
                families["inputs only", alone[gid]].add(gid)
            for i in g.inputs:
                families["reads", i].add(gid)
                if i in group_of:       # results of one kernel: a column sum's totals
                    families["after", group_of[i]].add(gid)
            for u in unit.successors(gid):      # ATen ops only: not the graph's output
                if isinstance(u, torch.fx.Node) and u.op == "call_function":
                    families["feeds", u].add(gid)
        best = None
        for key, ids in families.items():
            ids = sorted(ids)
            if key[0] == "inputs only":
                # groups alike and independent: the first pair of neighbours not rejected is
                # the family's one candidate (n groups, n - 1 merges, not the n^2 pairs'
                # scores each time)
                pair = next(((a, b) for a, b in zip(ids, ids[1:]) if (a, b) not in rejected),
                            None)
                pairs = [pair] if pair is not None else []
            else:
                pairs = itertools.combinations(ids, 2)
            for pair in pairs:
                if pair in rejected:
                    continue
                a, b = pair
                if pair not in scored:
                    if not independent(a, b) and reaches(a, b):
                        rejected.add(pair)
                        continue
                    merged = analyze(FusionGroup(
                        -1, groups[a].members | groups[b].members,
                        recomputed=groups[a].recomputed | groups[b].recomputed), view, ctx)
                    scored[pair] = (groups[a].cost.time + groups[b].cost.time
                                    - merged.cost.time, merged)
                score, merged = scored[pair]
                if score <= 0:
                    rejected.add(pair)
                elif best is None or score > best[0]:
                    best = (score, a, b, merged)
        if best is None:
            return next_id
        score, a, b, merged = best
        # checked again now: merging two other siblings since this pair was scored can have made
        # a path between them (a -> x ... y -> b, x and y merged), and fusing them a cycle
        if not independent(a, b) and reaches(a, b):
            rejected.add((a, b))
            continue
        try:
            check_legal(merged, view, ctx)
        except NotFusable as exc:
            decision = _decision(groups[a], groups[b], merged, score, False, str(exc))
            decision["kind"] = "horizontal"
            ctx.decisions.append(decision)
            rejected.add((a, b))
            continue
        charge_parts(merged, view, ctx)     # a multi-part kernel: each part loads what it reads
        score = groups[a].cost.time + groups[b].cost.time - merged.cost.time
        taken = score > 0
        decision = _decision(groups[a], groups[b], merged, score, taken, "fused (siblings)" if taken
                             else "does not pay: each part of the multi-part kernel loads the "
                                  "shared input again")
        decision["kind"] = "horizontal"
        ctx.decisions.append(decision)
        if not taken:
            rejected.add((a, b))
            continue
        merged.id = next_id
        next_id += 1
        for n in merged.members:
            group_of[n] = merged.id
        _merge_units(unit, (a, b), merged.id)
        order.clear()
        del groups[a], groups[b]
        groups[merged.id] = merged


# a group reading only graph inputs, with outputs this small, is a launch and little else
SMALL_OUTPUT = 1024


def _graph_inputs_only(g, size_hints):
    """The output shape of ``g`` where it reads graph inputs alone and writes small outputs of
    one shape, else None: BatchNorm's batch counters (``num_batches_tracked + 1``, one per
    layer, 53 in ResNet-50's training step). Such groups share no input and no reader, but
    nothing orders them either: groups of one shape are one pointwise kernel, a launch instead
    of one each, and each result is still written over its buffer (``inplace``;
    a multi-part kernel of other shapes would not be)."""
    if not g.inputs or not all(i.op == "placeholder" for i in g.inputs):
        return None
    shapes = {tuple(o.meta["fc_tensor"].shape) for o in g.outputs}     # symbolic: as traced
    if len(shapes) != 1:
        return None
    shape = shapes.pop()
    return shape if math.prod(hint(d, size_hints) for d in shape) <= SMALL_OUTPUT else None


def _decision(p, c, merged, score, taken, reason):
    return {"producer": [n.name for n in sorted(p.members, key=lambda n: n.name)],
            "consumer": [n.name for n in sorted(c.members, key=lambda n: n.name)],
            "score_us": score * 1e6, "kind": "merge", "bytes_before": p.cost.bytes + c.cost.bytes,
            "bytes_after": merged.cost.bytes, "taken": taken, "reason": reason}


def _unit_graph(gm, view, group_of) -> nx.DiGraph:
    """Graph of units: a group id per data node, the node itself for other non-view nodes.

    Views are contracted (an edge goes from the tensor a view reads to the view's users): a
    view is index arithmetic inside whichever kernel reads it, so it cannot make a cycle."""
    g = nx.DiGraph()
    unit = lambda n: group_of.get(n, n)  # noqa: E731
    for n in gm.graph.nodes:
        if view.is_transparent(n):
            continue
        g.add_node(unit(n))
        srcs = view.sources(n, set()) + [a for a in n.all_input_nodes if "fc_tensor" not in a.meta]
        for a in srcs:
            if unit(a) != unit(n):
                g.add_edge(unit(a), unit(n))
    return g


def _merge_units(unit: nx.DiGraph, old, new) -> None:
    """Replace groups ``old`` by group ``new``, their edges now its edges: what
    ``nx.relabel_nodes(unit, dict.fromkeys(old, new), copy=False)`` does, in the same order
    (the horizontal pass reads a group's successors in order: ties in score go to the first),
    for a tenth of its time (it walks every node to find ``old``, and builds views of edges).
    Group ids are ints, added to the graph in increasing order: sorted, they are in the
    graph's order, which relabel_nodes follows."""
    for o in sorted(old):
        unit.add_node(new)
        edges = [(new, new if t == o else t) for t in unit.successors(o)]
        edges += [(new if s == o else s, new) for s in unit.predecessors(o)]
        unit.remove_node(o)
        unit.add_edges_from(edges)


def _reaches(unit: nx.DiGraph, order: dict, a, b) -> bool:
    """True if a path leads from unit ``a`` to unit ``b``. ``order`` is a topological position
    of each unit (an edge goes to a greater one), so such a path passes only through units
    placed between the two: the search stays among them. (nx.has_path searched from both
    ends, through all that comes after a sibling or before the other: 468 searches on Llama
    1 x 128 took 34-42 ms; the horizontal pass makes a dozen merges, each sorted again in
    0.5 ms.)"""
    end = order[b]
    if order[a] >= end:
        return False
    seen, stack = {a}, [a]
    while stack:
        for s in unit.successors(stack.pop()):
            if s == b:
                return True
            if s not in seen and order[s] < end:
                seen.add(s)
                stack.append(s)
    return False


def _blocks(unit: nx.DiGraph, p, c, scores, groups, succ, pred, refused) -> float:
    """The largest score of a merge candidate beside (p, c) that merging p and c would make a
    cycle of (a path from its producer to its consumer through some other unit), among those
    not refused that save more bytes than (p, c) and at least half its time (so they are tried
    before it when it is put back, ``_search``); 0.0 where there is none."""
    score, moved = scores[(p, c)]
    # (candidate, the group of the two that the candidate does not have)
    beside = [((q, p), c) for q in pred[p] if q != c] + [((q, c), p) for q in pred[c] if q != p] \
        + [((p, r), c) for r in succ[p] if r != c] + [((c, r), p) for r in succ[c] if r != p]
    lost = 0.0
    for (a, b), other in beside:
        found = scores.get((a, b))
        if found is None or a not in groups or b not in groups or (a, b) in refused \
                or found[1] <= moved or found[0] < 0.5 * score or found[0] <= lost:
            continue
        # merged, the candidate's producer reaches the other group (or the other group its
        # consumer) through a unit that is neither: a path besides the direct edge
        if a in (p, c):
            starts, end = [s for s in unit.successors(other) if s not in (p, c, b)], b
        else:
            starts, end = [s for s in unit.successors(a) if s not in (p, c)], other
        if any(nx.has_path(unit, s, end) for s in starts):
            lost = found[0]
    return lost


def _makes_cycle(unit: nx.DiGraph, p, c) -> bool:
    """True if some path p -> x -> ... -> c avoids the direct edge p -> c."""
    for s in unit.successors(p):
        if s != c and nx.has_path(unit, s, c):
            return True
    return False
