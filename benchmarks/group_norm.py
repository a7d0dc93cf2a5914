"""GroupNorm + SiLU (a UNet's ResNet block) on the GPU: eager vs Inductor vs fusion against the
HBM floor (read x, write the output), bf16, do_bench medians (least of two turns).

    python benchmarks/group_norm.py [--out results.json]

Shapes: Stable Diffusion 1.5's UNet at 512 x 512 (batch 8, 32 groups): 320 channels at 64 x 64,
640 at 32 x 32, 1280 at 16 x 16; and the VAE decoder's 512 channels at 128 x 128, batch 1.
"""
import argparse
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

SHAPES = [(8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (1, 512, 128, 128)]


def gn_silu(x, w, b):
    return F.silu(F.group_norm(x, 32, w, b, eps=1e-5))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_TBps": bw / 1e12, "cases": {}}
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(shape[1], device="cuda", dtype=torch.bfloat16)
        b = torch.randn(shape[1], device="cuda", dtype=torch.bfloat16)
        floor = 2 * x.numel() * 2 / bw * 1e3
        torch._dynamo.reset()
        fns = {"eager": gn_silu, "inductor": torch.compile(gn_silu),
               "fusion": torch.compile(gn_silu, backend="fusion")}
        expected = gn_silu(x, w, b).float()
        row = {"floor_ms": floor}
        for name, f in fns.items():
            err = (f(x, w, b).float() - expected).abs().max().item()
            row[f"{name}_max_err"] = err
        for r in range(2):
            for name, f in in_turn(fns.items(), r):
                ms, _ = bench(f, (x, w, b))
                row.setdefault(f"{name}_rounds_ms", []).append(ms)
        for name in fns:
            row[f"{name}_ms"] = min(row[f"{name}_rounds_ms"])
        results["cases"][str(shape)] = row
        print(f"{str(shape):22s} floor {floor * 1e3:7.1f}us  " + "  ".join(
            f"{n} {row[f'{n}_ms'] * 1e3:7.1f}us ({floor / row[f'{n}_ms']:.0%}, err "
            f"{row[f'{n}_max_err']:.3g})" for n in fns), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
