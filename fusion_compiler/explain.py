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


def explain(model, *inputs, dynamic=False, training=False, profile=None, code=False):
    """Summaries (dicts) of every graph compiled for ``model(*inputs)``."""
    torch._dynamo.reset()
    env = {"FUSION_COMPILER_PROFILE": profile, "FUSION_COMPILER_EMIT_SOURCES": 1 if code else None}
    with _env(**env), capture_compiles() as reports:
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
    torch._dynamo.reset()
    return [dict(r.summary, kernels=r.kernels, ran_kernels=r.ran_kernels) for r in reports]


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
