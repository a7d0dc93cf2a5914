"""The pass pipeline, top to bottom, one pass a line."""
from __future__ import annotations

import time

import torch

from . import (classify, column_sums, constant_fold, contractions, conv_bias, dedupe,
               empty_values, fuse, generate, grouped_attention, index_rows, late_decompose,
               memory_order, middle_dims, outer_dims, pad_gemm, partition, roll, scan_dims,
               shapes, trailing_dims)


def analyze(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Decide the fusion groups; no code is generated (what `dump` and CPU runs need). The
    passes rewrite ``gm``'s graph, not its Python code: a caller that runs it recompiles it."""
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
    gm = shapes.run(gm, ctx)        # sympy sizes/strides of every tensor, size hints
    gm = classify.run(gm, ctx)      # op kind per node: pointwise, view, reduction, opaque
    gm = empty_values.run(gm, ctx)  # values with no elements: allocated, not computed
    gm = dedupe.run(gm, ctx)        # identical computations computed once
    gm = fuse.run(gm, ctx)          # priority fusion into groups, every decision recorded
    return gm


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
