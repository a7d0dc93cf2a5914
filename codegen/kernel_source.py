"""One fused kernel's @triton.jit source from its lowered form (codegen/lowered.py): the index
arithmetic, masks, loads and stores of each kind of kernel (pointwise, persistent, looped,
resident, split stages), in the order the lowering's phases give. codegen/render.py puts the
kernels of a group into one module with their launcher.
"""
from __future__ import annotations

import math
import re

import sympy
import torch

from . import ops, tiles
from .indexing import affine_coeffs, coalesce, flatten_index, print_expr, step_divisors
from .launcher import checks_indices, py_expr
from .lowered import COL, LoweredKernel
from .resident import resident_phases
from .row_loops import RED_FINAL, RED_INIT, column_loop, evicting, row_result, split_phases
from .statements import all_stores, index_values, loads_first, select_preds, store_value

XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
RINDEX = sympy.Symbol("rindex", integer=True, nonnegative=True)
COLS = sympy.Symbol("cols", integer=True, nonnegative=True)
COL0 = sympy.Symbol("col0", integer=True, nonnegative=True)     # a loop step's first column


def memory_order(lk: LoweredKernel, syms: list, sizes: list):
    """(syms, sizes) of a pointwise kernel in the order its linear index walks them: the
    largest output's memory order, its dims sorted by their strides, largest first. A
    channels-last output of a logically NCHW value (ConvNeXt's layer scale and residual) is
    then written, and inputs of the same layout read, in whole lines, not 2 bytes of every
    192. Each element is computed on its own, so any order computes the same values; the
    logical order stays where the strides are not all integers (dynamic shapes) or already
    in order."""
    best, order = None, None
    for store in all_stores(lk):
        value = lk.ir.values[lk.ir.outputs[store[1]]]
        coeffs = affine_coeffs(sympy.sympify(store[3]), set(syms)) if syms else None
        if coeffs is None or not all(isinstance(sympy.sympify(c), sympy.Integer)
                                     for c in coeffs.values()):
            continue
        size = value.dtype.itemsize * sympy.Mul(*value.shape)
        if not isinstance(size, sympy.Integer):
            continue
        if best is None or size > best:
            best = size
            strides = [int(coeffs.get(s, 0)) for s in syms]
            order = sorted(range(len(syms)), key=lambda d: -strides[d])   # stable: ties keep
    if order is None or order == sorted(order):
        return syms, sizes
    return [syms[d] for d in order], [sizes[d] for d in order]


