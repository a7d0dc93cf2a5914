"""Measured beside predicted: each fused kernel and the unfused ATen ops it replaced, timed.

`fusion-compiler dump --measure` (and ``explain(..., measure=True)``) compile the model while a
``recording()`` is active: every ATen graph that runs kernels keeps its original graph, its
groups and launchers, and a copy of the arguments of its first call. ``measure_graph`` then
replays that graph on those arguments to get each group's real inputs, and times

- fused: the group's launcher (one kernel), and
- unfused: the group's ATen ops run one by one, as eager PyTorch would run them,

each as the median of many runs (CUDA events on a GPU). The cost model's predictions for both
stand beside them, with the relative error of the fused prediction; the median absolute error
over the groups says how far the model can be trusted, and a group measured slower fused than
unfused is flagged. Under Triton's interpreter (CPU) the same code runs, but the times are the
interpreter's, not a GPU's: the CLI says so.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

_recording: list | None = None


@dataclass
class GraphTarget:
    """One compiled graph kept for measurement."""
    kind: str
    gm: torch.fx.GraphModule          # the ATen graph before partitioning
    groups: list                      # FusionGroups that have a launcher
    launchers: dict                   # group id -> launch function
    size_hints: dict
    unfused_cost: dict
    args: list = field(default_factory=list)    # the first call's arguments (copies)
    report: object = None                        # its GraphReport


class recording:
    """Context manager: graphs compiled inside it are kept (``.targets``) for measurement."""

    def __enter__(self):
        global _recording
        self.targets, self._old = [], _recording
        _recording = self.targets
        return self

    def __exit__(self, *exc):
        global _recording
        _recording = self._old
        return False


def keep(gm, ctx) -> GraphTarget | None:
    """Called by the backend for every graph that runs kernels; a target while recording."""
    if _recording is None or not ctx.launchers:
        return None
    target = GraphTarget(ctx.kind, gm, [g for g in ctx.groups if g.id in ctx.launchers],
                         dict(ctx.launchers), dict(ctx.size_hints), dict(ctx.unfused_cost))
    _recording.append(target)
    return target


def capture_first_call(fn, target: GraphTarget):
    """Wrap a boxed compiled function so that its first call's arguments are copied."""
    def boxed(args):
        if not target.args:
            target.args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        return fn(args)
    boxed._boxed_call = True
    return boxed


def _timer(fn, device_type: str, min_runs=10, budget_s=0.2) -> float:
    """Median seconds of ``fn()``: CUDA events on a GPU, the host clock elsewhere."""
    fn()                                                      # warm-up (and compile)
    times = []
    start_all = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start_all < budget_s and len(times) < 200):
        if device_type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Values(torch.fx.Interpreter):
    """Runs the graph and keeps the values of the nodes asked for."""

    def __init__(self, gm, wanted):
        super().__init__(gm)
        self.wanted, self.values = wanted, {}

    def run_node(self, n):
        out = super().run_node(n)
        if n in self.wanted:
            self.values[n] = out
        return out


def _symbol_values(group, hints):
    return [int(hints[s]) for s in group.graph_symbols]


def measure_graph(target: GraphTarget) -> list:
    """One row per fused group: predicted and measured times (seconds) fused and unfused."""
    if not target.args:
        return []
    # what the kernels load, and what their inlined views read besides (size values)
    wanted = {a for g in target.groups for n in [*g.inputs, *g.nodes]
              for a in ([n] if n in g.inputs else n.all_input_nodes) if a not in g.nodes}
    interp = _Values(target.gm, wanted)
    with torch.no_grad():
        interp.run(*target.args)
    rows = []
    for g in target.groups:
        ins = [interp.values[a] for a in g.inputs]
        device = next((t.device.type for t in ins if isinstance(t, torch.Tensor)
                       and t.device.type != "cpu"), "cpu")
        launch, syms = target.launchers[g.id], _symbol_values(g, target.size_hints)
        fused = _timer(lambda: launch(*ins, *syms), device)
        nodes = g.nodes

        outside = {a: interp.values[a] for n in nodes for a in n.all_input_nodes
                   if a not in g.nodes}

        def unfused():
            env = dict(outside)
            for n in nodes:
                args = torch.fx.node.map_arg(n.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
                env[n] = n.target(*args, **kwargs)
        with torch.no_grad():
            unfused_s = _timer(unfused, device)
        predicted_unfused = sum(target.unfused_cost[n].time for n in g.members)
        rows.append({"group": g.id, "predicted_fused_us": g.cost.time * 1e6,
                     "measured_fused_us": fused * 1e6,
                     "predicted_unfused_us": predicted_unfused * 1e6,
                     "measured_unfused_us": unfused_s * 1e6,
                     "error": (g.cost.time - fused) / fused})
    return rows


def summary(rows) -> dict:
    """Median absolute relative error of the fused predictions; groups slower fused."""
    errors = [abs(r["error"]) for r in rows]
    return {"groups_measured": len(rows),
            "median_abs_error": statistics.median(errors) if errors else None,
            "slower_fused": [r["group"] for r in rows
                             if r["measured_fused_us"] > r["measured_unfused_us"]]}

