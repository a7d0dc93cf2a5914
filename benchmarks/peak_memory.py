"""Peak memory of one compiled call's own tensors: by static liveness of each graph (the ATen
graph the backend gets, and the graph it runs), and, on a GPU, measured for eager, fusion and
Inductor.

    python3 benchmarks/peak_memory.py benchmarks/hf_zoo.py:convnext_tiny_32
    TRITON_INTERPRET=1 python3 benchmarks/peak_memory.py benchmarks/hf_zoo.py:convnext_tiny_32
    python3 benchmarks/peak_memory.py examples/llama.py:train_4x1024_lm --training

``--training``: the forward and backward graphs, and a step's forward and backward measured
(the outputs' floating-point elements summed as the loss). On the CPU the forward runs (in
Triton's interpreter) so that the backward compiles: use a small target there.

The static figure walks the graph in order, as FX's generated code frees a value after its
last use: a storage (by the fake values' storages; a launcher output written over a dead input,
``r{p}=``, is that input's; ``_reinterpret_tensor`` is a view) lives from the node that makes
it to the last use of any value on it. Graph inputs do not count. It prints the peak, where it
is and what is live there. On the CPU (Triton's interpreter) it stops after compiling: nothing
runs. On a GPU it then measures ``max_memory_allocated`` over one call's start for each backend.
Session 43: ConvNeXt-T 165.4 static against 166.4 measured, T5-base 78.0 against 78.0.
"""
import importlib.util
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fusion_compiler import backend


def _tensors(v) -> list:
    return [t for t in tree_leaves(v) if isinstance(t, torch.Tensor)]


def _key(node, alias):
    k = StorageWeakRef(node.meta["val"].untyped_storage())
    return alias.get(k, k)


def static_peak(gm, label: str) -> None:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)

    def last_use(n):
        return max((end if u.op == "output" else pos[u] for u in n.users), default=pos[n])

    alloc, free, size, who, alias, inputs = {}, {}, {}, {}, {}, set()
    for n in nodes:
        values = list(_tensors(n.meta.get("val")))
        if n.op == "call_function" and not values:      # a launcher call: its getitems' values
            over = {int(k[1:]): a for k, a in n.kwargs.items() if k.startswith("r")}
            for u in n.users:
                if u.args[1] in over:       # written over a dead input: that input's memory
                    src = _key(over[u.args[1]], alias)
                    free[src] = max(free.get(src, -1), last_use(u))
                    alias[StorageWeakRef(u.meta["val"].untyped_storage())] = src
                else:
                    values += list(_tensors(u.meta.get("val")))
        for v in values:
            k = StorageWeakRef(v.untyped_storage())
            k = alias.get(k, k)
            if "reinterpret" in str(n.target) and isinstance(n.meta.get("val"), torch.Tensor) \
                    and isinstance(n.args[0].meta.get("val"), torch.Tensor):
                alias[k] = k = _key(n.args[0], alias)       # fast_calls' view of a chain
            if n.op == "placeholder":
                inputs.add(k)
            if k not in alloc:
                alloc[k], size[k], who[k] = pos[n], v.untyped_storage().nbytes(), n.name
            free[k] = max(free.get(k, -1), last_use(n))
    own = [k for k in alloc if k not in inputs]
    best, at = 0, 0
    for i in range(end):
        live = sum(size[k] for k in own if alloc[k] <= i <= free[k])
        if live > best:
            best, at = live, i
    print(f"{label}: {end} nodes, peak {best / 2**20:.1f} MiB at node {at} ({nodes[at].name})")
    for k in sorted((k for k in own if alloc[k] <= at <= free[k]), key=lambda k: -size[k])[:8]:
        print(f"   {size[k] / 2**20:8.2f} MiB  {who[k]:40s} made at {alloc[k]}, last used {free[k]}")


def main() -> int:
    training = "--training" in sys.argv[2:]
    path, name = sys.argv[1].split(":")
    spec = importlib.util.spec_from_file_location("target", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gpu = torch.cuda.is_available()
    model, inputs = getattr(module, name)("cuda" if gpu else "cpu", torch.bfloat16)
    compile_graph = backend._compile_aten_graph

    def reporting(gm, kind, config, *rest):
        static_peak(gm, f"{kind} ATen graph")
        out = compile_graph(gm, kind, config, *rest)
        static_peak(out, f"{kind} fusion graph")
        if not gpu and (not training or kind == "backward"):
            raise SystemExit(0)         # the interpreter would run the whole model
        return out

    def step(fn):
        out = fn(*inputs)
        if training:
            sum(t.float().sum() for t in _tensors(out) if t.is_floating_point()).backward()
            model.zero_grad(set_to_none=True)
        return out

    def measured(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step(fn)
        torch.cuda.synchronize()
        del out
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    backend._compile_aten_graph = reporting
    if training:
        model.train()
    with torch.set_grad_enabled(training):
        fused = torch.compile(model, backend="fusion")
        step(fused)
        backend._compile_aten_graph = compile_graph
        eager_mb, fusion_mb = measured(model), measured(fused)
        torch._dynamo.reset()
        inductor = torch.compile(model)
        step(inductor)
        print(f"{name}, measured over a {'step' if training else 'call'}'s start (MiB): "
              f"eager {eager_mb:.1f}, "
              f"fusion {fusion_mb:.1f}, Inductor {measured(inductor):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
