"""A model's inference ATen graph as the backend receives it (CPU), for scripts that time the
passes on it: ``benchmarks/gc_compile.py``, ``benchmarks/analyze_time.py``."""
from __future__ import annotations

import torch


def inference_graph(target: str) -> torch.fx.GraphModule:
    """The first ATen graph of ``target`` (a model factory, as in `fusion-compiler bench`), in
    bf16 on the CPU, traced by aot_autograd with the backend's decompositions."""
    from torch._dynamo.backends.common import aot_autograd

    from fusion_compiler.decompositions import decomposition_table
    from fusion_compiler.targets import load_factory

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward
    model, inputs = load_factory(target)[0](device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=keep, inference_compiler=keep,
                                                  decompositions=decomposition_table()))(*inputs)
    return graphs[0]
