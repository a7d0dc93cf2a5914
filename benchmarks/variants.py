"""Which code-generation change would close a pattern's gap to the HBM floor? (GPU)

    python benchmarks/variants.py [--out DIR] [--only NAME ...] [--variants NAME ...]
        [--rounds N] [--rows M] [--kernel-time] [--graph] [--no-eager]

For each pattern below the 90% target, the kernel the backend generates is rewritten by small
text substitutions (each a hypothesis: a cheaper reduction combine, a reciprocal instead of a
per-element division, a compile-time row length, a cheaper tanh, other block shapes) and timed
beside the original and Inductor on the same inputs (do_bench medians, L2 flushed; the least
of ``--rounds`` interleaved rounds, with the rounds' median and the do_bench mean), with its
error against eager (and the share of fp8 / bf16 / fp16 elements bit-equal to eager's), and with
``--kernel-time`` the kernels' own device time (what small sizes need). Besides
the anchor patterns: GPT-2's GELU (``EXTRA_CASES``). A variant that wins here is then built into
the code generator properly;
this script only measures. Writes the kernels' PTX and Inductor's code under --out.
"""
import argparse
import importlib.util
import json
import re
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patterns import cases, copy_bandwidth  # noqa: E402
from timing import clean_flush_ms, graph_times, kernel_times  # noqa: E402

from fusion_compiler.bench import in_turn  # noqa: E402
from fusion_compiler.measure import recording  # noqa: E402

RECIP = (r"\((\w+) / (\w+)\)", r"(\1 * (1.0 / \2))")
TL_MAX = (r"fl\.row_max\(", "tl.max(")
# no masks: what a kernel specialized to sizes that divide its blocks would look like
NO_MASK = [(r", mask=rmask & cmask, other=0\)", ")"), (r", mask=rmask & cmask\)", ")"),
           (r", mask=cmask, other=0\)", ")"), (r", mask=rmask\)", ")"),
           (r"tl\.where\(mask, (\w+), (?:float\(\"-inf\"\)|0\.0)\)", r"\1"),
           (r", mask=xmask, other=0\)", ")"), (r", mask=xmask\)", ")")]


