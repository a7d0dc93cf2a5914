"""How long Triton takes to compile a model's generated kernels, measured without a GPU.

    python benchmarks/kernel_compile_time.py examples/gpt2.py:make_model_and_inputs \
        --factory-args batch=1 seq=8 n_layer=12 n_embd=768 n_head=12 vocab_size=50257 \
        n_positions=1024 --threads 1 2

The model is compiled by the fusion backend on the CPU with the kernels run in Triton's
interpreter (small shapes keep that quick: the kernels' structure, not their sizes, sets the
compile time), recording each launch the first GPU call would make (as the sm_90 test of
tests/test_precompile.py does). Then, in a process of its own (Triton's interpreter and its
compiler cannot share one) and with an empty Triton cache, every distinct launch is compiled
for sm_90 (front end, MLIR, LLVM, ptxas) on ``--threads`` threads, and the time of each is
printed, with Triton's stage times (front end: the kernel's AST to TTIR, in Python, holding
the GIL; then TTIR, TTGIR, LLVM IR, PTX, cubin) and the libdevice functions each kernel links.
Loading the binaries and building Triton's C launchers needs a GPU and is not included.
``--save-specs DIR`` keeps the recorded launches and their modules, and ``--specs DIR``
compiles them elsewhere, e.g. on the GPU's host, whose Python is slower than this machine's:

    python benchmarks/kernel_compile_time.py examples/llama.py:bench_1x128 \
        --factory-args --save-specs /tmp/llama_specs            # here, in the interpreter
    python benchmarks/kernel_compile_time.py - --specs /tmp/llama_specs --threads 1 2 4 8
"""
import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

COMPILE = r'''
import concurrent.futures, json, pickle, sys, threading, time
from triton import knobs
from triton.backends.compiler import GPUTarget
from fusion_compiler.codegen.precompile import compile_specs
specs, threads = pickle.load(sys.stdin.buffer)
stages = threading.local()
def listener(src, metadata, metadata_group, times, cache_hit):
    stages.times = [("front end", times.ir_initialization / 1e6)] + [
        (n, v / 1e6) for n, v in times.lowering_stages]
knobs.compilation.listener = listener
def one(spec):
    t = time.perf_counter()
    stages.times = []
    (r,) = compile_specs([spec], GPUTarget("cuda", 90, 32))
    return dict(r, seconds=time.perf_counter() - t, stages=stages.times)
# one kernel's launches on one thread, one after another, as the backend's compile threads take
# them (codegen/precompile.Compiling): launches of one kernel that compile to the same
# binary are then a cache hit, not two compiles racing each other
# Triton's key is computed once per process, and the backend keeps it on disk
# (codegen/triton_key.py): computed here first, so that no thread times its hashing
from triton.runtime.cache import triton_key
triton_key()
by_kernel = {}
for spec in specs:
    by_kernel.setdefault((spec["path"], spec["kernel"]), []).append(spec)
t = time.perf_counter()
with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    rows = [r for rs in pool.map(lambda ss: [one(s) for s in ss], by_kernel.values()) for r in rs]
print(json.dumps({"seconds": time.perf_counter() - t, "kernels": rows}))
'''


def record(target: str, factory_args: dict, dtype=None) -> list:
    """The distinct launches of the target's first call, as plain data."""
    import torch

    from fusion_compiler.codegen import precompile
    from fusion_compiler.passes import generate
    from fusion_compiler.targets import load_factory

    specs = {}

    class Recorder:         # in place of generate.KernelCompiles: records, compiles nothing
        def __init__(self, ctx):
            self.ctx = ctx

        def add(self, group, launch):
            pass

        def finish(self):
            for spec in precompile.launch_specs(self.ctx):
                specs.setdefault(repr(sorted(spec.items())), spec)
            return 0
    generate.LEAN = True
    generate.KernelCompiles = Recorder
    factory = load_factory(target)[0]
    model, inputs = factory(**factory_args, **({"dtype": dtype} if dtype is not None else {}))
    with torch.no_grad():
        torch.compile(model, backend="fusion")(*inputs)
    return list(specs.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--factory-args", nargs="*", default=[], metavar="KEY=INT")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="the factory's dtype argument (the bench factories' is bfloat16)")
    ap.add_argument("--save-specs", metavar="DIR",
                    help="also write the recorded launches and their kernel modules here")
    ap.add_argument("--specs", metavar="DIR",
                    help="compile the launches --save-specs wrote instead of recording (on "
                         "another machine, such as the GPU's host; target is then ignored)")
    a = ap.parse_args()
    if a.specs:
        with open(os.path.join(a.specs, "specs.pkl"), "rb") as f:
            specs = pickle.load(f)
        for spec in specs:
            spec["path"] = os.path.join(os.path.abspath(a.specs), spec["path"])
        compile_all(specs, a.threads)
        return
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # re-run this script with the interpreter on, before triton is imported
        env = dict(os.environ, TRITON_INTERPRET="1")
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    import torch
    specs = record(a.target, {k: int(v) for k, v in (kv.split("=") for kv in a.factory_args)},
                   getattr(torch, a.dtype) if a.dtype else None)
    if a.save_specs:
        os.makedirs(a.save_specs, exist_ok=True)
        saved = []
        for spec in specs:
            shutil.copy(spec["path"], a.save_specs)
            saved.append(dict(spec, path=os.path.basename(spec["path"])))
        with open(os.path.join(a.save_specs, "specs.pkl"), "wb") as f:
            pickle.dump(saved, f)
    compile_all(specs, a.threads)


def compile_all(specs: list, thread_counts: list) -> None:
    """Compile ``specs`` on each number of threads, each in a fresh process and Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for threads in thread_counts:
        with tempfile.TemporaryDirectory() as cache:
            env["TRITON_CACHE_DIR"] = cache
            proc = subprocess.run([sys.executable, "-c", COMPILE],
                                  input=pickle.dumps((specs, threads)), capture_output=True,
                                  env=env, check=True)
        result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        compiled = [k for k in result["kernels"] if k["seconds"] > 0.005]   # not a cache hit
        print(f"{len(specs)} distinct launches ({len(compiled)} compiled, the rest the same "
              f"kernel), {threads} thread(s): {result['seconds']:.2f} s")
        for k in compiled:
            print(f"  {k['name']:22s} {k['seconds']:.2f} s  libdevice: {k['libdevice'] or '-'}")
            print("      " + "  ".join(f"{n} {v:.3f}" for n, v in k.get("stages", [])))
        totals: dict = {}
        for k in compiled:
            for n, v in k.get("stages", []):
                totals[n] = totals.get(n, 0.0) + v
        print("  all kernels, s: " + "  ".join(f"{n} {v:.3f}" for n, v in totals.items()))


if __name__ == "__main__":
    main()
