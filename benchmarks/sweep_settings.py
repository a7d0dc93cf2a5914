"""Sweep the launch settings of the generated kernels on the GPU: what block shape and warp
count each pattern kernel runs fastest with, against what codegen/launch.py picks today.

    python benchmarks/sweep_settings.py [--cases add_rmsnorm:64:4096 ...] [--out sweep.json]

``--cases`` picks cases as PATTERN:ROWS:N (default: the list below). Each case is also compiled
by Inductor and timed in the same run, and Inductor's chosen launch configurations are printed
(block sizes, warps, stages; from its autotuners), so a miss against Inductor can be read off
as a settings difference or not. ``--kernel-time`` times every setting, and Inductor, by the
kernel's own device time from the profiler (each call after an L2 flush) instead of do_bench
medians, which host delays move at small sizes. ``--warm`` times them by the GPU's time per
call of calls captured back to back in a CUDA graph (timing.graph_times): inputs left in L2 by
the call before, as in a model whose layers feed each other, and no host in the way.

The settings functions of codegen/launch.py are replaced by ones that return a forced setting,
so the very kernels the backend generates are timed. The results feed the
heuristics in launch.py; nothing here is used at run time.
"""
import argparse
import gc
import json
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")     # before torch is imported

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import graph_times, kernel_times  # noqa: E402

import fusion_compiler.codegen.launch as L
from fusion_compiler import patterns as P

_row, _pw = L.row_settings, L.pointwise_settings
FORCE = {}
CHOSEN = {}     # what launch.py's own rule returned on the last call, by kind


def row_settings(rows, n, maxp):
    CHOSEN["row"] = _row(rows, n, maxp)
    return FORCE.get("row") or CHOSEN["row"]


def pointwise_settings(numel, stream_bytes=2):
    CHOSEN["pointwise"] = _pw(numel, stream_bytes)
    return FORCE.get("pointwise") or CHOSEN["pointwise"]


L.row_settings, L.pointwise_settings = row_settings, pointwise_settings

bf = torch.bfloat16
CASES = [  # (pattern, rows, n)
    ("add_rmsnorm", 16384, 4096), ("add_rmsnorm", 512, 4096), ("add_rmsnorm", 64, 4096),
    ("add_rmsnorm", 1, 4096), ("add_rmsnorm", 4096, 8192), ("add_rmsnorm", 2048, 16384),
    ("add_rmsnorm", 16384, 2048), ("add_rmsnorm", 4096, 1024),
    ("add_layernorm", 16384, 4096), ("rmsnorm_fp8", 16384, 4096),
    ("rmsnorm_dynamic_fp8", 16384, 4096), ("rmsnorm_dynamic_fp8", 64, 4096),
    ("softmax_scale", 262144, 1024), ("softmax_scale", 16384, 4096),
    ("swiglu", 16384, 11008), ("swiglu", 64, 11008), ("bias_gelu", 16384, 11008),
    ("dequant_add", 16384, 4096), ("swiglu", 1, 11008),
]


def row_candidates(rows, n):
    rb = 1 << max(n - 1, 0).bit_length()
    out = []
    for xb in (1, 2, 4, 8, 16):
        if xb * rb > 16384 or xb > max(1, rows):
            continue
        for w in (1, 2, 4, 8, 16, 32):
            if 32 * w <= xb * rb // 2 or w == 1:
                out.append((xb, rb, False, w))
    return out


def pointwise_candidates(numel):
    return [(b, w) for b in (128, 256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8, 16)
            if 32 * w * 2 <= b and b <= 4 * max(numel, 256)]


SEEN = set()


def inductor_configs():
    """Launch configurations Inductor's autotuners settled on, by kernel name (those not
    reported for an earlier case)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    out = {}
    for obj in gc.get_objects():
        try:                    # weak proxies among the objects raise once their referent died
            found = isinstance(obj, CachingAutotuner) and obj.launchers and id(obj) not in SEEN
        except ReferenceError:
            continue
        if found:
            SEEN.add(id(obj))
            c = obj.launchers[0].config
            out[obj.fn.__name__] = {"kwargs": dict(c.kwargs), "num_warps": c.num_warps,
                                    "num_stages": c.num_stages, "choices": len(obj.launchers)}
    return out


def parse_case(text):
    name, rows, n = text.split(":")
    return name, int(rows), int(n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cases", nargs="*", type=parse_case, default=CASES)
    ap.add_argument("--kernel-time", action="store_true",
                    help="time each setting by its kernel's device time (profiler) instead of "
                         "do_bench: small cases, where host delays move do_bench medians")
    ap.add_argument("--warm", action="store_true",
                    help="time each setting by the GPU's time per call of captured calls back "
                         "to back (CUDA graph, no L2 flush)")
    a = ap.parse_args()

    def time_ms(fn, args):
        if a.warm:
            return graph_times(fn, args)["graph_call_us"] / 1e3
        if a.kernel_time:
            return kernel_times(fn, args)["kernel_us"] / 1e3
        return do_bench(lambda: fn(*args), warmup=10, rep=60, return_mode="median")
    results = []
    for name, rows, n in a.cases:
        if name == "softmax_scale":
            args = (torch.randn(rows, n, device="cuda", dtype=bf),)
        else:
            args = P.make_args(name, rows, n, bf, "cuda")
        torch._dynamo.reset()
        ind = torch.compile(P.PATTERNS[name])
        ind(*args)
        ind_us = time_ms(ind, args) * 1e3
        ind_cfg = inductor_configs()
        f = torch.compile(P.PATTERNS[name], backend="fusion")
        FORCE.clear()
        f(*args)
        base = time_ms(f, args)
        pointwise = name in ("swiglu", "bias_gelu", "dequant_add")
        key = "pointwise" if pointwise else "row"
        default = CHOSEN[key]           # the rule's setting, with the kernel's own arguments
        cands = pointwise_candidates(rows * n) if pointwise else row_candidates(rows, n)
        times = {}
        for c in cands:
            FORCE[key] = c
            try:
                f(*args)
                times[str(c)] = time_ms(f, args)
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile
                times[str(c)] = f"error: {type(exc).__name__}"
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        FORCE.clear()
        results.append({"pattern": name, "rows": rows, "n": n, "default": str(default),
                        "default_us": base * 1e3, "best": best, "best_us": ok[best] * 1e3,
                        "inductor_us": ind_us, "inductor_configs": ind_cfg,
                        "all_us": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in times.items()}})
        print(f"{name:20s} {rows:6d} x {n:5d}: default {default} {base * 1e3:8.1f}us   "
              f"best {best} {ok[best] * 1e3:8.1f}us   inductor {ind_us:8.1f}us {ind_cfg}", flush=True)
        print("    all (us): " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in ok.items()), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
