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

Pointwise ops and their dtype rules are in lower_pointwise.py; the data types a lowered kernel
is made of (``Var``, ``Phase``, ``LoweredKernel``) in lowered.py.
"""
from __future__ import annotations

import sympy
import torch

from . import ops, tiles
from .indexing import (INDEX_OPS as _INDEX_OPS, affine_coeffs, broadcast_index, flip_index,
                       join_digits, print_expr, roll_index, view_index)
from .row_outputs import (FLIP, ROLL, alongside, layout_chain, moved, pointwise_shape, pulled,
                          push_index, read_beside, reshaped, traced)
from .kernel_ir import IROp, KernelIR, NotFusable, ref_id
from .lower_pointwise import PointwiseLowering, is_product, summed_values
from .launch import _next_pow2
from .lowered import (COL, REDUCTIONS, SCAN_BLOCK, SCANS, VIEWS, LoweredKernel, Phase, Var,
                      flat_args, mean_hidden, partnered)


def _ge(a, b):
    """``a >= b`` as a predicate: decided when ``a - b`` is a number, else left unevaluated.
    (sympy evaluating a symbolic inequality asks its assumption system, which knows only the
    index symbols' signs, not their bounds: work for no decision.)"""
    return sympy.Ge(a, b, evaluate=sympy.sympify(a - b).is_number)


def _lt(a, b):
    """``a < b`` as a predicate, as ``_ge``."""
    return sympy.Lt(a, b, evaluate=sympy.sympify(a - b).is_number)


def iteration_space(ir: KernelIR):
    """("row", rows + (N,)) if the group reduces, else ("pointwise", output shape)."""
    if any(s == 0 for v in ir.values for s in v.shape):
        raise NotFusable("an empty tensor (a dimension of size 0): nothing to compute")
    red_shapes = {ir.values[ref_id(op.args[0])].shape for op in ir.ops
                  if op.target in REDUCTIONS or op.target in SCANS}
    if len(red_shapes) > 1:
        raise NotFusable(f"reductions over different shapes {sorted(map(str, red_shapes))}")
    out_shapes = {ir.values[o].shape for o in ir.outputs}
    if red_shapes:
        shape = red_shapes.pop()
        rows = shape[:-1]
        allowed = {shape, rows + (sympy.Integer(1),), rows}
        bad = {ir.values[o].shape for o in ir.outputs
               if ir.values[o].shape not in allowed and not one_a_row(ir.values[o].shape, rows)
               and layout_chain(ir, o, shape) is None
               and pulled(ir, o, shape) is None and not reshaped(ir, o, shape)
               and alongside(ir, o, shape) is None and traced(ir, o, shape) is None
               and read_beside(ir, o, shape) is None}
        if bad:
            raise NotFusable(f"output shape {sorted(map(str, bad))} is neither per-element nor "
                             f"per-row of the reduction over {shape}")
        return "row", shape
    if len(out_shapes) == 1:
        return "pointwise", out_shapes.pop()
    shape = pointwise_shape(ir)
    if shape is None:
        raise NotFusable(f"pointwise outputs of different shapes {sorted(map(str, out_shapes))}"
                         ", not views of one another")
    return "pointwise", shape


def _sized(shape) -> tuple:
    return tuple(s for s in shape if s != 1)


def one_a_row(shape, rows) -> bool:
    """Whether an output of ``shape`` holds one value a row of a row kernel over ``rows``: its
    dims other than those of size 1 are the rows' (a BatchNorm statistic's [1, C, 1, 1] of
    rows [C, 1, 1])."""
    return _sized(shape) == _sized(rows)


def row_index(full, rows, shape) -> tuple:
    """The index of a row's value in an output of ``shape`` that ``one_a_row`` accepts: its dims
    of size 1 at 0, the others the rows' own, in order (``full``: the iteration index)."""
    sized = iter(i for i, n in zip(full, rows) if n != 1)
    return tuple(sympy.Integer(0) if n == 1 else next(sized) for n in shape)


class Lowering(PointwiseLowering):
    def __init__(self, ir: KernelIR, hints: dict, persistent: bool, row_tiles: bool = True):
        """``row_tiles``: a persistent row kernel may take a tile of rows (off with
        ``FUSION_COMPILER_TILES=0``); a looped one never does (``_check_beside_runs``)."""
        self.ir, self.hints, self.persistent = ir, hints, persistent
        self.row_tiles = row_tiles and persistent
        self.kind, self.shape = iteration_space(ir)
        prefix = "r" if self.kind == "row" else "i"
        n_iter = len(self.shape) - (1 if self.kind == "row" else 0)
        self.iter_syms = tuple(sympy.Symbol(f"{prefix}{d}", integer=True, nonnegative=True)
                               for d in range(n_iter)) + ((COL,) if self.kind == "row" else ())
        # the iteration index; dims of size 1 index 0, as broadcasting indexes them
        sizes = self.shape[:-1] if self.kind == "row" else self.shape
        self.full = tuple(sympy.Integer(0) if n == 1 else s
                          for s, n in zip(self.iter_syms, sizes)) + self.iter_syms[len(sizes):]
        # each iteration symbol's bound, so reshapes split a position exactly (delinearize)
        self.ranges = dict(zip(self.iter_syms, self.shape))
        self.phases = [Phase()]
        self.memo: dict = {}
        self.counter = 0
        self.products = set()   # registers holding a product (see ops.cast's guard)
        self.loads, self.stores, self.tail = [], [], []
        # a looped kernel's reductions taken in another's pass (lowered.partner_of): a softmax's
        # normaliser in its max's, a variance in its mean's (whose accumulator is then Welford's
        # running mean: ``welford``); a persistent kernel holds the row in registers, where a
        # second pass reads no memory
        self.partnered = {} if persistent or self.kind != "row" else partnered(ir)
        # each Welford mean -> its variance
        self.welford = {p: v for v, (kind, p) in self.partnered.items() if kind == "m2"}
        self.entries = {}       # reduction value id -> its (result, kind, acc, input)
        self.levels = self._reduction_levels()
        self.pending = []       # statements that follow the reductions of the current phase
        self.per_element = {COL}    # symbols that vary along a row: COL, per-element indices
        self.uses = [0] * len(ir.values)        # readers of each value (ops and stores)
        for op in ir.ops:
            for a in flat_args(op.args):
                if ref_id(a) is not None:
                    self.uses[ref_id(a)] += 1
        for o in ir.outputs:
            self.uses[o] += 1
        self.summed = summed_values(ir)

    # ------------------------------------------------------------------ schedule
    def run(self) -> LoweredKernel:
        full = self.full
        early = set()
        if self.kind == "row" and not self.persistent:
            # a looped kernel stores a per-element output that no reduction feeds in the first
            # pass, where its value is made: a later pass would read and compute it again
            for pos, vid in enumerate(self.ir.outputs):
                if self.depth[vid] == 0 and not self._per_row(self.ir.values[vid].shape):
                    self._store_output(pos, vid)
                    early.add(pos)
        if self.kind == "row":
            for level in range(max(self.levels.values(), default=-1) + 1):
                for vid, lv in self.levels.items():
                    if lv == level:
                        self._reduce(vid, full)
                self._next_phase()
                self.phases[-1].outer.extend(self.pending)
                self.pending = []
        for pos, vid in enumerate(self.ir.outputs):
            if pos not in early:
                self._store_output(pos, vid)
        return LoweredKernel(self.ir, self.kind, self.shape, self.phases, self.stores, self.tail,
                             self.loads, self.iter_syms)

    def _per_row(self, shape) -> bool:
        """Whether an output of ``shape`` holds one value a row (stored in the tail)."""
        return self.kind == "row" and shape != self.shape and (
            shape in (self.shape[:-1], self.shape[:-1] + (1,))
            or one_a_row(shape, self.shape[:-1]))

    def _store_output(self, pos, vid):
        """Emit output ``pos`` (value ``vid``): a per-row value in the tail, a per-element one
        in the current phase's loop."""
        full = self.full
        val = self.ir.values[vid]
        row = self.kind == "row"
        if self._per_row(val.shape):
            if val.shape in (self.shape[:-1], self.shape[:-1] + (1,)):
                index = full[:-1] + ((sympy.Integer(0),) if len(val.shape) == len(full) else ())
            else:
                index = row_index(full, self.shape[:-1], val.shape)
            var = self.value(vid, index, frozenset())
            self.tail.append(("store", pos, var, self._offset(index, val.stride), False))
        elif row and (chain := layout_chain(self.ir, vid, self.shape)) is not None:
            self._store_pushed(pos, val, *chain)
        elif row and val.shape != self.shape and (
                chain := pulled(self.ir, vid, self.shape)) is not None:
            self._store_pulled(pos, vid, val, chain)
        elif row and val.shape != self.shape and (
                chain := alongside(self.ir, vid, self.shape)) is not None:
            # where a value of its shape is pulled (through views alone, where a reshaped
            # output is too: the same index)
            self._store_pulled(pos, vid, val, chain)
        elif not row and val.shape != self.shape:     # a view of a value of the iteration's
            how, chain = moved(self.ir, vid, self.shape)    # (iteration_space checked it)
            if how == "push":
                self._store_pushed(pos, val, *chain)
            elif how == "pull":
                self._store_pulled(pos, vid, val, chain)
            else:
                self._store_traced(pos, vid, val, *chain)
        elif row and val.shape != self.shape and not reshaped(self.ir, vid, self.shape) and (
                chain := traced(self.ir, vid, self.shape)) is not None:
            self._store_traced(pos, vid, val, *chain)
        elif row and val.shape != self.shape and not reshaped(self.ir, vid, self.shape) and (
                found := read_beside(self.ir, vid, self.shape)) is not None:
            root, chain, views = found      # where the op reads it, back through the views
            self._store_pulled(pos, vid, val, views,
                               push_index(self.full, self.ir, root, chain, self.hints))
            self._check_beside_runs(val)
        elif row and val.shape != self.shape:   # reshaped (iteration_space checked it)
            index = view_index(full, self.shape, val.shape, self.hints, self.ranges)
            var = self.value(vid, index, frozenset())
            self._emit_to(True, ("store", pos, var, self._offset(index, val.stride), True))
        else:
            var = self.value(vid, full, frozenset())
            self._emit_to(True, ("store", pos, var, self._offset(full, val.stride), True))

    def _check_beside_runs(self, val):
        """A layout copy written beside the op that reads it (``read_beside``; the last store)
        walks memory along the column, the rows' innermost dim, or another row dim a tile of
        rows gives a sector of (``tiles.row_sector_reachable``); else NotFusable: in part
        sectors the copy cost more than a kernel of its own (Mamba2's G, runs of 16 bytes:
        the fused kernel 576 us against 94 + 225 unfused, H100, session 68)."""
        off = next(s[3] for s in reversed(self.phases[-1].body) if s[0] == "store")
        rows = [s for s, n in zip(self.iter_syms[:-1], self.shape[:-1]) if n != 1]
        co = affine_coeffs(off, set(self.iter_syms))
        unit = next((s for s in self.iter_syms if co and co.get(s, 0) == 1), None)
        if unit is None or unit == COL or not rows or unit == rows[-1]:
            return
        if not self.row_tiles:
            raise NotFusable(f"a layout copy stored along row dim of {self.ranges[unit]} "
                             "needs a tile of rows (tiles off, or a looped row): its own kernel "
                             "writes it faster")
        if not tiles.row_sector_reachable(self.ranges[unit], val.dtype.itemsize,
                                          self.shape[-1], (co.get(rows[-1]), co.get(COL))):
            raise NotFusable(f"a layout copy stored along row dim of {self.ranges[unit]} in "
                             "runs under a sector: its own kernel writes it faster")

    def _store_pushed(self, pos, val, root, chain_ops):
        """Store ``val``, value ``root`` laid out again by ``chain_ops`` (``layout_chain``):
        ``root`` computed at the iteration's index, stored where the chain puts it."""
        var = self.value(root, self.full, frozenset())
        for op, rid in chain_ops:       # a float cast on the way: on the register
            if op.target in ops.CASTS:
                dst = self.ir.values[rid].dtype
                var = self._assign(ops.cast(var.name, var.dtype, dst, guard=(
                    var.name in self.products and rid in self.summed)), dst,
                    var.row_level, op.target)
        index = push_index(self.full, self.ir, root, chain_ops, self.hints)
        self._emit_to(True, ("store", pos, var, self._offset(index, val.stride), True))

    def _store_pulled(self, pos, vid, val, chain, index=None):
        """Store ``val`` (value ``vid``), computed and stored at the index ``chain``'s views
        pull each element of the iteration (or the element at ``index`` of the chain's last
        result: ``read_beside``) back to (``pulled``, ``alongside``)."""
        index = self.full if index is None else index
        for op, rid in reversed(chain):     # back to vid, as the iteration reads it
            index = self._source_index(op, rid, index)
        var = self.value(vid, index, frozenset())
        self._emit_to(True, ("store", pos, var, self._offset(index, val.stride), True))

    def _store_traced(self, pos, vid, val, root, chain):
        """Store ``val`` (value ``vid``), computed element for element from ``root`` of the
        iteration's shape (``traced``): computed and stored where the chain's views move each
        element of the iteration."""
        index = push_index(self.full, self.ir, root, chain, self.hints)
        var = self.value(vid, index, frozenset())
        self._emit_to(True, ("store", pos, var, self._offset(index, val.stride), True))

    def _next_phase(self):
        self.phases.append(Phase())
        if not self.persistent:
            self.memo = {k: v for k, v in self.memo.items() if not v.row_level}

    def _reduction_levels(self) -> dict:
        levels, n_in = {}, len(self.ir.inputs)
        depth = [0] * len(self.ir.values)
        for j, op in enumerate(self.ir.ops):
            vid = n_in + j
            deps = [ref_id(a) for a in flat_args(op.args)]
            d = max((depth[r] for r in deps if r is not None), default=0)
            if op.target in REDUCTIONS:
                # a partnered reduction is taken in its partner's pass: at its level
                levels[vid] = levels[self.partnered[vid][1]] if vid in self.partnered else d
                d = levels[vid] + 1
            depth[vid] = d
        self.depth = depth      # reductions on the way to each value (0: none)
        return levels

    def _reduce(self, vid, full):
        op = self.ir.ops[vid - len(self.ir.inputs)]
        kind = REDUCTIONS[op.target]
        if vid in self.partnered:
            # taken in its partner's pass, from its partner's accumulator (row_loops): the sum of
            # exps in the max's (a lane's sum of exp(x - its running max)), the sum of squared
            # deviations in the mean's (a lane's, from its running mean)
            kind, partner = self.partnered[vid]
            p_res, _, p_acc, src = self.entries[partner]
            res = Var(self._name("sum" if kind == "lse" else "m2"), torch.float32, False)
            acc = self._name("acc")
            self.phases[-1].reductions.append((res, kind, acc, src))
            self.phases[-1].partners[acc] = (p_acc, p_res)
            out = res
            if op.target == "aten.mean.dim":
                out = Var(self._name("v"), torch.float32, False)
                self.pending.append(("assign", out, f"({res.name} / (N * 1.0))"))
            self.memo[("red", vid)] = out
            return
        src = self.value(ref_id(op.args[0]), full, frozenset())
        if src.dtype == torch.float64:
            raise NotFusable("fp64 reductions stay on ATen")
        if op.target == "aten.any.dim":
            src = self._assign(f"({src.name} != 0).to(tl.float32)", torch.float32, src.row_level)
        dtype = self.ir.values[vid].dtype
        if vid in self.welford:     # the mean itself: Welford's, its variance's partner
            kind = "wmean"
        res = Var(self._name(kind), torch.float32, False)
        self.phases[-1].reductions.append((res, kind, self._name("acc"), src))
        if kind == "wmean" and not mean_hidden(self.ir, vid, self.welford[vid]):
            self.phases[-1].sums.add(self.phases[-1].reductions[-1][2])
        self.entries[vid] = self.phases[-1].reductions[-1]
        out = res
        if kind == "mean" or dtype != torch.float32:
            expr = f"({res.name} / (N * 1.0))" if kind == "mean" else res.name
            out = Var(self._name("v"), dtype, False)
            self.pending.append(("assign", out, ops.cast(expr, torch.float32, dtype,
                                                         guard=False)))
        self.memo[("red", vid)] = out

    # ------------------------------------------------------------------ values
    def value(self, vid: int, index: tuple, preds: frozenset) -> Var:
        if preds and vid < len(self.ir.inputs) and self._in_bounds(vid, index):
            # the predicates of a cat's or a pad's range guard loads that could leave the
            # tensor; this one cannot, and its value is discarded where they are false. Loaded
            # once for every range that reads it there (a BatchNorm's weight, read by a max
            # pool's nine windows through a pad: once, not nine times)
            preds = frozenset()
        key = (vid, index, preds)
        if key in self.memo:
            return self.memo[key]
        if vid < len(self.ir.inputs):
            var = self._load(vid, index, preds, self.ir.values[vid].stride, sympy.Integer(0))
        else:
            var = self._op(vid, self.ir.ops[vid - len(self.ir.inputs)], index, preds)
        self.memo[key] = var
        return var

    def _in_bounds(self, vid: int, index: tuple) -> bool:
        """Whether ``index`` lies inside value ``vid`` wherever the kernel iterates: each
        component 0 or an iteration symbol whose range is that dimension's size."""
        shape = self.ir.values[vid].shape
        return len(index) == len(shape) and all(
            e == 0 or self.ranges.get(e) == n for e, n in zip(index, shape))

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
        # the digits of one value put back together (a GroupNorm's row read through its
        # channels: ``35 * (col // 35) + 7 * ((col // 7) % 5) + col % 7`` is ``col``)
        return join_digits(sympy.expand(sum((i * s for i, s in zip(index, stride)),
                                            sympy.Integer(0))))

    def _source_index(self, op: IROp, vid: int, index: tuple) -> tuple:
        """The index into a view's source of the element at ``index`` of its result ``vid``."""
        src = ref_id(op.args[0])
        if op.target in VIEWS:
            return view_index(index, self.ir.values[vid].shape, self.ir.values[src].shape,
                              self.hints, self.ranges)
        return _INDEX_OPS[op.target](index, op.args, self.ir.values[src].shape)

    def _op(self, vid, op: IROp, index, preds) -> Var:
        out = self.ir.values[vid]
        t, args, kw = op.target, op.args, dict(op.kwargs)
        if t in REDUCTIONS:
            return self._reduction_value(vid, index)
        if t in SCANS:
            return self._scan(vid, op, index, preds)
        if t in VIEWS or t in _INDEX_OPS:
            return self.value(ref_id(args[0]), self._source_index(op, vid, index), preds)
        if t == "aten.expand.default":
            src = ref_id(args[0])
            return self.value(src, broadcast_index(index, out.shape, self.ir.values[src].shape),
                              preds)
        if t == ROLL:
            src = ref_id(args[0])
            return self.value(src, roll_index(index, args, self.ir.values[src].shape), preds)
        if t == FLIP:
            src = ref_id(args[0])
            return self.value(src, flip_index(index, args, self.ir.values[src].shape), preds)
        if t == "aten.as_strided.default":
            return self._as_strided(args, index, preds)
        if t == "aten.cat.default":
            return self._cat(vid, args, kw, index, preds)
        if t == "aten.constant_pad_nd.default":
            return self._pad(vid, args, kw, index, preds)
        if t in ("aten.full_like.default", "aten.scalar_tensor.default", "aten.full.default"):
            return self._constant(args[0], out.dtype)  # shape and dtype: the IR value's
        if t in ARANGES:
            return self._arange(args, out.dtype, index)
        if t == "aten.embedding.default":
            return self._embedding(args, index, preds)
        if t == "aten.gather.default":
            return self._gather(args, index, preds, "gather")
        if t == "aten.index_select.default":
            return self._gather(args, index, preds, "index_select")
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

    def _gather(self, args, index, preds, op):
        """``src[..., idx[...], ...]`` along ``dim``: the index is loaded (or computed there) at
        ``index`` for a gather (an index of src's rank), at ``index[dim]`` for an index_select
        (a 1-d index); then ``src`` is evaluated at the index it names, checked as embedding's."""
        src, dim, idx = ref_id(args[0]), args[1], ref_id(args[2])
        shape = self.ir.values[src].shape
        dim = dim % len(shape)
        at, inside = self._index(idx, index if op == "gather" else (index[dim],), preds,
                                 shape[dim], op)
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
        # tested in the live lanes only (kernel_source): an index computed from the kernel's
        # own index (an arange) lies past the tensor in the lanes past its end
        self._emit_to(i.row_level, ("assert", f"(0 <= {i.name}) & ({i.name} < {print_expr(size)})",
                                    f"{op}: index out of range", i.row_level))
        return at, frozenset({_ge(at, 0), _lt(at, size)})

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

    def _scan(self, vid, op: IROp, index, preds) -> Var:
        """A cumsum along the row, in a persistent kernel: ``tl.cumsum`` over the row's block
        (fp32 for float results, each prefix rounded once to their dtype, as ATen's CPU scan
        and Inductor's; ATen's CUDA scan adds bf16/fp16 partials in their own precision, less
        exactly; int64 for integer ones), its columns past the row zero. Read at its own
        position, or backwards along the row (a flip: then a reverse scan), only: a view, a
        gather or a cat's range reading it elsewhere is refused."""
        n = self.shape[-1]
        backwards = self.full[:-1] + (n - 1 - COL,)     # the row read from its end (a flip)
        reverse = self.kind == "row" and tuple(index) == backwards and not preds
        if not reverse and (self.kind != "row" or tuple(index) != tuple(self.full) or preds):
            raise NotFusable("a cumsum is read at another position than its own (a view, a "
                             "gather, a cat or a pad reads it): its sums run along its rows")
        if not self.persistent or not n.is_Integer or _next_pow2(int(n)) > SCAN_BLOCK:
            raise NotFusable(f"a cumsum over rows of {n}: only static rows of at most "
                             f"{SCAN_BLOCK} elements are scanned in one block")
        out = self.ir.values[vid]
        if out.dtype == torch.float64:
            raise NotFusable("fp64 cumsums stay on ATen")
        acc = torch.float32 if out.dtype.is_floating_point else torch.int64
        src = self.value(ref_id(op.args[0]), index, preds)
        x = ops.cast(src.name, src.dtype, acc, guard=False)
        # read backwards (``flip(cumsum(flip(g)))``, a cumsum's gradient), element c is the sum
        # of the source read backwards from c to the row's end: a reverse scan, whose loads and
        # stores run forwards (the flip of g read backwards is g)
        total = self._assign(f"tl.cumsum(tl.where(mask, {x}, 0), axis=1"
                             + (", reverse=True)" if reverse else ")"), acc, True, op.target)
        return self._assign(ops.cast(total.name, acc, out.dtype, guard=False), out.dtype, True)

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
        refs = {ref_id(a) for a in args[0] if self.ir.values[ref_id(a)].shape[dim] != 0}
        if len(refs) == 1 and self.ir.values[min(refs)].shape[dim] == 1:
            # copies of one value of size 1 along dim (a repeat: nearest upsampling's): every
            # part reads it at 0 there, so it is read once, under no range's predicate
            return self.value(min(refs), index[:dim] + (sympy.Integer(0),) + index[dim + 1:],
                              preds)
        parts, lo = [], sympy.Integer(0)
        for a in args[0]:
            size = self.ir.values[ref_id(a)].shape[dim]
            if size == 0:
                continue
            pred = set()
            if lo != 0:
                pred.add(_ge(index[dim], lo))
            if sympy.simplify(lo + size - out.shape[dim]) != 0:
                pred.add(_lt(index[dim], lo + size))
            sub = index[:dim] + (index[dim] - lo,) + index[dim + 1:]
            v = self.value(ref_id(a), sub, preds | frozenset(pred))
            parts.append((frozenset(pred), v))
            lo = lo + size
        return self._select(out.dtype, parts)

    def _select(self, dtype, parts) -> Var:
        """A value chosen among ``parts`` ((predicates, value) pairs: the first whose predicates
        hold; the last one's are not tested)."""
        # a predicate of a per-element index (a gather's, loaded) varies along the row as well
        row_level = self.kind != "row" or any(
            v.row_level or any(p.has(*self.per_element) for p in pr) for pr, v in parts)
        var = Var(self._name("v"), dtype, row_level)
        self._emit_to(row_level, ("select", var, parts))
        return var

    def _arange(self, args, dtype, index) -> Var:
        """``arange(start, end, step)`` (integers) at ``index``: start + step * i, from the
        kernel's index, no memory read."""
        start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
        expr = sympy.expand(start + step * index[0])
        row_level = self.kind != "row" or expr.has(*self.per_element)
        var = Var(self._name("iota"), dtype, row_level)
        self._emit_to(row_level, ("index", var, expr))
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
                pred.add(_ge(index[d], before))
                sub[d] = index[d] - before
            if after:
                pred.add(_lt(index[d], before + shape[d]))
        if not pred:
            return self.value(src, tuple(index), preds)
        inside = self.value(src, tuple(sub), preds | frozenset(pred))
        return self._select(out.dtype, [(frozenset(pred), inside),
                                        (frozenset(), self._constant(value, out.dtype))])

    def _assign(self, expr, dtype, row_level, op=None) -> Var:
        if expr.isidentifier():     # a cast that changes nothing: same register
            return Var(expr, dtype, row_level)
        var = Var(self._name(_short(op) if op else "v"), dtype, row_level)
        if is_product(expr):
            self.products.add(var.name)
        self._emit_to(row_level, ("assign", var, expr))
        return var

    def _emit_to(self, row_level, stmt):
        phase = self.phases[-1]
        (phase.body if row_level or self.kind != "row" else phase.outer).append(stmt)

    def _name(self, prefix):
        self.counter += 1
        return f"{prefix}{self.counter}"


ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def _short(target: str) -> str:
    """Variable name stem for an op: aten.rsqrt.default -> rsqrt, prims.convert_... -> convert."""
    name = target.split(".")[1].lstrip("_")
    return {"to_copy": "cast", "convert_element_type": "cast"}.get(name, name)
