"""Row kernels over strided rows: how many rows a program should take (GPU).

    python benchmarks/strided_rows.py [--out FILE]

ConvNeXt's LayerNorm normalises the channels of an NCHW tensor (``layer_norm(x.permute(0, 2,
3, 1), (C,))``): a row's elements lie H*W apart and consecutive rows side by side, so a program
of XBLOCK rows reads each column as a run of XBLOCK elements. For ConvNeXt-T's four stages at
batch 32 (bf16), the fused kernel is timed at each (XBLOCK, warps) setting by rebinding its
module's ``row_settings`` (as the autotuner does), beside eager and Inductor: do_bench medians,
L2 flushed, and % of the HBM floor (x read, the output written, over the copy bandwidth
measured here). The rule's setting is marked ``rule``; ``launch.STRIDED_ROWS`` comes from here.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patterns import copy_bandwidth  # noqa: E402

from fusion_compiler.codegen import launch as L  # noqa: E402
from fusion_compiler.measure import recording  # noqa: E402

SHAPES = [(32, 96, 56, 56), (32, 192, 28, 28), (32, 384, 14, 14), (32, 768, 7, 7)]


def norm(x, w, b):
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), w, b, 1e-6)


def median_us(f):
    return statistics.median(do_bench(f, warmup=25, rep=100, return_mode="all")) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_TBps": bw / 1e12, "shapes": {}}
    for shape in SHAPES:
        n, c, h, w_ = shape
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        floor_us = 2 * x.numel() * 2 / bw * 1e6
        expected = norm(x, w, b)
        torch._dynamo.reset()
        with recording() as rec, torch.no_grad():
            fused = torch.compile(norm, backend="fusion")
            fused(x, w, b)
        (target,) = rec.targets
        (launch,) = target.launchers.values()
        module = getattr(launch, "func", launch).__globals__     # a partial binding DEVICE
        rows, rblock = n * h * w_, L._next_pow2(c)
        rule = module["row_settings"](rows, c, 16384, module.get("STRIDED", False))
        times = {"eager": median_us(lambda: norm(x, w, b))}
        torch._dynamo.reset()
        inductor = torch.compile(norm)
        inductor(x, w, b)
        times["inductor"] = median_us(lambda: inductor(x, w, b))
        original = module["row_settings"]
        settings = {}
        for xb in (L.row_settings(rows, c, 16384)[0], 8, 16, 32, 64, 128):
            for warps in (4, 8, 16):
                if xb * rblock <= 32768 and (xb, warps) not in settings:
                    settings[(xb, warps)] = (xb, rblock, False, warps)
        for (xb, warps), s in settings.items():
            module["row_settings"] = lambda *args, s=s: s
            out = fused(x, w, b)
            err = (out.float() - expected.float()).abs().max().item()
            label = f"x{xb} w{warps}" + (" rule" if s == rule else "")
            times[label] = median_us(lambda: fused(x, w, b))
            times[label + " err"] = err
        module["row_settings"] = original
        row = {k: v for k, v in times.items() if not k.endswith(" err")}
        best = min((k for k in row if k.startswith("x")), key=row.get)
        print(f"{str(shape):22s} floor {floor_us:7.1f} us  eager {row['eager']:7.1f}  inductor "
              f"{row['inductor']:7.1f} ({100 * floor_us / row['inductor']:.0f}%)  best {best} "
              f"{row[best]:7.1f} ({100 * floor_us / row[best]:.0f}%)", flush=True)
        print("    " + "  ".join(f"{k} {v:.1f}" for k, v in row.items() if k.startswith("x")),
              flush=True)
        results["shapes"][str(shape)] = {"floor_us": floor_us, "us": times, "rule": list(rule)}
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
