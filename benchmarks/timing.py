"""GPU timing helpers the benchmark scripts share, besides ``triton.testing.do_bench``.

do_bench's median is the measure of record (the issues' targets are stated in it). It is an
event pair around one call, after a 256 MB L2 flush; so it holds the call's kernels and, on
the GPU, whatever separates the flush from the first kernel and the last kernel from the end
event. These helpers take that apart:

  kernel_times      the kernels' own device time per call, after the same flush, from the
                    profiler; and the gap from the flush's end to the call's first kernel
  call_us           wall time per call of many calls back to back: the host's launch path
                    and the kernels together, as a launch-bound model sees them
  graph_times       the call captured in CUDA graphs, so that the host is out of the picture:
                    do_bench of one captured call (flush and events as do_bench's own), and the
                    GPU's time per call of many captured calls back to back
  clean_flush_ms    do_bench's event pair and median, with the flush made by a read of the
                    same 256 MB instead of do_bench's zero_: L2 then holds clean lines, and
                    nothing is left for the memory system to write back while the call runs.
                    On the H200 (session 28) do_bench's dirty flush cost the dynamic FP8
                    kernel 4.5 us of its 54 (49.6 us clean), a 1 GiB copy 3 us of 505
"""
from __future__ import annotations

import statistics
import time

import torch

FLUSH_BYTES = 256 << 20             # what do_bench zeroes between calls
_FLUSH_NAMES = ("fill", "memset")   # the flush's kernel (zero_), as the profiler names it


def _is_flush(name: str) -> bool:
    name = name.lower()
    return any(w in name for w in _FLUSH_NAMES)


def flushed_times(f, flush, reps: int = 200, warmup: int = 20) -> list:
    """ms of each of ``reps`` calls of ``f()`` between two events, each call after ``flush()``
    (do_bench's event pair, with the flush given)."""
    for _ in range(warmup):
        flush()
        f()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush()
        start.record()
        f()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def clean_flush(cache: torch.Tensor):
    """A flush of ``cache``'s bytes out of L2 that leaves clean lines: a sum over it."""
    out = torch.empty((), dtype=cache.dtype, device=cache.device)
    return lambda: torch.sum(cache, dim=0, out=out)


def clean_flush_ms(f, reps: int = 200, warmup: int = 20) -> float:
    """Median ms of ``f()`` between two events, each call after a 256 MB L2 flush that leaves
    clean lines (a sum over the buffer, where do_bench zeroes it)."""
    cache = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    return statistics.median(flushed_times(f, clean_flush(cache), reps, warmup))


def kernel_times(f, args, calls: int = 30) -> dict:
    """Device timeline of ``calls`` calls of ``f``, each after an L2 flush as in do_bench,
    from the profiler: medians over the calls of the kernels' summed device time (``kernel_us``),
    of the time from the flush's end to the call's last kernel end (``span_us``) and to its
    first kernel start (``lead_us``), and the kernels per call."""
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    f(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            f(*args)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    per_call, current = [], None
    for e in events:
        if _is_flush(e.name):
            current = {"flush_end": e.time_range.end, "kernels": []}
            per_call.append(current)
        elif current is not None:
            current["kernels"].append(e)
    per_call = [c for c in per_call if c["kernels"]]
    if not per_call:
        return {"kernel_us": float("nan"), "span_us": float("nan"), "lead_us": float("nan"),
                "kernels": 0}
    med = statistics.median
    return {
        "kernel_us": med(sum(k.time_range.elapsed_us() for k in c["kernels"]) for c in per_call),
        "span_us": med(max(k.time_range.end for k in c["kernels"]) - c["flush_end"]
                       for c in per_call),
        "lead_us": med(c["kernels"][0].time_range.start - c["flush_end"] for c in per_call),
        "kernels": round(med(len(c["kernels"]) for c in per_call)),
    }


def call_us(f, args, calls: int = 200) -> float:
    """Wall time per call (us) of ``calls`` calls back to back, no flush, then one sync: the
    host's launch path and the kernels together; whichever is longer sets the pace."""
    f(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _capture(f, args, calls: int):
    """A CUDA graph of ``calls`` calls of ``f`` (warmed up on a side stream first, as capture
    requires), or None where the call cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                f(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                f(*args)
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured reads NaN
        print(f"  (not captured: {type(e).__name__}: {e})"[:200], flush=True)
        torch.cuda.synchronize()
        return None
    return graph


def graph_times(f, args, calls: int = 20) -> dict:
    """``graph_us``: do_bench's median over the replay of a graph holding one call (the L2 flush
    and the event pair as for the call itself; the host's launch path replaced by one graph
    launch, which the GPU runs on its own). ``graph_call_us``: the GPU's time per call of
    ``calls`` captured calls back to back, no flush (the least of 5 event pairs, each around
    10 replays). NaN where the call cannot be captured."""
    from triton.testing import do_bench
    one, many = _capture(f, args, 1), _capture(f, args, calls)
    if one is None or many is None:
        return {"graph_us": float("nan"), "graph_call_us": float("nan")}
    graph_us = 1e3 * do_bench(one.replay, warmup=25, rep=100, return_mode="median")
    many.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            many.replay()
        end.record()
        end.synchronize()
        per_call.append(1e3 * start.elapsed_time(end) / (10 * calls))
    return {"graph_us": graph_us, "graph_call_us": min(per_call)}
