"""The loops of a row kernel whose row does not fit in registers, as Triton source: each phase
streams the row in steps of RBLOCK columns (``column_loop``), either one program a row (the
looped kernel) or a row split across programs, one kernel per phase, with the partial
reductions in between in a scratch buffer (``split_phases``: the few long rows of a VAE's
GroupNorm on every SM, not on 32 of 132). And the reductions' text: each kind's accumulator,
step, per-row result, and its partial of a chunk.
"""
from __future__ import annotations

import math
import os
import re

import sympy

from .statements import direct_loads, registers

# the reductions taken in a partner's pass (lowered.partner_of, Phase.partners):
# "lse": the sum of exp(x - the row's max), in the max's pass: each lane sums exp(x - its own
#   running max) (fl.lse_step, after its max's accumulator, its partner);
# "wmean" and "m2": a mean and the sum of squared deviations from it, in one pass (Welford's
#   update): each lane keeps its first element (``_k``), its running mean less that element
#   (wmean's accumulator: small where the row is offset, so its roundings are), where the mean
#   is seen its plain sum (``_s``: the mean of a row holding an infinity, fl.welford_mean;
#   Phase.sums), and the sum of squared deviations from its mean (m2's, the partner's mean
#   read after its update); the lanes, then a split row's chunks, combined by Chan's formula
#   (fl.chan_mean, fl.chan_m2)
RED_INIT = {"sum": "0.0", "mean": "0.0", "max": 'float("-inf")', "min": 'float("inf")',
            "lse": "0.0", "wmean": "0.0", "m2": "0.0"}
# the partials a split row's chunk leaves per reduction: a Welford mean's reference, its mean
# less the reference (fl.chan_mean) and, where kept, its plain sum
SLOTS = {"wmean": 3}
RED_FINAL = {"sum": "tl.sum({a}, axis=1)[:, None]", "mean": "tl.sum({a}, axis=1)[:, None]",
             "max": "fl.row_max({a}, 1)[:, None]", "min": "fl.row_min({a}, 1)[:, None]"}
_ROWS = {"sum": "tl.sum({a}, axis=1)", "mean": "tl.sum({a}, axis=1)",
         "max": "fl.row_max({a}, 1)", "min": "fl.row_min({a}, 1)"}
_COMBINE = {"sum": "tl.sum({a}, axis=0)", "mean": "tl.sum({a}, axis=0)",
            "max": "fl.row_max({a}, 0)", "min": "fl.row_min({a}, 0)"}
RED_STEP = {"sum": "{a} + {v}", "mean": "{a} + {v}", "max": "fl.max_combine({a}, {v})",
            "min": "fl.min_combine({a}, {v})"}
# loads issued a loop step ahead (column_loop); FUSION_COMPILER_PREFETCH=0 issues them in place
PREFETCH = os.environ.get("FUSION_COMPILER_PREFETCH", "1") == "1"
# a looped kernel's passes over its rows (evicting, below), where they hold at least
# EVICT_MIN_ELEMENTS elements (more than L2 holds at 2 bytes an element): 2, the passes before
# the last keep the row's lines in L2 (evict_last), the last pass and the stores stream them
# (evict_first); 1, the loads alone; 0, no hints
EVICT = int(os.environ.get("FUSION_COMPILER_EVICT", "2"))
EVICT_MIN_ELEMENTS = 1 << 25


