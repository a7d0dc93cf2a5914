"""`fusion-compiler bench --breakdown`: where one call's GPU time goes, from a profiler trace.

Every kernel (and copy, and memset) of one profiled call falls into one category by its name
(``RULES``, first match wins):

    gemm       matmuls and convolutions: cuBLAS/cuBLASLt, CUTLASS, _scaled_mm, Inductor templates
    attention  FlashAttention, PyTorch's memory-efficient attention, cuDNN SDPA, flex attention
    fused      generated kernels: ours (codegen/render.py), Inductor's `triton_*`
    aten       the rest: ATen's elementwise, reduction and copy kernels, memcpy, memset
    gaps       GPU idle time between the call's first kernel start and its last kernel end

The times are per category over the call's GPU span (first start to last end), so that the
shares add up to 100%:

    stream 1:  [gemm ]  [fused]      [aten]
    stream 2:     [attn]
    time:      |---------- span ----------|
    gaps:                      ^^^^^^
    a stretch where k kernels run together counts 1/k of its length for each of them

Time before the first kernel (guards, Python, the first launch) is not in the span: the median
latency of the main table includes it, this table does not. The profiler itself slows the host
down a little, so the gaps are an upper bound on the gaps of an unprofiled call.

The bytes a kernel moves are not in a trace, so % of the bandwidth floor is only reported for
the fused category, and only when the caller knows the floor time of the fused kernels (bench:
a pattern in inference whose every kernel is fused, so the pattern's floor is theirs).
"""
from __future__ import annotations

import re
from typing import NamedTuple

# (category, pattern): matched in order against the lowercase demangled kernel name
RULES = (
    # ours: codegen/render.py names every generated kernel one of these (split stages too)
    ("fused", r"^_(pointwise|persistent|resident|looped|split\d+)_kernel$"),
    # Inductor: templates first (max-autotune matmuls, flex attention), then what it fused;
    # its names carry the ATen ops, so `triton_poi_fused__scaled_dot_product_..._attention` is
    # a pointwise kernel, not attention
    ("attention", r"^triton_tem_.*(attention|flex)"),
    ("gemm", r"^triton_tem_"),
    ("fused", r"^triton_"),
    # before gemm: fmha_cutlassF_* is attention written with CUTLASS. Not `fprop`: cuDNN names
    # convolutions `..._xmma_fprop_implicit_gemm_...` too
    ("attention", r"flash|fmha|attention|sdpa"),
    # cuBLAS (sm90_xmma_gemm_*, nvjet_*, gemv*, splitKreduce), CUTLASS, Triton's matmul_kernel,
    # mm / bmm / _scaled_mm as a word (not the `mm` of `comm`)
    ("gemm", r"gemm|gemv|cutlass|xmma|cublas|nvjet|splitkreduce|matmul"
             r"|(^|[^a-z])b?mm([^a-z]|$)"),
)
_COMPILED = tuple((cat, re.compile(pattern)) for cat, pattern in RULES)
DEFAULT = "aten"
CATEGORIES = ("gemm", "attention", "fused", "aten", "gaps")


class Kernel(NamedTuple):
    """One GPU activity of a trace, times in microseconds."""
    name: str
    start_us: float
    duration_us: float


def category(name: str) -> str:
    """The category of a kernel name (``RULES``; anything unmatched is ``aten``)."""
    low = name.lower()
    return next((cat for cat, pattern in _COMPILED if pattern.search(low)), DEFAULT)


def all_fused(kernels) -> bool:
    """True when every kernel of the call is a fused one: then the fused kernels do all of the
    call's work, and the floor of the whole call is theirs."""
    return bool(kernels) and all(category(k.name) == "fused" for k in kernels)


def summarize(kernels, fused_floor_us: float | None = None) -> dict:
    """Per category: time (us), share of the call's GPU span, kernel count, and for ``fused``
    the fraction of its floor reached when ``fused_floor_us`` (the time the fused kernels' bytes
    take at copy bandwidth) is given; None where unknown."""
    kernels = list(kernels)
    own, busy = _attribute(kernels)
    span = (max(k.start_us + k.duration_us for k in kernels) - min(k.start_us for k in kernels)
            if kernels else 0.0)
    rows = {cat: {"us": 0.0, "kernels": 0} for cat in CATEGORIES}
    for k, t in zip(kernels, own):
        row = rows[category(k.name)]
        row["us"] += t
        row["kernels"] += 1
    rows["gaps"]["us"] = max(span - busy, 0.0)
    for row in rows.values():
        row["share"] = row["us"] / span if span > 0 else 0.0
        row["floor_frac"] = None
    fused_us = rows["fused"]["us"]
    if fused_floor_us is not None and fused_us > 0:
        rows["fused"]["floor_frac"] = fused_floor_us / fused_us
    return {"span_us": span, "busy_us": busy, "kernels": len(kernels), "categories": rows}


def _attribute(kernels):
    """(time per kernel, union of all intervals): a sweep over the starts and ends in which
    each stretch is split evenly among the kernels running during it."""
    timed = [(i, k) for i, k in enumerate(kernels) if k.duration_us > 0]   # an instant: no time
    edges = sorted([(k.start_us + k.duration_us, 0, i) for i, k in timed]
                   + [(k.start_us, 1, i) for i, k in timed])   # at a tie, ends before starts
    own = [0.0] * len(kernels)
    running: set[int] = set()
    busy, last = 0.0, None
    for t, is_start, i in edges:
        if running and t > last:
            part = (t - last) / len(running)
            for j in running:
                own[j] += part
            busy += t - last
        last = t
        if is_start:
            running.add(i)
        else:
            running.discard(i)
    return own, busy


def profile_call(fn, args) -> list[Kernel]:
    """The GPU activities of one call of ``fn(*args)`` (kernels, copies, memsets), from a
    profiler trace. One profiled call runs first and is thrown away (the profiler schedule's
    warm-up step): the first records of a trace are slower."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    traces = []
    with profile(activities=[ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=lambda p: traces.append(list(p.events()))) as prof:
        for _ in range(2):
            fn(*args)
            torch.cuda.synchronize()
            prof.step()
    if not traces:
        raise RuntimeError("the profiler returned no trace for the --breakdown call; run "
                           "without --breakdown, or check that CUPTI works (torch.profiler)")
    return [Kernel(e.name, e.time_range.start, e.time_range.elapsed_us())
            for e in traces[0] if e.device_type.name == "CUDA"]


def format_table(target: str, backend: str, breakdown: dict) -> str:
    """One breakdown as a small table: a row per category."""
    fused = "fused" if backend == "eager" else f"fused ({backend})"
    lines = [f"{target} / {backend}: GPU span {breakdown['span_us']:.1f}us, "
             f"{breakdown['kernels']} kernels",
             f"  {'category':22s} {'us':>10s} {'share':>7s} {'kernels':>8s} {'floor %':>8s}"]
    for cat, row in breakdown["categories"].items():
        floor = f"{row['floor_frac']:.0%}" if row["floor_frac"] is not None else "-"
        label = fused if cat == "fused" else cat
        lines.append(f"  {label:22s} {row['us']:10.1f} {row['share']:7.1%} {row['kernels']:8d} "
                     f"{floor:>8s}")
    return "\n".join(lines)


def format_tables(targets: dict) -> str:
    """A table per target and backend of bench's results that has a breakdown."""
    return "\n\n".join(format_table(name, backend, row["breakdown"])
                       for name, rows in targets.items()
                       for backend, row in rows.items() if "breakdown" in row)