def loads_where_used(text):
    """A pointwise kernel's loads each moved down to just before the first line that uses
    them: the order the code generator emitted before it put loads first (session 13)."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == "xmask = xindex < numel")
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("tl.store("))
    body = lines[start + 1:end]
    loads = [line for line in body if re.match(r"\s+x\d+ = tl\.load\(in\d+ \+ ", line)]
    rest = [line for line in body if line not in loads]
    for load in reversed(loads):
        var = load.split("=")[0].strip()
        at = next((i for i, line in enumerate(rest) if re.search(rf"\b{var}\b", line)), len(rest))
        rest.insert(at, load)
    return "\n".join(lines[:start + 1] + rest + lines[end:])


# the per-element division by a row's (or the kernel's) scale s, correctly rounded as eager's
# division is (div.full.f32, what Triton emits for `/`, is within 2 ulp): r = 1/s once,
# correctly rounded; q = y * r; one FMA correction (Markstein): c = q + (y - q * s) * r. Where
# c is NaN (an infinite or NaN operand, a zero scale) q is IEEE's answer; the sign of q is
# c's (a zero quotient keeps its sign). Measurement only: a scale under 2^-126 (r infinite)
# with y = 0 gives NaN where eager gives 0.
def exact(text):
    """The division by a shared divisor (``fl.div_shared``, codegen's replica of div.full.f32)
    made correctly rounded: r = 1/b once, correctly rounded; q = a * r; one FMA correction."""
    b = dict((r, b) for r, b, _ in re.findall(r"(\w+) = fl\.div_recip\((\w+), (\w+)\)", text))

    def rewrite(m):
        out, a, _k, r = m.groups()
        d = b[r]
        return (f"{out}_r = tl.math.div_rn(1.0, {d})\n    {out}_q = {a} * {out}_r\n"
                f"    {out}_c = tl.math.fma(tl.math.fma({out}_q, -{d}, {a}), {out}_r, {out}_q)\n"
                f"    {out}_c = tl.where({out}_c == {out}_c, {out}_c, {out}_q)\n"
                f"    {out} = ({out}_c.to(tl.uint32, bitcast=True) | ({out}_q.to(tl.uint32, "
                f"bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)\n")
    return re.sub(r"(\w+) = fl\.div_shared\((\w+), (\w+), (\w+)\)\n", rewrite, text)


# clamp(-448, 448) before a saturating e4m3 conversion: the conversion saturates to +-448 (and
# keeps NaN) by itself
NO_CLAMP = (r"= tl\.minimum\(tl\.maximum\((\w+), -448\.0, propagate_nan=tl\.PropagateNan\.ALL\), "
            r"448\.0, propagate_nan=tl\.PropagateNan\.ALL\)", r"= \1")


SIGMOID = (r"\(1\.0 / \(1\.0 \+ tl\.exp\(-(\w+)\)\)\)", r"tl.sigmoid(\1)")
# silu's rounding: fl.convert_bf16 since the rounding guard was narrowed (1f94d83)
NO_ROUND = (r"= fl\.(?:round|convert)_bf16\((mul\d+)\)", r"= \1")


def reload(text):
    """The row's input loaded again after the row reduction (from L1 / L2, where the first
    load left it) instead of kept in registers across it: fewer registers per element, so
    more rows in flight per SM (vLLM's fused RMSNorm+quant kernels read their row twice)."""
    lines = text.split("\n")
    first = next(i for i, line in enumerate(lines)
                 if re.match(r"\s+x\d+ = tl\.load\(in\d+ \+ \(cols", line))
    name, rhs = re.match(r"\s+(x\d+) = (.*)$", lines[first]).groups()
    after = next(i for i, line in enumerate(lines) if "fl.rsqrt(" in line)
    tail = [re.sub(rf"\b{name}\b", f"{name}_r", line) for line in lines[after + 1:]]
    # the two loads differ in their eviction hint (kept for the second read, then dropped),
    # which also keeps Triton from merging them into one
    keep = rhs.replace(", other=0)", ", other=0, eviction_policy='evict_last')")
    drop = rhs.replace(", other=0)", ", other=0, eviction_policy='evict_first')")
    assert keep != rhs, rhs
    return "\n".join(lines[:first] + [f"    {name} = {keep}"] + lines[first + 1:after + 1]
                     + [f"    {name}_r = {drop}"] + tail)


def _held_16bit(text, match, raw, reduction):
    """``match`` (a regex whose groups are the line's indent, the variable and its value) made
    ``var_raw = raw(value)``, ``var = var_raw.to(fp32)``; after the line that holds
    ``reduction`` the variable is widened again from ``var_raw`` by a bit shift, which the
    compiler cannot merge with the first widening, so the 16-bit value is what stays live."""
    m = re.search(match, text)
    ind, var, value = m.groups()
    text = text.replace(m.group(0), f"\n{ind}{var}_raw = {raw(value)}\n"
                                    f"{ind}{var} = {var}_raw.to(tl.float32)\n", 1)
    cut = text.index("\n", text.index(reduction)) + 1
    head, tail = text[:cut], text[cut:]
    tail = re.sub(rf"\b{var}\b", f"{var}_late", tail)
    at = tail.rfind("\n", 0, tail.index(f"{var}_late")) + 1
    widen = (f"({var}_raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)"
             ".to(tl.float32, bitcast=True)")
    return head + tail[:at] + f"{ind}{var}_late = {widen}\n" + tail[at:]


def x_bf16(text):
    """The row's input held across the row reduction in its own 16-bit dtype, widened to fp32
    again where it is used after the reduction: half the registers for the row, so more rows
    in flight per SM (the dynamic FP8 kernel: 56 -> 48 registers, 9 -> 10 blocks of 128
    threads; sm_90, CPU)."""
    return _held_16bit(text, r"\n(\s+)(x\d+) = (tl\.load\(in0 \+ [^\n]*?)\.to\(tl\.float32\)\n",
                       lambda load: load, "tl.sum(")


def y_bf16(text):
    """The dynamic FP8 kernel's normalized row (a bf16 product, ``fl.convert_bf16(cast * w)``)
    held across the amax reduction in bf16: with ``x_bf16`` the row takes 64 registers a
    thread, not 256, on one warp (4096 columns, sm_90, CPU: 168 registers and no spills, 12
    rows an SM in flight, no barrier in either reduction)."""
    return _held_16bit(text, r"\n(\s+)(mul\d+) = fl\.convert_bf16\(\((cast\d+ \* x\d+)\)\)\n",
                       lambda product: f"({product}).to(tl.bfloat16)", "fl.row_max(")


def maxnreg(n):
    """ptxas held to ``n`` registers a thread (Triton's ``maxnreg``): more blocks per SM where
    registers bound them (the dynamic FP8 kernel: 56 -> 48 with 6 more instructions and no
    spills, 9 -> 10 blocks of 128 threads; 40: 6 spilled values, 12 blocks; sm_90, CPU)."""
    return (r"num_warps=num_warps\)", f"num_warps=num_warps, maxnreg={n})")


# a row's amax as an integer max of the bit patterns of |y| (non-negative floats order as their
# bits do, NaN above inf, so NaN still wins): the warp's step becomes one REDUX.MAX instruction
# instead of five shuffles and maxes
INT_AMAX = (r'fl\.row_max\(tl\.where\(mask, (\w+), float\("-inf"\)\), 1\)\[:, None\]',
            r"tl.max(tl.where(mask, \1, 0.0).to(tl.int32, bitcast=True), 1)[:, None]"
            r".to(tl.float32, bitcast=True)")


# the row mask a constant True, as where the row count is a multiple of XBLOCK (every anchor
# case): Triton then drops the predicates of the row's loads and stores, as Inductor's kernels
# for static sizes have none (the dynamic FP8 kernel: 437 -> 424 SASS instructions; sm_90, CPU).
# On the GPU no faster (session 18, call 1: the figures under each pattern below)
ROWS_EVEN = (r"rmask = rindex < R\b", "rmask = tl.full([XBLOCK, 1], 1, tl.int1)")


# not candidates: what a row's reductions cost, each replaced by a constant
NO_SUM = (r"tl\.sum\(tl\.where\(mask, \w+, 0\.0\), axis=1\)\[:, None\]",
          "tl.full([XBLOCK, 1], 1.0, tl.float32)")
NO_AMAX = (r"fl\.row_max\(tl\.where\(mask, \w+, float\(\"-inf\"\)\), 1\)\[:, None\]",
           "tl.full([XBLOCK, 1], 1.0, tl.float32)")


SUM_TOP2 = """
@triton.jit
def _sum_top2(s1, m1, a1, n1, z1, s2, m2, a2, n2, z2):
    # (sum, largest |x*w|, its |x|, second largest |x*w|, least nonzero |x|)
    first = m1 >= m2
    least = tl.where((z1 < z2) | (z2 == 0), z1, z2)
    least = tl.where(z1 == 0, z2, least)
    return (s1 + s2, tl.maximum(m1, m2), tl.where(first, a1, a2),
            tl.where(first, tl.maximum(n1, m2), tl.maximum(n2, m1)), least)

"""


def one_pass_amax(fallback=True):
    """The dynamic FP8 kernel's amax taken in the sum's reduction (one cross-warp reduction a
    row instead of two). |y_i| = bf16(bf16(|x_i| r) |w_i|) for the row's rsqrt r. The first pass
    reduces, beside the sum of squares, the largest product |x_i w_i| (M1, exact in fp32: two
    8-bit significands), the |x| that gives it, the second largest (M2) and the least nonzero
    |x|. Each of the three roundings is within 2^-8 (2^-24 for fp32) relatively, so where M2 <
    0.984 M1 (((1 - 2^-8) / (1 + 2^-8))^2 = 0.98444) no other element's |y| can pass the
    argmax's, and the amax is bf16(bf16(a r) * M1 / a), exactly eager's. Otherwise (ties, near
    ties, NaN, values out of the normal range: the bound needs every |x| r normal) the row takes
    the second reduction as generated; a branch uniform over the block."""
    def rewrite(text):
        text = text.replace("@triton.jit(do_not_specialize", SUM_TOP2 + "@triton.jit(do_not_specialize", 1)
        m = re.search(r"\n(\s+)(\w+) = tl\.sum\(tl\.where\(mask, (\w+), 0\.0\), axis=1\)\[:, None\]\n", text)
        ind, mean, sq = m.groups()
        x = re.match(r"\((\w+) \* \1\)", re.search(rf"{sq} = (.*)\n", text).group(1)).group(1)
        text = text.replace(m.group(0), f"""
{ind}t_w = tl.abs(tl.load(in1 + cols, mask=cmask, other=0).to(tl.float32))
{ind}t_a = tl.abs({x})
{ind}t_p = t_a * t_w
{ind}t_p = tl.where(t_p != t_p, float("inf"), t_p)
{ind}{mean}, t_m1, t_a1, t_m2, t_z = tl.reduce((tl.where(mask, {sq}, 0.0), tl.where(mask, t_p, 0.0), t_a, tl.zeros_like(t_p), tl.where(mask, t_a, 0.0)), 1, _sum_top2)
{ind}{mean} = {mean}[:, None]
{ind}t_m1 = t_m1[:, None]
{ind}t_a1 = t_a1[:, None]
{ind}t_m2 = t_m2[:, None]
{ind}t_z = t_z[:, None]
""", 1)
        r = re.search(r"(\w+) = fl\.rsqrt\(", text).group(1)
        m = re.search(r"\n(\s+)(\w+) = fl\.row_max\(tl\.where\(mask, (\w+), float\(\"-inf\"\)\), 1\)\[:, None\]\n", text)
        ind, mx, ab = m.groups()
        guard = ("(t_m2 < t_m1 * 0.984) & (t_m1 >= 1.2e-38) & (t_m1 * " + r + " >= 1e-35) & (t_m1 * "
                 + r + " < 1e38) & (t_a1 * " + r + " < 1e38) & ((t_z * " + r + " >= 1.2e-38) | (t_z == 0))")
        cand = f"tl.abs(fl.convert_bf16(fl.convert_bf16(t_a1 * {r}) * (t_m1 / t_a1)))"
        if fallback:
            body = f"""
{ind}t_ok = tl.min(({guard}).to(tl.int32))
{ind}if t_ok != 0:
{ind}    {mx} = {cand}
{ind}else:
{ind}    {mx} = fl.row_max(tl.where(mask, {ab}, float("-inf")), 1)[:, None]
"""
        else:
            body = f"\n{ind}{mx} = {cand}\n"
        return text.replace(m.group(0), body, 1)
    return rewrite


def streamed(loads=True, stores=True, store_hint="evict_first"):
    """The row's loads and the row-sized stores marked evict-first in L1 and L2 (Triton's
    ``eviction_policy``: ``createpolicy.fractional.L2::evict_first`` and a cache hint on each
    access, sm_90, CPU): the bytes a row kernel reads and writes once displace other lines of
    L2 last. do_bench's flush leaves L2 full of dirty lines; evicting them costs writes.

    ``store_hint="evict_last"`` keeps the written rows in L2 instead (session 40's hypothesis,
    rejected: slower by every measure on both FP8 kernels and add+RMSNorm): the lines written back
    inside the timed call are the flush's and those of ours that L2 cannot hold at the end, so
    the more of the output L2 still holds dirty when the kernel ends, the fewer writes it waits
    for (and a consumer launched next, a GEMM reading the FP8 rows, would find them in L2)."""
    row = r"\(cols \+ \(\d+ \* rindex\)\)"
    subs = []
    if loads:
        subs.append((rf"(tl\.load\(in0 \+ {row}, mask=rmask & cmask, other=0)\)",
                     r'\1, eviction_policy="evict_first")'))
    if stores:
        subs.append((rf"(tl\.store\(out\d+ \+ {row}, .*?, mask=rmask & cmask)\)",
                     rf'\1, eviction_policy="{store_hint}")'))
    return subs


def store_early(text):
    """Each store of a row kernel moved up to just after the line that computes its value (the
    sum h = x + r of add+RMSNorm before the row's reduction, not after it): its write can
    start while the row reduces."""
    lines = text.split("\n")
    for line in list(lines):
        m = re.match(r"\s+tl\.store\(out\d+ \+ .*?, fl\.store_\w+\((\w+)\), ", line)
        if not m:
            continue
        at = next((j for j, ln in enumerate(lines) if re.match(rf"\s+{m.group(1)} = ", ln)), None)
        if at is not None and at + 1 < lines.index(line):
            lines.remove(line)
            lines.insert(at + 1, line)
    return "\n".join(lines)


def persistent(programs: int, stages: int = 0):
    """A fixed grid of ``programs`` programs, each looping over rows with a stride (no block
    launch per row); ``stages`` > 1 asks Triton's software pipeliner to load ahead."""
    def rewrite(text):
        lines = text.split("\n")
        i = next(i for i, line in enumerate(lines) if line.strip().startswith("rindex = pid * XBLOCK"))
        end = next(j for j in range(i, len(lines)) if lines[j].strip() == "" or lines[j].startswith("_COMPILED"))
        loop = (f"tl.range(pid * XBLOCK, R, tl.num_programs(0) * XBLOCK, num_stages={stages})"
                if stages else "range(pid * XBLOCK, R, tl.num_programs(0) * XBLOCK)")
        body = ["    for row0 in " + loop + ":",
                "        rindex = row0 + tl.arange(0, XBLOCK)[:, None]"]
        body += ["    " + line for line in lines[i + 1:end]]
        text = "\n".join(lines[:i] + body + lines[end:])
        return text.replace("grid = (R + XBLOCK - 1) // XBLOCK",
                            f"grid = min((R + XBLOCK - 1) // XBLOCK, {programs})")
    return rewrite


def prefetch(programs: int, hoist: bool = False):
    """A fixed grid of ``programs`` programs looping over rows with a stride, each loading its
    next row (in its own dtype, not yet widened) before it reduces the current one: two rows in
    flight per program, so the loads of one overlap the other's reductions and barriers. The
    weight is loaded per row from L1 unless ``hoist`` (then once per program, in registers)."""
    def rewrite(text):
        lines = text.split("\n")
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("rindex = pid * XBLOCK"))
        end = next(j for j in range(i, len(lines)) if lines[j].strip() == "")
        body = lines[i:end]
        at = next(j for j, ln in enumerate(body)
                  if re.match(r"\s+x1 = tl\.load\(in0 \+ \(cols \+ \((\d+) \* rindex\)\), "
                              r"mask=rmask & cmask, other=0\)\.to\(tl\.float32\)$", ln))
        n = re.search(r"\((\d+) \* rindex\)", body[at]).group(1)
        head = [ln for ln in body[:at] if not re.match(r"\s+(rindex|rmask|mask) = ", ln)]
        load = f"tl.load(in0 + (cols + ({n} * {{r}})), mask=({{r}} < R) & cmask, other=0)"
        out = ["    step = tl.num_programs(0) * XBLOCK",
               "    rindex = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]"] + head + [
               "    nxt = " + load.format(r="rindex"),
               "    for row0 in range(pid * XBLOCK, R, step):",
               "        rindex = row0 + tl.arange(0, XBLOCK)[:, None]",
               "        rmask = rindex < R",
               "        mask = rmask & cmask",
               "        x1 = nxt.to(tl.float32)",
               "        nindex = rindex + step",
               "        nxt = " + load.format(r="nindex")]
        out += ["    " + ln for ln in body[at + 1:]]
        text = "\n".join(lines[:i] + out + lines[end:])
        text = text.replace("grid = (R + XBLOCK - 1) // XBLOCK",
                            f"grid = min((R + XBLOCK - 1) // XBLOCK, {programs})")
        return text.replace("HOIST = few_programs(grid)", f"HOIST = {hoist}")
    return rewrite