def row_result(res, kind, acc, ph, scalar=False, span="N", skip="0"):
    """The lines giving ``res``, a reduction's per-row result ([XBLOCK, 1], or a scalar where
    the program's row is one: ``scalar``), from its accumulator, of phase ``ph``. An "lse" sum
    takes its partner (the max's accumulator and result): each lane's sum brought to the row's
    max. A "wmean" combines its lanes, which stepped over ``span`` columns in steps of RBLOCK,
    lanes below ``skip`` one step fewer (fl.welford_counts: a shifted row's ``span`` is
    ``N + sh``, of which the row's N elements); an "m2" takes its mean's lanes and result."""
    if kind == "lse":
        m_acc, m_res = ph.partners[acc]
        terms = f"fl.lse_terms({acc}, {m_acc}, {m_res.name})"
        total = (_COMBINE["sum"].format(a=_ROWS["sum"].format(a=terms)) if scalar
                 else RED_FINAL["sum"].format(a=terms))
        return [f"{res} = fl.lse_guard({total}, {m_res.name})"]
    if kind == "wmean":
        total = span if skip == "0" else "N"
        mean = (f"fl.welford_mean({acc}_r, {acc}_c, tl.sum({acc}_s, 1, keep_dims=True), {total})"
                if acc in ph.sums else f"{acc}_r + {acc}_c")
        return [f"{acc}_n = fl.welford_counts({span}, RBLOCK, {skip})  # each lane's elements",
                f"{acc}_r, {acc}_c = fl.chan_mean({acc}_n, {acc}_k, {acc}, {total}, 1)",
                f"{res} = " + _whole(mean, scalar)]
    if kind == "m2":
        m_acc, m_res = ph.partners[acc]
        return [f"{res} = " + _lanes_m2(acc, m_acc, m_res.name, scalar)]
    if scalar:
        return [f"{res} = " + _COMBINE[kind].format(a=_ROWS[kind].format(a=acc))]
    return [f"{res} = " + RED_FINAL[kind].format(a=acc)]


def _whole(a, scalar):
    """A [XBLOCK, 1] value of lanes combined: itself, or the scalar of a program's one row."""
    return _COMBINE["sum"].format(a=_ROWS["sum"].format(a=a)) if scalar else a


def _lanes_m2(acc, m_acc, mean, scalar):
    """An m2's lanes combined (Chan) about ``mean``, with its Welford mean's lanes and counts."""
    return _whole(f"fl.chan_m2({m_acc}_n, {m_acc}_k, {m_acc}, {acc}, {mean}, 1)", scalar)


def evicting(stmt_lines, last, shape):
    """A looped kernel's statements with eviction hints on the row's loads and stores (as
    ``EVICT`` says), where its rows (``shape``, static) hold more than L2
    (``EVICT_MIN_ELEMENTS``): the passes before the last keep the row in L2 for the next
    (evict_last), the last pass and the stores stream it (evict_first). H200, kernel time
    after an L2 flush, no hints / loads only / loads and stores (benchmarks/long_rows.py
    --profile, us): softmax 4096 x 50257
    511.0 / 525.5 / 495.8, log_softmax 8192 x 30522 484.7 / 468.2 / 443.6, LayerNorm 2048 x
    32768 125.4 / 124.6 / 117.7; GroupNorm 256 x 40960 (21 MB, left without) 28.3 / 30.5 /
    29.9."""
    sizes = [sympy.sympify(d) for d in shape]
    if not EVICT or not all(d.is_Integer for d in sizes) or \
            math.prod(int(d) for d in sizes) < EVICT_MIN_ELEMENTS:
        return stmt_lines
    loads = "evict_first" if last else "evict_last"
    stores = "evict_first" if EVICT == 2 else None
    return lambda stmt: stmt_lines(stmt, loads, stores)