def render_kernel(lk: LoweredKernel, name: str, part: bool = False, late=(), stage=None,
                   strided: bool = False, tiling: dict | None = None):
    """Source of one @triton.jit kernel and the names of its runtime size arguments. ``late``:
    a persistent kernel's loads written twice, under its HOIST switch (``late_loads``).
    ``stage``: a looped kernel's phase ``stage`` alone, over one chunk of the row
    (``row_loops.split_phases``). ``tiling``: where given, a pointwise kernel may take 2-d
    tiles (codegen/tiles.py), and ``tiling["cap"]`` is then the most elements its launcher
    may give a program; a persistent row kernel may take tiles of rows, and
    ``tiling["rows"]`` is then (least, most) rows its launcher may give a program and the
    least warps."""
    row = lk.kind == "row"
    exprs = [o for _, _, o, _ in lk.loads] + [s[3] for s in all_stores(lk)]
    preds = {p for _, _, _, ps in lk.loads for p in ps} | select_preds(lk)
    exprs += list(preds) + index_values(lk)
    syms = lk.iter_syms[:-1] if row else lk.iter_syms
    sizes = list(lk.shape[:-1]) if row else list(lk.shape)
    if not row:
        syms, sizes = memory_order(lk, list(syms), sizes)
    protected = set().union(*(p.free_symbols for p in preds)) if preds else set()
    new_syms, new_sizes, _ = coalesce(syms, sizes, exprs, protected)
    subs = {s: sympy.Integer(0) for s in syms if s not in new_syms}
    subs[COL] = COLS
    lin = RINDEX if row else XINDEX
    vec = {RINDEX, COLS} if row else {XINDEX}
    tile = (tiles.plan(lk, new_syms, new_sizes, subs) if tiling is not None and not row
            else None)
    if tile is not None:
        tiling["cap"] = tile.cap
        vec = tile.vector
    rtile = (tiles.row_plan(lk, new_syms, new_sizes, subs)
             if tiling is not None and row and name == "_persistent_kernel" and stage is None
             else None)
    rows = {RINDEX}         # the symbols of a row kernel's row index
    if rtile is not None:
        tiling["rows"] = (rtile.lo, rtile.cap, rtile.warps)
        rows = set(rtile.names.values()) | set(rtile.swapped.values())
        vec = rows | {COLS}
    tiled = tile if tile is not None else rtile

    def idx(e):
        if tiled is not None:
            return tiled.apply(sympy.sympify(e).xreplace(subs))
        return flatten_index(sympy.sympify(e).xreplace(subs), new_syms, new_sizes, lin)

    # a looped kernel's rows that do not start on 16 bytes: (elements in 16 bytes, the row's
    # first element), its loop then steps from the row's 16 bytes (row_loops.column_loop)
    resident = name == "_resident_kernel"
    shift = (_row_shift(lk, idx) if row and stage is None and name in ("_looped_kernel",
                                                                        "_resident_kernel")
             else None)
    # one row a program, a scalar (a resident kernel's is a [1, 1] block, as a persistent's)
    scalar_row = stage is not None or (shift is not None and not resident)

    def condition(pred_set):
        """Predicates as Triton code: True / False when the sizes alone decide them (a slice
        of a cat that falls inside one operand), else the conjunction of the rest."""
        preds = [idx(p) for p in sorted(pred_set, key=str)]
        if any(p is sympy.false for p in preds):
            return False
        rest = [print_expr(p) for p in preds if p is not sympy.true]
        return " & ".join(rest) if rest else True

    def mask_of(parts_syms, pred_set):
        parts = []
        if row:
            # a split stage's row always exists (R x S programs): its scalar rmask stays out
            # of the columns' masks (Triton 3.9's interpreter makes scalar & block integers)
            if parts_syms & rows and not (scalar_row and COLS in parts_syms):
                parts.append("rmask")
            if COLS in parts_syms:
                parts.append("cmask")
        elif XINDEX in parts_syms:     # (a tiled kernel has none: its tiles divide its dims)
            parts.append("xmask")
        cond = condition(pred_set)
        if cond is False:
            parts.append("False")           # never read: its value is never selected
        elif cond is not True:
            scalar = not set().union(*(idx(p).free_symbols for p in pred_set)) & vec
            if parts and scalar:
                # a test of loaded values alone (a gather's index read at one address) may be
                # a scalar: Triton 3.9's interpreter makes `block & scalar` a mask of integers,
                # which its loads reject; tl.where is the same conjunction
                return f"tl.where({cond}, {' & '.join(parts)}, False)"
            parts.append(cond)
        return " & ".join(parts) or "True"

    def row_address(ptr, off):
        """A resident kernel's address of column offset ``off``: the row's pointer first, then
        the chunk's columns, where the columns add to it (``cols + f(row)``): the load and
        the store of a chunk then share no per-element offsets, which kept 13 chunks' of them
        live between the two (spilled, softmax over rows of 50257: 65 spill instructions,
        4 this way; sm_90, CPU)."""
        rest = sympy.expand(off - COLS)
        if shift:
            return f"({ptr} + rowa) + vcols"
        if COLS in rest.free_symbols:
            return f"{ptr} + {print_expr(off)}"
        return f"({ptr} + {print_expr(rest)}) + cols"

    def load(stmt, evict=None):
        _, var, in_id, offset, pred_set = stmt
        off = idx(offset)
        conv = "" if ops.reg_dtype(var.dtype) == ops.TL_DTYPE.get(var.dtype) else f".to({ops.reg_dtype(var.dtype)})"
        used = off.free_symbols & vec
        pred_free = set().union(*(idx(p).free_symbols for p in pred_set)) if pred_set else set()
        pred_syms = pred_free & vec
        if not used and not pred_syms and (not pred_set or condition(pred_set) is True):
            return [f"{var.name} = tl.load(in{in_id} + {print_expr(off)}){conv}"]
        # predicates of loaded values alone (a gather into a cat: which part the index names,
        # and that it lies in range) still guard the load: unmasked, each part was read at
        # every index, before and past its own memory (an illegal address on the GPU). The
        # address takes the shape of every symbol its mask tests (a block mask needs a block
        # of pointers: an expanded source's address, stride 0, names no loaded index)
        pad = "".join(f" + 0 * {s.name}"
                      for s in sorted(pred_free - off.free_symbols, key=str))
        m = mask_of(used | pred_syms, pred_set)
        # fp8 has no literal for `other`: masked lanes are undefined there, and never used
        other = "" if var.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else ", other=0"
        # the row streamed (row_loops.evicting)
        hint = f', eviction_policy="{evict}"' if evict and {RINDEX, COLS} <= used else ""
        other += hint
        if resident and COLS in used:
            # a chunk inside every row has a constant mask, which Triton drops
            return [f"{var.name} = tl.load({row_address(f'in{in_id}', off)}{pad}, "
                    f"mask={m}{other}){conv}"]
        turned = rtile.turned(off) if rtile is not None and not pred_set else None
        if turned is not None:
            # read along Y (its runs of XBLOCK // XT), then reordered to the rows' X-inner order
            return [f"{var.name} = fl.swap_rows(tl.load(in{in_id} + {print_expr(turned)}, "
                    f"mask={m}{other}), {rtile.xt}, XBLOCK // {rtile.xt}, XBLOCK, RBLOCK){conv}"]
        if shift and COLS in used:
            # no mask inside the row: 16-byte loads from the row's 16 bytes
            addr = f"in{in_id} + (rowa + vcols)"
            return ["if inner:", f"    {var.name} = tl.load({addr}{hint}){conv}", "else:",
                    f"    {var.name} = tl.load({addr}, mask={m}{other}){conv}"]
        vector = (f"{var.name} = tl.load(in{in_id} + {print_expr(off)}{pad}){conv}" if m == "True"
                  else f"{var.name} = tl.load(in{in_id} + {print_expr(off)}{pad}, mask={m}{other}){conv}")
        ks = step_divisors(off, COLS) if stage is not None and not pred_set else None
        if ks:
            # one value a step (a GroupNorm's weight at the step's channel): one scalar load,
            # not a 2-byte load per element, where RBLOCK divides every K (a constexpr test)
            k = math.gcd(*ks)
            scalar = (f"{var.name} = tl.load(in{in_id} + {print_expr(off.xreplace({COLS: COL0}))}, "
                      f"mask=rmask & c0mask{other}){conv}")
            return [f"if {k} % RBLOCK == 0:", "    " + scalar, "else:", "    " + vector]
        return [vector]

    def store(stmt, evict=None):
        _, pos, var, offset, row_level = stmt
        off = idx(offset)
        rowvar = rtile.names[rtile.x] if rtile is not None else RINDEX
        want = ({rowvar, COLS} if row_level else {rowvar}) if row else vec
        pad = "".join(f" + 0 * {s.name}" for s in sorted(want - off.free_symbols, key=str))
        mask = mask_of(want, ())
        if scalar_row and not row_level:
            # a per-row value may be a block of one ([1]: it met a constant, as a
            # cross-entropy's ignored target does), which a scalar address cannot take; the
            # mask a block too (Triton 3.9's interpreter rejects a scalar one for a block)
            pad += " + tl.zeros([1], tl.int32)"
            mask = f"tl.where({mask}, tl.full([1], True, tl.int1), False)"
        dtype = lk.ir.values[lk.ir.outputs[pos]].dtype
        value = store_value(var.name, defs.get(var.name, ""), dtype)
        hint = f', eviction_policy="{evict}"' if evict and row_level else ""
        if row and not row_level and not scalar_row:
            # a per-row value of a [XBLOCK, 1] block: stored 1-d (triton_lib.store_rows)
            return [f"fl.store_rows(out{pos} + {print_expr(off)}{pad}, {value}, {mask}, XBLOCK)"]
        if resident and COLS in off.free_symbols:
            return [f"tl.store({row_address(f'out{pos}', off)}{pad}, {value}, mask={mask})"]
        turned = rtile.turned(off) if rtile is not None and row_level else None
        if turned is not None:
            # reordered to the Y-inner order, then written along Y
            value = f"fl.swap_rows({value}, XBLOCK // {rtile.xt}, {rtile.xt}, XBLOCK, RBLOCK)"
            return [f"tl.store(out{pos} + {print_expr(turned)}, {value}, mask={mask})"]
        if shift and COLS in off.free_symbols:
            addr = f"out{pos} + (rowa + vcols)"
            return ["if inner:", f"    tl.store({addr}, {value}{hint})", "else:",
                    f"    tl.store({addr}, {value}, mask={mask}{hint})"]
        if mask == "True":
            return [f"tl.store(out{pos} + {print_expr(off)}{pad}, {value}{hint})"]
        return [f"tl.store(out{pos} + {print_expr(off)}{pad}, {value}, mask={mask}{hint})"]

    defs = {st[1].name: st[2] for ph in lk.phases for st in ph.outer + ph.body + lk.tail
            if st[0] == "assign"}

    def stmt_lines(stmt, evict=None, evict_stores=None):
        kind = stmt[0]
        if kind == "load":
            return load(stmt, evict)
        if kind == "store":
            return store(stmt, evict_stores)
        if kind == "assign":
            return [f"{stmt[1].name} = {stmt[2]}"]
        if kind == "assert":      # in the live lanes: masked ones hold any index
            lanes = ("mask" if stmt[3] else "rmask") if row else "xmask"
            return [f"tl.device_assert(({stmt[1]}) | ~({lanes}), {stmt[2]!r})"]
        if kind == "index":     # a value of the index (an arange): a block of it, or a scalar
            var = stmt[1]
            return [f"{var.name} = (tl.full([1], 0, tl.int64) + ({print_expr(idx(stmt[2]))}))"
                    f".to({ops.reg_dtype(var.dtype)})"]
        if kind == "select":
            var, parts = stmt[1], stmt[2]
            expr = ops.cast(parts[-1][1].name, parts[-1][1].dtype, var.dtype)
            for pred_set, v in reversed(parts[:-1]):     # the first true predicate wins
                cond = condition(pred_set)
                if cond is True:
                    expr = ops.cast(v.name, v.dtype, var.dtype)
                elif cond is not False:
                    expr = f"tl.where({cond}, {ops.cast(v.name, v.dtype, var.dtype)}, {expr})"
            return [f"{var.name} = {expr}"]
        raise AssertionError(kind)

    lines = ["pid = tl.program_id(0)", "if INDEX64:", "    pid = pid.to(tl.int64)"] if row else []
    if row and stage is not None:
        lines += ["split = pid % S  # the chunk of the row this program takes",
                  # one row a program (XBLOCK 1), as a scalar: its per-row values are scalars,
                  # which broadcast into the columns' layout for free (a [1, 1] block from the
                  # partials' reduction is converted through shared memory)
                  "rindex = pid // S",
                  "rmask = rindex < R"]
        lines += split_phases(lk, stmt_lines, stage)
        if stage == len(lk.phases) - 1 and lk.tail:
            lines.append("rmask = rmask & (split == 0)  # per-row outputs: one program stores")
            for stmt in lk.tail:
                lines += stmt_lines(stmt)
    elif row and resident:
        lines += ["rindex = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]  # XBLOCK 1",
                  "rmask = tl.full([XBLOCK, 1], True, tl.int1)  # a program a row, none past R"]
        pad = 0
        if shift:
            v, start = shift
            pad = v - 1
            lines += [f"rstart = {print_expr(start)}  # the row's first element",
                      f"rowa = (rstart // {v}) * {v}  # rounded down to 16 bytes",
                      "sh = (rstart - rowa).to(tl.int32)  # the row's column at rowa is -sh"]
        lines += resident_phases(lk, stmt_lines, int(lk.shape[-1]), pad, shift is not None)
        for stmt in lk.tail:
            lines += stmt_lines(stmt)
    elif row and shift:
        v, start = shift
        lines += ["rindex = pid  # one row a program (XBLOCK 1), as a scalar",
                  "rmask = rindex < R",
                  f"rstart = {print_expr(start)}  # the row's first element",
                  f"rowa = (rstart // {v}) * {v}  # rounded down to 16 bytes",
                  "sh = (rstart - rowa).to(tl.int32)  # the row's column at rowa is -sh"]
        lines += _row_phases(lk, stmt_lines, False, late, shifted_row=True)
        for stmt in lk.tail:
            lines += stmt_lines(stmt)
    elif row:
        count = sympy.Mul(*lk.shape[:-1])
        # strided rows are loaded in vectors across the rows: a static row count as a literal
        # lets Triton prove the row mask constant over a vector (R itself is not specialized:
        # every access was one 2-byte load, a column sum 4x slower than eager on the H200)
        bound = py_expr(count) if strided and count.is_Integer else "R"
        if rtile is not None:
            lines += tiles.row_index_lines(rtile)
        else:
            lines += ["rindex = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]",
                      f"rmask = rindex < {bound}"]
        lines += _row_phases(lk, stmt_lines, name == "_persistent_kernel", late)
        for stmt in lk.tail:
            lines += stmt_lines(stmt)
    else:
        lines += ([] if part else ["pid = tl.program_id(0)"]) + [
                  "if INDEX64:",
                  "    pid = pid.to(tl.int64)"]
        if tile is not None:
            lines += tiles.index_lines(tile)
        elif part:
            lines += ["xindex = pid * BLOCK + tl.arange(0, BLOCK)", "xmask = xindex < numel"]
        else:
            # a constant mask: Triton drops it from the loads and stores (no predicates)
            lines += ["xindex = pid * BLOCK + tl.arange(0, BLOCK)",
                      "if EVEN:  # numel is a multiple of BLOCK",
                      "    xmask = tl.full([BLOCK], True, tl.int1)",
                      "else:",
                      "    xmask = xindex < numel"]
        for stmt in loads_first(lk.phases[0].outer + lk.phases[0].body):
            lines += stmt_lines(stmt)
    code = "\n".join("    " + ln for ln in lines)
    size_args = sorted({m for m in re.findall(r"\bk\d+\b", code)}, key=lambda s: int(s[1:]))
    params = [f"in{i},  # {v.dtype} {list(v.shape)}" for i, v in enumerate(lk.ir.inputs)]
    params += [f"out{p},  # {lk.ir.values[o].dtype} {list(lk.ir.values[o].shape)}"
               for p, o in enumerate(lk.ir.outputs)]
    if stage is not None:
        params.append("ws,  # fp32 [reductions, R, S]: each chunk's partial reductions")
    params += [f"{s}," for s in size_args]
    if row:
        params += ["R, N,  # rows, row length"]
        if stage is not None:
            params.append("S, CHUNK,  # chunks a row, columns a chunk (a multiple of RBLOCK)")
        params += ["XBLOCK: tl.constexpr, RBLOCK: tl.constexpr,"]
        if stage is not None:
            params.append("SBLOCK: tl.constexpr,  # S as a power of two")
        params.append("INDEX64: tl.constexpr,")
        if late:
            params.append("HOIST: tl.constexpr,")
        nospec = '"R"'
    else:
        params += (["pid,  # the block index, from the multi-part kernel"] if part else []) + [
            "numel,", "BLOCK: tl.constexpr, INDEX64: tl.constexpr,"] + (
            [] if part else ["EVEN: tl.constexpr,"])
        nospec = None   # Triton specializes numel % 16 == 0: the mask then keeps loads vectorised
    sig = "\n".join("    " + p for p in params)
    options = ([f"do_not_specialize=[{nospec}]"] if nospec else []) \
        + (["debug=True"] if checks_indices(lk.ir) else [])      # tl.device_assert is live
    deco = f"@triton.jit({', '.join(options)})" if options else "@triton.jit"
    src = f"{deco}\ndef {name}(\n{sig}\n):\n{code}"
    return src, size_args


