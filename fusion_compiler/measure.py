"""Measured beside predicted: each fused kernel and the unfused ATen ops it replaced, timed.

`fusion-compiler dump --measure` (and ``explain(..., measure=True)``) compile the model while a
``recording()`` is active: every ATen graph that runs kernels keeps its original graph, its
groups and launchers, and a copy of the arguments of its first call. ``measure_graph`` then
replays that graph on those arguments to get each group's real inputs, and times

- fused: the group's launcher (one kernel), and
- unfused: the group's ATen ops run one by one, as eager PyTorch would run them,

each as a model runs them: launched back to back (so the host's launch cost overlaps the GPU's
work, as it does between a model's kernels), on copies of the inputs that rotate so that together
they overflow the L2 cache (each launch reads from HBM), after an L2 flush; the time per launch
is the median over several such batches (CUDA events on a GPU), and the least of ``ROUNDS``
such medians taken seconds apart (the host's speed is not steady: ``measure_graph``).
`fusion-compiler calibrate` measures the launch overhead the same way, so predictions and
measurements agree on what a launch costs. The cost model's predictions for both
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


L2_BYTES = 64 << 20      # more than any current GPU's L2 (H100/H200: 50 MiB)


def copies_for(tensors, device_type: str) -> int:
    """How many copies of ``tensors`` rotate so that together they overflow the L2 cache."""
    if device_type != "cuda":
        return 1
    size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return max(2, min(32, -(-2 * L2_BYTES // max(size, 1))))


def twin(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides. A kernel bakes its inputs' strides in: ``clone`` of a
    view with gaps (a slice of a wider row) is contiguous, and the kernel read past its end
    (Mamba2's training graph: an illegal memory access on the H100). Dims of stride 0 (an
    expand) are copied once."""
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    one = tuple(slice(0, 1) if s == 0 else slice(None) for s in t.stride())
    out[one].copy_(t[one])
    return out


def rotated(values, copies: int) -> list:
    """``copies`` lists like ``values``, the first the values themselves, the rest copies
    with their strides (``twin``)."""
    return [values] + [[twin(v) if isinstance(v, torch.Tensor) else v for v in values]
                       for _ in range(copies - 1)]


def spin_up(seconds: float = 0.3) -> None:
    """Keep the GPU busy for ``seconds``: an idle GPU clocks down (the H200 idles at 345 MHz)
    and the first kernels timed after it would be measured slow."""
    a = torch.randn(2048, 2048, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def steady_seconds(fn, copies: int, device_type: str, batches=7, budget_s=0.1) -> float:
    """Seconds per call of ``fn(i)``, called back to back for i in range(copies) (i picks the
    copy of the inputs), after an L2 flush: the median over ``batches`` batches (at least).
    The host clock off the GPU."""
    for i in range(copies):                                    # warm-up (and compile)
        fn(i)
    batch = _cuda_batch() if device_type == "cuda" else _host_batch
    per_call, start_all = [], time.perf_counter()
    while len(per_call) < batches or (time.perf_counter() - start_all < budget_s
                                      and len(per_call) < 100):
        per_call.append(batch(fn, copies) / copies)
    return statistics.median(per_call)


def _host_batch(fn, copies: int) -> float:
    t0 = time.perf_counter()
    for i in range(copies):
        fn(i)
    return time.perf_counter() - t0


def _cuda_batch():
    """A batch timer on the GPU: flush L2, then CUDA events around the calls."""
    flush = torch.empty(2 * L2_BYTES // 4, dtype=torch.int32, device="cuda")

    def batch(fn, copies: int) -> float:
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(copies):
            fn(i)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e-3
    return batch


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


ROUNDS = 3      # passes over a graph's groups; each group's least median counts


def measure_graph(target: GraphTarget, rounds: int | None = None) -> list:
    """One row per fused group: predicted and measured times (seconds) fused and unfused.

    Every group is measured once per round, the rounds one after another, so each group's
    measurements lie seconds apart; the least of its rounds counts, fused and unfused alike.
    The host's speed is not steady: on the H200 machine of session 14 the same piece of Python
    took 9 ms or 17 ms, switching every few seconds, and a launch-bound kernel measured 4.6 us
    in one stretch and 12.3 us in the next. ``calibrate`` measures the launch overhead the same
    way (the least of rounds), so both describe the host at its speed, not a mix of two.
    One round under Triton's interpreter, whose times are not a GPU's anyway."""
    if not target.args:
        return []
    # what the kernels load, and what their inlined views read besides (size values)
    wanted = {a for g in target.groups for n in [*g.inputs, *g.nodes]
              for a in ([n] if n in g.inputs else n.all_input_nodes) if a not in g.nodes}
    interp = _Values(target.gm, wanted)
    with torch.no_grad():
        interp.run(*target.args)
    on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in target.args)
    if on_gpu:
        spin_up()
    rounds = rounds or (ROUNDS if on_gpu else 1)
    best, at, start = {}, {}, time.perf_counter()
    for _ in range(rounds):
        for g in target.groups:
            at.setdefault(g.id, time.perf_counter() - start)
            fused, unfused = _measure_group(g, target, interp.values)
            old = best.get(g.id, (fused, unfused))
            best[g.id] = (min(old[0], fused), min(old[1], unfused))
    rows = []
    for g in target.groups:
        fused, unfused = best[g.id]
        predicted_unfused = sum(target.unfused_cost[n].time for n in g.members)
        rows.append({"group": g.id, "predicted_fused_us": g.cost.time * 1e6,
                     "measured_fused_us": fused * 1e6,
                     "predicted_unfused_us": predicted_unfused * 1e6,
                     "measured_unfused_us": unfused * 1e6,
                     "error": (g.cost.time - fused) / fused,
                     "at_s": at[g.id]})       # when its first round began
    return rows


def _measure_group(g, target: GraphTarget, values: dict) -> tuple[float, float]:
    """(fused, unfused) seconds per call of one group, on rotating copies of its real inputs."""
    ins = [values[a] for a in g.inputs]
    device = next((t.device.type for t in ins if isinstance(t, torch.Tensor)
                   and t.device.type != "cpu"), "cpu")
    launch, syms = target.launchers[g.id], _symbol_values(g, target.size_hints)
    copies = copies_for(ins, device)
    in_sets = rotated(ins, copies)
    fused = steady_seconds(lambda i: launch(*in_sets[i], *syms), copies, device)
    nodes = g.nodes
    outside_nodes = list({a: None for n in nodes for a in n.all_input_nodes
                          if a not in g.nodes})
    outside_sets = rotated([values[a] for a in outside_nodes], copies)

    def unfused(i):
        env = dict(zip(outside_nodes, outside_sets[i]))
        for n in nodes:
            args = torch.fx.node.map_arg(n.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = n.target(*args, **kwargs)
    with torch.no_grad():
        return fused, steady_seconds(unfused, copies, device)


def summary(rows) -> dict:
    """Median absolute relative error of the fused predictions; groups slower fused."""
    errors = [abs(r["error"]) for r in rows]
    return {"groups_measured": len(rows),
            "median_abs_error": statistics.median(errors) if errors else None,
            "slower_fused": [r["group"] for r in rows
                             if r["measured_fused_us"] > r["measured_unfused_us"]]}

