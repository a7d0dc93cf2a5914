"""Sweep the launch settings of the generated kernels on the GPU: what block shape and warp
count each pattern kernel runs fastest with, against what codegen/launch.py picks today.

    python benchmarks/sweep_settings.py [--out sweep.json]

The settings functions of codegen/launch.py are replaced by ones that return a forced setting,
so the very kernels the backend generates are timed (do_bench medians). The results feed the
heuristics in launch.py; nothing here is used at run time.
"""
import argparse
import json

import torch
from triton.testing import do_bench

import fusion_compiler.codegen.launch as L
from fusion_compiler import patterns as P

_row, _pw = L.row_settings, L.pointwise_settings
FORCE = {}


def row_settings(rows, n, maxp):
    return FORCE.get("row") or _row(rows, n, maxp)


def pointwise_settings(numel):
    return FORCE.get("pointwise") or _pw(numel)


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
    return [(b, w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8, 16)
            if 32 * w * 2 <= b and b <= 4 * max(numel, 256)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    results = []
    for name, rows, n in CASES:
        if name == "softmax_scale":
            args = (torch.randn(rows, n, device="cuda", dtype=bf),)
        else:
            args = P.make_args(name, rows, n, bf, "cuda")
        torch._dynamo.reset()
        f = torch.compile(P.PATTERNS[name], backend="fusion")
        FORCE.clear()
        f(*args)
        base = do_bench(lambda: f(*args), warmup=10, rep=60, return_mode="median")
        pointwise = name in ("swiglu", "bias_gelu", "dequant_add")
        key = "pointwise" if pointwise else "row"
        default = _pw(rows * n) if pointwise else _row(rows, n, 16384)
        cands = pointwise_candidates(rows * n) if pointwise else row_candidates(rows, n)
        times = {}
        for c in cands:
            FORCE[key] = c
            try:
                f(*args)
                times[str(c)] = do_bench(lambda: f(*args), warmup=10, rep=60, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile
                times[str(c)] = f"error: {type(exc).__name__}"
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        results.append({"pattern": name, "rows": rows, "n": n, "default": str(default),
                        "default_us": base * 1e3, "best": best, "best_us": ok[best] * 1e3,
                        "all_us": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in times.items()}})
        print(f"{name:20s} {rows:6d} x {n:5d}: default {default} {base * 1e3:8.1f}us   "
              f"best {best} {ok[best] * 1e3:8.1f}us", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
