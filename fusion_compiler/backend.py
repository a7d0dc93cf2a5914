"""The torch.compile backend: dynamo graph -> aot_autograd (ATen, fwd + bwd) -> passes.

    torch.compile(model, backend="fusion")

Each ATen graph (forward, backward, or inference under no_grad) goes through
``passes.pipeline.compile_graph``. Tensors on the CPU run the ATen graph as it is (said once in
the log) unless Triton's interpreter is on (TRITON_INTERPRET=1), which the tests use.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from dataclasses import dataclass, field

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from torch.fx._lazy_graph_module import _LazyGraphModule

from . import aot_cache, cudagraphs, measure, training_partition
from .codegen.triton_lib import interpreting
from .config import Config, ConfigError, with_compile_args
from .decompositions import decomposition_table
from .passes import (channels_last, depthwise_conv, fast_calls, late_decompose, layout_checks,
                     nearest_upsample, sdpa_mask)
from .report import GraphReport, aten_compute_ops, publish
from . import summary

log = logging.getLogger("fusion_compiler")
_said_cpu = False
_caches: dict = {}


@dataclass
class CompileContext:
    """Everything a pass may read or write for one graph; passed in, never global."""
    config: Config
    kind: str
    profile: object
    cache: object
    run_on_cpu: bool
    size_hints: dict = field(default_factory=dict)
    decisions: list = field(default_factory=list)
    layout: str | None = None       # the Dynamo graph's layout decision (passes/channels_last.py)
    unfused_cost: dict = field(default_factory=dict)
    recomputed_anywhere: set = field(default_factory=set)   # set by the fuse pass
    groups: list = field(default_factory=list)
    launchers: dict = field(default_factory=dict)
    kernels: list = field(default_factory=list)
    constants: list = field(default_factory=list)   # (node name, bytes), constant_fold
    # (sum's node name, batch, M, K, N): summed broadcast products run as bmm, contractions
    contractions: list = field(default_factory=list)
    # (sum's node name, batch, M, K, N, why): matrix products kept fused reductions
    contractions_kept: list = field(default_factory=list)
    # (Dynamo node name, output shape, taps): depthwise 1-d convolutions rewritten as sums of
    # shifted products before aot_autograd (passes/depthwise_conv.py), on forward graphs
    depthwise_convs: list = field(default_factory=list)
    empty_values: list = field(default_factory=list)    # node names, empty_values
    passed_through: list = field(default_factory=list)  # cats with empty tensors, empty_values
    trimmed_cats: list = field(default_factory=list)    # cats without their empty inputs, empty_values
    seconds: dict = field(default_factory=dict)     # phase -> seconds (pipeline.compile_graph)
    # Triton kernels compiled at compile time: by worker processes (codegen/compile_pool.py), all
    compiled: list = field(default_factory=lambda: [0, 0])
    compiles: object = None     # the kernels compiling on threads (generate.KernelCompiles)
    analyzed: object = None     # the graph the groups were decided on (pipeline.compile_graph)
    inplace: list = field(default_factory=list)     # (group, output, input): passes/inplace.py
    # (group, output, graph input) whose copy_ the kernel made: passes/input_writes.py
    input_writes: list = field(default_factory=list)


@contextlib.contextmanager
def young_gc():
    """Python's cyclic collector, while compiling, scans only the objects made meanwhile.

    A full collection walks every object the process holds (torch, sympy, the model): one fell
    inside Llama 1 x 128's cold graph compile and took 0.18-0.23 s of its 0.78-0.89 s on the CPU
    (benchmarks/gc_compile.py --copy-graph). Objects that exist on
    entry are frozen (``gc.freeze``) and handed back to the collector on exit: garbage made
    while compiling is still collected, and the older objects are collected as before once
    the compile returns. Left alone where the process has frozen objects of its own (it
    manages the collector itself) or has it off."""
    global _young
    # nested (a graph's compile inside the backend call): already frozen. Asked before
    # get_freeze_count, which walks every frozen object (29 ms after freezing the process)
    if _young or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _young = True
    try:
        yield
    finally:
        _young = False
        gc.unfreeze()


_young = False      # young_gc has frozen the process's objects


def kernel_cache(config: Config):
    from .codegen.cache import KernelCache

    cache = _caches.get(config.cache_dir)
    if cache is None:
        cache = _caches[config.cache_dir] = KernelCache(config.cache_dir)
    return cache


def make_context(config: Config, kind: str, gm=None) -> CompileContext:
    """``gm``: the graph to compile; one that will be replayed from a CUDA graph is costed
    without the host's launch terms (a replay launches every kernel at once; what a kernel
    still costs is its GPU time, ``kernel_latency`` included)."""
    from .passes.cost_model import resolve_profile, without_host

    profile = resolve_profile(config.profile, config.cache_dir)
    if config.cudagraphs and gm is not None and cudagraphs.why_not(gm, kind) is None:
        profile = without_host(profile)
    return CompileContext(config=config, kind=kind, profile=profile,
                          cache=kernel_cache(config), run_on_cpu=interpreting())


def _devices(gm) -> set:
    return {n.meta["val"].device.type for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def compile_aten_graph(gm: torch.fx.GraphModule, kind: str, config: Config,
                       meanwhile=None, layout: str | None = None, depthwise: tuple = ()):
    """Run the pipeline on one ATen graph; return what aot_autograd should call.
    ``meanwhile()``, if given, is the caller's own work, run while the kernels compile (once,
    whatever happens). ``layout``: what the Dynamo graph's layout pass decided, for the report;
    ``depthwise``: the convolutions passes/depthwise_conv.py rewrote there, for the forward's.

    An unexpected error in the compiler never stops a model that eager PyTorch runs: the graph
    runs on ATen unfused, with a warning (or the error is raised with FUSION_COMPILER_STRICT=1),
    and the report says what happened."""
    pending = [meanwhile] if meanwhile is not None else []
    with young_gc():
        try:
            return _compile_aten_graph(gm, kind, config, pending, layout, depthwise)
        finally:
            _run_pending(pending)       # not run yet: the passes failed first


def _run_pending(pending: list) -> None:
    while pending:
        pending.pop()()


def _compile_aten_graph(gm: torch.fx.GraphModule, kind: str, config: Config, pending: list,
                        layout: str | None = None, depthwise: tuple = ()):
    from .passes import generate, pipeline       # here: `import fusion_compiler` stays light

    global _said_cpu
    started = time.perf_counter()
    ctx = make_context(config, kind, gm)
    ctx.layout = layout
    if kind != "backward":
        ctx.depthwise_convs = list(depthwise)
    report = GraphReport(kind=kind, ran_kernels=False, nodes_before=len(gm.graph.nodes))
    runs_kernels = "cuda" in _devices(gm) or ctx.run_on_cpu
    if not runs_kernels and not _said_cpu:
        log.info("fusion-compiler: CPU tensors run the ATen graph unfused "
                 "(set TRITON_INTERPRET=1 to run the generated kernels on the CPU)")
        _said_cpu = True
    # a graph of the partition's own is made ready to run while its kernels compile; the
    # analyzed graph itself (no group has a kernel) only after the report has read its nodes
    # (fast_calls renames their targets)
    own = lambda g: g is not gm and g is not ctx.analyzed   # noqa: E731
    try:
        new_gm = _run_passes(gm, ctx, runs_kernels)     # its kernels may still be compiling
        aten_ops = _runnable(new_gm) if own(new_gm) else None
        _run_pending(pending)               # the caller's work, meanwhile
        if runs_kernels:
            final = pipeline.finish(new_gm, ctx)
            if final is not new_gm:         # a kernel failed: its group is back on ATen
                new_gm, aten_ops = final, _runnable(final) if own(final) else None
    except Exception as exc:
        generate.abandon(ctx)               # no kernel left compiling
        if config.strict:
            raise
        log.warning("fusion-compiler: compiling the %s graph failed (%s: %s); running it on ATen "
                    "unfused. Set FUSION_COMPILER_STRICT=1 to raise instead.", kind,
                    type(exc).__name__, exc)
        report.error = f"{type(exc).__name__}: {exc}"
        report.summary = summary.failed(ctx, report.error)
        report.aten_ops = aten_compute_ops(gm)
        report.compile_seconds = time.perf_counter() - started
        publish(report)
        layout_checks.run(gm)       # a backward's kernels may read its saved convolutions
        return with_code(gm)        # as far as the passes rewrote it
    report.ran_kernels = runs_kernels
    report.phase_seconds = ctx.seconds
    report.kernels_by_workers = tuple(ctx.compiled)
    report.inplace = len(ctx.inplace)
    report.kernels = ctx.kernels
    report.aten_ops = aten_ops if aten_ops is not None else aten_compute_ops(new_gm)
    report.groups_not_generated = [([str(n.target) for n in g.members], g.error)
                                   for g in ctx.groups if g.id not in ctx.launchers]
    report.decisions = ctx.decisions
    report.summary = summary.summarize(gm, ctx)
    if log.isEnabledFor(logging.INFO):      # the dump's table, while torch.compile runs
        from .dump_format import render_table
        doc = {"target": f"torch.compile ({kind} graph)", "graphs": [dict(
            report.summary, kernels=ctx.kernels, ran_kernels=runs_kernels)],
            "options": {"device": "-", "dtype": None, "training": kind == "backward",
                        "dynamic": False, "profile": ctx.profile.name, "code": False}}
        log.info("%s", render_table(doc))
    publish(report)
    target = measure.keep(gm, ctx)                 # only while `dump --measure` records
    if target is not None:
        target.report = report
        new_gm._fc_measure = target
    if aten_ops is None:
        _runnable(new_gm)
    report.compile_seconds = time.perf_counter() - started      # the report object is shared
    return new_gm


def _runnable(gm: torch.fx.GraphModule) -> list:
    """``gm`` made ready to run (its ATen calls through torch's direct bindings, its code
    compiled); returns the ATen ops it keeps, named before fast_calls renames them."""
    ops = aten_compute_ops(gm)
    layout_checks.run(gm)
    fast_calls.run(gm)
    with_code(gm)
    return ops


class BoxedCode(torch.fx.graph.CodeGen):
    """Generated code that takes aot_autograd's argument list itself, ``forward(self,
    fc_args)``, and empties it: each input is then freed after its last use, as FX's code
    frees every value, where a call with the list unpacked (``make_boxed_func``) kept every
    input alive to the end. A backward graph's inputs are the forward's saved activations:
    Llama's training step held all of them to its last gradient (session 50: the step's peak
    740 MiB above Inductor's, whose code clears its list the same way)."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs):
        names = [v.split("#")[0].split(":")[0].split("=")[0].strip() for v in free_vars]
        names = [n for n in names if n and n != "self"]
        head = f"def {getattr(self, '_func_name', 'forward')}(self, fc_args){maybe_return_annotation}:"
        if not names:
            return head
        return f"{head}\n    {', '.join(names)}, = fc_args\n    fc_args.clear()"


