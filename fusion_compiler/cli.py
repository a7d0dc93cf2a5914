"""Command line: `fusion-compiler dump TARGET` shows the fusion decisions for a model.

    fusion-compiler dump examples/llama.py                  # tables: groups, ATen ops, refusals
    fusion-compiler dump models.py:make_vit --format html -o vit.html
    fusion-compiler dump pkg.models:factory --training --profile h100 --format json

TARGET names a factory returning ``(model, example_inputs)``: ``path/to/file.py`` (its
``make_model_and_inputs``), ``path.py:factory`` or ``package.module:factory``. The model is
compiled with ``fusion_compiler.explain`` (no GPU needed); ``dump_format`` renders the result,
docs/dump-format.md describes the JSON. A wrong TARGET or option is one line on stderr,
``fusion-compiler: error: ...``, and exit status 2 (1 if compiling the model fails).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import numbers
import os
import sys
import traceback
from pathlib import Path

from .targets import DumpError, call_factory, describe, load_factory, target_imports

SCHEMA = "fusion-compiler.dump/1"
DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("table", "json", "dot", "html")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error (still exit status 2)."""

    def error(self, message):
        self.exit(2, f"fusion-compiler: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from .passes.cost_model import PROFILES

    parser = _Parser(prog="fusion-compiler", description="Fusion compiler for PyTorch models")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "dump", help="show what the fusion backend does with a model",
        description="Compile a model with the fusion backend and show its fusion decisions: "
                    "the fused groups, the ops left on ATen, the refused fusions and the "
                    "cost model's totals. Needs no GPU.",
        epilog="TARGET: path/to/file.py (factory make_model_and_inputs), path.py:factory or "
               "package.module:factory; the factory returns (model, example_inputs) and gets "
               "device= and dtype= if it takes them.")
    d.add_argument("target", metavar="TARGET", help="where the model factory is")
    d.add_argument("--device", default="cpu", help="device= for the factory (default: cpu)")
    d.add_argument("--dtype", choices=DTYPES,
                   help="dtype= for the factory (default: the factory's own default)")
    d.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    d.add_argument("--training", action="store_true",
                   help="forward + backward graphs (default: inference under no_grad)")
    d.add_argument("--profile", type=str.lower, choices=[*PROFILES, "auto"],
                   help="GPU the cost model assumes; auto: the visible GPU's (h200 without one); "
                        "default: FUSION_COMPILER_PROFILE, else auto")
    d.add_argument("--format", choices=FORMATS, default="table", help="output (default: table)")
    d.add_argument("--code", action="store_true", help="also show each generated kernel's source")
    d.add_argument("--measure", action="store_true",
                   help="time each fused kernel and the ATen ops it replaced, beside the cost "
                        "model's predictions (needs --device cuda, or TRITON_INTERPRET=1)")
    d.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    d.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    c = sub.add_parser(
        "calibrate", help="measure this GPU for the cost model and store the profile",
        description="Measure copy bandwidth, kernel launch overhead and matmul rate on the "
                    "visible GPU and store them; later compiles with FUSION_COMPILER_PROFILE=auto "
                    "(the default) on a GPU of that name use them. Needs a CUDA GPU.")
    c.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    from .cli_bench import add_parser as add_bench
    add_bench(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:           # usage errors (status 2), --help (0): a status to return
        return exc.code
    if args.version:
        from . import __version__
        print(__version__)
        return 0
    if args.command == "calibrate":
        from .cli_bench import calibrate_command
        return calibrate_command(args)
    if args.command == "bench":
        from .cli_bench import command as bench_command
        return bench_command(args)
    if args.command != "dump":
        parser.print_help()
        return 0
    try:
        text = dump(args)
        if args.output:
            try:
                Path(args.output).write_text(text, encoding="utf-8")
            except OSError as exc:
                raise DumpError(f"cannot write {args.output}: {exc.strerror or exc}") from exc
        else:
            _write_stdout(text)
    except Exception as exc:            # noqa: BLE001 - every error is one line without --debug
        if args.debug:
            traceback.print_exception(exc)      # with the error that caused it, if any
        message = str(exc) if isinstance(exc, DumpError) else (
            f"internal error, please report it: {describe(exc)} (--debug shows the traceback)")
        print(f"fusion-compiler: error: {message}", file=sys.stderr)
        return getattr(exc, "status", 1)
    return 0


def _write_stdout(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:             # `fusion-compiler dump ... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def dump(args) -> str:
    """The dump of ``args.target`` in ``args.format``."""
    from .dump_format import render_table
    from .dump_graphics import render_dot, render_html

    profile = _check_options(args)
    with target_imports(), contextlib.redirect_stdout(sys.stderr):   # stdout: the dump only
        factory, where = load_factory(args.target)
        model, inputs, kwargs = call_factory(factory, where, args.device, args.dtype)
        summaries = _explain(model, inputs, args, profile, where)
    options = {"device": args.device, "dtype": args.dtype, "dynamic": args.dynamic,
               "training": args.training, "profile": profile, "code": args.code,
               "measure": args.measure}
    doc = document(args.target, where, options, kwargs, summaries)
    if args.format == "json":
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    return {"table": render_table, "dot": render_dot, "html": render_html}[args.format](doc)


def _check_options(args) -> str:
    """Validate what argparse cannot; returns the cost-model profile to use."""
    import torch

    from .backend import interpreting
    from .config import Config, ConfigError
    from .passes.cost_model import PROFILES

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise DumpError(f"--device {args.device!r} is not a device name; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise DumpError(f"--device {args.device}: the fusion backend compiles for cpu and cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DumpError(f"--device {args.device}: no CUDA device is visible here; use --device "
                        "cpu (--profile picks the GPU the cost model assumes)")
    if args.measure and device.type != "cuda" and not interpreting():
        raise DumpError("--measure times the kernels, which run on a GPU: add --device cuda on a "
                        "machine with one (or set TRITON_INTERPRET=1 for interpreter timings)")
    if args.code and args.format == "dot":
        raise DumpError("--code does not go with --format dot; use table, json or html")
    if args.output:
        out = Path(args.output)
        if out.is_dir():
            raise DumpError(f"-o {args.output} is a folder; give a file name")
        if not out.resolve().parent.is_dir():
            raise DumpError(f"-o {args.output}: folder {out.resolve().parent} does not exist")
    if args.profile:
        return args.profile
    try:
        profile = Config.from_env().profile.lower()
    except ConfigError as exc:
        raise DumpError(f"{exc}; fix or unset that environment variable") from exc
    if profile not in PROFILES and profile != "auto":
        raise DumpError(f"FUSION_COMPILER_PROFILE={profile!r} is not a known profile; use one "
                        f"of {', '.join(PROFILES)}, auto (or pass --profile)")
    return profile


def _explain(model, inputs, args, profile, where):
    import torch

    from .explain import explain

    if isinstance(model, torch.nn.Module):
        model.train(args.training)          # inference dumps see dropout etc. as in eval()
    try:
        with contextlib.nullcontext() if args.debug else _quiet_torch_logs():
            return explain(model, *inputs, dynamic=args.dynamic, training=args.training,
                           profile=profile, code=args.code, measure=args.measure)
    except Exception as exc:
        if args.training and isinstance(exc, ValueError) and "requires grad" in str(exc):
            raise DumpError(f"--training: no output of the model of {where} requires grad; "
                            "give it trainable parameters or drop --training") from exc
        root = exc
        while (root.__cause__ or root.__context__) is not None:   # dynamo wraps the error
            root = root.__cause__ or root.__context__             # that says what happened
        raise DumpError(f"compiling the model of {where} failed: {describe(root)} "
                        "(--debug shows the traceback)", status=1) from exc


@contextlib.contextmanager
def _quiet_torch_logs():
    """Keep torch's own error logs (tracebacks) off stderr: the error is our one line."""
    handlers = {h for name, lg in logging.root.manager.loggerDict.items()
                if (name == "torch" or name.startswith("torch.")) and isinstance(lg, logging.Logger)
                for h in lg.handlers}
    drop = lambda record: record.levelno >= logging.CRITICAL  # noqa: E731
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


def document(target, where, options, kwargs, summaries) -> dict:
    """The dump as plain JSON data (schema ``fusion-compiler.dump/1``, docs/dump-format.md)."""
    from . import __version__

    graphs = []
    for i, s in enumerate(summaries):
        s = dict(s, index=i)
        kernels = [dict(k) for k in s.get("kernels", [])]
        if options["code"]:
            for k in kernels:
                k["source"] = _read(k.get("path"))
        s["kernels"] = kernels
        graphs.append(s)
    return plain({"schema": SCHEMA, "version": __version__, "target": target, "factory": where,
                  "options": options, "factory_kwargs": kwargs, "graphs": graphs})


def _read(path):
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, TypeError):
        return None


def plain(obj):
    """``obj`` as JSON data: dicts, lists, str, int, finite float, bool, None."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj) if math.isfinite(float(obj)) else None
    return str(obj)


if __name__ == "__main__":
    sys.exit(main())
