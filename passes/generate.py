"""Generate pass: one Triton kernel module per legal group, through the on-disk cache.

Writes ``ctx.launchers`` (group id -> launcher function) and ``ctx.kernels`` (what was built).
A group that cannot be generated (its error says why) stays on ATen.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from ..codegen import autotune, compile_pool, precompile
from ..codegen.kernel_ir import NotFusable, canonical_hints
from ..codegen import launch as rules
from ..codegen.launch import LEAN
from ..codegen.render import generate
from .cost_model import op_name
from .partition import readable_symbols

log = logging.getLogger("fusion_compiler")


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Each group's kernel module; with lean launchers, each kernel starts compiling on the
    compile threads as soon as its launcher exists (``finish`` waits for them)."""
    readable = readable_symbols(n for n in gm.graph.nodes if n.op == "placeholder")
    order = ctx.groups
    if LEAN and ctx.config.compile_threads > 0:
        ctx.compiles = KernelCompiles(ctx)
        # the biggest kernels first: they take longest to compile (Llama's multi-part RoPE
        # kernel, 31 ops: 290-305 ms in a worker on the H200's host, the others 68-172 ms)
        order = sorted(ctx.groups, key=lambda g: -len(g.nodes))
    for g in order:
        if g.ir is None:
            continue
        device = g.outputs[0].meta["fc_tensor"].device
        runs = device.type != "cpu" or ctx.run_on_cpu
        if not runs and not ctx.config.emit_sources:
            g.error = "CPU tensors run on ATen (TRITON_INTERPRET=1 runs kernels on the CPU)"
            continue
        if not readable.issuperset(g.graph_symbols):
            g.error = "a size symbol is not readable from the graph inputs"
            continue
        hints = canonical_hints(g.graph_symbols, g.ir, ctx.size_hints)
        title = label(g)
        # everything the source depends on besides the IR goes into the key
        key = g.ir.key(*ctx.cache.salt(), title, str(ctx.config.max_persistent_block),
                       str(ctx.config.max_resident_row), str(rules.RESIDENT_RBLOCK),
                       str(rules.RESIDENT_VALUES), str(ctx.config.tiles))
        try:
            module = ctx.cache.load(key, lambda: generate(g.ir, hints, title,
                                                          ctx.config.max_persistent_block,
                                                          ctx.config.max_resident_row,
                                                          ctx.config.tiles))
        except NotFusable as exc:       # this group stays on ATen; the others still fuse
            if ctx.config.strict:
                raise
            g.error = f"code generation: {exc}"
            continue
        if runs:
            # the device is bound here, not stored in the module: one cached module serves
            # every graph with this kernel, on whichever device each runs
            launch = functools.partial(module.launch, device)
            launch.__name__ = launch.__qualname__ = "launch"     # FX names call targets
            launch.__module__ = module.__name__
            launch.inplace = module.INPLACE     # outputs it may write over a dead input
            launch.always_inplace = getattr(module, "INPLACE_ALWAYS", False)
            ctx.launchers[g.id] = launch
            if ctx.compiles is not None:
                ctx.compiles.add(g, launch)
        members = [n for n in g.nodes if n in g.members]    # graph order: a set's is not fixed
        ctx.kernels.append({"group": g.id, "key": key, "label": title, "path": module.__file__,
                            "ops": [str(n.target) for n in members], "runs": runs})
    if order is not ctx.groups:         # the kernels in the groups' order again
        position = {g.id: i for i, g in enumerate(ctx.groups)}
        ctx.kernels.sort(key=lambda k: position[k["group"]])
    return gm


