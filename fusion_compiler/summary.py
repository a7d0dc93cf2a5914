"""Summaries of a compiled graph for people and tools: groups, ops left on ATen, refusals, totals.

Built from the compile context after the passes ran; every number comes from the cost model
(``passes/cost_model.py``) evaluated at the example inputs' sizes.
"""
from __future__ import annotations

import operator

import torch

from .passes import column_sums, middle_dims, outer_dims, scan_dims, trailing_dims
from .passes.classify import OpKind
from .passes.generate import label
from .passes.shapes import hint

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul", "linear", "convolution",
         "_int_mm"}


def _short(target) -> str:
    name = str(target)
    for prefix in ("aten.", "prims."):
        name = name.replace(prefix, "")
    return name.replace(".default", "")


def _tensor(node, hints):
    info = node.meta["fc_tensor"]
    return {"name": node.name, "shape": [hint(s, hints) for s in info.shape],
            "dtype": str(info.dtype).replace("torch.", "")}


def aten_reason(node, config=None) -> str:
    """Why an op runs on ATen (``config``: the compile's, for the switches that decide)."""
    base = str(node.target).split(".")[1] if str(node.target).startswith("aten.") else str(node.target)
    if base in _GEMM:
        return "GEMM (cuBLAS)"
    if "scaled_dot_product" in base or "flash_attention" in base or "efficient_attention" in base:
        return "attention"
    if base == "embedding":
        return "embedding (gather)"
    if base == "copy_":
        return ("a graph input's update (a buffer's copy_): no kernel computing the value could "
                "write it there (passes/input_writes.py)")
    if base == "native_dropout":
        # no generated kernel makes random numbers: ATen's draws eager's mask for a seed, and
        # writes the output and the mask in one pass
        return ("dropout: ATen's own kernel (eager's random mask for a seed; output and mask "
                "in one pass)")
    if base in ("sum", "mean", "amax", "amin"):
        src = node.args[0].meta.get("fc_tensor") if node.args else None
        if src is not None and (not src.dtype.is_floating_point
                                or node.kwargs.get("dtype") not in (None, torch.float32)):
            return "reduction of integers or with a dtype= other than float32: stays on ATen"
        if src is not None and src.dtype == torch.float64:
            return "fp64 reduction: stays on ATen"
        why = column_sums.why_left(node, config is None or config.column_sums) \
            or trailing_dims.why_left(node) or middle_dims.why_left(node) \
            or outer_dims.why_left(node)
        return why or "reduction not over the last dimension"
    if base == "cumsum":
        why = scan_dims.why_left(node)
        if why is not None:
            return why
    return f"not supported by the code generator: {_short(node.target)}"