_ROW_LOAD = (r"\n(\s+)x1 = tl\.load\(in0 \+ \(cols \+ \((\d+) \* rindex\)\), "
             r"mask=rmask & cmask, other=0\)\.to\(tl\.float32\)\n")


def l2_prefetch(ahead: int, bulk: bool = False):
    """Each program, once it has asked for its own rows, asks L2 for the rows ``ahead`` rows on:
    the rows a program about that many rows later will load (1188 programs of one row are
    resident at once on the H200's 132 SMs). Unlike the register prefetches above, this holds
    no registers and needs no loop, so occupancy and the grid stay as generated. Per 128-byte
    line one ``prefetch.global.L2``; with ``bulk`` one ``cp.async.bulk.prefetch.L2`` (sm_90)
    for the program's row (programs of one row), issued by its first thread. The rows are
    bf16."""
    def rewrite(text):
        m = re.search(_ROW_LOAD, text)
        ind, n = m.group(1), int(m.group(2))
        row0 = f"tl.minimum(pid * XBLOCK + {ahead}, R - XBLOCK)"
        if bulk:
            lines = [f"{ind}pf_at = (tl.full([1], 0, tl.int64) + {n} * {row0}) * 2 + "
                     f"in0.to(tl.int64)",
                     f"{ind}pf_done = tl.inline_asm_elementwise(\"{{ .reg .pred p; .reg .b32 t; "
                     f"mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; @p cp.async.bulk.prefetch.L2."
                     f"global [$1], {2 * n}; mov.u32 $0, 0; }}\", \"=r,l\", "
                     f"[pf_at], dtype=tl.int32, is_pure=False, pack=1)"]
        else:
            lines = [f"{ind}pf_rows = tl.minimum(rindex + {ahead}, R - 1)",
                     f"{ind}pf_at = (in0 + (tl.arange(0, {n // 64})[None, :] * 64 + {n} * pf_rows))"
                     f".to(tl.int64)",
                     f"{ind}pf_done = tl.inline_asm_elementwise(\"prefetch.global.L2 [$1]; "
                     f"mov.u32 $0, 0;\", \"=r,l\", [pf_at], dtype=tl.int32, is_pure=False, "
                     f"pack=1)"]
        return text[:m.end()] + "\n".join(lines) + "\n" + text[m.end():]
    return rewrite