def column_loop(ph, stmt_lines, lo, extent, rows="rmask & ", shifted_row=False):
    """A phase's loop over the columns ``lo`` to ``lo + extent`` (steps of RBLOCK, masked by
    ``cols < N``): its accumulators, its body, the reduction steps.

    The loads addressed by the columns alone (``statements.direct_loads``) are issued one step
    ahead: the next step's before this step's arithmetic and stores. A step's arithmetic waits
    for its loads, and a load that follows a store in program order is issued after it; loaded
    one step ahead, a program's loads are in flight while it computes and stores the step
    before (softmax over 4096 rows of 50257 on the H200: 901 -> 510 us). The columns and masks
    are computed from the loop's counter in each step, so Triton's analysis still sees them
    contiguous and aligned (the loads stay vectorised). ``col0`` is the step's first column
    (a load that reads one value a step: render's ``load``). ``rows``: the row mask's part of
    ``mask`` (none in a split stage, whose row always exists).

    ``shifted_row``: the row does not start on 16 bytes (rows of a 50257 vocabulary: their
    loads were 2-byte loads). The loop then steps over virtual columns ``vcols`` from the row's
    first element rounded down to 16 bytes (``rowa``; the row's column is ``vcols - sh``): the
    steps wholly inside the row (``inner``) load and store without masks, in 16-byte vectors;
    the first and the last step mask by element (render's loads and stores, if / else)."""
    lines = [f"{a} = tl.full([XBLOCK, RBLOCK], {RED_INIT[kind]}, tl.float32)"
             for _, kind, acc, _ in ph.reductions for a in _accumulators(ph, kind, acc)]
    ahead = direct_loads(ph.body, registers(ph.body)) if PREFETCH else []
    moved = {id(st) for st in ahead}
    loads = [ln for st in ahead for ln in stmt_lines(st)]

    def ahead_of(line, names=("cols", "cmask", "col0", "c0mask", "vcols", "inner")):
        for name in names:
            line = re.sub(rf"\b{name}\b", "n" + name, line)
        return line

    def shifted(line):
        return re.sub(r"^(\s*)(\w+) =", r"\1\2_next =", ahead_of(line))
    if shifted_row:
        step = ["vcols = off + tl.arange(0, RBLOCK)[None, :]  # from the row's 16 bytes",
                "cols = vcols - sh",
                "cmask = (cols >= 0) & (cols < N)",
                "inner = (off >= sh) & (off + RBLOCK <= N + sh)  # no column outside the row"]
        first = ["off = 0"] + step + loads if ahead else []
        end, head = "N + sh", step + ["mask = cmask"]
        # the next step's columns and masks: the same lines at the next step's offset
        nxt = ["noff = off + RBLOCK"] + [
            ahead_of(ln, ("off", "cols", "cmask", "vcols", "inner")) for ln in step]
    else:
        first = [f"col0 = {lo}", "cols = col0 + tl.arange(0, RBLOCK)[None, :]",
                 "cmask = cols < N", "c0mask = col0 < N"] + loads if ahead else []
        end, head = extent, [f"col0 = {lo} + off  # the step's first column",
                             "cols = col0 + tl.arange(0, RBLOCK)[None, :]",
                             "cmask = cols < N", "c0mask = col0 < N", f"mask = {rows}cmask"]
        # a split stage's chunk ends before the row (a block compared with a block: Triton
        # 3.9's interpreter makes block & scalar integers)
        stop = "" if extent == "N" else f" & (ncols < {lo} + {extent})"
        nxt = ["ncol0 = col0 + RBLOCK", "ncols = cols + RBLOCK", f"ncmask = (ncols < N){stop}",
               f"nc0mask = (ncol0 < N){stop.replace('ncols', 'ncol0')}"]
    nxt = nxt + [shifted(ln) for ln in loads] if ahead else []
    lines += first
    start = "0"
    body = head + _welford_count(ph, shifted_row) + nxt + _step(ph, stmt_lines, ahead, moved)
    if _welford(ph):
        # the first step on its own: it takes each lane's first element, the loop's Welford
        # updates start from the second (no test of the step a lane starts on, per element);
        # a shifted row's lanes below sh start inside it a step later: the second step too,
        # which takes theirs (a step past the row's end, as it may be, is wholly masked)
        lines += ["off = 0"] + head + nxt + _step(ph, stmt_lines, ahead, moved, True)
        start = "RBLOCK"
        if shifted_row:
            late = [f"{acc}_k = tl.where(tl.arange(0, RBLOCK)[None, :] < sh, {src.name}, {acc}_k)"
                    for _, kind, acc, src in ph.reductions if kind == "wmean"]
            lines += ["off = RBLOCK"] + head + _welford_count(ph, True) + nxt + _step(
                ph, stmt_lines, ahead, moved, late=late)
            start = "2 * RBLOCK"
    return lines + [f"for off in range({start}, {end}, RBLOCK):"] + ["    " + ln for ln in body]


def _welford(ph):
    """Whether phase ``ph`` takes a Welford mean."""
    return any(kind == "wmean" for _, kind, _, _ in ph.reductions)


def partial_slots(phases) -> int:
    """The partials a split row's chunk leaves in ``ws`` for the reductions of ``phases``."""
    return sum(SLOTS.get(kind, 1) for ph in phases for _, kind, _, _ in ph.reductions)


