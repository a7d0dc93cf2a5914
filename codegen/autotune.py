"""Bounded, cached autotuning of launch settings (GPU): warps of a row kernel, block size and
warps of a pointwise kernel.

``launch.py`` picks settings by rules measured on the H200. A rule fits most kernels; a kernel
whose own best differs loses a few % of the HBM floor (rows of 4096: 4 warps were 1-3 points
better than 8 for add+RMSNorm and the FP8 quant kernels, which is why the rule now says 4).
With ``autotune`` = K (FUSION_COMPILER_AUTOTUNE), the K kernels of a graph that move the most
bytes (at least ``MIN_BYTES`` at the size hints; smaller ones are bound by launch latency, not
by their settings) each time at most three settings, the rule's among them, on random inputs
of the hinted sizes. A setting replaces the rule's only if it is ``MARGIN`` faster (less is
noise). The choice is stored on disk per kernel, sizes, GPU and Triton version, so a warm
compile times nothing; the candidates compile on the compile threads before they are timed.

What is bounded: K kernels, three settings each, a few milliseconds of timing per setting.
Kernels with integer or bool inputs are not tuned: random values there could be indices.

A tuned module's ``row_settings`` / ``pointwise_settings`` name is rebound to a function that
returns the tuned settings at the tuned sizes and the rule's at any other: modules not tuned
keep calling the rule directly and pay nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..passes.shapes import hint
from . import launch as L
from . import compile_pool, precompile

log = logging.getLogger("fusion_compiler")

MIN_BYTES = 32 << 20        # ~8 us of HBM traffic on the H200
MARGIN = 0.03
MAX_SETTINGS = 3


def _time(call) -> float:
    """Median seconds of ``call`` (Triton's do_bench: L2 flushed between runs)."""
    from triton.testing import do_bench
    return do_bench(call, warmup=3, rep=10, return_mode="median") * 1e-3


def candidates(kind: str, rule: tuple) -> list:
    """Settings to try, the rule's first: a row kernel's warps halved and doubled (2-16); a
    pointwise kernel's block halved and doubled (256-8192 elements, warps with it, 1-8)."""
    if kind == "row":
        xblock, rblock, looped, warps = rule
        options = [(xblock, rblock, looped, w) for w in (warps, warps // 2, warps * 2)
                   if 2 <= w <= 16]
    else:
        block, warps = rule
        options = [(b, max(1, min(8, w))) for b, w in
                   ((block, warps), (block // 2, warps // 2), (block * 2, warps * 2))
                   if 256 <= b <= 8192]
    seen, out = set(), []
    for o in options:
        if o not in seen:
            seen.add(o)
            out.append(o)
    return out[:MAX_SETTINGS]


def _kind(module: dict) -> str | None:
    if "_persistent_kernel" in module:
        return "row"
    if "_pointwise_kernel" in module:           # multi-part modules name theirs _partN
        return "pointwise"
    return None


def _override(module: dict, kind: str, table: dict) -> None:
    """Route the module's settings through ``table`` (sizes -> settings), else the rule; an
    empty table puts the rule itself back."""
    if not table:
        module["row_settings"], module["pointwise_settings"] = L.row_settings, L.pointwise_settings
        module.pop("_TUNED", None)
        return
    if kind == "row":
        rule = L.row_settings

        def row_settings(rows, n, max_persistent_block, strided=False, looped_block=None):
            return table.get((rows, n)) or rule(rows, n, max_persistent_block, strided,
                                                looped_block)
        module["row_settings"] = row_settings
    else:
        rule = L.pointwise_settings

        def pointwise_settings(numel, stream_bytes=2):
            return table.get(numel) or rule(numel, stream_bytes)
        module["pointwise_settings"] = pointwise_settings
    module["_TUNED"] = table


def _inputs(group, hints, device) -> list | None:
    """Random tensors laid out as the group's inputs at the size hints; None if an input is not
    floating point."""
    out = []
    for node in group.inputs:
        info = node.meta["fc_tensor"]
        if not info.dtype.is_floating_point:
            return None
        shape = [hint(s, hints) for s in info.shape]
        stride = [hint(s, hints) for s in info.stride]
        offset = hint(info.storage_offset, hints)
        span = offset + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) + 1
        base = torch.empty(span, dtype=torch.float32, device=device).normal_().to(info.dtype)
        out.append(base.as_strided(shape, stride, offset))
    return out


def _store(root: Path) -> Path:
    return Path(root) / "autotune"


def _disk_key(kernel_key: str, sizes, device) -> str:
    import triton
    text = json.dumps([kernel_key, list(sizes) if isinstance(sizes, tuple) else sizes,
                       torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       triton.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load(root, key):
    try:
        return json.loads((_store(root) / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _save(root, key, record) -> None:
    folder = _store(root)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError as exc:      # a read-only cache folder: tuned again next time
        log.debug("fusion-compiler: autotune result not stored (%s)", exc)


def _sizes(kind, call) -> tuple | int:
    """The sizes the launcher's settings rule was asked about, from a recorded launch."""
    _kernel, _grid, args, _kwargs = call
    return (args[-2], args[-1]) if kind == "row" else args[-1]


def tune(ctx, time_fn=None, count=None) -> int:
    """Tune the launch settings of up to ``count`` (default ``ctx.config.autotune``) of the
    graph's kernels (see the module docstring); how many kernels now run with settings other
    than the rule's. ``time_fn(call, settings)`` times one setting (seconds); tests pass
    their own."""
    time_fn = time_fn or (lambda call, settings: _time(call))
    count = ctx.config.autotune if count is None else count
    ranked = sorted((g for g in ctx.groups if g.id in ctx.launchers and g.cost is not None
                     and g.cost.bytes >= MIN_BYTES),
                    key=lambda g: -g.cost.bytes)
    keys = {k["group"]: k for k in ctx.kernels}
    changed = 0
    for g in ranked[:count]:
        try:
            changed += _tune_one(ctx, g, keys[g.id], time_fn)
        except Exception as exc:    # noqa: BLE001 - the rule's settings stay: still correct
            if ctx.config.strict:
                raise
            log.warning("fusion-compiler: autotuning group %s failed (%s: %s); it keeps the "
                        "default launch settings", g.id, type(exc).__name__, exc)
    return changed


def _tune_one(ctx, g, kernel: dict, time_fn) -> int:
    """Tune one group's launcher; 1 if its settings now differ from the rule's."""
    launch = ctx.launchers[g.id]
    module = launch.func.__globals__
    kind = _kind(module)
    if kind is None:
        return 0
    calls = precompile.recorded_launches(launch, *precompile.stand_ins(g, ctx.size_hints))
    if len(calls) != 1:
        return 0
    sizes = _sizes(kind, calls[0])
    kwargs = calls[0][3]
    rule = (L.row_settings(*sizes, ctx.config.max_persistent_block, module.get("STRIDED", False))
            if kind == "row"
            else (kwargs["BLOCK"], kwargs["num_warps"]))       # the launcher's own rule
    if kind == "row" and (rule[2] or "_persistent_kernel" not in module):
        return 0                        # looped kernels: settings are not their limit
    table = module.get("_TUNED", {})
    key = _disk_key(kernel["key"], sizes, launch.args[0])
    record = _load(ctx.config.cache_dir, key)
    if record is None:
        # compile time runs under aot_autograd's fake tensor mode: real tensors here
        with unset_fake_temporarily(), torch.no_grad():
            record = _measure(ctx, g, launch, module, kind, sizes, rule, table, time_fn)
        if record is None:
            return 0
        _save(ctx.config.cache_dir, key, record)
    best = tuple(record["settings"])
    kernel["tuned"] = {"sizes": sizes, "rule": list(rule), "settings": list(best),
                       "us": record.get("us", {})}
    if best == tuple(rule):
        return 0
    table[sizes] = best
    _override(module, kind, table)
    return 1


def _measure(ctx, g, launch, module, kind, sizes, rule, table, time_fn) -> dict | None:
    device = launch.args[0]
    inputs = _inputs(g, ctx.size_hints, device)
    if inputs is None:
        return None
    syms = [hint(s, ctx.size_hints) for s in g.graph_symbols]
    options = candidates(kind, tuple(rule))
    if L.LEAN and ctx.config.compile_threads > 0:
        # every candidate compiled first, on the compile threads
        calls = []
        for settings in options:
            _override(module, kind, {**table, sizes: settings})
            calls += precompile.recorded_launches(launch, *precompile.stand_ins(g, ctx.size_hints))
        failed = precompile.compile_launches(calls, device, ctx.config.compile_threads,
                                             compile_pool.current())
        if failed:
            options = [options[0]]
    times = {}
    try:
        for settings in options:
            _override(module, kind, {**table, sizes: settings})
            times[settings] = time_fn(lambda: launch(*inputs, *syms), settings)
    finally:
        _override(module, kind, table)
    base = times[options[0]]
    best = min(times, key=times.get)
    if times[best] > base * (1 - MARGIN):
        best = options[0]
    return {"settings": list(best), "rule": list(rule),
            "us": {str(list(s)): round(t * 1e6, 2) for s, t in times.items()}}