def gluon_fp8(text):
    """The whole module replaced by benchmarks/gluon_fp8.py: the dynamic FP8 kernel written by
    hand in Gluon, two block barriers per row instead of five (sm_90 SASS, CPU)."""
    return (Path(__file__).resolve().parent / "gluon_fp8.py").read_text()


def tma(stages=2, per_sm=0, store=False, warps=4, xblock=1):
    """The whole module replaced by benchmarks/tma_rows.py: the row loaded by TMA into shared
    memory; with ``per_sm`` a persistent grid whose programs keep ``stages`` rows in flight."""
    def rewrite(text):
        t = (Path(__file__).resolve().parent / "tma_rows.py").read_text()
        for name, value in (("STAGES", stages), ("PER_SM", per_sm), ("TMA_STORE", store),
                            ("WARPS", warps), ("XBLOCK", xblock)):
            t = re.sub(rf"^{name} = .*$", f"{name} = {value!r}", t, count=1, flags=re.M)
        return t
    return rewrite


def libdevice_tanh(text):
    """``fl.tanh`` (libdevice's tanhf without its branch, codegen/triton_lib.py) back to
    libdevice's own: the comparison that chose the branch-free form."""
    return text.replace("fl.tanh(", "fl.tanh_libdevice(")


def block(b, w):
    return (r"BLOCK, num_warps = pointwise_settings\(numel, \d+\)", f"BLOCK, num_warps = {b}, {w}")


def rows(x, w):
    return (r"XBLOCK, RBLOCK, looped, num_warps = row_settings\((\w+), (\w+), (\d+)\)",
            rf"XBLOCK, RBLOCK, looped, num_warps = {x}, triton.next_power_of_2(\2), False, {w}")


def looped(rblock, warps):
    """A looped row kernel's loop step and warps."""
    return (r"XBLOCK, RBLOCK, looped, num_warps = row_settings\((\w+), (\w+), (\d+)\)",
            f"XBLOCK, RBLOCK, looped, num_warps = 1, {rblock}, True, {warps}")


def looped_grid(per_sm):
    """A looped kernel (one row a program, ``rindex = pid``) on a fixed grid of ``per_sm``
    programs an SM, each looping over rows with a stride: the rows in flight at once, and so
    what the passes after a row's first read back, bounded (to stay in L2)."""
    def rewrite(text):
        lines = text.split("\n")
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("rindex = pid  #"))
        end = next(j for j in range(i, len(lines)) if lines[j].strip() == "")
        body = ["    for rindex in range(pid, R, tl.num_programs(0)):"]
        body += ["    " + ln for ln in lines[i + 1:end]]
        text = "\n".join(lines[:i] + body + lines[end:])
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return text.replace("grid = (R + XBLOCK - 1) // XBLOCK",
                            f"grid = min((R + XBLOCK - 1) // XBLOCK, {per_sm * sms})")
    return rewrite


def evict_passes(text):
    """A looped kernel's loads before its last pass kept in L2 (evict_last), the last pass's
    loads and the stores streamed (evict_first): the passes after the first then read L2."""
    lines = text.split("\n")
    last = max(i for i, ln in enumerate(lines) if ln.strip() == "off = 0")
    out = []
    for i, ln in enumerate(lines):
        if "tl.load(in" in ln and "rowa + " in ln:
            hint = "evict_first" if i > last else "evict_last"
            ln = re.sub(r"(tl\.load\([^()]*\([^()]*\)[^()]*)\)", rf'\1, eviction_policy="{hint}")', ln)
        elif "tl.store(out" in ln and "rowa + " in ln:
            ln = re.sub(r"\)$", ', eviction_policy="evict_first")', ln)
        out.append(ln)
    return "\n".join(out)


def newgelu(x):
    """Hugging Face's NewGELUActivation (GPT-2's), in the model's dtype op by op."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def bert_gelu(x, b):
    """BERT's MLP activation (exact GELU, erf) after its bias."""
    return torch.nn.functional.gelu(x + b)


EXTRA_CASES = {
    # GPT-2 8 x 512's MLP activation: [4096, 3072] bf16, read and written once
    "newgelu": (newgelu, lambda: (torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16),),
                4096 * 3072 * 2 * 2),
    # BERT 16 x 256's: bias + erf GELU over [4096, 3072] bf16 (`dump --measure` read it at 60%
    # of the floor in session 14, where the cost model predicted 13.5 us against 19.8 measured)
    "bert_gelu": (bert_gelu, lambda: (
        torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16),
        torch.randn(3072, device="cuda", dtype=torch.bfloat16)), (4096 * 3072 * 2 + 3072) * 2),
    # many rows of an odd vocabulary (looped kernels, rows read three times)
    "softmax_vocab": (lambda x: torch.softmax(x, -1), lambda: (
        torch.randn(4096, 50257, device="cuda", dtype=torch.bfloat16),), 4096 * 50257 * 2 * 2),
    "log_softmax_vocab": (lambda x: torch.log_softmax(x, -1), lambda: (
        torch.randn(8192, 30522, device="cuda", dtype=torch.bfloat16),), 8192 * 30522 * 2 * 2),
}