def _accumulators(ph, kind, acc):
    """A reduction's accumulators: a Welford mean's running mean less its lane's first element,
    that element (``_k``) and, where the mean is seen (``Phase.sums``), its plain sum (``_s``)."""
    if kind != "wmean":
        return (acc,)
    return (acc, f"{acc}_k") + ((f"{acc}_s",) if acc in ph.sums else ())


def _welford_count(ph, shifted_row):
    """The step's reciprocal count of a phase with a Welford mean: a lane's count is the step's
    (its lanes start together and stop at the row's end), one division a step, not one an
    element; in a shifted row the lanes below ``sh`` start a step later (outside the row in
    the first)."""
    if not _welford(ph):
        return []
    if shifted_row:
        return ["wr = tl.where(tl.arange(0, RBLOCK)[None, :] < sh, 1.0 / (off // RBLOCK), "
                "1.0 / (off // RBLOCK + 1))  # 1 / a live lane's count"]
    return ["wr = 1.0 / (off // RBLOCK + 1)  # 1 / a live lane's count"]


def _step(ph, stmt_lines, ahead, moved, first=False, late=()):
    """A column loop's step after its header: the statements, the reduction steps, and the
    loads ahead handed to the next step. ``first``: the step that takes each lane's first
    element for its Welford means, 0 where the lane is outside the row; ``late``: the lines
    taking the first element of a shifted row's lanes below sh, before the update (which then
    leaves their mean and m2 at 0)."""
    lines = [ln for st in ph.body if id(st) not in moved for ln in stmt_lines(st)] + list(late)
    for res, kind, acc, src in ph.reductions:    # before its max's accumulator moves
        if kind == "lse":
            m_acc, v = ph.partners[acc][0], f'tl.where(mask, {src.name}, float("-inf"))'
            lines += [f"{acc}_m = fl.max_combine({m_acc}, {v})",
                      f"{acc} = fl.lse_step({acc}, {m_acc}, {acc}_m, {v})"]
    for res, kind, acc, src in ph.reductions:
        if kind == "lse" or (first and kind == "m2"):
            continue
        if kind == "wmean" and first:
            lines += [f"{a} = tl.where(mask, {src.name}, 0.0)"
                      for a in _accumulators(ph, kind, acc)[1:]]
            continue
        if kind == "wmean":     # Welford's running mean, before its m2 partners read it
            x = f"{src.name} - {acc}_k"   # less the lane's first element
            lines += [f"{acc}_s = {acc}_s + tl.where(mask, {src.name}, 0.0)"] * (acc in ph.sums)
            lines += [f"{acc}_d = tl.where(mask, {x} - {acc}, 0.0)",
                      f"{acc} = {acc} + {acc}_d * wr"]
            continue
        if kind == "m2":        # (x - the old mean) * (x - the new mean)
            m_acc = ph.partners[acc][0]
            x = f"{src.name} - {m_acc}_k"
            lines.append(f"{acc} = {acc} + tl.where(mask, {m_acc}_d * ({x} - {m_acc}), 0.0)")
            continue
        step = RED_STEP[kind].format(a=acc, v=f"tl.where(mask, {src.name}, {RED_INIT[kind]})")
        lines.append(f"{acc} = {step}")
    return lines + [f"{st[1].name} = {st[1].name}_next" for st in ahead]


