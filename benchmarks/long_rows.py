"""Few long rows on the GPU: eager vs Inductor vs fusion, and fusion with its rows split across
programs turned off (one program a row, the looped kernel) and with no row held in registers
(``fusion_looped``: the looped kernel where the resident one would run), against the HBM floor (read the
input, write the output; cross-entropy: read the logits), bf16, do_bench medians (least of two turns).

    python benchmarks/long_rows.py [--out results.json] [--only NAME...] [--profile]
                                   [--variants PER_SM[:RBLOCK:WARPS]...] [--force-resident]

``--variants``: also fusion with the split rule aiming at PER_SM programs per SM (with loop
steps of RBLOCK columns on WARPS warps). ``--profile``: for
each backend, the host time a call (calls back to back) and one call's kernels after an L2
flush (torch.profiler): each kernel's time and the span from the first start to the last end.

Cases: GroupNorm + SiLU at the batch-1 shapes of Stable Diffusion's VAE decoder (32 groups: 32
rows of 65536 to 1048576 elements) and UNet (32 rows of 40960 and 20480), and the UNet's at
batch 8 (256 rows); softmax over a vocabulary (GPT-2's 50257, Llama 3's 128256) for 1 and 8
rows, as a sampler takes it; and many rows of an odd vocabulary (GPT-2's 50257, BERT's 30522),
whose rows are not 16-byte aligned: softmax, log_softmax, and cross-entropy over fp32 logits;
and LayerNorm over rows of 32768; RMSNorm, add+RMSNorm and add+LayerNorm over rows of about
50000 (the resident kernel's register estimate: held, held, not held).
"""
import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")     # before torch is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patterns import bench, copy_bandwidth  # noqa: E402

from fusion_compiler.bench import in_turn  # noqa: E402
from fusion_compiler.patterns import add_layernorm, add_rmsnorm, rmsnorm  # noqa: E402
from fusion_compiler.codegen import launch  # noqa: E402

bf = torch.bfloat16


def gn_silu(x, w, b):
    return F.silu(F.group_norm(x, 32, w, b, eps=1e-5))


def softmax(x):
    return torch.softmax(x, dim=-1)