_VOCAB = {
    "4096 w16": [looped(4096, 16)],
    "8192 w32": [looped(8192, 32)],
    "1024 w4": [looped(1024, 4)],
    "evict": [evict_passes],
    "grid 1/SM": [looped_grid(1)],
    "grid 2/SM": [looped_grid(2)],
    "grid 3/SM": [looped_grid(3)],
    "grid 2/SM, evict": [looped_grid(2), evict_passes],
    "grid 1/SM w16, evict": [looped_grid(1), looped(4096, 16), evict_passes],
    "grid 1/SM w32, evict": [looped_grid(1), looped(8192, 32), evict_passes],
    "grid 2/SM w16, evict": [looped_grid(2), looped(4096, 16), evict_passes],
}


VARIANTS = {
    "softmax_vocab": _VOCAB,
    "log_softmax_vocab": _VOCAB,
    "newgelu": {
        "libdevice tanh": [libdevice_tanh],
        "block 4096 w8": [block(4096, 8)],
        "block 1024 w4": [block(1024, 4)],
    },
    "bert_gelu": {
        "block 4096 w8": [block(4096, 8)],
        "block 1024 w4": [block(1024, 4)],
        # not candidates: what the erf and the bias's column index cost
        "erf as identity": [(r"tl\.math\.erf\((\w+)\)", r"\1")],
        "bias at column 0": [(r"\(xindex % 3072\)", "0")],
    },
    "bias_gelu": {
        "loads where used": [loads_where_used],
        "block 4096 w8": [block(4096, 8)],
        "block 1024 w4": [block(1024, 4)],
        "no masks, block 4096 w8": NO_MASK + [block(4096, 8)],
    },
    "swiglu": {
        "block 2048 w4": [block(2048, 4)],
        "block 4096 w8": [block(4096, 8)],
        "block 1024 w4": [block(1024, 4)],
        "no masks": NO_MASK,
        "no masks, block 1024 w4": NO_MASK + [block(1024, 4)],
        "tl.sigmoid": [SIGMOID],
        "loads where used": [loads_where_used],
        # not a candidate (silu's output no longer rounded to bf16 as eager's is): only to see
        # what the rounding costs, since Inductor by default keeps it in fp32
        "fp32 silu": [NO_ROUND],
    },
    "dequant_add": {
        "block 2048 w4": [block(2048, 4)],
        "loads where used": [loads_where_used],
        "block 4096 w8": [block(4096, 8)],
        "block 1024 w4": [block(1024, 4)],
    },
    "softmax_scale": {
        # session 17 call 7 (us): Inductor 999.0, generated 1001.1, no masks 1032.4, no masks
        # 8 rows w8 1014.5, no masks 2 rows w4 1003.2 (the last two the rule's own setting).
        # Session 18 call 1: Inductor 1004.2, generated 1005.4, rows even 1006.5, rows even 1 row
        # w1 1008.7, prefetch 1584 1098.2, prefetch 3696 1 row w1 1085.1
        "rows even": [ROWS_EVEN],
        "rows even, 1 row w1": [ROWS_EVEN, rows(1, 1)],
        # session 28 call 1 (do_bench / kernel, us): generated 1009.6 / 1006.13, evict-first
        # loads 1033.1 / 1029.71, loads and stores 1039.4 / 1036.08 (Inductor 1008.8)
        "evict-first loads and stores": streamed(),
        "evict-first loads": streamed(stores=False),
        # 2 rows on 4 warps: 40 registers (12 blocks an SM); 1 row on 1 warp: 66 (28 blocks)
        "prefetch 1584": [prefetch(1584)],
        "prefetch 3696, 1 row w1": [prefetch(3696), rows(1, 1)],
        # 1584 programs of 2 rows resident: 3168 rows. Session 19 call 1 (do_bench / kernel,
        # us): Inductor 1003.0 / 1006.42, generated 1007.4 / 1001.87, L2 prefetch 1584 1264.5 /
        # 1262.19, 3168 1359.5 / 1355.41, 6336 1382.6 / 1380.18
        "L2 prefetch 1584": [l2_prefetch(1584)],
        "L2 prefetch 3168": [l2_prefetch(3168)],
        "L2 prefetch 6336": [l2_prefetch(6336)],
        # session 20: rows loaded by TMA (benchmarks/tma_rows.py)
        "tma, 2 rows a program": [tma(1, xblock=2)],
        "tma, 1 row w1": [tma(1, warps=1)],
        "tma, 1 row w2": [tma(1, warps=2)],
        "tma, 2 rows w2": [tma(1, warps=2, xblock=2)],
        "tma, 4 rows w8": [tma(1, warps=8, xblock=4)],
        # 2 rows on 4 warps: 40 registers (12 blocks an SM); 1 row on 1 warp: 64 (32)
        "tma, 2 rows, persistent 12/SM, 2 stages": [tma(2, 12, xblock=2)],
        "tma, 2 rows, persistent 12/SM, 3 stages": [tma(3, 12, xblock=2)],
        "tma, 1 row w1, persistent 32/SM, 3 stages": [tma(3, 32, warps=1)],
        "tma, 2 rows, persistent 12/SM, 2 stages, tma store": [tma(2, 12, True, xblock=2)],
        # session 31 call 1 (16 rounds; do_bench least median / kernel median, us): Inductor
        # 1009.4 / 1013.2, generated 1010.3 / 1006.7, 1 row w2 1011.9 / 1008.6, 4 rows w4 1018.5
        # / 1057.8, 4 rows w8 1039.6 / 1036.4, 8 rows w8 1053.1 / 1059.7: the rule's 2 rows on
        # 4 warps stays
        "1 row w2": [rows(1, 2)],
        "4 rows w4": [rows(4, 4)],
        "4 rows w8": [rows(4, 8)],
        "8 rows w8": [rows(8, 8)],
    },
    "add_rmsnorm": {
        # session 40 call 1 (6 rounds; do_bench / kernel / clean flush / back to back, us):
        # generated 132.5 / 129.31 / 128.22 / 129.87, evict-last stores 133.5 / 130.38 / 126.45
        # / 130.78, evict-first loads + evict-last stores 134.8 / 131.60 / 128.74 / 132.08
        "evict-last stores": streamed(loads=False, store_hint="evict_last"),
        "evict-first loads, evict-last stores": streamed(store_hint="evict_last"),
        "w4": [rows(1, 4)],
        "store early": [store_early],
        # 64 registers, 8 blocks of 128 threads an SM; held to 56 (9 blocks): 4 spilled values
        "maxnreg 56": [maxnreg(56)],
    },
    "add_layernorm": {
        "store early": [store_early],
        # 69 registers, 7 blocks of 128 threads an SM; held to 64: 8 blocks, no spills (CPU)
        "maxnreg 64": [maxnreg(64)],
    },
    "rmsnorm_fp8": {
        # session 17, kernel time (us) at 16384 rows. Call 1: generated 49.49, x kept bf16
        # 49.65, w1 55.90, w2 49.94, no sum 48.88. Call 2: generated 49.71, maxnreg 40 54.37,
        # w2 49.97, no sum 48.98. Session 18 call 1 (do_bench / kernel): generated 52.6 / 49.44,
        # rows even 52.6 / 49.18, w2 + rows even 53.9 / 49.81, prefetch 924 55.3 / 51.95,
        # prefetch 1056 + maxnreg 64 55.2 / 52.14. Call 3 (12 rounds, do_bench mean): generated
        # 52.90, w2 53.42, no sum 52.22
        "maxnreg 40": [maxnreg(40)],
        "w2": [rows(1, 2)],
        "rows even": [ROWS_EVEN],
        "w2, rows even": [rows(1, 2), ROWS_EVEN],
        # session 28 call 1 (do_bench / kernel, us): generated 52.5 / 49.20, evict-first
        # loads 53.8 / 50.21, loads and stores 54.6 / 51.36
        "evict-first loads and stores": streamed(),
        "evict-first loads": streamed(stores=False),
        # session 40 call 1 (6 rounds; do_bench / kernel / clean flush / back to back, us):
        # generated 52.8 / 49.60 / 47.17 / 47.81, evict-last stores 54.5 / 51.20 / 47.84 /
        # 49.27, + evict-first loads 56.0 / 52.80 / 48.48 / 52.45, + maxnreg 48 54.5 / 51.20 /
        # 47.81 / 49.26: keeping the output in L2 is slower by every measure
        "evict-last stores": streamed(loads=False, store_hint="evict_last"),
        "evict-first loads, evict-last stores": streamed(store_hint="evict_last"),
        "evict-last stores, maxnreg 48": [*streamed(loads=False, store_hint="evict_last"), maxnreg(48)],
        # 72 registers (7 blocks of 128 threads an SM, 132 SMs); 64: 8 blocks, no spills
        "prefetch 924": [prefetch(924)],
        "prefetch 1056, maxnreg 64": [prefetch(1056), maxnreg(64)],
        "prefetch 8192": [prefetch(8192)],
        "prefetch 8192, maxnreg 64": [prefetch(8192), maxnreg(64)],
        # no registers held (programs of one row: 1188 resident at 9 an SM). Session 19 call 1
        # (do_bench / kernel / back to back, us): generated 53.5 / 49.79 / 47.69, L2 prefetch
        # 594 58.6 / 55.09 / 54.72, 1188 65.5 / 62.48 / 62.45, 2376 81.1 / 80.08 / 72.60, bulk
        # 1188 54.8 / 51.42 / 51.60, bulk 2376 67.2 / 66.61 / 59.60: every prefetch slower, the
        # farther ahead the slower (lines evicted before their row is loaded, so read twice)
        "L2 prefetch 594": [l2_prefetch(594)],
        "L2 prefetch 1188": [l2_prefetch(1188)],
        "L2 prefetch 2376": [l2_prefetch(2376)],
        "L2 bulk prefetch 1188": [l2_prefetch(1188, bulk=True)],
        "L2 bulk prefetch 2376": [l2_prefetch(2376, bulk=True)],
        "no sum (not a candidate)": [NO_SUM],
    },
    "rmsnorm_dynamic_fp8": {
        # session 17, kernel time (us) at 16384 rows. Call 1: generated 51.60, x kept bf16 52.90,
        # w1 62.40, w2 50.82, x kept bf16 + w2 53.06, no amax 49.54, no sum no amax 49.18.
        # Call 2: generated 51.52, x kept bf16 52.59, w2 50.78, int amax 52.00, maxnreg 48 50.75,
        # maxnreg 40 57.60, int amax + maxnreg 48 51.44, int amax + w2 51.65, no amax 49.87.
        # By do_bench none passed the generated kernel by more than 0.3 us. Session 18 call 1
        # (do_bench / kernel): generated 53.2 / 51.28, rows even 53.5 / 51.63, w2 + rows even
        # 53.7 / 51.33, prefetch 924 56.2 / 52.91, prefetch 1056 + maxnreg 64 57.1 / 53.31,
        # prefetch 792 + weight held 56.7 / 52.91. Call 3 (12 rounds; do_bench mean / kernel
        # median): generated 53.77 / 51.64, maxnreg 48 53.56 / 50.92, w2 53.99 / 51.13, no sum no
        # amax 52.49 / 49.34: the kernel without reductions is the ceiling, 91.3% of the floor
        "x kept bf16": [x_bf16],
        "w2": [rows(1, 2)],
        "int amax": [INT_AMAX],
        "maxnreg 48": [maxnreg(48)],
        "maxnreg 40": [maxnreg(40)],
        "int amax, maxnreg 48": [INT_AMAX, maxnreg(48)],
        "int amax, w2": [INT_AMAX, rows(1, 2)],
        "rows even": [ROWS_EVEN],
        "w2, rows even": [rows(1, 2), ROWS_EVEN],
        # 71 registers (7 blocks of 128 threads an SM, 132 SMs); 64: 8 blocks, no spills; the
        # weight held in registers: 80 (6 blocks)
        "prefetch 924": [prefetch(924)],
        "prefetch 1056, maxnreg 64": [prefetch(1056), maxnreg(64)],
        "prefetch 792, weight held": [prefetch(792, hoist=True)],
        # not persistent: 2 (4) rows a program, the second loaded while the first reduces
        "prefetch 8192": [prefetch(8192)],
        "prefetch 4096": [prefetch(4096)],
        "prefetch 8192, maxnreg 64": [prefetch(8192), maxnreg(64)],
        # no registers held (programs of one row: 1188 resident at 9 an SM). Session 19 call 1
        # (do_bench / kernel / back to back, us): generated 54.0 / 51.78 / 48.81, L2 prefetch
        # 594 60.5 / 57.82 / 57.59, 1188 67.0 / 63.68 / 63.79, 2376 83.4 / 80.45 / 73.42, bulk
        # 1188 56.0 / 52.58 / 52.75, bulk 2376 69.4 / 66.50 / 61.19, 1188 held to 56 registers
        # 66.9 / 63.58 / 63.67: every prefetch slower, the farther ahead the slower
        "L2 prefetch 594": [l2_prefetch(594)],
        "L2 prefetch 1188": [l2_prefetch(1188)],
        "L2 prefetch 2376": [l2_prefetch(2376)],
        "L2 bulk prefetch 1188": [l2_prefetch(1188, bulk=True)],
        "L2 bulk prefetch 2376": [l2_prefetch(2376, bulk=True)],
        # the per-line prefetch takes 58 registers (8 blocks an SM); held to 56: 9
        "L2 prefetch 1188, maxnreg 56": [l2_prefetch(1188), maxnreg(56)],
        "no amax (not a candidate)": [NO_AMAX],
        "no sum, no amax (not a candidate)": [NO_SUM, NO_AMAX],
        # 48 registers, 372 SASS instructions, 2 barriers (the generated kernel: 56, 437, 5);
        # its control: the generated kernel with the same two simplifications (a max that drops
        # NaN, the divisor's scaling factor left out), so that the barriers are what differs.
        # Session 18 call 11 (do_bench / mean / kernel, us): generated 53.4 / 53.69 / 51.39,
        # gluon 53.3 / 53.41 / 49.78, control 53.3 / 53.48 / 50.66, no reductions 52.2 / 52.43 /
        # 49.10: by its own time the Gluon kernel is within 0.7 us of the ceiling
        "gluon, two barriers": [gluon_fp8],
        # session 20: rows loaded by TMA (benchmarks/tma_rows.py)
        "tma, a row a program": [tma(stages=1)],
        # 64 registers a thread with 2 stages (8 blocks an SM), 72 with 3 (7), sm_90, CPU
        "tma, persistent 8/SM, 2 stages": [tma(2, 8)],
        "tma, persistent 7/SM, 3 stages": [tma(3, 7)],
        "tma, persistent 4/SM, 3 stages": [tma(3, 4)],
        "tma, persistent 8/SM, 2 stages, tma store": [tma(2, 8, True)],
        # session 28 call 1 (do_bench / kernel, us, 6 rounds): generated 53.3 / 51.38, evict-
        # first loads 54.3 / 51.34, stores 53.3 / 51.28, both 55.0 / 52.16, both + maxnreg 48
        # 55.5 / 52.32, maxnreg 48 alone 53.1 / 50.42. Call 5 (do_bench / after a clean flush,
        # --clean-flush): generated 53.4 / 48.77, maxnreg 48 53.2 / 48.14, gluon 53.2 / 46.94,
        # no reductions 52.2 / 46.13: the faster kernels gain after a clean flush only
        "evict-first loads": streamed(stores=False),
        "evict-first stores": streamed(loads=False),
        # session 40 call 1 (6 rounds; do_bench / kernel / clean flush / back to back, us):
        # generated 53.4 / 51.41 / 49.25 / 48.69, maxnreg 48 53.3 / 50.72 / 48.03 / 48.50,
        # evict-last stores 55.0 / 52.91 / 50.30 / 49.61, + evict-first loads 55.5 / 52.46 /
        # 49.44 / 51.89, + maxnreg 48 55.0 / 52.40 / 49.41 / 49.69: slower by every measure
        "evict-last stores": streamed(loads=False, store_hint="evict_last"),
        "evict-first loads, evict-last stores": streamed(store_hint="evict_last"),
        "evict-last stores, maxnreg 48": [*streamed(loads=False, store_hint="evict_last"), maxnreg(48)],
        "evict-first loads and stores": streamed(),
        "evict-first loads and stores, maxnreg 48": [*streamed(), maxnreg(48)],
        # session 30 (do_bench / kernel / after a clean flush, us; 6 rounds): generated 53.4 /
        # 51.42 / 48.61, maxnreg 48 53.2 / 50.54 / 48.61, one-pass amax 101.8 / 99.49 / 100.77,
        # + maxnreg 48 131.4, no fallback 99.3: a five-value combine in the cross-warp tree
        # costs twice the kernel. Exact against the generated kernel at 37x4096, 5x1000,
        # 64x4096, 1x4096, 129x2048 (ten input kinds), not at 16384x4096 or 300x8192 (its sum
        # of squares is added in another order than tl.sum's): rejected on both counts
        "one-pass amax": [one_pass_amax()],
        "one-pass amax, maxnreg 48": [one_pass_amax(), maxnreg(48)],
        "one-pass amax, no fallback (not a candidate)": [one_pass_amax(False)],
        # session 31: rows on one or two warps (sm_90, CPU: registers / spills / rows in flight
        # an SM): x and y bf16 on one warp 168 / 0 / 12; reload + y bf16 167 / 0 / 12; x, y bf16
        # on two warps held to 80: 80 / 0 / 12; two rows on two warps 168 / 0 / 12. Call 4 (12
        # rounds; do_bench least median / kernel median, us): generated 53.3 / 51.54, maxnreg 48
        # 53.0 / 50.71, one warp 55.4 / 53.36, one warp reloading 63.1 / 62.48, two warps held to
        # 80 53.6 / 51.25, two rows on two warps 64.9 / 62.93, x bf16 + maxnreg 48 54.2 / 52.74,
        # no reductions 52.0 / 49.09: none passes the register cap alone
        "x, y bf16, 1 row w1": [x_bf16, y_bf16, rows(1, 1)],
        "reload, y bf16, 1 row w1": [reload, y_bf16, rows(1, 1)],
        "x, y bf16, w2, maxnreg 80": [x_bf16, y_bf16, rows(1, 2), maxnreg(80)],
        "x, y bf16, 2 rows w2": [x_bf16, y_bf16, rows(2, 2)],
        "x bf16, maxnreg 48": [x_bf16, maxnreg(48)],
        "plain max, no scaling factor (gluon's control)": [
            TL_MAX, (r"fl\.div_shared\((\w+), \w+, (\w+)\)", r"(\1 * \2)")],
    },
}


