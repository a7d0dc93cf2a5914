"""Row kernels over tiles of rows: which tile and how many warps (GPU; values only on the CPU).

    python benchmarks/row_tiles.py [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/row_tiles.py      # CPU: each plan's values, small

Mamba2's segment-sum kernels (transformers 5.17's PyTorch path) hold rows of 256 columns and
read their largest operand along one row dim (h) while writing along another (l): a tiled row
kernel (codegen/tiles.py, ``row_plan``) takes ``XT`` values of l by ``XBLOCK // XT`` of h a
program. Session 67 (H100) timed the plan's 8 x 4 at 40-49% of the floor, and 16 x 4 and 32
x 4 slower, in the step and alone; a tile of more h per program (longer loads) and the warps
were not tried. Each plan here is made by the tiles module's constants, each setting of warps
by rebinding the kernel module's ``row_settings`` (as the autotuner does); do_bench medians,
L2 flushed, % of the floor (the kernel's bytes over the copy bandwidth measured here), beside
Inductor and eager, and each plan's largest error against fp64.

Cases, fp32 as in the model: ``segsum`` stores ``G * exp(segment_sum(A))`` as [b, c, h, l, s]
(s contiguous) from G [b, c, l, s, h] (h contiguous): the forward's product; ``segsum2`` also
stores ``exp(segment_sum(A))`` itself, as the training forward does.
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import segment_sum  # noqa: E402

from fusion_compiler.codegen import tiles  # noqa: E402
from fusion_compiler.measure import recording  # noqa: E402

GPU = torch.cuda.is_available()
# (label, ROW_SECTOR, ROW_MIN_YT, ROW_ELEMS_MAX): XT = ROW_SECTOR / 4 bytes of l, and at least
# ROW_MIN_YT of h (the launcher's least XBLOCK is their product; rows of 256 columns)
PLANS = [("8 x 4 (default)", 32, 4, 8192), ("8 x 8", 32, 8, 16384), ("8 x 16", 32, 16, 32768),
         ("16 x 4", 64, 4, 16384), ("16 x 8", 64, 8, 32768), ("32 x 4", 128, 4, 32768),
         ("off", None, None, None)]
WARPS = (4, 8, 16) if GPU else (None,)


def segsum(A, G):
    L = torch.exp(segment_sum(A))                       # [b, h, c, l, s]
    return (G * L.permute(0, 2, 3, 4, 1)).permute(0, 1, 4, 2, 3).contiguous()


def segsum2(A, G):
    L = torch.exp(segment_sum(A))
    return L.contiguous(), (G * L.permute(0, 2, 3, 4, 1)).permute(0, 1, 4, 2, 3).contiguous()


def median_us(f):
    from triton.testing import do_bench
    return do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3


def compiled(fn, plan):
    """``fn`` compiled under ``plan``'s tile constants, in a cache of its own; (the compiled
    function, its kernel module's globals)."""
    label, sector, min_yt, elems = plan
    saved = tiles.ROW_SECTOR, tiles.ROW_MIN_YT, tiles.ROW_ELEMS_MAX
    os.environ["FUSION_COMPILER_TILES"] = "0" if sector is None else "1"
    os.environ["FUSION_COMPILER_CACHE_DIR"] = tempfile.mkdtemp(prefix="row-tiles-")
    if sector is not None:
        tiles.ROW_SECTOR, tiles.ROW_MIN_YT, tiles.ROW_ELEMS_MAX = sector, min_yt, elems
    try:
        torch._dynamo.reset()
        with recording() as rec, torch.no_grad():
            f = torch.compile(fn, backend="fusion")
            f(*ARGS)
    finally:
        tiles.ROW_SECTOR, tiles.ROW_MIN_YT, tiles.ROW_ELEMS_MAX = saved
        os.environ.pop("FUSION_COMPILER_TILES")
    (target,) = rec.targets
    (launch,) = target.launchers.values()
    return f, getattr(launch, "func", launch).__globals__


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cuda" if GPU else "cpu"
    b, h, c, n = (4, 32, 4, 256) if GPU else (1, 8, 2, 32)
    torch.manual_seed(0)
    A = -torch.rand(b, h, c, n, device=dev) * 0.1
    G = torch.randn(b, c, n, n, h, device=dev)
    ARGS = (A, G)
    results = {"cases": {}}
    if GPU:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from patterns import copy_bandwidth
        bw = copy_bandwidth()
        results["copy_TBps"] = bw / 1e12
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for fn in (segsum, segsum2):
        want = [o.double() for o in torch.utils._pytree.tree_leaves(fn(A.double(), G.double()))]
        nbytes = (A.numel() + G.numel() + sum(o.numel() for o in want)) * 4
        row = {}
        if GPU:
            floor = nbytes / bw * 1e6
            row["eager"] = median_us(lambda: fn(A, G))
            torch._dynamo.reset()
            ind = torch.compile(fn)
            ind(A, G)
            row["inductor"] = median_us(lambda: ind(A, G))
        for plan in PLANS:
            f, module = compiled(fn, plan)
            original = module["row_settings"]
            clamp = [ln.strip() for ln in Path(module["__file__"]).read_text().splitlines()
                     if "# tiles of rows" in ln]
            print(f"{fn.__name__:8s} {plan[0]}: {clamp[0] if clamp else 'consecutive rows'}")
            for warps in WARPS:
                if warps is not None:
                    module["row_settings"] = lambda *args, w=warps: (*original(*args)[:3], w)
                got = torch.utils._pytree.tree_leaves(f(A, G))
                err = max((g.double() - w).abs().max().item() for g, w in zip(got, want))
                label = plan[0] + ("" if warps is None else f", {warps} warps")
                row[label] = median_us(lambda: f(A, G)) if GPU else None
                row[label + " err"] = err
                print(f"{fn.__name__:8s} {label:26s} err {err:.2e}"
                      + (f"  {row[label]:7.1f} us ({100 * floor / row[label]:5.1f}%)" if GPU
                         else ""), flush=True)
            module["row_settings"] = original
        if GPU:
            print(f"{fn.__name__:8s} floor {floor:.1f} us, eager {row['eager']:.1f}, inductor "
                  f"{row['inductor']:.1f} ({100 * floor / row['inductor']:.1f}%)", flush=True)
            row["floor_us"] = floor
        results["cases"][fn.__name__] = row
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
