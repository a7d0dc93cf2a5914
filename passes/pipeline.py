"""The pass pipeline, top to bottom, one pass a line."""
from __future__ import annotations

import time

import torch

from . import (classify, column_sums, constant_fold, conv_bias, dedupe, empty_values, fuse,
               generate, index_rows, late_decompose, pad_gemm, partition, roll, shapes)


def analyze(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Decide the fusion groups; no code is generated (what `dump` and CPU runs need). The
    passes rewrite ``gm``'s graph, not its Python code: a caller that runs it recompiles it."""
    late_decompose.run(gm, ctx)     # norms, activations, softmaxes the trace kept whole
    constant_fold.run(gm, ctx)      # values computed from constants alone: computed now, kept
    roll.run(gm, ctx)               # index_select by a constant rotation as a roll
    pad_gemm.run(gm, ctx)           # GEMMs with unaligned rows padded for cuBLAS (GPU only)
    conv_bias.run(gm, ctx)          # cuDNN convolutions' biases added by the graph (GPU only)
    index_rows.run(gm, ctx)         # table[idx] as a gather of rows
    column_sums.run(gm, ctx)        # sums over leading dims as split sums of rows
    gm = shapes.run(gm, ctx)        # sympy sizes/strides of every tensor, size hints
    gm = classify.run(gm, ctx)      # op kind per node: pointwise, view, reduction, opaque
    gm = empty_values.run(gm, ctx)  # values with no elements: allocated, not computed
    gm = dedupe.run(gm, ctx)        # identical computations computed once
    gm = fuse.run(gm, ctx)          # priority fusion into groups, every decision recorded
    return gm


def compile_graph(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """ATen graph -> graph of generated kernels and the ATen ops left over. The time of each
    phase goes to ``ctx.seconds`` (generate's Triton compiles under "triton")."""
    started = time.perf_counter()
    gm = analyze(gm, ctx)           # groups
    analyzed = time.perf_counter()
    gm = generate.run(gm, ctx)      # one cached Triton kernel per group
    generated = time.perf_counter()
    gm = partition.run(gm, ctx)     # one launcher call per group; the rest stays ATen
    compiled = ctx.seconds.get("triton", 0.0) + ctx.seconds.get("autotune", 0.0)
    ctx.seconds.update(analyze=analyzed - started, sources=generated - analyzed - compiled,
                       partition=time.perf_counter() - generated)
    return gm
