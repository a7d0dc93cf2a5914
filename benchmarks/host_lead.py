"""Does do_bench's figure hold host time? The dynamic FP8 pattern timed as do_bench times it,
and again with the host far ahead of the GPU (GPU).

    python benchmarks/host_lead.py [--rounds N]

do_bench records its start event after the flush and before the call; if the host enqueued the
call's kernel late, the GPU would idle between the two and the idle time would count. Each call
(fusion, Inductor, eager's ``x.to(fp8)`` of the same bytes) is timed four ways, us, the median of
200 event pairs after do_bench's flush: as do_bench loops; with every launch queued behind a
1 s GPU sleep first (the host can be late for none); with a 10 us and a 100 us GPU spin between
the flush and the start event. Also the host's own time per loop step.

Session 31 (H200): fusion 53.0-53.8 us every way (host 38 us a step against the GPU's ~115),
Inductor 108.8-110.5, eager 65.2-65.7: the figure is the GPU's; nothing is waiting on the host.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import FLUSH_BYTES  # noqa: E402

from fusion_compiler import patterns as P  # noqa: E402


def loop(f, cache, n, pre_sleep=0, gap_sleep=0):
    """(median us between the event pair, host us a step) of ``n`` flushed calls of ``f``."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    torch.cuda.synchronize()
    if pre_sleep:
        torch.cuda._sleep(pre_sleep)
    t0 = time.perf_counter()
    for start, end in events:
        cache.zero_()
        if gap_sleep:
            torch.cuda._sleep(gap_sleep)
        start.record()
        f()
        end.record()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events), host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    x = torch.randn(16384, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    q = torch.empty(16384, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    fused = torch.compile(P.rmsnorm_dynamic_fp8, backend="fusion")
    fused(x, w)
    torch._dynamo.reset()
    inductor = torch.compile(P.rmsnorm_dynamic_fp8)
    inductor(x, w)
    calls = {"fusion": lambda: fused(x, w), "inductor": lambda: inductor(x, w),
             "eager x.to(fp8)": lambda: q.copy_(x)}
    for f in calls.values():       # the fusion call recompiles after Inductor's dynamo.reset()
        for _ in range(10):
            f()
    for r in range(a.rounds):
        for name, f in calls.items():
            plain, host = loop(f, cache, 200)
            ahead, _ = loop(f, cache, 200, pre_sleep=int(2e9))     # ~1 s at the H200's clock
            spin10, _ = loop(f, cache, 200, gap_sleep=int(2e4))
            spin100, _ = loop(f, cache, 200, gap_sleep=int(2e5))
            db = do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3
            print(f"{r} {name:16s} do_bench {db:7.2f}  loop {plain:7.2f} (host {host:5.1f} us a "
                  f"step)  host ahead {ahead:7.2f}  spin 10 us {spin10:7.2f}  spin 100 us "
                  f"{spin100:7.2f}", flush=True)


if __name__ == "__main__":
    main()
