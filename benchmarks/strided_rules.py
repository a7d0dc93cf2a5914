"""Strided-row launch rules compared on the column-sum cases (GPU).

    python benchmarks/strided_rules.py [--out FILE]

Each case of benchmarks/column_sums.py is compiled with the fusion backend once; its strided
row kernels' ``row_settings`` is then rebound (in each generated module, as the autotuner
does) to each rule of ``RULES``: at most E elements a program, rows doubled while the grid
keeps P programs an SM, W warps (8 at 8192 elements where marked). The kernels' own device time
per call after an L2 flush (``timing.kernel_times``), us. Session 27 (BENCHMARKS.md) ran it as
a scratch script; these are its rules.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import column_sums as CS  # noqa: E402
from patterns import busy  # noqa: E402
from timing import kernel_times  # noqa: E402

from fusion_compiler.codegen import launch as L  # noqa: E402

# label -> (elements a program, programs an SM, 8 warps at 8192 elements)
RULES = {"8192/4/w8 (the code's)": (8192, 4, True), "16384/1.5/w4": (16384, 1.5, False),
         "8192/1.5/w4": (8192, 1.5, False), "16384/4/w4": (16384, 4, False)}
_RULE = L.row_settings.__wrapped__


def rule(elems, per_sm, w8):
    def settings(rows, n, max_persistent_block, strided=False):
        rblock = L._next_pow2(max(n, 1))
        if not strided or rblock > max_persistent_block:
            return _RULE(rows, n, max_persistent_block, strided)
        xblock = min(L._next_pow2(rows), max(1, L.ROW_ELEMS // rblock))
        while 2 * xblock * rblock <= elems and -(-rows // (2 * xblock)) >= per_sm * L._sm_count():
            xblock *= 2
        return xblock, rblock, False, 8 if w8 and xblock * rblock >= 8192 else 4
    return settings


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    busy(2)
    results = {}
    for name, fn, shapes, _ in CS.cases():
        args = CS.fresh(shapes)
        torch._dynamo.reset()
        fused = torch.compile(fn, backend="fusion")
        fused(*args)
        row = {}
        for label, params in RULES.items():
            for module in list(sys.modules.values()):   # the generated strided-row modules
                names = getattr(module, "__dict__", {})
                if names.get("STRIDED") is True and "row_settings" in names:
                    names["row_settings"] = rule(*params)
            row[label] = kernel_times(fused, args)["kernel_us"]
        results[name] = row
        print(f"{name:36s} " + "  ".join(f"{k} {v:6.1f}" for k, v in row.items()), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
