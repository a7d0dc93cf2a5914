"""Where a training step's compile spends its time, by part, in fresh processes (GPU or CPU).

    python benchmarks/compile_parts.py examples/gpt2.py:bench_8x512
    TRITON_INTERPRET=1 python benchmarks/compile_parts.py TARGET --device cpu --runs cold warm
    python benchmarks/compile_parts.py examples/llama.py:bench_1x128 --inference
    TRITON_INTERPRET=1 python benchmarks/compile_parts.py examples/gpt2.py:bench_8x512 \
        --device cpu --compile-only

Each run is its own Python process over one set of caches (an empty folder made here): the
first run is cold, the next ones warm (aot_autograd's result, kernels and decisions on disk).
A run is train_compile_time.py's step (the model built, compiled with the fusion backend, one
training step: forward, a sum of squares, backward; with --inference one call under no_grad,
the model in eval mode); it prints the step's wall time, Dynamo's time in the
backend and the seconds (and calls) of each part, timed by wrappers installed in the child:

  _key, _pickled, loads the AOT cache's key, pickling the ATen graphs (cold), and unpickling
                        them (warm); aot make_entry, aot save: torch's making and writing
                        of the cache entry (cold)
  late_decompose        the composite ops the trace kept whole, decomposed (before the AOT
                        cache keeps a graph, and first in analyze)
  compile_aten_graph    the backend's work on one ATen graph; within it analyze, generate
                        (kernel_cache_load: the kernel modules, each kernel then sent to the
                        compile threads), partition, fast_calls, kernels wait (pipeline.finish:
                        the wait for Triton's compiles or cache loads on threads, after the
                        graph was made ready)
  recompile FILE:LINE   GraphModule.recompile (Python generated from a graph and compiled),
                        by the caller's caller
  compile KIND          Python's compile(): "fx" for graph code, "import" for files (modules
                        without a .pyc, and the kernel modules), the rest by filename
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from train_compile_time import CHILD as STEP      # the step, timed in a fresh process

TIMERS = r'''
import builtins, collections, os, time, traceback
import torch
import torch.fx
from fusion_compiler import aot_cache, backend
from fusion_compiler.codegen import cache as kernel_cache, precompile
from fusion_compiler.passes import fast_calls, generate, late_decompose, partition, pipeline
from torch._functorch._aot_autograd import autograd_cache

# named apart from the step's own variables (it sets `seconds`)
part_seconds, part_calls = collections.defaultdict(float), collections.Counter()


def add(label, started):
    part_seconds[label] += time.perf_counter() - started
    part_calls[label] += 1


def timed(owner, attr, label=None):
    inner, label = getattr(owner, attr), label or attr

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            add(label, started)
    setattr(owner, attr, wrapper)


recompile = torch.fx.GraphModule.recompile


def timed_recompile(self):
    started = time.perf_counter()
    try:
        return recompile(self)
    finally:
        where = traceback.extract_stack(limit=3)[0]
        add(f"recompile {os.path.basename(where.filename)}:{where.lineno}", started)


python_compile = builtins.compile


def timed_compile(source, filename, *args, **kwargs):
    started = time.perf_counter()
    try:
        return python_compile(source, filename, *args, **kwargs)
    finally:
        name = str(filename)
        kind = "fx" if "eval_with_key" in name else "import" if name.endswith(".py") else name[:24]
        add(f"compile {kind}", started)


torch.fx.GraphModule.recompile = timed_recompile
builtins.compile = timed_compile
timed(aot_cache, "_key")
timed(aot_cache, "_pickled")
timed(aot_cache.FusionOutputCode, "post_compile")
timed(autograd_cache.AOTAutogradCache, "save", "aot save")
timed(autograd_cache.AOTAutogradCache, "make_entry", "aot make_entry")
timed(aot_cache.GraphPickler, "loads")
timed(backend, "compile_aten_graph")
timed(pipeline, "analyze")
timed(generate, "run", "generate")
timed(partition, "run", "partition")
timed(late_decompose, "run", "late_decompose")
timed(fast_calls, "run", "fast_calls")
timed(pipeline, "finish", "kernels wait")
timed(kernel_cache.KernelCache, "load", "kernel_cache_load")

if os.environ.get("FC_PARTS_COMPILE_ONLY"):
    # --compile-only: stop once the backend returns (forward and backward compile together
    # where the AOT cache is on), before the step runs: a CPU run at a model's real sizes,
    # whose kernels Triton's interpreter would take hours to run
    import json, sys
    import torch._dynamo.output_graph as output_graph
    from torch._dynamo.utils import counters
    user_compiler = output_graph.OutputGraph.call_user_compiler

    def compile_then_exit(self, *args, **kwargs):
        started = time.perf_counter()
        user_compiler(self, *args, **kwargs)
        print(json.dumps({"seconds": None, "in_backend": time.perf_counter() - started,
                          "aot_cache": {k: v for k, v in counters["aot_autograd"].items()
                                        if "cache" in k}}))
        print(json.dumps({k: [round(v, 3), part_calls[k]] for k, v in
                          sorted(part_seconds.items(), key=lambda kv: -kv[1]) if v >= 0.005}))
        sys.stdout.flush()
        os._exit(0)
    output_graph.OutputGraph.call_user_compiler = compile_then_exit
'''
# then train_compile_time's step, which prints its JSON line; then the parts on a line of their own
PARTS = r'''
print(json.dumps({k: [round(v, 3), part_calls[k]]
                  for k, v in sorted(part_seconds.items(), key=lambda kv: -kv[1]) if v >= 0.005}))
'''


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--inference", action="store_true",
                        help="one call under no_grad instead of a training step")
    parser.add_argument("--compile-only", action="store_true",
                        help="stop once the backend returns (no step is run; in_backend is "
                             "timed around the first graph's backend call)")
    parser.add_argument("--runs", nargs="+", default=["cold", "warm", "warm"],
                        help="labels, one process each; the first finds the caches empty")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    env = dict(os.environ, FUSION_COMPILER_CACHE_DIR=folder,
               **({"FC_PARTS_COMPILE_ONLY": "1"} if args.compile_only else {}),
               TORCHINDUCTOR_CACHE_DIR=folder + "/inductor", TRITON_CACHE_DIR=folder + "/triton")
    for label in args.runs:
        argv = [args.target, "fusion", args.device] + ["inference"] * args.inference
        done = subprocess.run([sys.executable, "-c", TIMERS + STEP + PARTS, *argv], env=env,
                              text=True, capture_output=True, timeout=900)
        if done.returncode != 0:
            print(label, "failed:", done.stderr[-2000:], flush=True)
            continue
        step, parts = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
        print(label, json.dumps({**step, "parts": parts}), flush=True)


if __name__ == "__main__":
    main()
