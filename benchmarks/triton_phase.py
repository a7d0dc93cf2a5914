"""Where a cold compile's Triton phase goes: per kernel, per stage, per thread. (GPU)

    python benchmarks/triton_phase.py examples/llama.py:bench_1x128

Compiles the model once with the fusion backend on empty kernel and Triton caches, in this
process. Printed: the backend's phase times (its report); for each Triton compile, the thread
it ran on and Triton's own stage times (``knobs.compilation.listener``: the Python front end
that turns the kernel's AST into TTIR, then TTIR, TTGIR, LLVM IR, PTX, cubin); each
``JITFunction.warmup`` span on the compile threads (codegen/precompile.py); each C module
Triton loaded (``compile_module_from_src``: its driver utilities, a kernel's launcher) and
whether gcc built it, with its span; and the Python modules compiled from source (no usable
``.pyc``) during the call, grouped by folder; when each compile worker (codegen/compile_pool.py)
started and was ready. Spans are seconds from the first call's start.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import tempfile
import threading
import time

_root = tempfile.mkdtemp()
os.environ["FUSION_COMPILER_CACHE_DIR"] = os.path.join(_root, "kernels")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_root, "triton")

_from_source: list = []
_source_to_code = importlib.machinery.SourceFileLoader.source_to_code


def _timed_source_to_code(self, data, path, *args, **kwargs):
    t = time.perf_counter()
    code = _source_to_code(self, data, path, *args, **kwargs)
    _from_source.append((path, time.perf_counter() - t))
    return code


importlib.machinery.SourceFileLoader.source_to_code = _timed_source_to_code

import torch  # noqa: E402
import triton.backends.nvidia.driver as triton_driver  # noqa: E402
import triton.runtime.build as triton_build  # noqa: E402
import triton.runtime.jit as triton_jit  # noqa: E402
from triton import knobs  # noqa: E402

import fusion_compiler  # noqa: E402
from fusion_compiler.targets import load_factory  # noqa: E402


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    compiles, spans = [], []

    def listener(src, metadata, metadata_group, times, cache_hit):
        compiles.append((threading.current_thread().name, getattr(src, "name", "?"), times,
                         cache_hit))
    knobs.compilation.listener = listener
    warmup = triton_jit.JITFunction.warmup

    def timed_warmup(self, *args, **kwargs):
        t = time.perf_counter()
        result = warmup(self, *args, **kwargs)
        spans.append((threading.current_thread().name, self.__name__, t, time.perf_counter()))
        return result
    triton_jit.JITFunction.warmup = timed_warmup
    modules = []        # (thread, what, start, end): C modules loaded, and gcc's builds of them

    def timed(owner, name, what, position):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                label = kwargs.get("name", args[position] if len(args) > position else "?")
                modules.append((threading.current_thread().name, f"{what} {label}", t,
                                time.perf_counter()))
        setattr(owner, name, wrapper)
    timed(triton_driver, "compile_module_from_src", "loaded", 1)    # (src, name, ...)
    timed(triton_build, "_build", "gcc", 0)                         # (name, src, ...)

    model, inputs = load_factory(sys.argv[1])[0](device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    mark = len(_from_source)
    with fusion_compiler.capture_compiles() as reports, torch.no_grad():
        start = time.perf_counter()
        torch.compile(model, backend="fusion")(*inputs)
        torch.cuda.synchronize()
        print(f"first call {time.perf_counter() - start:.2f} s")
    for r in reports:
        print("phases (s):", {k: round(v, 3) for k, v in r.phase_seconds.items()},
              "kernels by workers: {} of {}".format(*r.kernels_by_workers))
    from fusion_compiler.codegen import compile_pool
    pool = compile_pool.current()
    for i, w in enumerate(pool.started() if pool is not None else []):
        ready = ("not ready" if w.ready_seconds is None else f"ready {w.ready_seconds:.3f} s "
                 f"after, at {w.started_at + w.ready_seconds - start:.3f}")
        print(f"worker {i}: started at {w.started_at - start:.3f} s, {ready}")
    print(f"{len(compiles)} Triton compiles ({sum(c[3] for c in compiles)} cache hits), s:")
    totals: dict = {}
    for thread, name, times, _ in compiles:
        stages = [("front end", times.ir_initialization / 1e6)]
        stages += [(n, v / 1e6) for n, v in times.lowering_stages]
        for n, v in stages:
            totals[n] = totals.get(n, 0.0) + v
        print(f"  {thread:18s} {name:22s} " + "  ".join(f"{n} {v:.3f}" for n, v in stages))
    print("  all kernels         " + "  ".join(f"{n} {v:.3f}" for n, v in totals.items()))
    print("warmup spans and C modules (s from the first call's start):")
    for thread, name, a, b in sorted(spans + modules, key=lambda s: s[2]):
        if b - a > 1e-3:
            print(f"  {thread:18s} {name:30s} {a - start:.3f} -> {b - start:.3f}")
    during = _from_source[mark:]
    print(f"modules compiled from source during the call: {len(during)}, "
          f"{sum(s for _, s in during):.3f} s")
    folders: dict = {}
    for path, s in during:
        key = "/".join(path.split("/")[-4:-1])
        folders[key] = folders.get(key, 0.0) + s
    for key, s in sorted(folders.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {s:.3f}  {key}")
    print(f"before the call: {mark} modules from source, "
          f"{sum(s for _, s in _from_source[:mark]):.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
