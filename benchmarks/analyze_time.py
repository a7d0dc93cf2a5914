"""Time of the analysis passes (the fusion decisions) of a model's graph, cold, on the CPU.

    TRITON_INTERPRET=1 python benchmarks/analyze_time.py examples/gpt2.py:bench_8x512 --reps 12

The model is traced once (aot_autograd with the backend's decompositions); then
``pipeline.analyze`` runs ``--reps`` times on copies of its graph, each with an empty cache
folder (no stored decisions) and the lowering memo of the fuse pass cleared, as in a cold
process, with Python's cyclic collector off while timed. Printed: each time (the first after
the trace), the least and the median, and a hash of the groups found (a change that should not
move a decision must leave it as it was).
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import os
import statistics
import tempfile
import time



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a model factory, as in `fusion-compiler bench`")
    parser.add_argument("--reps", type=int, default=5)
    a = parser.parse_args()
    from aten_graph import inference_graph

    from fusion_compiler import backend as B
    from fusion_compiler.config import Config
    from fusion_compiler.passes import legality, pipeline

    graph = inference_graph(a.target)
    times = []
    for _ in range(a.reps):
        os.environ["FUSION_COMPILER_CACHE_DIR"] = tempfile.mkdtemp()
        gm = copy.deepcopy(graph)
        ctx = B.make_context(Config.from_env(), "inference", gm)
        legality._LOWERED.clear()
        gc.collect()
        gc.disable()            # the collector's pauses are not the passes' work
        started = time.perf_counter()
        pipeline.analyze(gm, ctx)
        times.append(time.perf_counter() - started)
        gc.enable()
    groups = repr(sorted(sorted(str(n) for n in g.members) for g in ctx.groups))
    print("each:", " ".join(f"{t:.3f}" for t in times))
    print(f"{a.target}: analyze least {min(times):.3f} s, median {statistics.median(times):.3f} s "
          f"over {a.reps}; {len(ctx.groups)} groups, {len(ctx.decisions)} decisions, groups hash "
          f"{hashlib.sha256(groups.encode()).hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
