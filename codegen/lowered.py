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
# scans: per-element results along the row, computed in a persistent row kernel alone (the
# whole row in one block of at most SCAN_BLOCK columns: tl.cumsum over it)
SCANS = {"aten.cumsum.default": "sum"}
SCAN_BLOCK = 16384
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
    # a partnered reduction's accumulator ("lse", "m2") -> (its partner's accumulator, the
    # partner's result Var)
    partners: dict = field(default_factory=dict)
    # the "wmean" accumulators that keep their plain sum: their mean is seen where a row's
    # infinity would make Welford's NaN (lowered.mean_hidden)
    sums: set = field(default_factory=set)


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


class IRGraph:
    """A kernel IR as ``partner_of`` reads it: nodes are value ids."""

    def __init__(self, ir: KernelIR):
        self.ir, self.n_in = ir, len(ir.inputs)

    def op(self, vid):
        """(target, args, kwargs) of the op giving ``vid``; None for an input."""
        if vid is None or vid < self.n_in:
            return None
        o = self.ir.ops[vid - self.n_in]
        return o.target, o.args, o.kwargs

    def ref(self, arg):
        return ref_id(arg)

    def meta(self, vid):
        """(dtype, shape) of ``vid``, the sizes as text (symbolic ones compare without guards)."""
        v = self.ir.values[vid]
        return v.dtype, tuple(str(d) for d in v.shape)


_LAYOUT = VIEWS | {"aten.expand.default"}


def partner_of(red, g):
    """A reduction taken in another's pass by a looped row kernel, as ``(kind, partner)``:

    - ``("lse", amax)``: ``red`` is ``sum(exp(x - amax(x)))``, a softmax's normaliser (the online
      softmax: each lane's sum rescaled as its max grows);
    - ``("m2", mean)``: ``red`` is ``sum`` or ``mean`` of ``(x - mean(x))**2``, a norm's variance
      (Welford's update per lane: each lane's mean and sum of squared deviations from it);

    else None. Over fp32 values, each reduction over the same dims, the partner reaching the
    ``sub`` through views and expands that keep it one value a row (its keepdim shape, or
    expanded from it to x's). ``g`` reads the graph: an ``IRGraph`` (the code generator) or the
    FX graph of a group (the cost model, passes/groups.py), whose nodes and op targets spell
    the same."""
    def fp32(n):
        return n is not None and g.meta(n)[0] == torch.float32
    o = g.op(red)
    if o is None or not fp32(red) or o[0] not in ("aten.sum.dim_IntList", "aten.mean.dim"):
        return None
    dims, arg = list(o[1][1]), g.ref(o[1][0])
    a = g.op(arg)
    if a is None or not fp32(arg):
        return None
    if a[0] == "aten.exp.default" and o[0] == "aten.sum.dim_IntList":
        kind, want, d = "lse", "aten.amax.default", g.ref(a[1][0])
    elif ((a[0] == "aten.mul.Tensor" and g.ref(a[1][0]) is not None
           and g.ref(a[1][0]) == g.ref(a[1][1]))
          or (a[0] == "aten.pow.Tensor_Scalar" and a[1][1] == 2)):
        kind, want, d = "m2", "aten.mean.dim", g.ref(a[1][0])
    else:
        return None
    s = g.op(d)
    if s is None or s[0] != "aten.sub.Tensor" or s[2] or not fp32(d):
        return None
    x, m = g.ref(s[1][0]), g.ref(s[1][1])
    if not fp32(x) or m is None:
        return None
    full = g.meta(x)[1]
    axes = {k % len(full) for k in dims} if full else set()
    kept = tuple("1" if k in axes else n for k, n in enumerate(full))
    shapes = {g.meta(m)[1]}     # the sub's operand's, then each view's or expand's below it
    while (mo := g.op(m)) is not None and mo[0] in _LAYOUT:
        shapes.add(g.meta(m)[1])
        if mo[0] == "aten.expand.default" and g.meta(g.ref(mo[1][0]))[1] != kept:
            return None
        m = g.ref(mo[1][0])
    mo = g.op(m)
    if (mo is None or mo[0] != want or g.ref(mo[1][0]) != x or list(mo[1][1]) != dims
            or not shapes <= {kept, full} or not fp32(m)):
        return None
    return kind, m


def partnered(ir: KernelIR) -> dict:
    """{value id: (kind, partner value id)} of the reductions of ``ir`` that ``partner_of``
    finds."""
    g = IRGraph(ir)
    found = {}
    for j in range(len(ir.ops)):
        p = partner_of(g.n_in + j, g)
        if p is not None:
            found[g.n_in + j] = p
    return found


# ops whose result is NaN where an operand is (a norm's rstd from its variance)
_NAN_KEEPING = _LAYOUT | {
    "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.mul.Tensor",
    "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar", "aten.rsqrt.default",
    "aten.sqrt.default", "aten.reciprocal.default", "aten.pow.Tensor_Scalar",
    "aten._to_copy.default", "aten.clone.default", "aten.squeeze.dim", "aten.unsqueeze.default"}


def mean_hidden(ir: KernelIR, mean: int, m2: int) -> bool:
    """Whether a Welford mean's value (``mean``, partner of the variance ``m2``) is seen only
    through a norm: read (through views and expands) by ``x - mean`` alone, each read by the
    variance's square or multiplied by a value computed from the variance by ops that keep its
    NaN (rstd; not a ``where`` or a ``nan_to_num``). Then a row
    holding an infinity, whose Welford mean is NaN where a sum's is the infinity, gives NaN
    anyway (its variance is NaN), and the plain sum beside the mean is not kept (Phase.sums):
    a LayerNorm's or a GroupNorm's, not a var_mean's."""
    n_in = len(ir.inputs)
    readers = {}
    for j, op in enumerate(ir.ops):
        for a in flat_args(op.args):
            if ref_id(a) is not None:
                readers.setdefault(ref_id(a), []).append(n_in + j)

    def op(vid):
        return ir.ops[vid - n_in]

    def from_m2(vid, seen):     # computed from the variance by ops that keep its NaN
        if vid == m2:
            return True
        if vid is None or vid < n_in or vid in seen or op(vid).target not in _NAN_KEEPING:
            return False
        seen.add(vid)
        return any(from_m2(ref_id(a), seen) for a in flat_args(op(vid).args))
    square = ref_id(op(m2).args[0])
    outputs = set(ir.outputs)
    layout, subs = [mean], []
    while layout:
        v = layout.pop()
        if v in outputs:
            return False
        for r in readers.get(v, []):
            (layout if op(r).target in _LAYOUT else subs).append(r)
    for sub in subs:
        if sub in outputs or op(sub).target != "aten.sub.Tensor":
            return False
        for r in readers.get(sub, []):
            if r == square:
                continue
            o = op(r)
            if r in outputs or o.target != "aten.mul.Tensor" or not any(
                    ref_id(a) != sub and from_m2(ref_id(a), set()) for a in o.args):
                return False
    return True


def flat_args(args):
    """The operands of an op's argument list, nested lists and tuples flattened (a
    ``("ref", i)`` pair is one operand)."""
    for a in args:
        if isinstance(a, tuple) and not (len(a) == 2 and a[0] == "ref"):
            yield from flat_args(a)
        else:
            yield a