def load_module(source: str, name: str, folder: Path):
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(out, expected) -> dict:
    """Worst error over the outputs, matched by shape and dtype (a launcher returns them in its
    group's order, not necessarily the function's), and among outputs alike in both (add+RMSNorm's
    sum and norm) by the least error."""
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    worst, exact = 0.0, 1.0
    for e in expected:
        alike = [i for i, o in enumerate(out) if o.shape == e.shape and o.dtype == e.dtype]
        i = min(alike, key=lambda i: (out[i].float() - e.float()).abs().max().item())
        a = out.pop(i)
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            exact = min(exact, (a.view(torch.uint8) == e.view(torch.uint8)).float().mean().item())
        elif a.dtype in (torch.bfloat16, torch.float16):
            exact = min(exact, (a.view(torch.int16) == e.view(torch.int16)).float().mean().item())
        worst = max(worst, (a.float() - e.float()).abs().max().item())
    return {"max_abs_error": worst, "bits_equal": exact}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/variants")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, interleaved; keep the least median")
    ap.add_argument("--rows", type=int, default=16384,
                    help="rows of the anchor patterns (their widths as in patterns.py)")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="only these variants (the generated kernel, fusion and Inductor always)")
    ap.add_argument("--no-eager", action="store_true", help="leave eager out of the timing")
    ap.add_argument("--graph", action="store_true",
                    help="also the GPU's time per call of calls captured in a CUDA graph and run "
                         "back to back, no flush (timing.graph_times: inputs warm in L2, as in a "
                         "model whose kernels feed each other)")
    ap.add_argument("--clean-flush", action="store_true",
                    help="also do_bench's event pair after a flush that leaves L2 clean "
                         "(timing.clean_flush_ms): no write-back of do_bench's dirty lines")
    ap.add_argument("--kernel-time", action="store_true",
                    help="also the kernels' own device time per call after an L2 flush "
                         "(profiler): small sizes, where do_bench's timer and host delays blur")
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_TBps": bw / 1e12, "patterns": {}}
    all_cases = dict(cases(a.rows), **EXTRA_CASES)
    for name, variants in VARIANTS.items():
        if a.only and name not in a.only:
            continue
        fn, make, nbytes = all_cases[name]
        floor_ms = nbytes / bw * 1e3
        args = make()
        expected = fn(*args)
        torch._dynamo.reset()
        with recording() as rec, torch.no_grad():
            compiled = torch.compile(fn, backend="fusion")
            compiled(*args)
        (target,) = rec.targets
        (group,) = target.groups
        placeholders = [n for n in target.gm.graph.nodes if n.op == "placeholder"]
        ins = [args[placeholders.index(n)] for n in group.inputs]
        (kernel,) = target.report.kernels
        source = Path(kernel["path"]).read_text()
        code = [f"# ===== {name}: fusion =====\n{source}"]
        row = {"floor_ms": floor_ms}
        timed = {} if a.no_eager else {"eager": lambda: fn(*args)}
        timed["fusion"] = lambda: compiled(*args)
        torch._dynamo.reset()
        inductor = torch.compile(fn)
        from torch._inductor.utils import run_and_get_code
        _, codes = run_and_get_code(inductor, *args)
        code.append(f"# ===== {name}: inductor =====\n" + "\n\n".join(codes))
        timed["inductor"] = lambda: inductor(*args)
        dev = torch.device("cuda", torch.cuda.current_device())
        chosen = {k: v for k, v in variants.items() if a.variants is None or k in a.variants}
        for vname, subs in {"generated": [], **chosen}.items():
            text = source
            for sub in subs:
                if callable(sub):
                    text = sub(text)
                    continue
                pat, rep = sub
                text, count = re.subn(pat, rep, text)
                if count == 0:
                    print(f"  {name} / {vname}: pattern {pat!r} not found", flush=True)
            try:
                mod = load_module(text, f"v_{name}_{len(timed)}", work)
                got = mod.launch(dev, *ins)
                row.setdefault("errors", {})[vname] = compare(got, expected)
                timed[vname] = (lambda m=mod: m.launch(dev, *ins))
                if vname == "generated":
                    table = next(v for k, v in vars(mod).items() if k.startswith("_COMPILED_"))
                    for *_, compiled_kernel in table.values():      # launch.direct_entry
                        code.append(f"# ===== {name}: fusion PTX =====\n{compiled_kernel.asm['ptx']}")
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row.setdefault("failed", {})[vname] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {name} / {vname}: failed: {e}"[:300], flush=True)
        rounds, means, samples = {}, {}, {}
        # interleaved rounds, a drift hits every label alike (bench.in_turn: every other round
        # in reverse)
        for r in range(a.rounds):
            for label, f in in_turn(timed.items(), r):
                times = do_bench(f, warmup=25, rep=200, return_mode="all")
                rounds.setdefault(label, []).append(statistics.median(times))
                means.setdefault(label, []).append(statistics.fmean(times))
                samples[label] = times
        kernel_us = {}
        for r in range(a.rounds if a.kernel_time else 0):
            for label, f in in_turn(timed.items(), r):
                kernel_us.setdefault(label, []).append(kernel_times(lambda f=f: f(), ())["kernel_us"])
        clean = {}
        for r in range(a.rounds if a.clean_flush else 0):
            for label, f in in_turn(timed.items(), r):
                clean.setdefault(label, []).append(clean_flush_ms(f))
        gcall = {}
        for r in range(a.rounds if a.graph else 0):
            for label, f in in_turn(timed.items(), r):
                gcall.setdefault(label, []).append(graph_times(lambda f=f: f(), ())["graph_call_us"])
        for label, all_ms in rounds.items():
            # the least median of the rounds counts; with several rounds, their median and
            # spread beside it, so that a difference can be told from the rounds' scatter
            ms = min(all_ms)
            # the mean too: at 50 us one kernel's readings form two clusters about 1.5 us apart
            # (session 18), so the median jumps as their shares shift; the mean moves smoothly.
            # The last round's readings are kept, rounded to 10 ns, to show the clusters
            row[label] = {"ms": ms, "pct_floor": 100 * floor_ms / ms, "rounds_ms": all_ms,
                          "mean_ms": min(means[label]), "rounds_mean_ms": means[label],
                          "last_round_us": dict(sorted(Counter(
                              round(t * 1e3, 2) for t in samples[label]).items()))}
            spread = f"  mean {min(means[label]) * 1e3:8.2f}"
            spread += (f"  rounds: median {statistics.median(all_ms) * 1e3:8.1f}, "
                       f"max {max(all_ms) * 1e3:8.1f}" if len(all_ms) > 2 else "")
            kt = ""
            if label in kernel_us:
                row[label].update(kernel_us=min(kernel_us[label]), kernel_rounds_us=kernel_us[label])
                kt = f"  kernel {min(kernel_us[label]):6.2f} us"
                if len(kernel_us[label]) > 2:
                    kt += f" (median {statistics.median(kernel_us[label]):6.2f})"
            if label in clean:
                row[label].update(clean_ms=min(clean[label]), clean_rounds_ms=clean[label])
                kt += (f"  clean flush {min(clean[label]) * 1e3:6.2f} us "
                       f"({100 * floor_ms / min(clean[label]):5.1f}%)")
            if label in gcall:
                row[label].update(gcall_us=min(gcall[label]), gcall_rounds_us=gcall[label])
                kt += f"  back to back {min(gcall[label]):6.2f} us"
            err = row.get("errors", {}).get(label)
            err = (f"  max err {err['max_abs_error']:.3g}, bits equal {100 * err['bits_equal']:.4f}%"
                   if err else "")
            print(f"{name:22s} {label:32s} {ms * 1e3:8.1f} us  {100 * floor_ms / ms:5.1f}% of floor"
                  f"{spread}{kt}{err}", flush=True)
        results["patterns"][name] = row
        with open(out_dir / "code.txt", "a") as f:
            f.write("\n".join(code) + "\n")
        torch.cuda.empty_cache()
    (out_dir / "variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
