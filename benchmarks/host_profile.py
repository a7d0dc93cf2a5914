"""Where a compiled model's host time goes (GPU): graphs, Dynamo's wrapper, the CPU-side ops.

    python benchmarks/host_profile.py examples/bert.py:bench_16x256 [--backends inductor fusion]

For each backend: the call's host time (20 calls, no synchronization inside), how many graphs
Dynamo compiled (graph breaks), the host time of fusion's compiled ATen graphs called directly
(the rest is Dynamo's guards and glue), and one profiled call's CPU-side events by self time:
ATen ops, CUDA runtime calls (launches, synchronizations, copies).
"""
import argparse
import time

import torch

from fusion_compiler import backend as B
from fusion_compiler.targets import load_factory


def per_call(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def run(target: str, backend: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    graphs = []
    compile_aten_graph = B.compile_aten_graph

    def spy(gm, kind, config, **kwargs):
        new = compile_aten_graph(gm, kind, config, **kwargs)
        forward = new.forward           # takes the inputs as one list, which it empties
        entry = {"fn": forward}
        graphs.append(entry)

        def call(args):
            entry.setdefault("args", list(args))
            return forward(args)
        new.forward = call
        return new
    B.compile_aten_graph = spy
    try:
        model, inputs = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
        f = model if backend == "eager" else torch.compile(model, backend=backend)
        with torch.no_grad():
            f(*inputs)
            whole = per_call(lambda: f(*inputs))
            parts = [per_call(lambda g=g: g["fn"](list(g["args"]))) for g in graphs
                     if "args" in g]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                f(*inputs)
                torch.cuda.synchronize()
    finally:
        B.compile_aten_graph = compile_aten_graph
    print(f"\n== {target} / {backend}: {whole:.0f} us host per call; "
          + (f"{len(graphs)} fusion graphs, called alone: "
             + ", ".join(f"{p:.0f} us" for p in parts) if backend == "fusion" else ""), flush=True)
    rows = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    print(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--backends", nargs="+", default=["inductor", "fusion"])
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    for b in a.backends:
        run(a.target, b, a.top)


if __name__ == "__main__":
    main()
