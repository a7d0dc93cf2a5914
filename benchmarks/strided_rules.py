"""Strided-row launch rules compared on the column-sum cases (GPU).

    python benchmarks/strided_rules.py [--out FILE]
    python benchmarks/strided_rules.py --step TARGET [--rounds N]

Each case of benchmarks/column_sums.py is compiled with the fusion backend once; its strided
row kernels' ``row_settings`` is then rebound (in each generated module, as the autotuner
does) to each rule of ``RULES``: at most E elements a program, rows doubled while the grid
keeps P programs an SM, W warps (8 at 8192 elements where marked). The kernels' own device time
per call after an L2 flush (``timing.kernel_times``), us. Session 27 (BENCHMARKS.md) ran it as
a scratch script; these are its rules.

``--step TARGET`` (as `fusion-compiler bench` takes it) times a whole training step instead:
the model compiled once, then per rule the step's kernels (profiler, one step after two warm
ones), summed by category (fusion_compiler.breakdown). Session 28: GPT-2 8 x 512 and BERT
16 x 256, the code's rule the fastest (below).
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

# label -> (elements a program, programs an SM, 8 warps at 8192 elements for kind 2: STRIDED = 2,
# statements.strided_kind; kind 1 is on 4 in every rule)
RULES = {"8192/4/w8 (the code's)": (8192, 4, True), "8192/4/w4": (8192, 4, False),
         "16384/1.5/w4": (16384, 1.5, False), "8192/1.5/w4": (8192, 1.5, False),
         "16384/4/w4": (16384, 4, False)}
CODE = "8192/4/w8 (the code's)"
_RULE = L.row_settings.__wrapped__


def rule(elems, per_sm, w8):
    def settings(rows, n, max_persistent_block, strided=0, looped_block=None):
        rblock = L._next_pow2(max(n, 1))
        if not strided or rblock > max_persistent_block:
            return _RULE(rows, n, max_persistent_block, strided, looped_block)
        xblock = min(L._next_pow2(rows), max(1, L.ROW_ELEMS // rblock))
        while 2 * xblock * rblock <= elems and -(-rows // (2 * xblock)) >= per_sm * L._sm_count():
            xblock *= 2
        return xblock, rblock, False, 8 if w8 and strided == 2 and xblock * rblock >= 8192 else 4
    return settings


def rebind(params) -> int:
    """Every generated strided-row module's ``row_settings`` set to the rule ``params``."""
    count = 0
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        if names.get("STRIDED") in (1, 2) and "row_settings" in names:
            names["row_settings"] = rule(*params)
            count += 1
    return count


def training_step(target: str, rounds: int) -> dict:
    """Per rule, the kernel time (us) of one training step of ``target``, by category."""
    import collections

    from fusion_compiler import bench
    from fusion_compiler import breakdown as BD
    from fusion_compiler.targets import call_factory, load_factory, target_imports

    torch.manual_seed(0)
    with target_imports():
        factory, where = load_factory(target)
        model, args, _ = call_factory(factory, where, "cuda", "bfloat16")
    step = bench._training_step(torch.compile(model, backend="fusion"), model)
    for _ in range(3):
        step(*args)
    results = {}
    for r in range(rounds):
        for label, params in RULES.items():
            modules = rebind(params)
            for _ in range(2):
                step(*args)
            torch.cuda.synchronize()
            kernels = BD.profile_call(step, args)
            cats = collections.defaultdict(float)
            for k in kernels:
                cats[BD.category(k.name)] += k.duration_us
            total = sum(k.duration_us for k in kernels)
            results.setdefault(label, []).append({"total_us": total, **cats})
            print(f"{r} {label:24s} strided modules {modules:3d}  kernels {len(kernels)}  "
                  f"total {total:8.1f} us  " + "  ".join(
                      f"{c} {v:.1f}" for c, v in sorted(cats.items())), flush=True)
    rebind(RULES[CODE])
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--step", default=None, help="time a training step of this target instead")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every rule (--step)")
    a = ap.parse_args()
    if a.step:
        results = training_step(a.step, a.rounds)
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
        return
    busy(2)
    results = {}
    for name, fn, shapes, _ in CS.cases():
        args = CS.fresh(shapes)
        torch._dynamo.reset()
        fused = torch.compile(fn, backend="fusion")
        fused(*args)
        row = {}
        for label, params in RULES.items():
            rebind(params)                  # the generated strided-row modules
            row[label] = kernel_times(fused, args)["kernel_us"]
        results[name] = row
        print(f"{name:36s} " + "  ".join(f"{k} {v:6.1f}" for k, v in row.items()), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
