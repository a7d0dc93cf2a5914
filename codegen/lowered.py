"""What the lowering produces and what its modules share: registers (``Var``), the phases of a
row kernel, the lowered kernel itself, and the op families the lowering tells apart."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from .kernel_ir import KernelIR

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


def flat_args(args):
    """The operands of an op's argument list, nested lists and tuples flattened (a
    ``("ref", i)`` pair is one operand)."""
    for a in args:
        if isinstance(a, tuple) and not (len(a) == 2 and a[0] == "ref"):
            yield from flat_args(a)
        else:
            yield a
