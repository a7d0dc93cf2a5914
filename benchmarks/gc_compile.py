"""Python's cyclic collector during one cold compile of a model's graph. (CPU)

    TRITON_INTERPRET=1 python benchmarks/gc_compile.py examples/llama.py:bench_1x128 [--plain]
        [--copy-graph]

Captures the model's inference ATen graph (aot_autograd with the backend's decompositions, on
the CPU), then times one ``backend.compile_aten_graph`` of it with empty caches, and the
collector's time in each generation meanwhile (``gc.callbacks``). ``--plain`` runs it without
``backend.young_gc`` (every object of the process scanned by a full collection), for the
comparison. Whether a full collection falls inside the compile depends on what the process
allocated just before it: ``--copy-graph`` compiles a deep copy of the graph, made right before,
as a process that has just traced the graph (aot_autograd, inside the backend) has allocated a
graph's worth of objects. Run each variant in fresh processes. Last, one forced full
collection is timed outside and inside ``young_gc``: what each full collection costs either way.
"""
import argparse
import contextlib
import copy
import gc
import os
import tempfile
import time

os.environ["FUSION_COMPILER_CACHE_DIR"] = tempfile.mkdtemp()     # a cold compile

from aten_graph import inference_graph  # noqa: E402
from fusion_compiler import backend as B  # noqa: E402
from fusion_compiler.config import Config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--plain", action="store_true", help="without backend.young_gc")
    ap.add_argument("--copy-graph", action="store_true",
                    help="compile a deep copy of the graph made right before")
    a = ap.parse_args()
    graph = inference_graph(a.target)
    young_gc = B.young_gc
    if a.plain:
        B.young_gc = contextlib.nullcontext
    gm = copy.deepcopy(graph) if a.copy_graph else graph
    spent, started = [0.0, 0.0, 0.0], {}

    def on_gc(phase, info):
        g = info["generation"]
        if phase == "start":
            started[g] = time.perf_counter()
        elif g in started:
            spent[g] += time.perf_counter() - started.pop(g)
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    B.compile_aten_graph(gm, "inference", Config.from_env())
    seconds = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    print(f"{a.target} {'plain' if a.plain else 'young_gc'}: compile_aten_graph {seconds:.3f} s; "
          f"collector by generation {spent[0]:.3f} / {spent[1]:.3f} / {spent[2]:.3f} s")
    t0 = time.perf_counter()
    gc.collect()
    outside = time.perf_counter() - t0
    with young_gc():
        t0 = time.perf_counter()
        gc.collect()
        inside = time.perf_counter() - t0
    print(f"one full collection: {outside:.3f} s, inside young_gc {inside:.4f} s")


if __name__ == "__main__":
    main()
