"""A lowered kernel's statements, as the renderer orders and stores them: which loads a kernel
issues first (those addressed by the block's indices alone), which a persistent row kernel
issues before its first reduction under ``HOIST``, whether its rows are strided (the launcher
then takes more rows a program), and the value each store writes.
"""
from __future__ import annotations

import re

import sympy
import torch

from . import ops
from .lowered import COL


def direct_loads(stmts: list, regs: set) -> list:
    """The loads among ``stmts`` addressed by the block's indices alone, not through a register
    of ``regs`` (a loaded index)."""
    def direct(st):
        if st[0] != "load":
            return False
        names = {s.name for e in (st[3], *st[4]) for s in sympy.sympify(e).free_symbols}
        return not names & regs
    return [st for st in stmts if direct(st)]


DEFINES = ("load", "assign", "select", "index")     # statements that define a register


def registers(stmts) -> set:
    """The register names ``stmts`` define."""
    return {st[1].name for st in stmts if st[0] in DEFINES}


def loads_first(stmts: list) -> list:
    """A pointwise body with its direct loads (addressed by the block's indices alone, not by
    a loaded index) first, the rest in order: every input is requested before any arithmetic
    waits on one, as Inductor's kernels do."""
    first = direct_loads(stmts, registers(stmts))
    moved = {id(st) for st in first}
    return first + [st for st in stmts if id(st) not in moved]


def late_loads(lk) -> list:
    """The direct loads of a persistent row kernel that come after its first reduction (a norm's
    weight row, a scale): issued where they are, each waits on memory after the reduction.
    With ``HOIST`` set, the kernel issues them before it instead (kernel_source.py, ``_row_phases``)."""
    if not lk.phases or not lk.phases[0].reductions:
        return []
    stmts = [st for ph in lk.phases for st in ph.outer + ph.body]
    later = [st for ph in lk.phases[1:] for st in ph.outer + ph.body]
    return direct_loads(later, registers(stmts))


def strided_rows(lk) -> int:
    """How many of a row kernel's loads and per-element stores address a row whose elements
    lie apart in memory (a stride above 1 along the columns) while consecutive rows lie side
    by side (a stride of 1 along the last row dimension): a LayerNorm over the channels of an
    NCHW tensor, the statistics of a channels-last BatchNorm, a cumsum over a middle dim
    stored where its rows lie (Mamba2's segment sum, whose input rows are contiguous: with
    its masks computed, not loaded strided, the store alone is strided, and R unspecialized
    in its mask stored one element at a time, 237 against 64 us on an H100). 0: none."""
    if lk.kind != "row" or len(lk.iter_syms) < 2:
        return 0
    inner = lk.iter_syms[-2]
    count = 0
    offsets = [(None, None, o, None) for o in
               (st[3] for st in all_stores(lk) if st[4])]      # per-element stores
    for _, _, offset, _ in list(lk.loads) + offsets:
        offset = sympy.expand(offset)
        col, row = offset.coeff(COL), offset.coeff(inner)
        if row != 1 or (offset - row * inner).has(inner):
            continue
        # a symbolic stride is a product of sizes, each at least 2 (0 and 1 are specialized)
        apart = col > 1 if col.is_number else not col.has(COL, inner)
        if apart and not (offset - col * COL - row * inner).has(COL, inner):
            count += 1
        elif col == 0 and offset.has(COL) and _columns_apart(offset, lk.iter_syms):
            count += 1
    return count


def strided_kind(lk) -> int:
    """The module's ``STRIDED`` for a persistent row kernel (launch.row_settings): 0 where no
    load or store addresses strided rows (``strided_rows``); 1 where one does and the kernel
    only reduces one such load (no per-element store: a channels-last BatchNorm's statistics, a column
    sum's partials) or is a norm (every per-element store computed from the kernel's
    reductions: a LayerNorm over NCHW channels, forward or its input's gradient); else 2 (a
    column sum of several loads, per-element outputs beside a column sum: GPT-2's GELU
    gradient and its bias gradient)."""
    loads = strided_rows(lk)
    if not loads:
        return 0
    stores = [st[2] for ph in lk.phases for st in ph.body if st[0] == "store"]
    if not stores:
        return 1 if loads == 1 else 2
    return 1 if _from_reductions(lk, stores) else 2