def boxed(gm: torch.fx.GraphModule):
    """What aot_autograd calls for a graph whose code is ``BoxedCode``'s: its forward itself (a
    GraphModule's ``__call__`` goes through nn.Module's hook machinery on every call, ~1 us of
    host time), marked as taking the argument list. A partial, not a wrapper function: no
    Python frame of its own on the call path."""
    fn = functools.partial(gm.forward)
    fn._boxed_call = True
    return fn


def with_code(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its forward compiled from its graph, taking its inputs as one list that it
    empties (``BoxedCode``: call it as ``gm.forward(list_of_inputs)``). The passes rewrite
    graphs and leave their code alone: a graph's Python is generated and compiled once, here,
    not after each pass (GPT-2's training graphs: 0.05-0.1 s a compile on the CPU)."""
    gm.graph.set_codegen(BoxedCode())
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
    else:
        gm.recompile()
    return gm


def _run_passes(gm, ctx, runs_kernels: bool):
    from .passes import generate, pipeline

    if runs_kernels:
        return pipeline.compile_graph(gm, ctx)
    pipeline.analyze(gm, ctx)              # the decisions, for reports and `dump`
    if ctx.config.emit_sources:
        generate.run(gm, ctx)              # sources for `dump --code`; nothing launches them
    return gm


@functools.lru_cache(maxsize=1)
def _aot_cache_usable() -> bool:
    why = aot_cache.available()
    if why is not None:
        log.info("fusion-compiler: aot_autograd's result is not kept on disk: %s", why)
    return why is None


def fusion_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """torch.compile backend entry point (registered as "fusion")."""
    config = with_compile_args(Config.from_env(), kwargs.pop("mode", None),
                               kwargs.pop("options", None))
    if kwargs:
        raise ConfigError(f"the fusion backend takes mode= and options=, not {', '.join(kwargs)}")
    if config.disable:
        return gm.forward
    cuda = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda),
                None)
    start_workers = None
    if cuda is not None and not interpreting():
        # Triton's key for its kernel cache, hashed by a helper process while we trace
        from .codegen import precompile, triton_key
        known = triton_key.install(config.cache_dir, helper=True)
        if config.compile_threads > 0:
            precompile.prepare_driver()     # its gcc run, while we trace
            if config.compile_workers > 0 and torch.version.hip is None:
                from .codegen import compile_pool
                major, minor = torch.cuda.get_device_capability(cuda)
                # worker processes get ready to compile this graph's kernels while we trace;
                # not for a graph the AOT cache loads (its kernels are in Triton's cache:
                # eight processes starting Triton would only compete with it)
                start_workers = functools.partial(compile_pool.start, config.compile_workers,
                                                  10 * major + minor, known)
    # where kernels run (the CPU runs ATen's ops one by one: its upsample kernel is better)
    if (cuda is not None or interpreting() or config.emit_sources) and nearest_upsample.run(gm):
        log.info("fusion-compiler: nearest upsampling as index arithmetic "
                 "(passes/nearest_upsample.py)")
    depthwise = ()
    if config.depthwise_conv and (cuda is not None or interpreting() or config.emit_sources):
        depthwise = tuple(depthwise_conv.run(gm))
        if depthwise:
            log.info("fusion-compiler: %d depthwise 1-d convolutions as sums of shifted products "
                     "(passes/depthwise_conv.py)", len(depthwise))
    if sdpa_mask.run(gm):
        log.info("fusion-compiler: attention masks copied to contiguous memory, so SDPA can "
                 "pick its fused CUDA kernels (passes/sdpa_mask.py)")
    layout = None
    if config.channels_last:
        # the CPU runs what the GPU would where the interpreter runs the kernels (tests)
        decision = channels_last.run(gm, ("cuda", "cpu") if interpreting() else ("cuda",))
        layout = decision.note()
        if layout is not None:
            log.info("fusion-compiler: convolution activations %s (passes/channels_last.py)",
                     layout)

    def finish(aten_gm, kind, static_inputs, meanwhile=None):
        """One ATen graph compiled into what aot_autograd calls (boxed: it passes the argument
        list itself, so inputs can be freed early)."""
        compiled = compile_aten_graph(aten_gm, kind, config, meanwhile=meanwhile,
                                      layout=layout, depthwise=depthwise)
        fn = boxed(compiled)
        target = getattr(compiled, "_fc_measure", None)
        if target is not None:
            return measure.capture_first_call(fn, target)
        if config.cudagraphs:
            reason = cudagraphs.why_not(aten_gm, kind, static_inputs)
            if reason is None:
                return cudagraphs.CudaGraphRunner(fn, f"{kind} graph", static_inputs,
                                                  config.cudagraph_copy_outputs)
            log.info("fusion-compiler: %s graph not captured in a CUDA graph: %s", kind, reason)
        return fn

    partition = "min_cut" if config.backward_recompute else "default"
    # training and inference graphs alike: aot_autograd's trace is most of a warm compile
    # (Llama 1 x 128's inference graph: 1.1 s of its 1.6 s in the backend, H200)
    if config.aot_cache and _aot_cache_usable():
        def compiler(kind):
            return aot_cache.compiler(kind, finish, cudagraphs.static_input_indices)
        # the decomposition table is part of what aot_autograd made: its switch keys the entries
        table_kind = partition if config.max_pool else f"{partition}+aten-max-pool"
        if cuda is None and not (interpreting() or config.emit_sources):
            # where no kernel runs, composite ops keep ATen's kernels (decompositions.py,
            # _kernels_run): a graph traced so must not serve the interpreter or `dump`
            table_kind += "+no-kernels"
        kept = aot_cache.context(aot_cache.namespace(config.cache_dir, table_kind), finish,
                                 on_miss=start_workers)
    else:
        def compiler(kind):
            return lambda aten_gm, _inputs: finish(aten_gm, kind,
                                                   cudagraphs.static_input_indices())
        kept = contextlib.nullcontext()
        if start_workers is not None:
            start_workers()

    with young_gc(), kept:      # aot_autograd's tracing and the forward graph's passes
        return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                            inference_compiler=compiler("inference"),
                            decompositions=decomposition_table(
                                late_decompose.deferred(gm, example_inputs), config.max_pool),
                            partition_fn=training_partition.partition
                            if partition == "min_cut" else default_partition,
                            keep_inference_input_mutations=True,
                            )(gm, example_inputs)