def log_softmax(x):
    return torch.log_softmax(x, dim=-1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def cross_entropy(x, t):
    return F.cross_entropy(x.float(), t)


def _norm(fn, shape, vectors, residual=False):
    """A norm over rows of ``shape`` with ``vectors`` weights (and a residual add)."""
    def make():
        rows = [torch.randn(shape, device="cuda", dtype=bf) for _ in range(1 + residual)]
        return (*rows, *(torch.randn(shape[1], device="cuda", dtype=bf) for _ in range(vectors)))
    return fn, make, shape, (4 + 4 * residual) * shape[0] * shape[1]


# each case: (function, its inputs, its rows (R, N), the bytes that must move)
def _gn(shape):
    def make():
        return (torch.randn(shape, device="cuda", dtype=bf),
                torch.randn(shape[1], device="cuda", dtype=bf),
                torch.randn(shape[1], device="cuda", dtype=bf))
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    return gn_silu, make, (32 * shape[0], numel // (32 * shape[0])), 2 * 2 * numel


def _sm(shape, fn=softmax):
    return (fn, lambda: (torch.randn(shape, device="cuda", dtype=bf),), shape,
            2 * 2 * shape[0] * shape[1])


def _ce(shape):
    def make():
        return (torch.randn(shape, device="cuda", dtype=bf),
                torch.randint(0, shape[1], (shape[0],), device="cuda"))
    return cross_entropy, make, shape, 2 * shape[0] * shape[1]


CASES = {
    "gn_vae_512x64x64": _gn((1, 512, 64, 64)),
    "gn_vae_512x128x128": _gn((1, 512, 128, 128)),
    "gn_vae_256x256x256": _gn((1, 256, 256, 256)),
    "gn_vae_128x512x512": _gn((1, 128, 512, 512)),
    "gn_unet_320x64x64": _gn((1, 320, 64, 64)),
    "gn_unet_640x32x32": _gn((1, 640, 32, 32)),
    "gn_unet8_320x64x64": _gn((8, 320, 64, 64)),
    "gn_unet8_640x32x32": _gn((8, 640, 32, 32)),
    "softmax_1x50257": _sm((1, 50257)),
    "softmax_1x128256": _sm((1, 128256)),
    "softmax_8x128256": _sm((8, 128256)),
    # many rows of a vocabulary whose length is odd (GPT-2's, BERT's): unaligned rows
    "softmax_4096x50257": _sm((4096, 50257)),
    "log_softmax_8192x30522": _sm((8192, 30522), log_softmax),
    "cross_entropy_4096x50257": _ce((4096, 50257)),
    # a row longer than a program holds, with a weight and a bias
    "layer_norm_2048x32768": (layer_norm, lambda: (
        torch.randn(2048, 32768, device="cuda", dtype=bf),
        torch.randn(32768, device="cuda", dtype=bf), torch.randn(32768, device="cuda", dtype=bf)),
        (2048, 32768), 2 * 2 * 2048 * 32768),
    # rows a resident kernel holds (or not: add+LayerNorm's values exceed its registers)
    "rms_norm_1024x50257": _norm(rmsnorm, (1024, 50257), 1),
    "add_rms_norm_1024x50000": _norm(add_rmsnorm, (1024, 50000), 1, True),
    "add_layer_norm_1024x50000": _norm(add_layernorm, (1024, 50000), 2, True),
}


class _Split:
    """The split rule's settings while timing: ``per_sm`` programs per SM (0: one program a
    row), and where given the loop's step and the warps; or ``values``, launch's settings."""

    def __init__(self, per_sm=None, rblock=None, warps=None, values=None):
        self.values = dict(values or {})
        if per_sm is not None:
            self.values["SPLIT_PROGRAMS_PER_SM"] = per_sm
        if rblock:
            self.values["SPLIT_RBLOCK"] = rblock
        if warps:
            self.values["SPLIT_WARPS"] = warps

    def __enter__(self):
        self.saved = {k: getattr(launch, k) for k in self.values}
        for k, v in self.values.items():
            setattr(launch, k, v)
        launch.split_settings.cache_clear()

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(launch, k, v)
        launch.split_settings.cache_clear()


def max_error(out, expected) -> float:
    """The largest difference between ``out`` and ``expected``, a tensor or a tuple of them."""
    pairs = zip(out, expected) if isinstance(expected, tuple) else [(out, expected)]
    return max((a.float() - e.float()).abs().max().item() for a, e in pairs)


def profile_call(f, args, calls: int = 5) -> dict:
    """Host time a call (200 calls back to back), and the kernels of a call after an L2 flush:
    each kernel's median time over ``calls`` profiled calls, and their sum."""
    import statistics
    import time

    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        f(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        f(*args)
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    flush = torch.empty(1 << 28, dtype=torch.int8, device="cuda")
    times = {}
    for _ in range(calls):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f(*args)
            torch.cuda.synchronize()
        ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type.name == "CUDA")
        for i, (a, b, name) in enumerate(ks):
            times.setdefault(f"{i}:{name[:28]}", []).append(b - a)
    kernels = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"host_us": host, "kernels": kernels, "kernel_us": round(sum(kernels.values()), 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--variants", nargs="*", default=[],
                    help="also time fusion with these split settings, each PER_SM[:RBLOCK:WARPS]")
    ap.add_argument("--force-resident", action="store_true",
                    help="also time fusion with the resident kernel wherever a row fits its "
                         "length, its registers' estimate aside (fusion_forced)")
    ap.add_argument("--profile", action="store_true",
                    help="host time a call and one call's kernels of each fusion variant")
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_TBps": bw / 1e12, "cases": {}}
    for case, (fn, make, rows, nbytes) in CASES.items():
        if a.only and case not in a.only:
            continue
        args = make()
        floor = nbytes / bw * 1e3
        torch._dynamo.reset()
        fused = torch.compile(fn, backend="fusion")
        # the rows streamed by the looped kernel, not held by the resident one
        looped = torch.compile(lambda *xs: fn(*xs), backend="fusion",
                               options={"max_resident_row": 0})
        fns = {"eager": fn, "inductor": torch.compile(fn), "fusion": fused,
               "fusion_nosplit": fused, "fusion_looped": looped}
        settings = {"fusion_nosplit": _Split(0)}
        if a.force_resident:    # held whatever its registers (compiled on its first call)
            fns["fusion_forced"] = torch.compile(lambda *xs: fn(*xs), backend="fusion")
            settings["fusion_forced"] = _Split(values={"RESIDENT_VALUES": 1000})
        for v in a.variants:
            fns[f"fusion_{v}"] = fused
            settings[f"fusion_{v}"] = _Split(*map(int, v.split(":")))
        expected = fn(*args)
        row = {"floor_ms": floor, "rows_n": rows, "split": launch.split_settings(*rows)}
        for name, f in fns.items():
            with settings.get(name, contextlib.nullcontext()):
                row[f"{name}_max_err"] = max_error(f(*args), expected)
        for r in range(2):
            for name, f in in_turn(fns.items(), r):
                with settings.get(name, contextlib.nullcontext()):
                    ms, _ = bench(f, args)
                row.setdefault(f"{name}_rounds_ms", []).append(ms)
        for name in fns:
            row[f"{name}_ms"] = min(row[f"{name}_rounds_ms"])
        if a.profile:
            for name, f in fns.items():
                if name != "fusion_nosplit" or row["split"] is not None:
                    with settings.get(name, contextlib.nullcontext()):
                        row[f"{name}_profile"] = p = profile_call(f, args)
                    print(f"  {name:18s} host {p['host_us']:6.1f}us  kernels {p['kernel_us']:7.1f}us"
                          f"  {p['kernels']}", flush=True)
        results["cases"][case] = row
        print(f"{case:20s} {rows} split {(row['split'] or ())[:2]} floor {floor * 1e3:7.1f}us  " + "  ".join(
            f"{n} {row[f'{n}_ms'] * 1e3:7.1f}us ({floor / row[f'{n}_ms']:.0%}, err "
            f"{row[f'{n}_max_err']:.3g})" for n in fns), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
