"""The pass pipeline, top to bottom, one pass a line."""
from __future__ import annotations

import logging
import time

import torch

from . import (classify, column_sums, constant_fold, contractions, conv_bias, dedupe,
               empty_values, fuse, generate, grouped_attention, index_rows, late_decompose,
               memory_order, middle_dims, outer_dims, pad_gemm, partition, roll, scan_dims,
               shapes, trailing_dims)

log = logging.getLogger("fusion_compiler")


def analyze(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Decide the fusion groups; no code is generated (what `dump` and CPU runs need). The
    passes rewrite ``gm``'s graph, not its Python code: a caller that runs it recompiles it."""
    traced = _output_strides(gm)
    late_decompose.run(gm, ctx)     # norms, activations, softmaxes the trace kept whole
    grouped_attention.run(gm, ctx)  # GQA attention on grouped k/v heads, not repeated copies
    constant_fold.run(gm, ctx)      # values computed from constants alone: computed now, kept
    roll.run(gm, ctx)               # index_select by a constant rotation as a roll
    contractions.run(gm, ctx)       # summed broadcast products (einsums) as batched GEMMs
    pad_gemm.run(gm, ctx)           # GEMMs with unaligned rows padded for cuBLAS (GPU only)
    conv_bias.run(gm, ctx)          # cuDNN convolutions' biases added by the graph (GPU only)
    index_rows.run(gm, ctx)         # table[idx] as a gather of rows
    memory_order.run(gm, ctx)       # reductions over dims out of memory order as in it
    outer_dims.run(gm, ctx)         # sums over leading and trailing dims as one over each
    column_sums.run(gm, ctx)        # sums over leading dims as split sums of rows
    trailing_dims.run(gm, ctx)      # reductions over several trailing dims as over one
    middle_dims.run(gm, ctx)        # reductions over one middle dim as over the last
    scan_dims.run(gm, ctx)          # cumsums over another dim than the last as over the last
    _keep_output_layouts(gm, traced, ctx)   # a rewrite's output in the trace's strides again
    gm = shapes.run(gm, ctx)        # sympy sizes/strides of every tensor, size hints
    gm = classify.run(gm, ctx)      # op kind per node: pointwise, view, reduction, opaque
    gm = empty_values.run(gm, ctx)  # values with no elements: allocated, not computed
    gm = dedupe.run(gm, ctx)        # identical computations computed once
    gm = fuse.run(gm, ctx)          # priority fusion into groups, every decision recorded
    return gm


def _output_strides(gm) -> list:
    """(sizes, strides) of each output of ``gm`` that has static ones; None for the others
    (and no outputs where the graph does not return a tuple, as aot_autograd's do)."""
    out, outputs = [], gm.graph.output_node().args[0]
    for arg in outputs if isinstance(outputs, (tuple, list)) else ():
        layout = shapes.static_layout(arg.meta.get("val")) \
            if isinstance(arg, torch.fx.Node) else None
        out.append(None if layout is None else layout[:2])
    return out


def _addressed(layout) -> tuple:
    """The strides of the dims of a (sizes, strides) layout that are not of size 1 (those
    address nothing)."""
    return tuple(st for n, st in zip(*layout) if n != 1)


def _keep_output_layouts(gm, traced: list, ctx) -> None:
    """Put back in the trace's strides each output of ``gm`` a rewrite left in others: the
    caller gets the strides the trace promised, and a training graph's backward reads the
    values its forward saves by them (passes/middle_dims.py's elementwise sums wrote the
    slices' layout: a wrong gradient). A pass's bug, so it raises under
    FUSION_COMPILER_STRICT; else a warning, and the output is copied into the traced layout
    (a permute of a contiguous copy), which its kernel may write directly."""
    now_strides = _output_strides(gm)
    if now_strides == traced:
        return
    outputs = list(gm.graph.output_node().args[0])
    for k, (now, then) in enumerate(zip(now_strides, traced)):
        if now is None or then is None or _addressed(now) == _addressed(then):
            continue
        why = (f"output {k} ({outputs[k].name}) left the ATen passes in strides {now[1]}, "
               f"the trace's {then[1]}")
        if ctx is None or ctx.config.strict:
            raise AssertionError(why)
        # dims from the largest traced stride to the smallest: a contiguous copy in that order
        order = sorted(range(len(then[1])), key=lambda d: (-then[1][d], -then[0][d]))
        node, mode = outputs[k], outputs[k].meta["val"].fake_mode
        with gm.graph.inserting_after(node):
            ordered = pad_gemm.emit(gm, torch.ops.aten.permute.default, (node, order), mode)
        with gm.graph.inserting_after(ordered):
            copy = pad_gemm.contiguous(gm, ordered)
        back = sorted(range(len(order)), key=order.__getitem__)
        with gm.graph.inserting_after(copy):
            fixed = pad_gemm.emit(gm, torch.ops.aten.permute.default, (copy, back), mode)
        if _addressed(shapes.static_layout(fixed.meta["val"])[:2]) != _addressed(then):
            raise AssertionError(why + " (no dense copy has those)")
        log.warning("fusion-compiler: %s; copied into them (a bug: please report it)", why)
        outputs[k] = fixed
        gm.graph.output_node().args = (type(gm.graph.output_node().args[0])(outputs),)


def compile_graph(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """ATen graph -> graph of generated kernels and the ATen ops left over. Its kernels may
    still be compiling on threads when it returns: the caller gets the graph ready to run
    meanwhile, then calls ``finish``. The time of each phase goes to ``ctx.seconds``."""
    started = time.perf_counter()
    gm = ctx.analyzed = analyze(gm, ctx)    # groups
    analyzed = time.perf_counter()
    try:
        generate.run(gm, ctx)       # one cached Triton kernel per group, compiling on threads
        generated = time.perf_counter()
        out = partition.run(gm, ctx)    # one launcher call per group; the rest stays ATen
    except BaseException:
        generate.abandon(ctx)       # no kernel left compiling
        raise
    ctx.seconds.update(analyze=analyzed - started, sources=generated - analyzed,
                       partition=time.perf_counter() - generated)
    return out


def finish(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Wait for the kernels ``compile_graph`` left compiling (the wait goes to
    ``ctx.seconds["triton"]``). Returns its graph ``gm``, or, where Triton could not compile a
    group's kernel, the graph partitioned anew with that group on ATen."""
    if generate.finish(ctx):
        return partition.run(ctx.analyzed, ctx)
    return gm
