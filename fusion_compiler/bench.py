"""`fusion-compiler bench`: eager vs Inductor vs fusion on the GPU, one table and a JSON file.

For each target and backend: median latency (triton.testing.do_bench: warm-up, then the median
of repeated calls on fresh random inputs; with several backends, the median of ``rounds``
rounds, five by default, that time each backend in turn, and each fusion backend's per-round
difference from the others), speedup over eager, the HBM floor and the fraction of
it reached (patterns), CUDA kernels launched per call (profiler count), cold compile time (first
call) and warm compile time (dynamo reset, kernel caches full), peak memory (reserved, at least the
call's own allocated tensors; and those tensors), and the largest
difference from eager. With ``breakdown=True``, also where one call's GPU time goes
(breakdown.py). A backend that fails on a target (Inductor on transformers' Mamba2, torch 2.11)
gets a row that says so, and the others are timed.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from . import breakdown as BD
from . import patterns as P

# name -> torch.compile arguments (None: eager). "-cg": CUDA graphs (mode="reduce-overhead");
# "fusion-save": training graphs that save every forward value the backward reads instead of
# recomputing the cheap ones (config.backward_recompute off), to compare the two; "fusion-nchw":
# convolution networks in the layout the model gives (config.channels_last off);
# "fusion-atenpool": ATen's max pool, forward and backward (config.max_pool off).
COMPILE_ARGS = {"eager": None, "inductor": {"backend": "inductor"},
                "inductor-cg": {"backend": "inductor", "mode": "reduce-overhead"},
                "fusion": {"backend": "fusion"},
                "fusion-cg": {"backend": "fusion", "mode": "reduce-overhead"},
                "fusion-save": {"backend": "fusion", "options": {"backward_recompute": False}},
                "fusion-nchw": {"backend": "fusion", "options": {"channels_last": False}},
                "fusion-atenpool": {"backend": "fusion", "options": {"max_pool": False}}}
BACKENDS = tuple(COMPILE_ARGS)
DEFAULT_BACKENDS = ("eager", "inductor", "fusion")


def pattern_target(name: str, rows=None, dtype=torch.bfloat16):
    """(fn, make_inputs) for a built-in pattern at its anchor size (or ``rows`` rows)."""
    size = P.ANCHOR_SIZES.get(name)
    if name not in P.PATTERNS or size is None:
        raise KeyError(name)
    r, n = size
    r = rows or r

    def make():
        return P.make_args(name, r, n, dtype, "cuda")
    return P.PATTERNS[name], make


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    if hasattr(out, "to_tuple"):
        return _outputs(out.to_tuple())
    if isinstance(out, dict):
        return [t for o in out.values() for t in _outputs(o)]
    return []


def max_error(out, ref) -> float:
    """Largest |out - ref| over all outputs; NaN where only one side is NaN counts as inf."""
    errs = [0.0]
    for a, b in zip(_outputs(out), _outputs(ref)):
        a, b = a.detach().float(), b.detach().float()
        d = (a - b).abs()
        d = torch.where(a.isnan() & b.isnan(), 0.0, torch.where(d.isnan(), float("inf"), d))
        same_inf = (a == b)      # equal infinities give inf - inf = nan above: no error
        d = torch.where(same_inf, 0.0, d)
        errs.append(d.max().item() if d.numel() else 0.0)
    return max(errs)


def kernels_per_call(fn, args) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()        # work queued before (a timing loop) is not this call's
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(fn, make_inputs, backend: str, mode: str, floor_bytes=None, ref=None,
            breakdown=False):
    """Numbers for one target on one backend: returns (row, eager's outputs or None, the timed
    call for ``interleaved``, a function that profiles the call: kernels per call and, with
    ``breakdown``, GPU time per category)."""
    from triton.testing import do_bench

    # every call in the timed calls' grad mode: grad mode is in Dynamo's guards, so a call with
    # grad on recompiles (Inductor: ~2640 CUDA kernels counted against 138)
    grad = torch.no_grad if mode == "inference" else _null
    torch._dynamo.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held_before = torch.cuda.memory_reserved()      # earlier backends' (kept for interleaved)
    args = make_inputs()
    compile_args = COMPILE_ARGS[backend]
    f = fn if compile_args is None else torch.compile(fn, **compile_args)
    step = _training_step(f, fn) if mode == "training" else (lambda *a: f(*a))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with grad():
        out = step(*args)
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0
    # now: CUDA-graph backends may reuse the output memory in later calls
    err = None if ref is None else max_error(out, ref)
    out = [t.detach().clone() for t in _outputs(out)] if ref is None else None
    warm = None
    if compile_args is not None:
        torch._dynamo.reset()
        f = torch.compile(fn, **compile_args)
        step = _training_step(f, fn) if mode == "training" else (lambda *a: f(*a))
        t0 = time.perf_counter()
        with grad():
            step(*args)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
    fresh = [make_inputs() for _ in range(3)]
    calls = iter(range(1 << 30))

    def call():
        a = fresh[next(calls) % len(fresh)]     # rotate inputs: no cache-resident reruns
        with grad():
            return step(*a)
    ms = do_bench(call, warmup=25, rep=100, return_mode="median")
    # Peak memory: what the process holds from the GPU at most during one call, over what it
    # held before this backend began. Reserved, not allocated, memory: a CUDA graph's private
    # pool stays reserved for its replays, while the allocator counts as free the blocks a
    # graph freed during capture, and Inductor's CUDA-graph trees hand out outputs whose blocks
    # it counts free (GPT-2 8 x 512 on the H200: the process's allocated peak during an
    # inductor-cg call, 636 MB, was below the weights plus eager's reference logits it held,
    # 659 MB). Blocks cached by the compile and the timing are released first; a live graph's
    # pool is not.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated_before = torch.cuda.memory_allocated()
    with grad():
        step(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - held_before
    # beside it, the call's own tensors: allocated memory over what was allocated before the
    # call, without the allocator's rounding to segments (a tensor of 1-10 MB takes a segment
    # of 20 MB). It undercounts CUDA-graph backends, whose pools the allocator counts free.
    peak_allocated = torch.cuda.max_memory_allocated() - allocated_before
    # An earlier backend's segments that a live tensor keeps reserved (empty_cache cannot give
    # them back) serve this call's blocks without new reserves: Mamba2's training step after
    # eager's (49 GB) counted 10 MB. The call's own tensors are a floor under it.
    peak = max(peak, peak_allocated)

    def profile() -> dict:
        """Kernels per call and (``breakdown``) GPU time per category, from the profiler: run
        after every timing, since a profiler session slows later calls in the same process
        (GPT-2 with fusion on the H200: 2.54 -> 3.81 ms per call, do_bench)."""
        with grad():
            step(*args)         # Dynamo recompiles what a later target's reset cleared
            found = {"kernels_per_call": kernels_per_call(step, args)}
        if breakdown:
            with grad():
                kernels = BD.profile_call(step, args)
            # a pattern's floor (inference) is its fused kernels' floor when they do all its work
            whole = "floor_ms" in row and mode == "inference" and BD.all_fused(kernels)
            found["breakdown"] = BD.summarize(kernels, row["floor_ms"] * 1e3 if whole else None)
        return found

    row = {"backend": backend, "ms": ms, "cold_compile_s": cold, "warm_compile_s": warm,
           "peak_mem_bytes": peak, "peak_allocated_bytes": peak_allocated,
           "max_err_vs_eager": err}
    if floor_bytes:
        row["floor_ms"] = floor_bytes / _copy_bandwidth() * 1e3
        row["frac_of_floor"] = row["floor_ms"] / ms
    return row, out, call, profile


ROUNDS = 5


def in_turn(items, r: int) -> list:
    """``items`` in order in round ``r``, reversed every other round: timed in turns this way,
    no item always comes right after the same one (in session 17 a kernel timed right after
    eager's long run read 1.2-2.0 points of the floor under the same kernel timed later)."""
    items = list(items)
    return items[::-1] if r % 2 else items


def interleaved(calls: dict, rounds: int = ROUNDS) -> dict:
    """backend -> the median latency (ms) of ``rounds`` rounds, each timing every backend in
    turn (``do_bench`` medians, the order reversed every other round), so a drift of the host's
    speed or the GPU's clocks during the run falls on all backends alike: on the H200 host,
    eager's time for one model moved 5-12 ms between runs."""
    from triton.testing import do_bench

    for call in calls.values():     # Dynamo recompiles what later backends' resets cleared
        call()
    torch.cuda.synchronize()
    times = {b: [] for b in calls}
    for r in range(rounds):
        for b, call in in_turn(calls.items(), r):
            times[b].append(do_bench(call, warmup=5, rep=40, return_mode="median"))
    return times


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _training_step(f, model):
    """forward, backward of a mean-square loss over the outputs that need grad, and (for a
    module) an SGD step with zeroed gradients: a whole training step. The module stays in the
    mode it came in (the examples' factories build it in eval(): no dropout)."""
    params = [p for p in model.parameters() if p.requires_grad] if isinstance(
        model, torch.nn.Module) else []
    opt = torch.optim.SGD(params, lr=1e-6, foreach=True) if params else None

    def step(*args):
        out = f(*args)
        loss = sum(t.float().square().mean() for t in _outputs(out) if t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out
    return step


_BW = []


def _copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, measured once per process."""
    if not _BW:
        from triton.testing import do_bench
        a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
        _BW.append(2 * a.numel() * 2 / (ms * 1e-3))
    return _BW[0]


def paired(times: dict) -> dict:
    """Each fusion backend against each other backend (plain fusion also against the other fusion
    variants), round by round: ``times`` maps a backend
    to its interleaved rounds' latencies (ms). Returns {fusion backend: {other: {"median_diff_ms",
    "median_diff_frac", "faster_rounds", "rounds"}}}: the median of the rounds' differences
    (negative: fusion faster), the same over the other's median, and in how many rounds fusion
    was the faster. A round's two timings sit seconds apart, so a drift of the GPU's clock
    between rounds (a GEMM-bound model on the H200 moved 6.0-7.4 ms between rounds, session 40)
    falls on both; the medians of the two columns alone do not tell a 2% lead from that noise."""
    out = {}
    for f in (b for b in times if b.startswith("fusion")):
        # plain fusion also against its variants (fusion-nchw, fusion-atenpool, fusion-save,
        # fusion-cg)
        for o in (b for b in times if not b.startswith("fusion") or f == "fusion" != b):
            d = [x - y for x, y in zip(times[f], times[o])]
            if not d:
                continue
            med = statistics.median(d)
            out.setdefault(f, {})[o] = {"median_diff_ms": med,
                                        "median_diff_frac": med / statistics.median(times[o]),
                                        "faster_rounds": sum(x < 0 for x in d), "rounds": len(d)}
    return out


def format_paired(results) -> str:
    """A line per target and pair of backends from ``paired``, under the main table."""
    lines = []
    for name, rows in results["targets"].items():
        for f, row in rows.items():
            for o, p in row.get("paired", {}).items():
                lines.append(f"{name}: {f} - {o} per round: median "
                             f"{p['median_diff_ms'] * 1e3:+.1f}us ({p['median_diff_frac']:+.1%}), "
                             f"{f} faster in {p['faster_rounds']} of {p['rounds']} rounds")
    return "\n".join(lines)


def run(targets, backends=DEFAULT_BACKENDS, mode="inference", out_path=None, progress=sys.stderr,
        breakdown=False, rounds=ROUNDS):
    """Benchmark ``targets`` [(name, fn, make_inputs, is_pattern)], timing the backends in
    ``rounds`` interleaved rounds; print a table (and with ``breakdown``, a GPU time breakdown
    per target and backend), return rows."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench times kernels on a CUDA GPU and none is visible")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    results = {"copy_TBps": _copy_bandwidth() / 1e12, "mode": mode, "targets": {}}
    total = len(targets) * len(backends)
    done, profiling = 0, []
    for name, fn, make, is_pattern in targets:
        floor = None
        if is_pattern:
            args = make()
            floor = P.floor_bytes(name, args, fn(*args))
        ref, rows, calls, profiles = None, {}, {}, {}
        # training steps change the weights: every backend starts from the same ones
        start = ({k: v.detach().clone() for k, v in fn.state_dict().items()}
                 if mode == "training" and isinstance(fn, torch.nn.Module) else None)
        for backend in backends:
            done += 1
            print(f"[{done}/{total}] {name}: {backend}", file=progress, flush=True)
            if start is not None:
                fn.load_state_dict(start)
            try:
                row, out, call, profiles[backend] = measure(fn, make, backend, mode, floor, ref,
                                                            breakdown)
            except Exception as exc:    # noqa: BLE001 - the other backends are still timed
                if isinstance(exc, torch.cuda.OutOfMemoryError) or len(backends) == 1:
                    raise
                rows[backend] = {"failed": failure(exc)}
                print(f"{name}: {backend} failed: {rows[backend]['failed']}", file=progress,
                      flush=True)
                continue
            if backend == "eager":
                ref = out
            rows[backend] = row
            if call is not None:
                calls[backend] = call
        if len(calls) > 1:
            print(f"{name}: {rounds} interleaved timing rounds", file=progress, flush=True)
            times = interleaved(calls, rounds)
            for backend, ms in times.items():
                row = rows[backend]
                row["ms_alone"], row["ms_rounds"] = row["ms"], ms
                row["ms"] = sorted(ms)[len(ms) // 2]
                if "floor_ms" in row:
                    row["frac_of_floor"] = row["floor_ms"] / row["ms"]
            for backend, against in paired(times).items():
                rows[backend]["paired"] = against
        eager_ms = rows.get("eager", {}).get("ms")
        for row in rows.values():
            if "failed" not in row:
                row["speedup_vs_eager"] = eager_ms / row["ms"] if eager_ms else None
        results["targets"][name] = rows
        profiling.append((rows, profiles))
    # last, once every target is timed: a profiler session slows the process's later calls
    for rows, profiles in profiling:
        for backend, row in rows.items():
            if backend in profiles:
                row.update(profiles[backend]())
    print(format_table(results))
    pairs = format_paired(results)
    if pairs:
        print(pairs)
    if breakdown:
        print("\n" + BD.format_tables(results["targets"]))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    return results


def failure(exc: BaseException) -> str:
    """A backend's failure on one line: its type and the first line of its message (Inductor's
    own errors wrap the cause: ``InductorError: TypeError: ...``)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def failed(results) -> list:
    """(target, backend) pairs that failed, from ``run``'s results."""
    return [(n, b) for n, rows in results["targets"].items() for b, r in rows.items()
            if "failed" in r]


def format_table(results) -> str:
    lines = [f"copy bandwidth {results['copy_TBps']:.2f} TB/s, mode {results['mode']}",
             f"{'target':24s} {'backend':9s} {'median':>10s} {'speedup':>8s} {'floor %':>8s} "
             f"{'kernels':>8s} {'cold s':>7s} {'warm s':>7s} {'peak MB':>8s} {'alloc MB':>8s} "
             f"{'max err':>9s}"]
    for name, rows in results["targets"].items():
        for b, r in rows.items():
            if "failed" in r:
                lines.append(f"{name:24s} {b:9s} failed: {r['failed']}")
                continue
            floor = f"{r['frac_of_floor']:.0%}" if "frac_of_floor" in r else "-"
            warm = f"{r['warm_compile_s']:.2f}" if r["warm_compile_s"] is not None else "-"
            err = f"{r['max_err_vs_eager']:.2g}" if r["max_err_vs_eager"] is not None else "-"
            alloc = r.get("peak_allocated_bytes")
            alloc = f"{alloc / 2**20:.0f}" if alloc is not None else "-"
            speedup = r["speedup_vs_eager"]     # None: eager not timed
            speedup = f"{speedup:7.2f}x" if speedup is not None else "       -"
            lines.append(f"{name:24s} {b:9s} {r['ms'] * 1e3:8.1f}us {speedup} "
                         f"{floor:>8s} {r['kernels_per_call']:8d} {r['cold_compile_s']:7.2f} "
                         f"{warm:>7s} {r['peak_mem_bytes'] / 2**20:8.0f} {alloc:>8s} {err:>9s}")
    return "\n".join(lines)
