"""What one compile did: kernels generated, ops left on ATen, fusion decisions.

``capture_compiles()`` collects a ``GraphReport`` for every graph compiled inside it, so tests
and tools can count kernels without reading logs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

_listeners: list = []


@dataclass
class GraphReport:
    kind: str                                   # "forward", "backward" or "inference"
    ran_kernels: bool                           # False when the ATen graph runs as it is
    kernels: list = field(default_factory=list)  # dicts: group, key, label, path, ops
    aten_ops: list = field(default_factory=list)  # targets of the compute ops left on ATen
    groups_not_generated: list = field(default_factory=list)  # (ops, reason)
    decisions: list = field(default_factory=list)
    nodes_before: int = 0
    summary: dict = field(default_factory=dict)   # fusion_compiler.summary.summarize
    error: str = ""                                # the compiler failed: the graph ran on ATen
    measured: list = None                          # rows of measure.measure_graph, if asked
    compile_seconds: float = 0.0                   # time in the backend's passes for this graph
    phase_seconds: dict = field(default_factory=dict)   # analyze, sources, triton, autotune, partition
    # Triton kernels compiled at compile time: (by worker processes, all)
    kernels_by_workers: tuple = (0, 0)
    inplace: int = 0        # kernel outputs written over inputs that die with the kernel

    @property
    def num_kernels(self) -> int:
        """Generated kernels this graph runs."""
        return sum(1 for k in self.kernels if k.get("runs", True))


_FREE = {"getitem", "sym_size", "sym_stride", "sym_numel", "view", "_unsafe_view", "unsqueeze",
         "squeeze", "permute", "t", "transpose", "slice", "select", "alias", "expand",
         "as_strided", "detach", "reshape"}


def aten_compute_ops(gm: torch.fx.GraphModule) -> list:
    """Targets of call_function nodes that do work on ATen (views and sym reads excluded)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or "fc_launcher" in n.meta or "fc_profile_range" in n.meta:
            continue
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        val = n.meta.get("val")
        makes_tensors = isinstance(val, torch.Tensor) or (
            isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val))
        if name in _FREE or not hasattr(n.target, "_schema") and not makes_tensors:
            continue
        out.append(str(n.target))
    return out


def publish(report: GraphReport) -> None:
    for sink in _listeners:
        sink.append(report)


@contextlib.contextmanager
def capture_compiles():
    """Yield a list that receives a GraphReport for each graph compiled in the block."""
    sink: list = []
    _listeners.append(sink)
    try:
        yield sink
    finally:
        _listeners.remove(sink)
