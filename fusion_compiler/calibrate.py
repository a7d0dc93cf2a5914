"""`fusion-compiler calibrate`: measure the cost model's device numbers on this GPU and store them.

    copy bandwidth    a 1 GiB device-to-device copy (bytes read + written) / time
    launch overhead   time per launch of an empty Triton kernel, back to back
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
    import triton
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        raise RuntimeError("calibrate needs a CUDA GPU; none is visible")
    bandwidth = _copy_bandwidth(device, do_bench)

    # no annotations here: under `from __future__ import annotations` Triton evaluates them in
    # this module's globals, where `tl` (imported in this function) is unknown
    @triton.jit
    def _empty_kernel(x_ptr):
        pass

    x = torch.empty(1, device=device)
    _empty_kernel[(1,)](x)
    torch.cuda.synchronize()
    reps = 2000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        _empty_kernel[(1,)](x)
    end.record()
    torch.cuda.synchronize()
    launch = start.elapsed_time(end) * 1e-3 / reps

    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = do_bench(lambda: m @ m, warmup=25, rep=100, return_mode="median")
    mm_flops = 2 * 8192 ** 3 / (ms * 1e-3)
    return DeviceProfile(torch.cuda.get_device_name(), bandwidth, launch, mm_flops / 16)


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
