"""Compile workers (codegen/compile_pool.py, compile_worker.py): a kernel a worker compiles is
the one this process then looks up in Triton's cache (a hit, not a second compile), and a
worker that is not ready, fails a kernel or dies leaves its kernels to this process.

Triton's real compiler (for sm_90, without a GPU) runs in a process of its own: Triton's
interpreter, which the CPU tests load, cannot share a process with it."""
import json
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch

from fusion_compiler.codegen import compile_pool, compile_worker, precompile
from helpers import assert_close, compile_and_run, instead_of_compiles, kernel_count
from test_precompile import gqa_attention


def _cases():
    F = torch.nn.functional
    return [
        ("add + RMSNorm", lambda x, y, w: (lambda h: h * torch.rsqrt(
            h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) * w)(x + y),
         (torch.randn(5, 3, 96, dtype=torch.bfloat16), torch.randn(5, 3, 96, dtype=torch.bfloat16),
          torch.randn(96, dtype=torch.bfloat16))),
        # with the repeats kept as copies (FUSION_COMPILER_GROUPED_ATTENTION=0 where the case
        # runs): RoPE of q, RoPE of k with its repeat, v's repeat
        ("attention inputs (a kernel of three parts)", gqa_attention,
         (torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16),
          torch.randn(9, 16), torch.randn(9, 16))),
        ("embedding + layernorm (a gather: debug=True for its index assert)",
         lambda ids, wte, w, b: F.layer_norm(F.embedding(ids, wte) * 2.0, (24,), w, b),
         (torch.randint(0, 50, (2, 7)), torch.randn(50, 24), torch.randn(24), torch.randn(24))),
        ("fp64 tanh (libdevice linked)", lambda x: torch.tanh(x * 2.0) + 1.0,
         (torch.randn(5, 37, dtype=torch.float64),)),
    ]


def _record(monkeypatch) -> list:
    """The launches the first GPU calls of ``_cases`` would make, as ``launch_specs``."""
    specs = []
    instead_of_compiles(monkeypatch,
                        at_finish=lambda ctx: specs.extend(precompile.launch_specs(ctx)))
    monkeypatch.setenv("FUSION_COMPILER_GROUPED_ATTENTION", "0")     # three parts: see _cases
    for name, fn, args in _cases():
        before = len(specs)
        out, reports = compile_and_run(fn, args)
        assert_close(out, fn(*args), name=name)
        assert len(specs) - before >= kernel_count(reports) == 1, name
    return specs


# In a process without the interpreter: `Compiling` over the recorded launches, each run
# here by `compile_for_target` (what `kernel.warmup` does on a GPU), listening for cache hits
_POOL = """
import json, os, pickle, sys, threading, types
from triton import knobs
from triton.backends.compiler import GPUTarget
from fusion_compiler.codegen import compile_pool, precompile
specs, how = pickle.load(sys.stdin.buffer)
target = GPUTarget("cuda", 90, 32)
by_kernel, modules = {}, {}
for spec in specs:
    module = modules.get(spec["path"])
    if module is None:
        module = modules[spec["path"]] = types.ModuleType(f"m{len(modules)}")
        module.__file__ = spec["path"]
        exec(compile(open(spec["path"]).read(), spec["path"], "exec"), module.__dict__)
    kernel = module.__dict__[spec["kernel"]]
    by_kernel.setdefault(kernel, []).append((kernel, (1,), spec["args"], spec["kwargs"]))
pool = compile_pool.CompilePool(2, 90)
ready = [w.poll_ready(120) for w in pool.started()]
if how == "dead":
    for w in pool.workers:
        w.proc.kill()
        w.proc.wait()
if how == "bad request":                # each worker fails what it is sent
    for w in pool.workers:
        real = w.compile
        w.compile = lambda requests, real=real: real([("/no/such/file.py",) + r[1:]
                                                      for r in requests])
compiled = []
knobs.compilation.listener = lambda **kw: compiled.append(
    (threading.current_thread().name, kw["src"].name, kw["cache_hit"]))
ran = []
def run(kernel, launches):
    ran.append(kernel.fn.__name__)
    for _, _, args, kwargs in launches:
        precompile.compile_for_target(kernel, args, kwargs, target)
with precompile.Compiling(run, 2, pool, target) as compiling:
    for calls in by_kernel.values():    # one kernel at a time, as the generate pass adds them
        compiling.add(calls)
counts = compiling.counts
assert not compiling.failed, compiling.failed
alive = [w.alive for w in pool.workers]
pool.close()
print(json.dumps({"ready": ready, "alive": alive, "kernels": len(by_kernel), "ran": len(ran),
                  "by_workers": counts["by_workers"], "compiled": compiled,
                  "exited": [w.proc.returncode for w in pool.workers]}))
"""


