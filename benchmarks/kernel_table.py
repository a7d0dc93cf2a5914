"""Where each backend's GPU time goes, kernel by kernel, for one model call (GPU).

    python benchmarks/kernel_table.py examples/gpt2.py:bench_8x512 [--backends inductor fusion]
    python benchmarks/kernel_table.py benchmarks/hf_zoo.py:resnet50_128_train --mode training
    python benchmarks/kernel_table.py benchmarks/hf_zoo.py:mamba2_4x1024 --backends fusion --groups

For each backend: one profiled call after warm-up (torch.profiler, CUDA activity), the CUDA
kernels grouped by name with their count and total GPU time, the largest first, and the call's
wall time (host) beside the sum of kernel times (GPU busy). ``bench --breakdown`` sorts the same
profile into categories; this shows the kernels themselves (which attention kernel SDPA picked,
which GEMMs, which fused kernels). ``--groups``: fusion's kernels by group instead (its
``profile_ranges`` option: each launch in a range ``fc#<id> <label>``, the ids `dump` shows),
the slowest first, since the generated kernels share a few names (``_persistent_kernel``),
each with the bytes its kernel moves (its source's header) and the % of the floor those bytes
take at the copy bandwidth measured in the same run: what is left to win, group by group.
"""
import argparse
import collections
import time

import torch

import fusion_compiler
from fusion_compiler.codegen.render import bytes_moved

from fusion_compiler.targets import load_factory


def group_bytes(reports) -> dict:
    """``fc#<id>`` -> the bytes the group's kernel moves (read + written, its source's header),
    for each compiled group whose sizes are static."""
    found = {}
    for r in reports:
        for k in r.kernels:
            with open(k["path"]) as f:
                nbytes = bytes_moved(f.read())
            if nbytes is not None:
                found[f"fc#{k['group']}"] = nbytes
    return found


def table(target: str, backend: str, top: int, mode: str = "inference",
          groups: bool = False) -> None:
    """``mode="training"``: each call is bench's training step (forward, backward, SGD).
    ``groups``: fusion's kernels timed per fused group (``profile_ranges``)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from fusion_compiler.bench import _copy_bandwidth, _training_step

    torch._dynamo.reset()
    model, inputs = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
    options = {"profile_ranges": True} if groups and backend == "fusion" else None
    f = model if backend == "eager" else torch.compile(model, backend=backend, options=options)
    if mode == "training":
        f = _training_step(f, model)
    with torch.no_grad() if mode == "inference" else contextlib.nullcontext():
        with fusion_compiler.capture_compiles() as reports:
            for _ in range(5):
                f(*inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            f(*inputs)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 20 * 1e6
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if options else [])
        with profile(activities=activities) as prof:
            f(*inputs)
            torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and not e.name.startswith("fc#"):   # not a range's span
            k = kernels[e.name[:90]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    busy = sum(v[1] for v in kernels.values())
    print(f"\n== {target} / {backend}: {wall:.0f} us per call (host, 20 calls), "
          f"{busy:.0f} us of kernels, {sum(v[0] for v in kernels.values())} kernels", flush=True)
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us:8.1f} us {n:4d}x  {name}")
    if options:
        # each range is two events: the host's (its calls; its device time is 0, the kernels
        # are not its children) and the GPU's span from its first kernel's start to its last's
        # end (the profiler's gpu_user_annotation)
        by_group = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.name.startswith("fc#"):
                if e.device_type.name == "CUDA":
                    by_group[e.name][0] += e.device_time_total
                else:
                    by_group[e.name][1] += 1
        ranges = sorted(((us, n, name) for name, (us, n) in by_group.items()), reverse=True)
        moved = group_bytes(reports)
        bw = _copy_bandwidth()
        print(f"  by fused group ({len(ranges)} groups, {sum(r[0] for r in ranges):.0f} us; "
              f"`fusion-compiler dump` names them; floor at {bw / 1e12:.2f} TB/s):")
        for us, n, name in ranges[:top]:
            nbytes = moved.get(name.split(" ")[0])
            floor = "" if nbytes is None or not us else \
                f"  {nbytes * n / 1e6:8.1f} MB  {100 * nbytes * n / bw / (us * 1e-6):5.1f}% of floor"
            print(f"  {us:8.1f} us {n:4d}x{floor}  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--backends", nargs="+", default=["eager", "inductor", "fusion"])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--mode", choices=["inference", "training"], default="inference")
    ap.add_argument("--groups", action="store_true",
                    help="fusion's kernel time per fused group, as `dump` numbers them")
    a = ap.parse_args()
    for b in a.backends:
        table(a.target, b, a.top, a.mode, a.groups)


if __name__ == "__main__":
    main()
