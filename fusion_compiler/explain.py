"""``explain(model, *inputs)``: the fusion decisions for a model, without reading logs.

Compiles ``model`` with the fusion backend (forward, or forward + backward with
``training=True``) and returns one summary per ATen graph (``fusion_compiler.summary``).
Works on a CPU-only machine: the analysis needs no GPU, and ``profile`` names the GPU whose
numbers the cost model uses.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .report import capture_compiles


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def explain(model, *inputs, dynamic=False, training=False, profile=None, code=False,
            measure=False):
    """Summaries (dicts) of every graph compiled for ``model(*inputs)``. Every kernel source is
    generated (``code`` is kept for callers; the sources are always in the kernel cache). With
    ``measure`` (a GPU, or Triton's interpreter) each summary also has ``measured``: every fused
    kernel and the ATen ops it replaced, timed, beside the cost model's predictions
    (measure.py)."""
    from . import measure as measure_mod
    from .backend import interpreting

    torch._dynamo.reset()
    # every kernel is generated, also where none runs (a CPU machine): a group the code
    # generator cannot make one kernel of is then reported as not generated, never as fused
    env = {"FUSION_COMPILER_PROFILE": profile, "FUSION_COMPILER_EMIT_SOURCES": 1}
    recording = measure_mod.recording() if measure else contextlib.nullcontext()
    with _env(**env), capture_compiles() as reports, recording as rec:
        compiled = torch.compile(model, backend="fusion", dynamic=dynamic)
        if training:
            out = compiled(*inputs)
            leaves = [t for t in _tensors(out) if t.requires_grad]
            if not leaves:
                raise ValueError("training=True, but no output of the model requires grad")
            sum(t.float().sum() for t in leaves).backward()
        else:
            with torch.no_grad():
                compiled(*inputs)
    if measure:
        for target in rec.targets:
            target.report.measured = measure_mod.measure_graph(target)
    torch._dynamo.reset()
    out = []
    for r in reports:
        s = dict(r.summary, kernels=r.kernels, ran_kernels=r.ran_kernels)
        if measure:
            rows = r.measured or []
            s["measured"] = {"groups": rows, **measure_mod.summary(rows),
                             "interpreted": interpreting()}
        out.append(s)
    return out


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
    elif hasattr(out, "to_tuple"):
        yield from _tensors(out.to_tuple())