def finish(ctx) -> int:
    """Wait for the kernels compiling since ``run`` (the time goes to ``ctx.seconds["triton"]``),
    then tune them if asked. A group whose kernel Triton could not compile loses its launcher
    and stays on ATen (its error says why); returns how many did."""
    compiles, ctx.compiles = ctx.compiles, None
    dropped = 0
    if compiles is not None:
        started = time.perf_counter()
        dropped = compiles.finish()
        ctx.seconds["triton"] = time.perf_counter() - started
    if LEAN and ctx.config.autotune > 0:
        started = time.perf_counter()
        tuned = autotune.tune(ctx)
        ctx.seconds["autotune"] = time.perf_counter() - started
        if tuned:
            log.info("fusion-compiler: %d kernels run with tuned launch settings", tuned)
    return dropped


class KernelCompiles:
    """The graph's Triton kernels compiled on threads and in the compile workers
    (codegen/precompile.py) while the compile goes on: each group's launches are recorded
    and sent as its launcher is made (``add``); ``finish`` waits for them. The first call
    then finds every kernel in Triton's cache."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.users: dict = {}           # Triton kernel -> the groups that launch it
        self.on: dict = {}              # device -> precompile.Compiling

    def add(self, g, launch) -> None:
        ctx = self.ctx
        try:
            calls = precompile.recorded_launches(launch, *precompile.stand_ins(g, ctx.size_hints))
        except Exception as exc:    # not predicted: the first call compiles it, as it would
            if ctx.config.strict:
                raise
            log.debug("fusion-compiler: group %s not compiled ahead (%s)", g.id, exc)
            return
        device = launch.args[0]
        compiling = self.on.get(device)
        if compiling is None:
            # the workers compile for one GPU at a time: the first device's kernels (a CPU
            # graph's, interpreted, on a GPU machine: none)
            pool = None if self.on or device.type != "cuda" else compile_pool.current()
            compiling = self.on[device] = precompile.Compiling(
                functools.partial(precompile.compile_here, device), ctx.config.compile_threads,
                pool, precompile.cuda_target(device) if pool is not None else None)
        for call in calls:
            self.users.setdefault(call[0], []).append(g)
        compiling.add(calls)

    def finish(self) -> int:
        ctx, dropped = self.ctx, 0
        errors = []
        for compiling in self.on.values():
            failed = compiling.wait()
            counts = compiling.counts
            ctx.compiled[0] += counts["by_workers"]
            ctx.compiled[1] += counts["kernels"]
            if counts["by_workers"]:
                log.debug("fusion-compiler: %d of %d kernels compiled by worker processes",
                          counts["by_workers"], counts["kernels"])
            for kernel, exc in failed.items():
                errors.append(exc)
                why = f"{type(exc).__name__}: {next(iter(str(exc).strip().splitlines()), '')}"
                for g in self.users[kernel]:
                    g.error = f"Triton could not compile its kernel ({why})"
                    dropped += ctx.launchers.pop(g.id, None) is not None
        if errors and ctx.config.strict:
            raise errors[0]
        ctx.kernels[:] = [k for k in ctx.kernels if not k["runs"] or k["group"] in ctx.launchers]
        return dropped


def abandon(ctx) -> None:
    """Wait for the kernels still compiling and keep nothing of them: the graph's compile
    failed before ``finish`` (no thread is left holding the compile pool)."""
    compiles, ctx.compiles = ctx.compiles, None
    if compiles is not None:
        with contextlib.suppress(Exception):
            compiles.finish()


def _op(node) -> str:
    """'mul' for an ``aten.mul.Tensor`` node; '' for inputs and constants."""
    return op_name(node.target) if node.op == "call_function" else ""


def _viewed(node):
    """The node ``node`` is a view of (through views, unsqueezes and expands), or itself."""
    while _op(node) in ("view", "_unsafe_view", "reshape", "unsqueeze", "expand"):
        node = node.args[0]
    return node


def _gate(group) -> str | None:
    """"swiglu" where a sigmoid's result multiplies a value it was not computed from (SwiGLU's
    up projection, apart or a half of one tensor), "silu" where it multiplies its own input
    (SiLU, x * sigmoid(x); QuickGELU, x * sigmoid(1.702 x)); None where no product pairs a
    sigmoid with a tensor (a scaled sigmoid, sigmoid(x) * 3)."""
    members = set(group.members)

    def ancestors(node):
        seen, todo = set(), [node]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    if a in members:
                        todo.append(a)
        return seen

    def unwrapped(node):        # a dtype conversion of x is x
        while _op(node) in ("_to_copy", "convert_element_type") and node in members:
            node = node.all_input_nodes[0]
        return node

    gate = None
    for n in group.members:
        if _op(n) != "mul" or len(n.all_input_nodes) != 2:
            continue
        for this, other in (n.all_input_nodes, n.all_input_nodes[::-1]):
            for s in ancestors(this) | {this}:
                if s in members and _op(s) == "sigmoid":
                    source = {unwrapped(a) for a in ancestors(s)}
                    if unwrapped(other) not in source and s not in ancestors(other):
                        return "swiglu"
                    gate = "silu"
    return gate


def _has_constant(group, value: float) -> bool:
    return any(isinstance(a, float) and abs(a - value) < 1e-9 for n in group.members
               for a in n.args)


def label(group) -> str:
    """Short name of what a group computes, read off its ops (for people, not for decisions)."""
    ops = {_op(n) for n in group.members}
    out_dtypes = {n.meta["fc_tensor"].dtype for n in group.members}
    in_dtypes = {n.meta["fc_tensor"].dtype for n in group.inputs}
    fp8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    reductions = sum(1 for n in group.members if _op(n) in ("mean", "sum"))
    parts = []
    # ops traced from a batch norm's decomposition carry it (make_fx's ``original_aten``)
    batch_norm = any("batch_norm" in str(n.meta.get("original_aten")) for n in group.members)
    # a pool (fusion_compiler/max_pool.py): its integer window positions are not a dequant
    pool = any("max_pool2d" in str(n.meta.get("original_aten")) for n in group.members)
    if {"amax", "exp", "sum"} <= ops:
        parts.append("softmax")
    elif batch_norm:
        parts.append("batchnorm")
    elif ("rsqrt" in ops or "sqrt" in ops) and reductions:
        # LayerNorm subtracts the row's mean; RMSNorm does not (a group may hold two norms).
        # Written out, a LayerNorm may divide by a sqrt (the ConvNeXt repository's
        # LayerNorm2d), where a std alone takes one
        centred = any(_op(n) == "sub" and any(_op(_viewed(a)) == "mean" for a in n.all_input_nodes)
                      for n in group.members)
        divided = any(_op(n) == "div" and len(n.args) > 1 and isinstance(n.args[1], torch.fx.Node)
                      and _op(_viewed(n.args[1])) == "sqrt" for n in group.members)
        if "rsqrt" in ops or (centred and divided):
            parts.append("layernorm" if centred else "rmsnorm")
    if "cat" in ops and "neg" in ops:
        parts.append("rope")
    gate = _gate(group) if "sigmoid" in ops and "mul" in ops else None
    if gate is not None:
        parts.append(gate)
    if "erf" in ops or ("tanh" in ops and _has_constant(group, 0.044715)):
        parts.append("gelu")            # exact, or tanh's approximation (its cubic's factor)
    elif "tanh" in ops:
        parts.append("tanh")            # e.g. Gemma 2's soft-capping of attention scores
    if pool:
        parts.append("maxpool")
    if "cumsum" in ops:
        parts.append("cumsum")
    if out_dtypes & fp8:
        parts.append("quant")
    if in_dtypes & ({torch.int8, torch.uint8} | fp8) and not out_dtypes & fp8 and not pool:
        parts.append("dequant")
    if any(n.meta.get("fc_column_sum") for n in group.members):    # passes/column_sums.py
        parts.append("column sum")
    if not parts and ops & {"mean", "sum", "amax", "amin"}:
        parts.append("reduction")
    if not parts:
        floats = all(d.is_floating_point for d in out_dtypes)
        parts.append("residual" if ops <= {"add"} and floats else "pointwise")
    return "+".join(parts)
