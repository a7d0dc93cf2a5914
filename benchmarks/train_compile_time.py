"""Compile time of a training step (forward + backward), each run in a fresh process (GPU).

    python benchmarks/train_compile_time.py examples/gpt2.py:bench_8x512 examples/llama.py:bench_4x1024

For each target, in this order, each in its own Python process (nothing cached in memory):
  fusion cold            empty caches (kernels, decisions, aot_autograd's results)
  fusion warm            the same caches, a second process: aot_autograd's result loaded
                         (fusion_compiler/aot_cache.py)
  fusion warm, no aot    the same caches with FUSION_COMPILER_AOT_CACHE=0: aot_autograd traces
                         and partitions again (the backend before aot_cache.py)
  fusion cold, no aot    empty caches of its own, FUSION_COMPILER_AOT_CACHE=0: what keeping
                         aot_autograd's result adds to a cold compile
  inductor cold / warm   torch.compile's default, empty caches, then a second process
Each row: the first step's wall time (model built, inputs made and the GPU synchronized before
the clock starts; the step is the compiled forward, a sum of squares and its backward), and
Dynamo's metric of the time inside the backend (``OutputGraph.call_user_compiler``: the
forward's aot_autograd and compiler; the backward compiles there too when it is not lazy).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# argv: target, backend[, device: "cuda" (bf16) or "cpu" (fp32)[, "inference": one call under
# no_grad instead of the step]]; benchmarks/compile_parts.py runs it too, with timers installed
CHILD = r'''
import json, sys, time, torch
from fusion_compiler.targets import load_factory
import fusion_compiler
from torch._dynamo.utils import counters
target, backend = sys.argv[1], sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
training = sys.argv[4:5] != ["inference"]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
model, inputs = load_factory(target)[0](
    device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)[:2]
model.train(training)
sync()
t0 = time.perf_counter()
with torch.set_grad_enabled(training):
    out = torch.compile(model, backend=backend)(*inputs)
if training:
    out = out if isinstance(out, torch.Tensor) else out[0]
    out.float().square().sum().backward()
sync()
seconds = time.perf_counter() - t0
from torch._dynamo.utils import compilation_time_metrics as metrics
print(json.dumps({"seconds": seconds,
                  "in_backend": sum(metrics.get("OutputGraph.call_user_compiler", [])),
                  "aot_cache": {k: v for k, v in counters["aot_autograd"].items()
                                if "cache" in k}}))
'''


def step(target: str, backend: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, target, backend], env=env, text=True,
                          capture_output=True, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("targets", nargs="+")
    parser.add_argument("-o", "--output", help="also write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for target in args.targets:
        fusion_dir, inductor_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
        env = dict(os.environ, FUSION_COMPILER_CACHE_DIR=fusion_dir,
                   TORCHINDUCTOR_CACHE_DIR=inductor_dir, TRITON_CACHE_DIR=inductor_dir + "/t")
        off = {"FUSION_COMPILER_AOT_CACHE": "0"}
        runs = [("fusion cold", "fusion", {}), ("fusion warm", "fusion", {}),
                ("fusion warm, no aot", "fusion", off),
                ("fusion cold, no aot", "fusion",
                 dict(off, FUSION_COMPILER_CACHE_DIR=tempfile.mkdtemp())),
                ("inductor cold", "inductor", {}), ("inductor warm", "inductor", {})]
        for label, backend, extra in runs:
            result = step(target, backend, dict(env, **extra))
            rows.append({"target": target, "run": label, **result})
            if "error" in result:
                print(f"{target:34s} {label:20s} failed: {result['error']}", flush=True)
                continue
            print(f"{target:34s} {label:20s} {result['seconds']:7.2f} s  in backend "
                  f"{result['in_backend']:6.2f} s  {result['aot_cache']}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
