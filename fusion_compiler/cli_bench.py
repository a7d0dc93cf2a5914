"""The GPU subcommands: `fusion-compiler bench` (timing in bench.py) and `calibrate`."""
from __future__ import annotations

import sys
import traceback


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bench", help="time eager vs Inductor vs fusion on the GPU",
        description="Time a model or the built-in patterns with eager PyTorch, torch.compile's "
                    "default (Inductor) and the fusion backend in one run: median latency, "
                    "speedup, % of the HBM floor (patterns), kernels per call, compile times, "
                    "peak memory, max error vs eager. Needs a CUDA GPU.",
        epilog="TARGET: a built-in pattern name (add_rmsnorm, swiglu, ...), 'patterns' for all "
               "of them, or a model as in `dump` (file.py, file.py:factory, module:factory).")
    b.add_argument("targets", metavar="TARGET", nargs="+")
    b.add_argument("--compare", default="eager,inductor,fusion",
                   help="comma-separated, from eager, inductor, fusion, inductor-cg, fusion-cg, "
                        "fusion-save, fusion-nchw, fusion-atenpool (-cg: CUDA graphs, "
                        "mode='reduce-overhead'; fusion-save: training graphs save what the "
                        "backward reads, no recompute; fusion-nchw: no channels-last rewrite of "
                        "convolution networks; fusion-atenpool: ATen's max pool); default: "
                        "eager,inductor,fusion")
    b.add_argument("--mode", choices=("inference", "training"), default="inference",
                   help="training: forward, backward and an SGD step, the model in the mode its "
                        "factory left it (the examples' factories: eval(), so dropout is off)")
    b.add_argument("--rows", type=int, help="rows of the patterns (default: the anchor sizes)")
    b.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    b.add_argument("--breakdown", action="store_true",
                   help="also profile one call per target and backend and print where its GPU "
                        "time goes: GEMM, attention, fused kernels, ATen ops left unfused, gaps "
                        "between kernels (share of the call, kernels, %% of the HBM floor of "
                        "the fused kernels where known); in the JSON under 'breakdown'")
    b.add_argument("--rounds", type=_rounds, metavar="N",
                   help="interleaved timing rounds (each times every backend in turn; the "
                        "latency is their median, and fusion's per-round difference from each "
                        "other backend is printed under the table); default 5. A GEMM-bound "
                        "model's time can drift several %% between rounds: use more to tell a "
                        "lead of a few %% from that drift")
    b.add_argument("-o", "--output", metavar="FILE", help="also write the results as JSON")
    b.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def _rounds(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of rounds (1 or more)")
    return n


def command(args) -> int:
    import torch

    from . import bench
    from . import patterns as P

    if not torch.cuda.is_available():
        print("fusion-compiler: error: bench times kernels on a CUDA GPU and none is visible; "
              "run it on a GPU machine (`fusion-compiler dump` works without one)", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.compare.split(",") if b.strip()]
    unknown = [b for b in backends if b not in bench.BACKENDS]
    if unknown or not backends:
        print(f"fusion-compiler: error: --compare {args.compare!r}: choose from "
              f"{', '.join(bench.BACKENDS)}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    try:
        targets = []
        for t in args.targets:
            names = [n for n, s in P.ANCHOR_SIZES.items() if s] if t == "patterns" else [t]
            for name in names:
                if name in P.PATTERNS:
                    fn, make = bench.pattern_target(name, args.rows, dtype)
                    targets.append((name, fn, make, True))
                else:
                    targets.append(_model_target(name, args.dtype))
        results = bench.run(targets, backends, args.mode, args.output,
                            breakdown=args.breakdown, rounds=args.rounds or bench.ROUNDS)
        failed = bench.failed(results)
        if failed:
            print("fusion-compiler: error: bench: failed on "
                  + ", ".join(f"{n} ({b})" for n, b in failed)
                  + "; the table has the other backends' numbers", file=sys.stderr)
            return 1
    except Exception as exc:        # noqa: BLE001 - one line unless --debug
        if args.debug:
            traceback.print_exception(exc)
        print(f"fusion-compiler: error: bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return getattr(exc, "status", 1)
    return 0


def _model_target(target: str, dtype):
    from .targets import call_factory, load_factory, target_imports

    with target_imports():
        factory, where = load_factory(target)
        model, inputs, _ = call_factory(factory, where, "cuda", dtype)
    return (target, model, lambda: inputs, False)


def calibrate_command(args) -> int:
    import torch

    from .calibrate import calibrate
    from .config import Config

    if not torch.cuda.is_available():
        print("fusion-compiler: error: calibrate measures a CUDA GPU and none is visible; "
              "run it on the machine the models will run on", file=sys.stderr)
        return 2
    try:
        profile, path = calibrate(Config.from_env().cache_dir)
    except Exception as exc:        # noqa: BLE001 - one line unless --debug
        if args.debug:
            traceback.print_exception(exc)
        print(f"fusion-compiler: error: calibration failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"{profile.name}: copy bandwidth {profile.hbm_bandwidth / 1e12:.2f} TB/s, launch "
          f"overhead {profile.launch_overhead * 1e6:.2f} us (+{profile.launch_per_output * 1e6:.2f}"
          f" us per further output, +{profile.launch_per_input * 1e6:.2f} us per further input;"
          f" GPU {profile.kernel_latency * 1e6:.2f} us per kernel), peak "
          f"{profile.peak_flops / 1e12:.1f} "
          f"TFLOP/s (fp32 vector estimate)\nstored in {path}")
    return 0
