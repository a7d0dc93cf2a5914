"""Recomputation: a producer group without reductions computed again inside each of its
consumer groups instead of writing its result (one launch and a write + reads saved where the
cost model says it pays). Candidates, their application to the fuse search's state, and the
outputs a recomputed op's operands then need."""
from __future__ import annotations

from collections import defaultdict

import networkx as nx

from ..codegen.kernel_ir import NotFusable
from .classify import OpKind
from .groups import DATA, FusionGroup, analyze, read_across_the_grain
from .legality import check_legal


def expose_inputs(groups, view, ctx):
    """A recomputed op reads its operands in every group that computes it: an operand that is a
    member of another group must be written by that group, though its own consumers are inside."""
    containing = defaultdict(set)
    for g in groups.values():
        for n in g.members:
            containing[n].add(g.id)
    for g in groups.values():
        extra = frozenset(m for m in g.members - g.recomputed for c in view.consumers(m)
                          if any(m not in groups[h].members for h in containing.get(c, ())))
        if extra - set(g.outputs):
            g.extra_outputs = extra
            g.ir = None         # outputs changed: legality is checked again
            analyze(g, view, ctx)


def candidate(groups, p, consumers, view, ctx):
    """(score, [consumer u p ...]) for computing producer ``p`` again inside each consumer
    group instead of writing its result, or None when that is not possible or does not pay.

    Possible when p has no reduction (a reduction is never duplicated), at least two consumer
    groups, and nothing else reads it (no ATen op, no graph output), and p holds no ops that
    are recomputed already, unless it loads nothing (a mask of aranges): recomputing again
    what was recomputed makes chains (a residual stream x1 = x0 + a0, x2 = x1 + a1, ...: each
    step saves a launch, and each layer's kernels end up reading every earlier layer's
    output; Llama 1 x 128 on the H200 with a calibrated profile: its 16 RMSNorm kernels
    measured 4.8 us at the first and 9.3 us at the last)."""
    if len(consumers) < 2:
        return None
    prod = groups[p]
    if any(view.kind[n] is OpKind.REDUCTION for n in prod.members):
        return None
    for m in prod.outputs:
        if any(view.kind.get(c) not in DATA for c in view.consumers(m)):
            return None
    merged = [analyze(FusionGroup(-1, groups[c].members | prod.members,
                                  recomputed=groups[c].recomputed | prod.members), view, ctx)
              for c in sorted(consumers)]
    score = prod.cost.time + sum(groups[c].cost.time for c in consumers) - sum(
        g.cost.time for g in merged) - sum(
        read_across_the_grain(prod, groups[c], view, ctx.size_hints)[0] for c in consumers)
    # a producer that loads nothing (a mask made of aranges) reads no earlier layer's output
    # however often it is computed again: no chain to make
    if score <= 0 or (prod.recomputed and prod.inputs):
        ctx.decisions.append(decision(
            prod, consumers, groups, merged, score, False,
            "holds recomputed ops: recomputing them again would make chains" if score > 0 else
            "unprofitable: recomputing in every consumer moves more than it saves"))
        return None
    return score, merged


def apply(p, consumers, merged, groups, group_of, succ, pred, unit, next_id, ctx, score, view):
    """Replace producer group p by a copy of its ops inside each consumer (if all are legal)."""
    prod = groups[p]
    try:
        for g in merged:
            check_legal(g, view, ctx)
    except NotFusable as exc:
        ctx.decisions.append(decision(prod, consumers, groups, merged, score, False, str(exc)))
        return next_id, []
    ctx.decisions.append(decision(prod, consumers, groups, merged, score, True,
                                  "recomputed in each consumer"))
    view.recomputed_anywhere |= prod.members
    producers = pred.pop(p, set())
    succ.pop(p)
    for x in producers:
        succ[x].discard(p)
    unit_preds = list(unit.predecessors(p))
    unit.remove_node(p)
    for c, g in zip(consumers, merged):
        g.id = next_id
        next_id += 1
        for n in g.members:
            group_of[n] = g.id
        nx.relabel_nodes(unit, {c: g.id}, copy=False)
        unit.add_edges_from((u, g.id) for u in unit_preds)
        del groups[c]
        groups[g.id] = g
        succ[g.id] = succ.pop(c, set())
        pred[g.id] = (pred.pop(c) - {p}) | producers
        for x in succ[g.id]:
            pred[x] = (pred[x] - {c}) | {g.id}
        for x in pred[g.id]:
            succ[x] = (succ[x] - {c}) | {g.id}
    del groups[p]
    return next_id, [g.id for g in merged]


def decision(prod, consumers, groups, merged, score, taken, reason):
    """The dump's record of a recompute candidate, taken or not, with its numbers and reason."""
    return {"producer": sorted(n.name for n in prod.members),
            "consumer": sorted(n.name for c in consumers for n in groups[c].members),
            "score_us": score * 1e6, "kind": "recompute",
            "bytes_before": prod.cost.bytes + sum(groups[c].cost.bytes for c in consumers),
            "bytes_after": sum(g.cost.bytes for g in merged), "taken": taken, "reason": reason}
