"""The resident row kernel's phases as Triton source: a static row longer than a persistent
program's block, held in registers by one program as static chunks (``launch.resident_chunks``)
and read once, where the looped kernel (``row_loops``) reads it once a pass; and the estimate of
the registers it would take (``_held_values``), past which the row loops instead
(``NotHeld``). kernel_source.py's ``_resident_kernel`` writes the loads and stores, this module the
order of the statements and the reductions across chunks.
"""
from __future__ import annotations

import re

from . import launch as rules
from .row_loops import RED_FINAL, RED_INIT, RED_STEP
from .statements import DEFINES, NAME, direct_loads, registers, uses


class NotHeld(Exception):
    """The row's values would not fit a resident kernel's registers (launch.RESIDENT_VALUES)."""


def resident_phases(lk, stmt_lines, n, pad, shifted):
    """A resident kernel's phases: the persistent lowering's, its row held in registers as
    ``launch.resident_chunks`` static chunks of RBLOCK columns, every column statement written
    once a chunk (its values named ``_j`` for chunk j): in the first phase each statement for
    all chunks before the next, so all the row's loads go out before its first reduction; in
    the later phases a chunk's statements before the next chunk's, so a chunk's values die
    before the next chunk's are made (a LayerNorm's weight and bias loaded for all 13 chunks
    beside its normalised row spilled 184 instructions, 17 this way), its direct loads (a
    weight's) a chunk ahead: a load after a store in program order waits for it (RMSNorm over
    1024 rows of 50257 on the H200: weights loaded in place, 94.9 us). A reduction combines
    its chunks element by element, then reduces once (one cross-warp exchange, not one a
    chunk). A chunk wholly inside every row has a constant mask, which Triton drops: its loads
    and stores are unpredicated vectors (4 elements a thread on 32 warps: 8 bytes of bf16).
    ``shifted``: the chunks step from the row's
    first element rounded down to 16 bytes (``rowa``, ``pad`` columns before it at most)."""
    chunks = rules.resident_chunks(n, pad)
    if not rules.resident_fits(chunks, _held_values(lk)):
        raise NotHeld
    names = sorted({st[1].name for ph in lk.phases for st in ph.body
                    if st[0] in DEFINES}
                   | {"cols", "vcols", "cmask", "mask"}, key=len, reverse=True)
    # not a keyword argument (``mask=``)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b(?!=[^=])")

    def at(line, j):
        return pattern.sub(lambda m: f"{m.group(1)}_{j}", line)
    lines = []
    for j in range(chunks):
        first = f"{j} * RBLOCK + tl.arange(0, RBLOCK)[None, :]"
        lines += [f"vcols_{j} = {first}", f"cols_{j} = vcols_{j} - sh"] if shifted else [
            f"cols_{j} = {first}"]
        if j * rules.RESIDENT_RBLOCK >= pad and (j + 1) * rules.RESIDENT_RBLOCK <= n:
            lines.append(f"cmask_{j} = tl.full([1, RBLOCK], True, tl.int1)  # inside every row")
        else:
            lines.append(f"cmask_{j} = (cols_{j} >= 0) & (cols_{j} < {n})" if shifted
                         else f"cmask_{j} = cols_{j} < {n}")
        lines.append(f"mask_{j} = rmask & cmask_{j}")
    # a store goes out where its value is made, not where the lowering put it (after the
    # reductions): the value is not kept in registers across them
    body = [st for ph in lk.phases for st in ph.body]
    made = {st[1].name: k for k, st in enumerate(body) if st[0] in DEFINES}
    after = {}
    for st in body:
        if st[0] == "store":
            src = [made[name] for name in NAME.findall(st[2].name) if name in made]
            if src:     # after the last statement its value reads
                after.setdefault(id(body[max(src)]), []).append(st)
    moved = {id(st) for sts in after.values() for st in sts}
    for i, ph in enumerate(lk.phases):
        lines += [ln for st in ph.outer for ln in stmt_lines(st)]
        body = [one for st in ph.body if id(st) not in moved
                for one in [st] + after.get(id(st), [])]
        if i == 0:      # the row's loads: all of them out before the first reduction
            lines += [at(ln, j) for st in body for j in range(chunks) for ln in stmt_lines(st)]
        else:
            # a chunk at a time, so its values die before the next chunk's are made; its
            # direct loads a chunk ahead (a load after a store in program order waits for it)
            ahead = direct_loads(body, registers(body))
            early = {id(st) for st in ahead}
            first = [ln for st in ahead for ln in stmt_lines(st)]
            rest = [ln for st in body if id(st) not in early for ln in stmt_lines(st)]
            lines += [at(ln, 0) for ln in first]
            for j in range(chunks):
                lines += [at(ln, j + 1) for ln in first if j + 1 < chunks]
                lines += [at(ln, j) for ln in rest]
        for res, kind, acc, src in ph.reductions:
            lines.append(f"{acc} = tl.where(mask_0, {at(src.name, 0)}, {RED_INIT[kind]})")
            lines += [f"{acc} = " + RED_STEP[kind].format(
                a=acc, v=f"tl.where(mask_{j}, {at(src.name, j)}, {RED_INIT[kind]})")
                for j in range(1, chunks)]
            lines.append(f"{res.name} = " + RED_FINAL[kind].format(a=acc))
    return lines


def _held_values(lk) -> float:
    """fp32 values an element of a resident kernel's row keeps in registers at its peak, as
    estimated: its first phase's column loads together (a bf16 element is half a register; all
    issued before the first reduction; a later phase's, a weight's, are a chunk's at a time),
    or the column values defined before a reduction and read after it (stores excepted:
    resident_phases writes them where their value is made), if more. Times the chunks, the
    registers a thread's 4 elements a chunk take, over 4 (launch.RESIDENT_VALUES)."""
    loads = sum(lk.ir.inputs[st[2]].dtype.itemsize / 4 for st in lk.phases[0].body
                if st[0] == "load")
    defined, last = {}, {}
    for i, ph in enumerate(lk.phases):
        for st in ph.body:
            if st[0] != "store":
                for name in uses(st):
                    last[name] = i
            if st[0] in DEFINES:
                defined[st[1].name] = i
        for _, _, _, src in ph.reductions:
            for name in NAME.findall(src.name):
                last[name] = max(last.get(name, i), i)
    live = max((sum(1 for name, i in defined.items() if i <= b < last.get(name, -1))
                for b in range(len(lk.phases))), default=0)
    return max(loads, live, 1)
