"""`fusion-compiler calibrate`: measure the cost model's device numbers on this GPU and store them.

    copy bandwidth    a 1 GiB device-to-device copy (bytes read + written) / time
    launch overhead   time per launch of a one-element generated kernel (``x + 1``), launched back
                      to back through the backend's own launcher (host and device cost, as
                      ``dump --measure`` times kernels: the same batches, the least of rounds
                      seconds apart); per further output, from the same with three outputs;
                      per further input, from a sum of nine inputs
    kernel latency    GPU time per such kernel with the host out of the way (queued behind a
                      GPU sleep)
    peak FLOP/s       an 8192^3 bf16 matmul (the fp32 vector rate is taken as 1/16 of it)

The profile is written as JSON under the cache folder, named after the GPU; later compiles on a
GPU of that name use it (``passes.cost_model.resolve_profile``).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .passes.cost_model import DeviceProfile


def profile_path(cache_dir: Path, device_name: str) -> Path:
    safe = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return Path(cache_dir) / "profiles" / f"{safe}.json"


def measure(device: str = "cuda") -> DeviceProfile:
    """Measure this GPU. Needs CUDA."""
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        raise RuntimeError("calibrate needs a CUDA GPU; none is visible")
    from .measure import spin_up

    spin_up()
    bandwidth = _copy_bandwidth(device, do_bench)

    launch, per_output, per_input = launch_overhead(device)
    latency = kernel_latency(device)

    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = do_bench(lambda: m @ m, warmup=25, rep=100, return_mode="median")
    mm_flops = 2 * 8192 ** 3 / (ms * 1e-3)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return DeviceProfile(torch.cuda.get_device_name(), bandwidth, launch, mm_flops / 16,
                         per_output, latency, per_input, l2)


def launch_overhead(device: str = "cuda", rounds: int = 5) -> tuple[float, float, float]:
    """(seconds per launch, per further output, per further input): tiny generated kernels with
    one input and one output, three outputs, nine inputs, each launched back to back through
    its launcher, in batches of as many launches as ``dump --measure`` makes of a kernel this
    small (``measure.copies_for``). Each is measured ``rounds`` times, the rounds seconds apart,
    and the least counts, as ``dump --measure`` takes its measurements (the host's speed is not
    steady: ``measure.measure_graph``)."""
    from .measure import copies_for, steady_seconds

    kinds = [_tiny_launcher(lambda x: x + 1, device),
             _tiny_launcher(lambda x: (x + 1, x * 3, x - 2), device),
             _tiny_launcher(lambda *xs: sum(xs[1:], xs[0]), device, inputs=9)]
    device_type = torch.device(device).type
    best = [float("inf")] * len(kinds)
    for _ in range(rounds):
        for k, (launch, xs) in enumerate(kinds):
            t = steady_seconds(lambda i: launch(*xs), copies_for(xs, device_type), device_type)
            best[k] = min(best[k], t)
    one, three, nine = best
    return one, max(three - one, 0.0) / 2, max(nine - one, 0.0) / 8


def kernel_latency(device: str = "cuda", launches: int = 500) -> float:
    """GPU seconds per tiny kernel when the host is not the limit: the launches are queued
    behind a GPU sleep long enough for the host to enqueue them all, and timed from an event
    recorded after the sleep, so the time is the GPU's alone."""
    launch, (x,) = _tiny_launcher(lambda x: x + 1, device)
    cycles = 100_000_000        # ~50 ms at ~2 GHz: far longer than enqueueing the launches

    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()                  # runs when the sleep ends, before the queued launches
        for _ in range(launches):
            launch(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / launches

    timed()                                           # warm-up
    return sorted(timed() for _ in range(3))[1]


def _tiny_launcher(fn, device: str, inputs: int = 1):
    """(launcher, inputs) of ``fn`` compiled for one-element tensors: it must be one kernel."""
    from .measure import recording

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusion", dynamic=False)
    xs = tuple(torch.randn(1, device=device) for _ in range(inputs))
    with recording() as rec, torch.no_grad():
        compiled(*xs)
    torch._dynamo.reset()
    launchers = [launch for t in rec.targets for launch in t.launchers.values()]
    if len(launchers) != 1:
        raise RuntimeError(f"calibrate: expected one generated kernel, got {len(launchers)}")
    return launchers[0], xs


def _copy_bandwidth(device, do_bench) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def calibrate(cache_dir: Path) -> tuple[DeviceProfile, Path]:
    profile = measure()
    path = profile_path(cache_dir, profile.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=1))
    return profile, path
