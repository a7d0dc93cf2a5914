"""Lowering: kernel IR -> a scheduled kernel (statements placed in loops, symbolic offsets).

Note on the algorithm. Each value of the IR is a function of an index (the `inner_fn` idea):
``value(v, index)`` emits the statements that compute value ``v`` at ``index`` and returns the
register holding it. Views rewrite the index and recurse; loads turn it into an offset; cat
selects between its inputs under a predicate. Values are memoised per (value, index, predicate).

Two iteration spaces:

    pointwise      one linear index over the output shape         xindex
    row reduction  [rows..., N], reductions over N                rindex (rows), cols

A row-reduction kernel runs in phases: phase L computes the reductions of level L (level = how
many reductions it depends on), the last phase stores the per-element outputs. Persistent
kernels keep the row in registers (one scope, nothing recomputed); looped kernels run one loop
over the row per phase, reloading what a phase needs. Values that do not depend on ``cols``
(reduction results, per-row loads, what is computed from them) are hoisted out of the loops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from . import ops
from .indexing import INDEX_OPS as _INDEX_OPS, broadcast_index, print_expr, view_index
from .kernel_ir import IROp, KernelIR, NotFusable, ref_id

REDUCTIONS = {"aten.sum.dim_IntList": "sum", "aten.mean.dim": "mean",
              "aten.amax.default": "max", "aten.amin.default": "min",
              "aten.any.dim": "max"}      # any: the max of (x != 0) as 0.0 / 1.0
VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}
GATHERS = {"aten.embedding.default", "aten.gather.default"}
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


def iteration_space(ir: KernelIR):
    """("row", rows + (N,)) if the group reduces, else ("pointwise", output shape)."""
    if any(s == 0 for v in ir.values for s in v.shape):
        raise NotFusable("an empty tensor (a dimension of size 0): nothing to compute")
    red_shapes = {ir.values[ref_id(op.args[0])].shape for op in ir.ops if op.target in REDUCTIONS}
    if len(red_shapes) > 1:
        raise NotFusable(f"reductions over different shapes {sorted(map(str, red_shapes))}")
    out_shapes = {ir.values[o].shape for o in ir.outputs}
    if red_shapes:
        shape = red_shapes.pop()
        rows = shape[:-1]
        allowed = {shape, rows + (sympy.Integer(1),), rows}
        bad = out_shapes - allowed
        if bad:
            raise NotFusable(f"output shape {sorted(map(str, bad))} is neither per-element nor "
                             f"per-row of the reduction over {shape}")
        return "row", shape
    if len(out_shapes) != 1:
        raise NotFusable(f"pointwise outputs of different shapes {sorted(map(str, out_shapes))}")
    return "pointwise", out_shapes.pop()


# Ops that read a value without adding anything to it, so that the GPU compiler cannot contract
# a product rounded for them into an fma; casts and views pass the question on to their readers.
_NO_ADD = {
    "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.abs.default", "aten.amax.default", "aten.amin.default", "aten.clamp.default",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.minimum.default",
    "aten.maximum.default"} | {f"aten.{c}.{o}" for c in ops.COMPARE for o in ("Tensor", "Scalar")}
_PASS_ON = ops.CASTS | VIEWS


def _summed(ir: KernelIR) -> set:
    """Ids of the values something may add to (an add, a sum, an op not known to scale):
    rounded there, a product needs ``fl.round_*``'s guard."""
    readers: dict = {}
    for i, op in enumerate(ir.ops):
        for a in _flat(op.args):
            if ref_id(a) is not None:
                readers.setdefault(ref_id(a), []).append((op.target, len(ir.inputs) + i))
    memo: dict = {}

    def summed(v) -> bool:
        if v not in memo:
            memo[v] = any(summed(out) if t in _PASS_ON else t not in _NO_ADD
                          for t, out in readers.get(v, ()))
        return memo[v]
    return {v for v in range(len(ir.values)) if summed(v)}