def _row_phases(lk, stmt_lines, persistent, late, shifted_row=False):
    lines = []
    if persistent:
        # a static row length as a literal: where it fills the block (4096 of 4096) Triton
        # drops the column masks, their selects and predicates (~2 instructions per element of
        # the FP8 quant kernels, 11-13% of their SASS); otherwise the same compare
        n = lk.shape[-1]
        bound = py_expr(n) if sympy.sympify(n).is_Integer else "N"
        lines += ["cols = tl.arange(0, RBLOCK)[None, :]", f"cmask = cols < {bound}",
                  "mask = rmask & cmask"]
        if late:
            # HOIST (a grid of few programs per SM, launch.few_programs): the loads after the
            # reduction go out before it, so a program waits on memory once; 64 rows of 4096 on
            # the H200, kernel time: add+RMSNorm 2.50 -> 2.30 us, add+LayerNorm 2.88 -> 2.53,
            # RMSNorm+FP8 1.74 -> 1.54. Not on large grids, whose programs overlap each other's
            # waits anyway: there the longer-lived registers cost 0.2-1.6% (16384 rows).
            lines.append("if HOIST:")
            lines += ["    " + ln for st in late for ln in stmt_lines(st)]

    hoisted = {id(st) for st in late}

    def in_place(stmts):
        out = []
        for stmt in stmts:
            if id(stmt) in hoisted:
                out += ["if not HOIST:"] + ["    " + ln for ln in stmt_lines(stmt)]
            else:
                out += stmt_lines(stmt)
        return out
    last = max((i for i, ph in enumerate(lk.phases) if ph.body), default=0)
    for i, ph in enumerate(lk.phases):
        lines += in_place(ph.outer)
        if not ph.body and not ph.reductions:
            continue
        body = in_place(ph.body)
        if persistent:
            lines += body
            for res, kind, acc, src in ph.reductions:
                masked = f"tl.where(mask, {src.name}, {RED_INIT[kind]})"
                lines.append(f"{res.name} = " + RED_FINAL[kind].format(a=masked))
            continue
        lines += column_loop(ph, evicting(stmt_lines, i == last, lk.shape), "0", "N",
                             shifted_row=shifted_row)
        # a shifted row's loop starts sh columns before it (row_loops.column_loop)
        span, skip = ("N + sh", "sh") if shifted_row else ("N", "0")
        for res, kind, acc, _ in ph.reductions:
            lines += row_result(res.name, kind, acc, ph, shifted_row, span, skip)
    return lines