def _with_workers(specs, how, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    proc = subprocess.run([sys.executable, "-c", _POOL], input=pickle.dumps((specs, how)),
                          capture_output=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test: on a GPU machine the GPU suite "
                    "compiles through the workers itself")
def test_workers_compile_what_this_process_looks_up(monkeypatch, tmp_path):
    """Every kernel compiled by a worker, and each launch's compile here then a cache hit: the
    worker's compile had the key (source, specialization, options, target) this process
    computes. One kernel of each kind: persistent rows, several parts, a gather with its
    debug assert, libdevice."""
    specs = _record(monkeypatch)
    r = _with_workers(specs, "ready", tmp_path)
    assert r["ready"] == [True, True] and r["alive"] == [True, True]
    assert r["kernels"] == len(_cases()) and r["by_workers"] == r["ran"] == r["kernels"], r
    assert len(r["compiled"]) == len(specs), r["compiled"]
    assert all(hit for _, _, hit in r["compiled"]), r["compiled"]
    assert r["exited"] == [0, 0]           # end of input ends a worker


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test (as above)")
@pytest.mark.parametrize("how", ["dead", "bad request"])
def test_kernels_a_worker_cannot_compile_compile_here(how, monkeypatch, tmp_path):
    """Workers killed before the kernels came, or failing each request: every kernel is still
    compiled, here (no cache hits), and none counts as the workers'."""
    specs = _record(monkeypatch)[:3]
    r = _with_workers(specs, how, tmp_path)
    assert r["by_workers"] == 0 and r["ran"] == r["kernels"] >= 2, r
    assert len(r["compiled"]) == len(specs) and not any(hit for _, _, hit in r["compiled"]), r
    assert r["alive"] == ([False, False] if how == "dead" else [True, True])


def test_worker_code_leaves_out_only_the_launcher_imports(monkeypatch, device):
    """The worker runs a generated module without torch and the launch helpers, each kernel at
    its own line of the file (Triton's cache key includes the line a kernel starts at)."""
    specs = []
    instead_of_compiles(monkeypatch,
                        at_finish=lambda ctx: specs.extend(precompile.launch_specs(ctx)))
    monkeypatch.setenv("FUSION_COMPILER_GROUPED_ATTENTION", "0")     # three parts: see _cases
    name, fn, args = _cases()[1]
    compile_and_run(fn, [a.to(device) for a in args])
    path = specs[0]["path"]
    code = compile_worker.kernel_code(path)
    names = set(code.co_names)
    assert "torch" not in names and "first_launch" not in names, names
    assert {"triton", "tl", "fl", "_multipart_kernel", "_part0", "launch"} <= names, names
    full = types.ModuleType("full")
    exec(compile(open(path).read(), path, "exec"), full.__dict__)
    lean = types.ModuleType("lean")
    exec(code, lean.__dict__)
    assert "torch" in full.__dict__ and "torch" not in lean.__dict__
    for kernel in ("_multipart_kernel", "_part0", "_part1", "_part2"):
        assert (lean.__dict__[kernel].fn.__code__.co_firstlineno
                == full.__dict__[kernel].fn.__code__.co_firstlineno), kernel


def test_workers_leave_two_cores(monkeypatch):
    for cores, requested, expected in [(2, 8, 0), (3, 8, 1), (16, 8, 8), (16, 20, 14), (64, 0, 0)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert compile_pool.workers_for(requested) == expected, (cores, requested)


def test_no_pool_on_a_machine_of_two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(compile_pool, "_POOL", None)
    assert compile_pool.start(8, 90) is None and compile_pool.current() is None


@pytest.mark.gpu
def test_gpu_kernels_compiled_by_ready_workers(monkeypatch, cache_dir, tmp_path, caplog):
    """On the GPU, with two ready workers and empty kernel and Triton caches: every kernel of
    the graph is compiled by a worker (this process's compile is then a cache hit), and the
    compiled graph matches eager."""
    import logging

    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(compile_pool, "_POOL", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    major, minor = torch.cuda.get_device_capability()
    pool = compile_pool.start(2, 10 * major + minor)
    try:
        assert [w.poll_ready(120) for w in pool.started()] == [True, True]
        hits = []
        monkeypatch.setattr(triton.knobs.compilation, "listener",
                            lambda **kw: hits.append(kw["cache_hit"]))
        name, fn, args = _cases()[0]
        args = [a.cuda() for a in args]
        with caplog.at_level(logging.DEBUG, logger="fusion_compiler"):
            out, reports = compile_and_run(fn, args)
        assert_close(out, fn(*args), dtype=torch.bfloat16, name=name)
        assert kernel_count(reports) == 1
        assert "1 of 1 kernels compiled by worker processes" in caplog.text, caplog.text
        assert hits and all(hits), hits
    finally:
        pool.close()


def test_an_idle_pool_is_closed_and_the_next_graph_starts_another(monkeypatch):
    """Workers left unused for IDLE_S exit (each holds ~0.2 GB of host memory); ``start``
    then starts a new pool. A pool in use (its lock held) is not closed."""
    import time

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(compile_pool, "_POOL", None)
    monkeypatch.setattr(compile_pool, "IDLE_S", 0.4)
    pool = compile_pool.start(2, 90)
    workers = pool.started()
    assert len(workers) == 2 and compile_pool.current() is pool
    with pool.lock:                         # in use: kept past its idle time
        time.sleep(1.0)
        assert compile_pool.current() is pool and all(w.alive for w in workers)
    deadline = time.monotonic() + 30
    while compile_pool.current() is pool and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compile_pool.current() is None
    for w in workers:                       # closed: end of input, each worker exits
        assert w.proc.wait(timeout=30) == 0
    again = compile_pool.start(2, 90)
    try:
        assert again is not pool and compile_pool.current() is again
    finally:
        monkeypatch.setattr(compile_pool, "IDLE_S", 60.0)
        again.close()