NAME = re.compile(r"[A-Za-z_]\w*")


def uses(stmt) -> set:
    """Names a lowered statement other than a store reads (its text's identifiers; loads and
    asserts: none that matter here, their offsets and tests being indices)."""
    kind = stmt[0]
    if kind == "assign":
        return set(NAME.findall(stmt[2]))
    if kind == "select":
        return {v.name for _, v in stmt[2]}
    return set()


def _from_reductions(lk, values) -> bool:
    """Whether every one of ``values`` is computed from a reduction of the kernel (a norm's
    output from its row's mean and variance), following the statements that define them."""
    reduced = {r[0].name for ph in lk.phases for r in ph.reductions}
    made = {st[1].name: st for ph in lk.phases for st in ph.outer + ph.body + lk.tail
            if st[0] in ("assign", "select")}

    def reads(name) -> bool:
        seen, todo = set(), [name]
        while todo:
            name = todo.pop()
            if name in reduced:
                return True
            if name not in seen and name in made:
                seen.add(name)
                todo += uses(made[name])
        return False
    return all(reads(getattr(v, "name", str(v))) for v in values)


def _columns_apart(offset, syms) -> bool:
    """Whether a static row's column index, split into digits (``x // 28``, ``x % 28``: the H x W
    positions of a channels-last tensor's chunk), puts every column at least 2 elements from
    the one before: the first 64 columns' steps, the other iteration symbols at 0."""
    at = offset.subs({s: 0 for s in syms if s != COL})
    if at.free_symbols - {COL}:
        return False
    places = [at.subs(COL, c) for c in range(65)]
    return all(abs(b - a) >= 2 for a, b in zip(places, places[1:]))


_STORE_FN = {torch.bfloat16: ("fl.round_bf16(", "fl.store_bf16("),
             torch.float8_e4m3fn: ("fl.round_fp8e4m3(", "fl.store_fp8e4m3(")}


def store_value(name: str, definition: str, dtype) -> str:
    """The value to store for register ``name`` of ``dtype``. A value that was just rounded to
    its storage type is stored from the unrounded expression, so the kernel converts once."""
    if dtype in _STORE_FN:
        round_fn, store_fn = _STORE_FN[dtype]
        if definition.startswith(round_fn) and _call_spans(definition, len(round_fn) - 1):
            return store_fn + definition[len(round_fn):]
        if dtype == torch.float8_e4m3fn:
            return f"{store_fn}{name}, {ops.FP8_SATURATES})"
        return f"{store_fn}{name})"
    return f"{name}.to({ops.TL_DTYPE[dtype]})"


def _call_spans(expr: str, open_at: int) -> bool:
    """True if the parenthesis at ``open_at`` closes at the end of ``expr``."""
    depth = 0
    for i in range(open_at, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return i == len(expr) - 1
    return False


def all_stores(lk):
    for ph in lk.phases:
        for s in ph.outer + ph.body:
            if s[0] == "store":
                yield s
    yield from (s for s in lk.tail if s[0] == "store")


def index_values(lk) -> list:
    """The index expressions of the kernel's aranges (``index`` statements): the dims they walk
    may not be merged with others, as an address's may not (kernel_source's coalescing)."""
    return [s[2] for ph in lk.phases for s in ph.outer + ph.body if s[0] == "index"] + [
        s[2] for s in lk.tail if s[0] == "index"]


def select_preds(lk):
    preds = set()
    for ph in lk.phases:
        for s in ph.outer + ph.body:
            if s[0] == "select":
                for pred_set, _ in s[2]:
                    preds |= set(pred_set)
    return preds


def element_registers(lk) -> int:
    """32-bit registers the per-element loads and index values of a row kernel take for each
    element of its block: one a load, two an 8-byte one (an int64 index)."""
    loads = sum(2 if lk.ir.inputs[i].dtype.itemsize == 8 else 1
                for var, i, _, _ in lk.loads if var.row_level)
    # an arange's values per element (a mask's row and column): one each, computed where
    # they are read
    return loads + sum(1 for ph in lk.phases for st in ph.outer + ph.body
                       if st[0] == "index" and st[1].row_level)