def split_phases(lk, stmt_lines, stage):
    """Phase ``stage`` of a looped row kernel over one chunk of ``CHUNK`` columns of the row
    (program ``split`` of the row's ``S``; one row a program, ``rindex`` a scalar): a grid of
    few long rows (the 32 group rows of a VAE's GroupNorm) then runs on every SM, not on one
    per row. The reductions of the earlier phases are read back from the partials their stages
    left in ``ws`` and combined (the same reduction over S values); the reductions of this
    phase leave this chunk's partials there, as scalars. The last stage stores the outputs. A
    sum's partials are its chunks' fp32 sums, combined in fp32: the looped kernel's own
    association, grouped by chunk."""
    lines = ["start = split * CHUNK",
             "sidx = tl.arange(0, SBLOCK)",
             "smask = sidx < S"]
    slot = 0        # each reduction's partials: ws[slot, row, chunk]
    slots = {}      # accumulator -> its slot

    def partials(k, kind):
        return (f"tl.load(ws + ({k} * R + rindex) * S + sidx, mask=smask, "
                f"other={RED_INIT[kind]})")
    if any(_welford(ph) for ph in lk.phases[:stage]):
        # each chunk's elements, for Chan's combination of their means and m2s
        lines.append("scount = tl.where(smask, tl.minimum(CHUNK, N - sidx * CHUNK), 0)"
                     ".to(tl.float32)")
    for i, ph in enumerate(lk.phases[:stage + 1]):
        lines += [ln for st in ph.outer for ln in stmt_lines(st)]
        if i < stage:
            for res, kind, acc, _ in ph.reductions:
                slots[acc] = slot
                if kind == "lse":
                    # the chunks' sums, each brought from its chunk's max to the row's
                    m_acc, m_res = ph.partners[acc]
                    terms = (f"fl.lse_terms({partials(slot, kind)}, "
                             f"{partials(slots[m_acc], 'max')}, {m_res.name})")
                    lines.append(f"{res.name} = fl.lse_guard(tl.sum({terms}, axis=0), "
                                 f"{m_res.name})")
                elif kind == "wmean":   # the chunks' references and means less them
                    mean = (f"fl.welford_mean({acc}_r, {acc}_c, tl.sum("
                            f"{partials(slot + 2, kind)}, 0, keep_dims=True), N)"
                            if acc in ph.sums else f"{acc}_r + {acc}_c")
                    lines += [f"{acc}_r, {acc}_c = fl.chan_mean(scount, {partials(slot, kind)}, "
                              f"{partials(slot + 1, kind)}, N, 0)",
                              f"{res.name} = tl.sum({mean}, axis=0)"]
                elif kind == "m2":
                    m_acc, m_res = ph.partners[acc]
                    w = slots[m_acc]
                    lines.append(f"{res.name} = tl.sum(fl.chan_m2(scount, {partials(w, kind)}, "
                                 f"{partials(w + 1, kind)}, {partials(slot, kind)}, "
                                 f"{m_res.name}, 0), axis=0)")
                else:
                    lines.append(f"{res.name} = " + _COMBINE[kind].format(
                        a=partials(slot, kind)))
                slot += SLOTS.get(kind, 1)
            continue
        if not ph.body and not ph.reductions:
            continue
        # CHUNK is a multiple of RBLOCK: a step never crosses into the next chunk
        lines += column_loop(ph, stmt_lines, "start", "CHUNK", rows="")
        for res, kind, acc, src in ph.reductions:
            if kind == "lse":       # the chunk's lanes brought to the chunk's max (its partial)
                m_acc = ph.partners[acc][0]
                terms = f"fl.lse_terms({acc}, {m_acc}, {m_acc}_p)"
                part = _COMBINE["sum"].format(a=_ROWS["sum"].format(a=terms))
            elif kind == "wmean":   # the chunk's reference, its mean less it, its sum
                span = "tl.minimum(N - start, CHUNK)"
                lines += [f"{acc}_n = fl.welford_counts({span}, RBLOCK, 0)",
                          f"{acc}_r, {acc}_c = fl.chan_mean({acc}_n, {acc}_k, {acc}, {span}, 1)",
                          f"{acc}_r = {_whole(f'{acc}_r', True)}",
                          f"{acc}_c = {_whole(f'{acc}_c', True)}",
                          f"{acc}_mu = {acc}_r + {acc}_c  # the chunk's mean, its m2s'"]
                part = f"{acc}_r"
                for k, v in ((1, f"{acc}_c"), (2, _whole(f"{acc}_s", True)))[:1 + (acc in ph.sums)]:
                    lines.append(f"tl.store(ws + ({slot + k} * R + rindex) * S + split, {v}, "
                                 "mask=rmask)")
            elif kind == "m2":
                m_acc = ph.partners[acc][0]
                part = _lanes_m2(acc, m_acc, f"{m_acc}_mu", True)
            else:       # a scalar, named: an lse partner reads the chunk's max
                lines.append(f"{acc}_p = " + _COMBINE[kind].format(a=_ROWS[kind].format(a=acc)))
                part = f"{acc}_p"
            lines.append(f"tl.store(ws + ({slot} * R + rindex) * S + split, {part}, mask=rmask)")
            slot += SLOTS.get(kind, 1)
    return lines