def summarize(gm: torch.fx.GraphModule, ctx) -> dict:
    """Everything the dump shows for one graph, as plain data (the JSON schema of `dump`)."""
    hints = ctx.size_hints
    groups, before_time, after_time = [], 0.0, 0.0
    before_bytes = after_bytes = 0
    in_groups = set()
    for g in ctx.groups:
        members = sorted(g.members, key=lambda n: n.name)     # a fixed order: reproducible sums
        unfused = [ctx.unfused_cost[n] for n in members]
        # an op recomputed in several groups counts once in the unfused totals
        fresh = [ctx.unfused_cost[n] for n in members if n not in in_groups]
        ub = sum(c.bytes for c in unfused)
        ut = sum(c.time for c in unfused)
        generated = g.id in ctx.launchers or (not ctx.launchers and g.ir is not None and not g.error)
        members = sorted(g.members, key=lambda n: g.nodes.index(n))
        groups.append({
            "id": g.id, "label": label(g), "ops": [_short(n.target) for n in members],
            "nodes": [n.name for n in members],
            "inputs": [_tensor(n, hints) for n in g.inputs],
            "outputs": [_tensor(n, hints) for n in g.outputs],
            "bytes_unfused": ub, "bytes_fused": g.cost.bytes,
            "launches_saved": len(unfused) - 1,
            "time_unfused_us": ut * 1e6, "time_fused_us": g.cost.time * 1e6,
            "time_saved_us": (ut - g.cost.time) * 1e6,
            "kernel": bool(generated), "why_not": g.error, "form": g.form,
            "recomputed": sorted(n.name for n in g.recomputed),
        })
        in_groups.update(g.members)
        before_time += sum(c.time for c in fresh)
        before_bytes += sum(c.bytes for c in fresh)
        if generated:
            after_time, after_bytes = after_time + g.cost.time, after_bytes + g.cost.bytes
        else:
            after_time, after_bytes = after_time + ut, after_bytes + ub
    aten = []
    written = {name for _, _, name in ctx.input_writes}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in in_groups or n.target is operator.getitem:
            continue
        if n.target is torch.ops.aten.copy_.default and n.args[0].name in written:
            continue        # the kernel computing the value writes it there (input_writes)
        val = n.meta.get("val")
        produces_tensor = isinstance(val, torch.Tensor) or (
            isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val))
        if not produces_tensor or n.meta.get("fc_kind") in (OpKind.VIEW, OpKind.BROADCAST):
            continue
        aten.append({"node": n.name, "op": _short(n.target),
                     "reason": aten_reason(n, ctx.config)})
    refused = [d for d in ctx.decisions if not d["taken"]]
    # data flow between nodes, by name: what `dump --format dot|html` draws
    edges = [[a.name, n.name] for n in gm.graph.nodes if n.op == "call_function"
             for a in n.all_input_nodes if a.op in ("call_function", "placeholder")]
    kernels_after = sum(1 for g in groups if g["kernel"]) + sum(
        len(g["ops"]) for g in groups if not g["kernel"])
    return {
        "kind": ctx.kind, "profile": ctx.profile.name, "layout": ctx.layout,
        "groups": groups, "aten_ops": aten,
        "refused": refused, "edges": edges,
        "constants": [{"node": name, "bytes": size} for name, size in ctx.constants],
        "contractions": [{"node": name, "batch": b, "m": m, "k": k, "n": n}
                         for name, b, m, k, n in ctx.contractions],
        "contractions_kept": [{"node": name, "batch": b, "m": m, "k": k, "n": n, "reason": why}
                              for name, b, m, k, n, why in ctx.contractions_kept],
        "depthwise_convs": [{"node": name, "shape": list(shape), "taps": taps}
                            for name, shape, taps in ctx.depthwise_convs],
        "empty": list(ctx.empty_values),
        "inplace": [{"group": g, "output": p, "over": name} for g, p, name in ctx.inplace],
        "input_writes": [{"group": g, "output": p, "into": name}
                         for g, p, name in ctx.input_writes],
        "passed_through": list(ctx.passed_through),
        "trimmed_cats": list(ctx.trimmed_cats),
        "totals": {
            "fusible_ops": len(in_groups),
            "kernels_before": len(in_groups),
            "kernels_after": kernels_after,
            "aten_ops": len(aten),
            "bytes_before": before_bytes, "bytes_after": after_bytes,
            "time_before_us": before_time * 1e6, "time_after_us": after_time * 1e6,
        },
    }


def failed(ctx, error: str) -> dict:
    """The summary of a graph the compiler could not compile (it runs on ATen unfused)."""
    return {"kind": ctx.kind, "profile": ctx.profile.name, "layout": ctx.layout, "error": error,
            "groups": [],
            "aten_ops": [], "refused": [], "edges": [], "constants": [], "contractions": [],
            "contractions_kept": [], "depthwise_convs": [],
            "empty": [],
            "inplace": [], "input_writes": [], "passed_through": [], "trimmed_cats": [],
            "totals": {"fusible_ops": 0, "kernels_before": 0, "kernels_after": 0, "aten_ops": 0,
                       "bytes_before": 0, "bytes_after": 0,
                       "time_before_us": 0.0, "time_after_us": 0.0}}