def _is_product(expr: str) -> bool:
    """Whether a register expression multiplies (ops.POINTWISE prints ``a * b``)."""
    return " * " in expr


class Lowering:
    def __init__(self, ir: KernelIR, hints: dict, persistent: bool):
        self.ir, self.hints, self.persistent = ir, hints, persistent
        self.kind, self.shape = iteration_space(ir)
        prefix = "r" if self.kind == "row" else "i"
        n_iter = len(self.shape) - (1 if self.kind == "row" else 0)
        self.iter_syms = tuple(sympy.Symbol(f"{prefix}{d}", integer=True, nonnegative=True)
                               for d in range(n_iter)) + ((COL,) if self.kind == "row" else ())
        # the iteration index; dims of size 1 index 0, as broadcasting indexes them
        sizes = self.shape[:-1] if self.kind == "row" else self.shape
        self.full = tuple(sympy.Integer(0) if n == 1 else s
                          for s, n in zip(self.iter_syms, sizes)) + self.iter_syms[len(sizes):]
        self.phases = [Phase()]
        self.memo: dict = {}
        self.counter = 0
        self.products = set()   # registers holding a product (see ops.cast's guard)
        self.loads, self.stores, self.tail = [], [], []
        self.levels = self._reduction_levels()
        self.pending = []       # statements that follow the reductions of the current phase
        self.per_element = {COL}    # symbols that vary along a row: COL, per-element indices
        self.uses = [0] * len(ir.values)        # readers of each value (ops and stores)
        for op in ir.ops:
            for a in _flat(op.args):
                if ref_id(a) is not None:
                    self.uses[ref_id(a)] += 1
        for o in ir.outputs:
            self.uses[o] += 1
        self.summed = _summed(ir)

    # ------------------------------------------------------------------ schedule
    def run(self) -> LoweredKernel:
        full = self.full
        if self.kind == "row":
            for level in range(max(self.levels.values(), default=-1) + 1):
                for vid, lv in self.levels.items():
                    if lv == level:
                        self._reduce(vid, full)
                self._next_phase()
                self.phases[-1].outer.extend(self.pending)
                self.pending = []
        for pos, vid in enumerate(self.ir.outputs):
            val = self.ir.values[vid]
            if self.kind == "row" and val.shape != self.shape:
                index = full[:-1] + ((sympy.Integer(0),) if len(val.shape) == len(full) else ())
                var = self.value(vid, index, frozenset())
                self.tail.append(("store", pos, var, self._offset(index, val.stride), False))
            else:
                var = self.value(vid, full, frozenset())
                self._emit_to(True, ("store", pos, var, self._offset(full, val.stride), True))
        return LoweredKernel(self.ir, self.kind, self.shape, self.phases, self.stores, self.tail,
                             self.loads, self.iter_syms)

    def _next_phase(self):
        self.phases.append(Phase())
        if not self.persistent:
            self.memo = {k: v for k, v in self.memo.items() if not v.row_level}

    def _reduction_levels(self) -> dict:
        levels, n_in = {}, len(self.ir.inputs)
        depth = [0] * len(self.ir.values)
        for j, op in enumerate(self.ir.ops):
            vid = n_in + j
            deps = [ref_id(a) for a in _flat(op.args)]
            d = max((depth[r] for r in deps if r is not None), default=0)
            if op.target in REDUCTIONS:
                levels[vid] = d
                d += 1
            depth[vid] = d
        return levels

    def _reduce(self, vid, full):
        op = self.ir.ops[vid - len(self.ir.inputs)]
        kind = REDUCTIONS[op.target]
        src = self.value(ref_id(op.args[0]), full, frozenset())
        if src.dtype == torch.float64:
            raise NotFusable("fp64 reductions stay on ATen")
        if op.target == "aten.any.dim":
            src = self._assign(f"({src.name} != 0).to(tl.float32)", torch.float32, src.row_level)
        dtype = self.ir.values[vid].dtype
        res = Var(self._name(kind), torch.float32, False)
        self.phases[-1].reductions.append((res, kind, self._name("acc"), src))
        out = res
        if kind == "mean" or dtype != torch.float32:
            expr = f"({res.name} / (N * 1.0))" if kind == "mean" else res.name
            out = Var(self._name("v"), dtype, False)
            self.pending.append(("assign", out, ops.cast(expr, torch.float32, dtype,
                                                         guard=False)))
        self.memo[("red", vid)] = out

    # ------------------------------------------------------------------ values
    def value(self, vid: int, index: tuple, preds: frozenset) -> Var:
        key = (vid, index, preds)
        if key in self.memo:
            return self.memo[key]
        if vid < len(self.ir.inputs):
            var = self._load(vid, index, preds, self.ir.values[vid].stride, sympy.Integer(0))
        else:
            var = self._op(vid, self.ir.ops[vid - len(self.ir.inputs)], index, preds)
        self.memo[key] = var
        return var

    def _load(self, in_id, index, preds, stride, base):
        if self.ir.inputs[in_id].host_scalar:     # passed by value: no memory access
            var = Var(self._name("s"), self.ir.inputs[in_id].dtype, False)
            self._emit_to(False, ("assign", var, f"in{in_id}"))
            return var
        offset = base + self._offset(index, stride)
        # an index loaded per element (a gather's) makes what it addresses per element too
        row_level = self.kind != "row" or any(e.has(*self.per_element) for e in (offset, *preds))
        var = Var(self._name("x"), self.ir.inputs[in_id].dtype, row_level)
        self.loads.append((var, in_id, offset, preds))
        self._emit_to(row_level, ("load", var, in_id, offset, preds))
        return var

    def _offset(self, index, stride):
        if len(index) != len(stride):
            raise NotFusable(f"index of rank {len(index)} for a tensor of rank {len(stride)}")
        return sympy.expand(sum((i * s for i, s in zip(index, stride)), sympy.Integer(0)))

    def _op(self, vid, op: IROp, index, preds) -> Var:
        out = self.ir.values[vid]
        t, args, kw = op.target, op.args, dict(op.kwargs)
        if t in REDUCTIONS:
            return self._reduction_value(vid, index)
        if t in VIEWS:
            src = ref_id(args[0])
            return self.value(src, view_index(index, out.shape, self.ir.values[src].shape,
                                              self.hints), preds)
        if t == "aten.expand.default":
            src = ref_id(args[0])
            return self.value(src, broadcast_index(index, out.shape, self.ir.values[src].shape),
                              preds)
        if t in _INDEX_OPS:
            src = ref_id(args[0])
            return self.value(src, _INDEX_OPS[t](index, args, self.ir.values[src].shape), preds)
        if t == "aten.as_strided.default":
            return self._as_strided(args, index, preds)
        if t == "aten.cat.default":
            return self._cat(vid, args, kw, index, preds)
        if t == "aten.constant_pad_nd.default":
            return self._pad(vid, args, kw, index, preds)
        if t in ("aten.full_like.default", "aten.scalar_tensor.default"):
            return self._constant(args[0], out.dtype)  # shape and dtype: the IR value's
        if t == "aten.embedding.default":
            return self._embedding(args, index, preds)
        if t == "aten.gather.default":
            return self._gather(args, index, preds)
        return self._pointwise(vid, op, index, preds)

    def _embedding(self, args, index, preds):
        """``table[idx[index[:-1]], index[-1]]``: the index is loaded, then the row it names.
        An index outside the table is a device-side error, as in eager's CUDA embedding
        (``tl.device_assert``; the kernel is compiled with ``debug``), and the load of the
        row is masked by the same test, so no address outside the table is read."""
        table, idx = ref_id(args[0]), ref_id(args[1])
        if table is None or table >= len(self.ir.inputs) or self.ir.inputs[table].host_scalar:
            raise NotFusable("an embedding's table is computed in the kernel: it must be loaded")
        row, inside = self._index(idx, index[:-1], preds, self.ir.values[table].shape[0],
                                  "embedding")
        return self._load(table, (row, index[-1]), preds | inside,
                          self.ir.values[table].stride, sympy.Integer(0))

    def _gather(self, args, index, preds):
        """``src[..., idx[index], ...]`` along ``dim``: the index is loaded, then ``src`` is
        evaluated at the index it names (loaded, or computed there), checked as embedding's."""
        src, dim, idx = ref_id(args[0]), args[1], ref_id(args[2])
        shape = self.ir.values[src].shape
        dim = dim % len(shape)
        at, inside = self._index(idx, index, preds, shape[dim], "gather")
        return self.value(src, index[:dim] + (at,) + index[dim + 1:], preds | inside)

    def _index(self, idx, index, preds, size, op):
        """(the symbol of the index value ``idx`` loaded at ``index``, the predicates that it
        lies in [0, size)); asserts it there."""
        i = self.value(idx, index, preds)
        if i.dtype != torch.int64:
            i = self._assign(f"{i.name}.to(tl.int64)", torch.int64, i.row_level)
        at = sympy.Symbol(i.name, integer=True)
        if i.row_level:
            self.per_element.add(at)
        self._emit_to(i.row_level, ("assert", f"(0 <= {i.name}) & ({i.name} < {print_expr(size)})",
                                    f"{op}: index out of range"))
        return at, frozenset({sympy.Ge(at, 0), sympy.Lt(at, size)})

    def _reduction_value(self, vid, index):
        rows = self.full[:-1]
        shape = self.ir.values[vid].shape
        # past the rows, a keepdim result has dims of size 1, whose only index is 0 whatever
        # symbol the consumer indexes them with (a last dim of size 1 is indexed by the column)
        if self.kind != "row" or tuple(index[:len(rows)]) != rows or any(
                i != 0 and shape[d] != 1 for d, i in enumerate(index) if d >= len(rows)):
            raise NotFusable("a reduction result is used at another row than the one it reduces")
        if ("red", vid) not in self.memo:
            raise NotFusable("reduction used before it is computed")
        return self.memo[("red", vid)]

    def _as_strided(self, args, index, preds):
        """as_strided addresses its input's storage: find the loaded tensor under the views."""
        src = ref_id(args[0])
        while src is not None and src >= len(self.ir.inputs):
            op = self.ir.ops[src - len(self.ir.inputs)]
            if op.target not in VIEWS and op.target not in _INDEX_OPS and op.target != "aten.expand.default":
                raise NotFusable("as_strided of a value computed in the kernel")
            src = ref_id(op.args[0])
        offset = sympy.sympify(args[3] if len(args) > 3 and args[3] is not None else 0)
        base = offset - self.ir.inputs[src].storage_offset
        return self._load(src, index, preds, tuple(sympy.sympify(s) for s in args[2]), base)

    def _cat(self, vid, args, kw, index, preds):
        """cat as index arithmetic: each input is read under the predicate of its range."""
        out = self.ir.values[vid]
        dim = (args[1] if len(args) > 1 else kw.get("dim", 0)) % len(out.shape)
        parts, lo = [], sympy.Integer(0)
        for a in args[0]:
            size = self.ir.values[ref_id(a)].shape[dim]
            if size == 0:
                continue
            pred = set()
            if lo != 0:
                pred.add(sympy.Ge(index[dim], lo))
            if sympy.simplify(lo + size - out.shape[dim]) != 0:
                pred.add(sympy.Lt(index[dim], lo + size))
            sub = index[:dim] + (index[dim] - lo,) + index[dim + 1:]
            v = self.value(ref_id(a), sub, preds | frozenset(pred))
            parts.append((frozenset(pred), v))
            lo = lo + size
        return self._select(out.dtype, parts)

    def _select(self, dtype, parts) -> Var:
        """A value chosen among ``parts`` ((predicates, value) pairs: the first whose predicates
        hold; the last one's are not tested)."""
        row_level = self.kind != "row" or any(v.row_level or any(p.has(COL) for p in pr)
                                              for pr, v in parts)
        var = Var(self._name("v"), dtype, row_level)
        self._emit_to(row_level, ("select", var, parts))
        return var

    def _constant(self, value, dtype) -> Var:
        return self._assign(f"tl.full([1], {self._as(value, dtype)}, {ops.reg_dtype(dtype)})",
                            dtype, self.kind != "row")

    def _pad(self, vid, args, kw, index, preds):
        """constant_pad_nd as index arithmetic: the input read under the predicate of its range,
        the pad value elsewhere (one kernel where ATen fills the output, then copies into it)."""
        out = self.ir.values[vid]
        src = ref_id(args[0])
        pads = list(args[1])
        value = args[2] if len(args) > 2 else kw.get("value", 0)
        if any(not isinstance(p, int) or p < 0 for p in pads) or not isinstance(value, (int, float)):
            raise NotFusable("constant_pad_nd with negative or symbolic pads, or a tensor value")
        shape = self.ir.values[src].shape
        sub, pred = list(index), set()
        for i in range(len(pads) // 2):
            d = len(shape) - 1 - i
            before, after = pads[2 * i], pads[2 * i + 1]
            if before:
                pred.add(sympy.Ge(index[d], before))
                sub[d] = index[d] - before
            if after:
                pred.add(sympy.Lt(index[d], before + shape[d]))
        if not pred:
            return self.value(src, tuple(index), preds)
        inside = self.value(src, tuple(sub), preds | frozenset(pred))
        return self._select(out.dtype, [(frozenset(pred), inside),
                                        (frozenset(), self._constant(value, out.dtype))])

    def _one_plus_tanh(self, vid, op: IROp, index, preds):
        """``1 + tanh(u)`` (GELU's tanh form) as ``2 / (1 + exp(-2u))``: the same value in
        fp32, without libdevice's tanh (which made bias+GELU compute-bound: 73% of the HBM
        floor on the H200, 90% with this form) and without the cancellation of 1 + tanh(u)
        near u = -inf. Only for fp32 values whose tanh nothing else reads; None otherwise."""
        if (op.target not in ("aten.add.Tensor", "aten.add.Scalar")
                or dict(op.kwargs).get("alpha", 1) != 1 or len(op.args) != 2):
            return None
        a, b = op.args
        tanh_ref, one = (a, b) if ref_id(a) is not None else (b, a)
        r = ref_id(tanh_ref)
        if r is None or r < len(self.ir.inputs) or isinstance(one, tuple) or one != 1:
            return None
        tanh = self.ir.ops[r - len(self.ir.inputs)]
        out, t_val = self.ir.values[vid], self.ir.values[r]
        if (tanh.target != "aten.tanh.default" or self.uses[r] != 1
                or out.dtype != torch.float32 or t_val.dtype != torch.float32):
            return None
        u_ref = ref_id(tanh.args[0])
        t_index = broadcast_index(index, out.shape, t_val.shape)
        u = self.value(u_ref, broadcast_index(t_index, t_val.shape, self.ir.values[u_ref].shape),
                       preds)
        if u.dtype != torch.float32:
            return None
        row_level = self.kind != "row" or u.row_level
        return self._assign(f"(2.0 / (1.0 + tl.exp(-2.0 * {u.name})))", torch.float32,
                            row_level, "aten.tanh.default")

    def _pointwise(self, vid, op: IROp, index, preds) -> Var:
        out = self.ir.values[vid]
        t = op.target
        fused = self._one_plus_tanh(vid, op, index, preds)
        if fused is not None:
            return fused
        args, saturate = op.args, None
        if out.dtype == torch.float8_e4m3fn and t in ops.CASTS and ref_id(args[0]) is not None:
            past = ops.past_saturating_clamps(self.ir, ref_id(args[0]))
            if past != ref_id(args[0]):
                args, saturate = (("ref", past),) + args[1:], True
        tensors, printed = [], []
        for a in args:
            r = ref_id(a)
            if r is not None:
                v = self.value(r, broadcast_index(index, out.shape, self.ir.values[r].shape), preds)
                tensors.append(v)
                printed.append(v)
            else:
                printed.append(a)
        row_level = self.kind != "row" or any(v.row_level for v in tensors)
        if t not in ops.CASTS and t != "aten.copy.default":
            printed = self._promote_zero_dim(op, printed)
            tensors = [p for p in printed if isinstance(p, Var)]
        if t in ops.CASTS or t == "aten.copy.default":
            src = tensors[-1]
            return self._assign(ops.cast(src.name, src.dtype, out.dtype, saturate,
                                         guard=src.name in self.products
                                         and vid in self.summed), out.dtype,
                                row_level, t)
        if t in ops.LOGICAL or (out.dtype == torch.bool and t in ops.BOOL_BITWISE):
            fn = ops.LOGICAL.get(t) or ops.LOGICAL[ops.BOOL_BITWISE[t]]
            names = [p.name if isinstance(p, Var) else ops.literal(p, torch.float32) for p in printed]
            return self._assign(fn(names), torch.bool, row_level, t)
        if t == "aten.where.self":
            c, a, b = printed
            ct = out.dtype
            expr = f"tl.where({self._as(c, torch.bool)}, {self._as(a, ct)}, {self._as(b, ct)})"
            return self._assign(expr, ct, row_level, t)
        if t == "aten.masked_fill.Scalar":
            x, m, fill = printed
            expr = f"tl.where({self._as(m, torch.bool)}, {self._as(fill, out.dtype)}, {self._as(x, out.dtype)})"
            return self._assign(expr, out.dtype, row_level, t)
        if t == "aten.fill.Scalar":
            return self._assign(f"tl.full([1], {self._as(printed[1], out.dtype)}, {ops.reg_dtype(out.dtype)})",
                                out.dtype, row_level)
        if t not in ops.POINTWISE:
            raise NotFusable(f"no Triton lowering for {t}")
        is_compare = t.split(".")[1] in ops.COMPARE
        ct = ops.compute_dtype([v.dtype for v in tensors]) if is_compare else out.dtype
        if ct in ops.ROUNDED:
            ct = torch.float32
        if ct == torch.bool and not is_compare:
            raise NotFusable(f"{t} on bool tensors")
        if is_compare and tensors and tensors[0].dtype in ops.ROUNDED:
            # ATen compares a bf16/fp16 tensor with a scalar in the tensor's dtype
            printed = [p if isinstance(p, Var) or not isinstance(p, float)
                       else torch.tensor(p, dtype=tensors[0].dtype).item() for p in printed]
        names = [self._as(p, ct) if p is not None else None for p in printed]
        kwargs = {k: ops.literal(v, ct) for k, v in op.kwargs if isinstance(v, (int, float))}
        expr = self._by_shared_divisor(op, printed, names, ct) or ops.POINTWISE[t](names, kwargs, ct)
        dtype = torch.bool if is_compare else out.dtype
        guard = _is_product(expr) and vid in self.summed
        return self._assign(ops.cast(expr, ct, dtype, guard=guard) if not is_compare
                            else expr, dtype, row_level, t)

    def _by_shared_divisor(self, op, printed, names, ct):
        """``a / b`` where ``b`` is one value per row (or per kernel): div.full.f32, which
        Triton emits for ``/``, is (a * k) * rcp(b * k) with k a power of two that keeps b in
        range; k and the reciprocal once per row, then two multiplies per element instead of
        the division's three instructions. The same bits as ``/`` on the GPU; in the
        interpreter, as ``/`` there, an exact division."""
        if op.target != "aten.div.Tensor" or op.kwargs or ct != torch.float32:
            return None
        b = printed[1]
        if not isinstance(b, Var):
            return None
        ref = ref_id(op.args[1])
        scalar = ref is not None and all(d == 1 for d in self.ir.values[ref].shape)
        if not scalar and (self.kind != "row" or b.row_level):
            return None
        k = self._assign(f"fl.div_scale({names[1]})", torch.float32, b.row_level)
        r = self._assign(f"fl.div_recip({names[1]}, {k.name})", torch.float32, b.row_level)
        return f"fl.div_shared({names[0]}, {k.name}, {r.name})"

    def _promote_zero_dim(self, op, printed):
        """ATen's type promotion: a 0-dim tensor next to dimensioned ones of the same kind
        (float, int, bool) takes their dtype first (bf16 x > fp32 0-dim 0.1 compares with
        bf16(0.1)), as a Python scalar would."""
        refs = [ref_id(a) for a in op.args]
        dims = [p.dtype for p, r in zip(printed, refs) if r is not None and self.ir.values[r].shape != ()]
        if not dims or len(dims) == sum(r is not None for r in refs):
            return printed
        common = dims[0]
        for d in dims[1:]:
            common = torch.promote_types(common, d)
        out = []
        for i, (p, r) in enumerate(zip(printed, refs)):
            if (r is not None and self.ir.values[r].shape == () and p.dtype != common
                    and 1 <= _category(p.dtype) <= _category(common)   # masks stay bool
                    and not self._keeps_scalar_precision(op, i, r, common)):
                guard = p.name in self.products and op.target not in _NO_ADD
                p = self._assign(ops.cast(p.name, p.dtype, common, guard=guard), common,
                                 p.row_level)
            out.append(p)
        return out

    def _keeps_scalar_precision(self, op, position, ref, common) -> bool:
        """ATen's CPU mul and div read a 0-dim second operand at its own precision (fp32 next
        to a bf16/fp16 tensor: ``original_scalar_value``), not rounded to the tensor's dtype;
        add, sub, and a 0-dim first operand are rounded. CPU kernels (the interpreter) follow
        that; CUDA kernels round, as for a 0-dim CUDA tensor."""
        return (self.ir.device_type == "cpu" and position == 1 and common in ops.ROUNDED
                and op.target in ("aten.mul.Tensor", "aten.div.Tensor")
                and self.ir.values[ref].dtype.is_floating_point)

    def _as(self, p, ct: torch.dtype) -> str:
        """An operand (register or scalar) in compute dtype ``ct``."""
        if isinstance(p, Var):
            return ops.cast(p.name, p.dtype, ct if ct not in ops.ROUNDED else torch.float32)
        if isinstance(p, sympy.Expr):
            return f"({print_expr(p)} * {'1.0' if ct.is_floating_point else '1'})"
        return ops.literal(p, ct)

    def _assign(self, expr, dtype, row_level, op=None) -> Var:
        if expr.isidentifier():     # a cast that changes nothing: same register
            return Var(expr, dtype, row_level)
        var = Var(self._name(_short(op) if op else "v"), dtype, row_level)
        if _is_product(expr):
            self.products.add(var.name)
        self._emit_to(row_level, ("assign", var, expr))
        return var

    def _emit_to(self, row_level, stmt):
        phase = self.phases[-1]
        (phase.body if row_level or self.kind != "row" else phase.outer).append(stmt)

    def _name(self, prefix):
        self.counter += 1
        return f"{prefix}{self.counter}"


def _category(dtype: torch.dtype) -> int:
    return 2 if dtype.is_floating_point else (0 if dtype == torch.bool else 1)


def _short(target: str) -> str:
    """Variable name stem for an op: aten.rsqrt.default -> rsqrt, prims.convert_... -> convert."""
    name = target.split(".")[1].lstrip("_")
    return {"to_copy": "cast", "convert_element_type": "cast"}.get(name, name)


def _flat(args):
    for a in args:
        if isinstance(a, tuple) and not (len(a) == 2 and a[0] == "ref"):
            yield from _flat(a)
        else:
            yield a

