"""What the lowering produces and what its modules share: registers (``Var``), the phases of a
row kernel, the lowered kernel itself, and the op families the lowering tells apart."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from .kernel_ir import KernelIR, ref_id

REDUCTIONS = {"aten.sum.dim_IntList": "sum", "aten.mean.dim": "mean",
              "aten.amax.default": "max", "aten.amin.default": "min",
              "aten.any.dim": "max"}      # any: the max of (x != 0) as 0.0 / 1.0
VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}
GATHERS = {"aten.embedding.default", "aten.gather.default", "aten.index_select.default"}
COL = sympy.Symbol("c", integer=True, nonnegative=True)


@dataclass
class Var:
    name: str
    dtype: torch.dtype      # the ATen dtype this register value stands for
    row_level: bool         # depends on cols (row kernels); always True in pointwise kernels


@dataclass
class Phase:
    outer: list = field(default_factory=list)   # statements before the loop (per-row values)
    body: list = field(default_factory=list)    # statements in the loop over cols
    reductions: list = field(default_factory=list)  # (result Var, kind, acc name, input Var)
    # an "lse" reduction's accumulator -> (its row max's accumulator, the max's result Var)
    partners: dict = field(default_factory=dict)


@dataclass
class LoweredKernel:
    ir: KernelIR
    kind: str               # "pointwise" | "row"
    shape: tuple            # pointwise: output shape; row: rows + (N,)
    phases: list            # list[Phase]
    stores: list            # (output position, Var, offset, row_level)
    tail: list              # statements after the last phase (per-row stores)
    loads: list             # (Var, input id, offset, preds) in order of emission
    iter_syms: list         # iteration symbols (row syms then COL for row kernels)


def online_sums(ir: KernelIR) -> dict:
    """{value id of ``sum(exp(x - amax(x)))``: value id of that amax} over fp32 values: a
    softmax's (log_softmax's, cross-entropy's) normaliser, which a looped kernel computes in
    the max's pass (the online softmax: each lane's sum rescaled as its max grows), not in a
    pass of its own after it."""
    n_in = len(ir.inputs)

    def op(vid):
        return ir.ops[vid - n_in] if vid is not None and vid >= n_in else None

    def fp32(vid):
        return ir.values[vid].dtype == torch.float32
    found = {}
    for j, red in enumerate(ir.ops):
        if red.target != "aten.sum.dim_IntList" or not fp32(n_in + j):
            continue
        e_id = ref_id(red.args[0])
        e = op(e_id)
        if e is None or e.target != "aten.exp.default" or not fp32(e_id):
            continue
        d_id = ref_id(e.args[0])
        d = op(d_id)
        if d is None or d.target != "aten.sub.Tensor" or d.kwargs or not fp32(d_id):
            continue
        x, m_id = ref_id(d.args[0]), ref_id(d.args[1])
        m = op(m_id)
        while m is not None and m.target in VIEWS | {"aten.expand.default"}:
            m_id = ref_id(m.args[0])
            m = op(m_id)
        if (x is None or m is None or m.target != "aten.amax.default" or ref_id(m.args[0]) != x
                or not fp32(x) or list(m.args[1]) != list(red.args[1])):
            continue
        found[n_in + j] = m_id
    return found


def flat_args(args):
    """The operands of an op's argument list, nested lists and tuples flattened (a
    ``("ref", i)`` pair is one operand)."""
    for a in args:
        if isinstance(a, tuple) and not (len(a) == 2 and a[0] == "ref"):
            yield from flat_args(a)
        else:
            yield a