def _row_shift(lk, idx):
    """(V, the row's first element as an expression of ``rindex``) where a looped kernel's rows
    do not all start on 16 bytes (V elements of its narrowest row dtype: a row of 50257 bf16
    elements starts on 2 bytes) and every load and store of its columns reads the same row,
    column for column (``cols + start``), at static sizes and without predicates; else None.
    Its loop then steps from the row's 16 bytes (row_loops.column_loop): one shift for all of
    them. Not where a weight is read by column alone: it would take another shift."""
    starts, sizes = set(), []
    accesses = [(off, preds, lk.ir.inputs[i].dtype) for _, i, off, preds in lk.loads]
    accesses += [(st[3], (), lk.ir.values[lk.ir.outputs[st[1]]].dtype) for st in all_stores(lk)]
    for off, preds, dtype in accesses:
        e = idx(off)
        if COLS not in e.free_symbols:
            continue
        start = sympy.expand(e - COLS)
        if preds or not start.free_symbols <= {RINDEX}:
            return None
        starts.add(start)
        sizes.append(dtype.itemsize)
    if len(starts) != 1:
        return None
    start = starts.pop()
    a, b = start.coeff(RINDEX), start.subs(RINDEX, 0)
    if not (a.is_Integer and b.is_Integer):
        return None
    v = 16 // min(sizes)
    return None if int(a) % v == 0 and int(b) % v == 0 else (v, start)
