"""Where a cold first call's time goes besides Triton's compiler: the C modules Triton builds
for its launchers (one per argument signature, by gcc on a cold cache). GPU; BENCHMARKS.md.

    python benchmarks/launcher_builds.py examples/gpt2.py:bench_8x512 fusion|inductor

Empty Triton, Inductor and fusion caches (a temporary folder); wraps Triton's
``compile_module_from_src`` (every C module load, built or cached) and ``_build`` (the gcc
runs) to count them and sum their time, then prints one JSON object for the first call.
"""
import collections
import json
import os
import sys
import tempfile
import time

_tmp = tempfile.mkdtemp()
os.environ.update(TRITON_CACHE_DIR=f"{_tmp}/triton", FUSION_COMPILER_CACHE_DIR=f"{_tmp}/fusion",
                  TORCHINDUCTOR_CACHE_DIR=f"{_tmp}/inductor")

import torch  # noqa: E402
import triton.backends.nvidia.driver as driver  # noqa: E402
import triton.runtime.build as build  # noqa: E402

import fusion_compiler  # noqa: E402
from fusion_compiler.targets import load_factory  # noqa: E402

stats = collections.defaultdict(lambda: [0, 0.0])


def timed(module, name, key):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            stats[key][0] += 1
            stats[key][1] += time.perf_counter() - start
    setattr(module, name, wrapper)


def main() -> int:
    target, backend = sys.argv[1], sys.argv[2]
    timed(driver, "compile_module_from_src", "C modules loaded (compile_module_from_src)")
    timed(build, "_build", "C modules built by gcc (_build)")
    model, inputs = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with fusion_compiler.capture_compiles() as reports, torch.no_grad():
        start = time.perf_counter()
        torch.compile(model, backend=backend)(*inputs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    print(json.dumps({"target": target, "backend": backend, "first_call_s": seconds,
                      "passes_s": sum(r.compile_seconds for r in reports),
                      "builds": {k: {"calls": n, "seconds": round(t, 3)}
                                 for k, (n, t) in stats.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
