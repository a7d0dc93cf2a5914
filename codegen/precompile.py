"""Compile a graph's Triton kernels at compile time, several at once.

Triton compiles a kernel on its first launch, so a new graph's kernels would compile one after
another inside its first call: about 0.14 s each on the H200's host, most of a cold compile.
Here each generated launcher runs once at compile time on stand-ins (the size hints for sizes;
for tensors, objects that carry a dtype and an address with the tensor's alignment) with a
recorder in place of each Triton kernel. The recorded launches are compiled with
``JITFunction.warmup`` on a thread pool; those torch's prebuilt launcher cannot launch
(``launch.fits_static``) are also loaded, which builds Triton's C launcher for the kernel's
signature. Triton keeps each result in the kernel's own cache, where the first real launch
finds it. Threads overlap what runs outside the GIL (ptxas and the C compiler at least):
16 kernels took 2.29 s one after another and 1.16 s on 8 threads on the H200 device's host
(`python benchmarks/thread_compile.py`).

A launch predicted wrong (an input at an address no compile-time value shows, a host scalar's
value) costs what it did before: the first call compiles the variant it needs.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import threading
import time
import types

import torch
from triton.runtime.jit import MockTensor

from ..passes.shapes import hint
from .launch import fits_static

log = logging.getLogger("fusion_compiler")


class StandIn(MockTensor):
    """In place of a tensor: its dtype, and an address as aligned as the tensor's will be."""

    def __init__(self, dtype, address: int = 0):
        super().__init__(dtype)
        self.address = address

    def data_ptr(self) -> int:
        return self.address

    def narrow(self, *args):
        """A padded output's margin, which its launcher zeroes (row_outputs.pad_slabs)."""
        return self

    def zero_(self):
        return self

    def item(self):
        # a 0-dim CPU tensor passed by value: floats are not specialized; for an integer 2
        # stands for "neither 1 nor a multiple of 16", Triton's usual case
        return 0.5 if self.dtype.is_floating_point else (True if self.dtype == torch.bool else 2)


class _Recorder:
    """In place of a Triton kernel: ``kernel[grid](...)`` records the launch instead."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.calls.append((self.kernel, grid, args, kwargs))
        return record


def recorded_launches(launch, inputs, syms) -> list:
    """The Triton launches generated launcher ``launch`` (generate's partial) makes for these
    inputs, as (kernel, grid, args, kwargs), made against recorders: nothing runs."""
    module = launch.func.__globals__
    device = launch.args[0]
    calls: list = []
    env = dict(module)
    for name in module:
        if name.startswith("_COMPILED_"):
            kernel = name[len("_COMPILED_"):]
            env[name] = {}                                  # every launch takes Triton's path
            env[f"_{kernel}_kernel"] = _Recorder(module[f"_{kernel}_kernel"], calls)
    env.update(first_launch=lambda table, key, kernel, grid, *a, **kw: kernel[(grid,)](*a, **kw),
               FAST_ALLOC=True, current_device=lambda: device.index,
               empty_cuda=lambda size, stride, dtype: StandIn(dtype))
    types.FunctionType(launch.func.__code__, env, "launch", launch.func.__defaults__)(
        device, *inputs, *syms)
    return calls


def stand_ins(group, hints: dict) -> tuple:
    """(inputs, size values) for ``group``'s launcher at the size hints."""
    inputs = []
    for node in group.inputs:
        info = node.meta["fc_tensor"]
        inputs.append(StandIn(info.dtype, hint(info.storage_offset, hints) * info.itemsize))
    return inputs, [hint(s, hints) for s in group.graph_symbols]


def bind_for_target(kernel, args, kwargs, target) -> tuple:
    """What Triton compiles one launch of ``kernel`` (a JITFunction) with, for ``target`` (a
    ``GPUTarget``): the steps of ``JITFunction.run`` up to its compile (argument binding and
    specialization, options), as ``(signature, constexprs, attrs, options)``, plain data."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    backend = _backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    return signature, constexprs, attrs, options.__dict__


@functools.lru_cache(maxsize=None)
def _backend(target):
    from triton.compiler.compiler import make_backend

    return make_backend(target)


def compile_for_target(kernel, args, kwargs, target):
    """Compile one recorded launch with Triton's own compiler (front end, MLIR, LLVM, ptxas)
    for ``target`` (a ``GPUTarget``), on a machine without that GPU, as ``JITFunction.run``
    would on one (``bind_for_target``). The CPU tests compile the generated kernels this way
    for sm_90, where Triton's interpreter would hide a kernel the real compiler rejects.
    Returns Triton's ``CompiledKernel``."""
    from triton.compiler.compiler import ASTSource
    from triton.compiler.compiler import compile as triton_compile

    signature, constexprs, attrs, options = bind_for_target(kernel, args, kwargs, target)
    return triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options)


def launch_specs(ctx) -> list:
    """The launches a compiled graph's first call will make (its context ``ctx``), as plain
    data for ``compile_specs``: each names the generated module's file, one of its kernels and
    the recorded arguments."""
    paths = {k["group"]: k["path"] for k in ctx.kernels}
    specs = []
    for g in ctx.groups:
        launch = ctx.launchers.get(g.id)
        if launch is None:
            continue
        names = {id(v): k for k, v in launch.func.__globals__.items() if k.endswith("_kernel")}
        for kernel, _grid, args, kwargs in recorded_launches(launch, *stand_ins(g, ctx.size_hints)):
            specs.append({"path": paths[g.id], "kernel": names[id(kernel)], "args": args,
                          "kwargs": kwargs})
    return specs


def compile_specs(specs: list, target, asm: tuple = ()) -> list:
    """Compile launches described by plain data (for a process of its own, where Triton's
    interpreter has never been loaded): each spec names a generated module's file, one of its
    kernels and the recorded arguments. Returns, per spec, the compiled kernel's name, shared
    memory, cubin size and the libdevice functions it calls, and the text of each stage named
    in ``asm`` ("ptx", "llir", ...)."""
    import sys
    from pathlib import Path

    done = []
    for spec in specs:
        path = spec["path"]
        name = f"fusion_kernel_{Path(path).stem}_for_target"
        module = sys.modules.get(name)
        if module is None:
            module = types.ModuleType(name)
            module.__file__ = path
            sys.modules[name] = module
            exec(compile(Path(path).read_text(), path, "exec"), module.__dict__)
        compiled = compile_for_target(module.__dict__[spec["kernel"]], spec["args"],
                                      spec["kwargs"], target)
        done.append({"name": compiled.metadata.name, "shared": compiled.metadata.shared,
                     "cubin_bytes": len(compiled.asm["cubin"]),
                     "libdevice": sorted(set(re.findall(r"__nv_\w+", compiled.asm["llir"]))),
                     **{stage: compiled.asm[stage] for stage in asm}})
    return done


_DRIVER: threading.Thread | None = None


def prepare_driver() -> None:
    """Create Triton's CUDA driver now, on a thread of its own, while aot_autograd traces.
    Creating it builds Triton's driver utilities (a C module) with gcc on a cold Triton cache:
    0.3-0.75 s on the H200 device's host. Left to the compile threads, each of them created a
    driver of its own at once, six gcc runs side by side, and that was most of a cold Triton
    phase (Llama 1 x 128: six gcc runs over 0.6-0.78 s of the phase's 1.05 s, session 15,
    ``benchmarks/triton_phase.py``). gcc runs outside the GIL, so the thread costs the tracing
    little. It also takes the backend's hash (ptxas's version). ``compile_launches`` waits for
    it."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = threading.Thread(target=_create_driver, name="fc-triton-driver", daemon=True)
        _DRIVER.start()


def _create_driver() -> None:
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime import driver

        driver.active.utils         # noqa: B018  (created on first use)
        # the backend's part of every kernel's cache key: on CUDA it runs `ptxas --version`
        # (twice, each cached for the process), which a warm compile's first cache lookup
        # would otherwise wait for (get_ptxas 0.1 s under cProfile in a warm GPT-2 compile)
        make_backend(driver.active.get_current_target()).hash()
        # a process's first argument binding imports Triton's gluon packages (Triton 3.6's
        # native specializer; 54-65 ms on the H200 device's host): here, while aot_autograd
        # traces, not on the compile thread that binds the first kernel request (it held up
        # every request by 105 ms, session 38)
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        native_specialize_impl(BaseBackend, StandIn(torch.float32, 0), False, True, True)
    except Exception as exc:        # the compile threads will meet it again, and report it
        log.debug("fusion-compiler: Triton's driver not prepared (%s)", exc)


def compile_launches(calls: list, device: torch.device, threads: int, pool=None,
                     counts: dict | None = None) -> dict:
    """Compile the recorded launches, ``threads`` at a time, with the help of ``pool``'s
    workers (codegen/compile_pool.py) where it has any; return {kernel: exception} for the
    kernels Triton could not compile. ``counts`` gets how many kernels each way compiled."""
    compiling = Compiling(functools.partial(compile_here, device), threads, pool,
                          cuda_target(device) if pool is not None else None)
    with compiling:
        compiling.add(calls)
    if counts is not None:
        counts.update(compiling.counts)
    return compiling.failed


def cuda_target(device: torch.device):
    from triton.backends.compiler import GPUTarget

    major, minor = torch.cuda.get_device_capability(device)
    return GPUTarget("cuda", 10 * major + minor, 32)


def compile_here(device: torch.device, kernel, kernel_calls: list) -> None:
    """Compile ``kernel``'s recorded launches in this process (a cache hit where a worker
    compiled them), for ``device``."""
    # a thread starts on device 0: Triton compiles for, and caches under, the current one (a
    # CPU graph's kernels, on a GPU machine where Triton's interpreter was turned on after it
    # loaded: interpreted, warmup compiles nothing)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        for _, grid, args, kwargs in kernel_calls:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            if compiled is None or fits_static(compiled, len(args)) is not None:
                continue        # torch's launcher will launch it (launch.first_launch)
            # on its first launch Triton would also load the binary and build the kernel's
            # C launcher (a C compiler run per argument signature, cached on disk); done
            # here it runs beside the others, and "out of shared memory" shows up now
            load = getattr(compiled, "_init_handles", None)
            if load is not None:
                load()


class Compiling:
    """Kernels compiled while the caller goes on: ``add`` launches as they become known (the
    generate pass adds each group's as its source is ready), ``wait`` for them all.

    Each kernel goes to a ready worker of ``pool`` (compiled for ``target`` there, then
    ``run(kernel, launches)`` here: a cache hit); while no worker is ready, up to ``threads``
    threads ``run`` kernels here, which compiles them. Without workers, ``threads`` threads
    run them all. A launch already added (the same kernel, arguments and options: a
    repeated layer's kernel) is not added again. ``failed`` maps each kernel that raised to
    its exception; ``counts`` says how many kernels there were and how many the workers
    compiled. While in use it holds ``pool.lock``: ``wait`` (or leaving a ``with`` block)
    releases it."""

    def __init__(self, run, threads: int, pool=None, target=None):
        self.failed: dict = {}
        self._run, self._threads, self._pool, self._target = run, max(1, threads), pool, target
        self._seen: set = set()           # launches added
        self._kernels: set = set()         # kernels added
        self._by_workers: set = set()      # kernels a worker compiled
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._workers: list | None = None       # None: not started (nothing added yet)
        self._started: list = []
        self._locked = False

    @property
    def counts(self) -> dict:
        return {"kernels": len(self._kernels), "by_workers": len(self._by_workers)}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.wait()

    def add(self, calls: list) -> None:
        """Queue recorded launches (kernel, grid, args, kwargs); a kernel's launches stay
        together in one job."""
        jobs: dict = {}
        for call in calls:
            kernel, _, args, kwargs = call
            try:
                key = (kernel, _launch_key(args), _launch_key(sorted(kwargs.items())))
                if key in self._seen:
                    continue
                self._seen.add(key)
            except TypeError:       # an argument that does not hash: added, as it comes
                pass
            jobs.setdefault(kernel, []).append(call)
        if not jobs:
            return
        if self._workers is None:
            self._start()
        with self._cond:
            self._kernels.update(jobs)
            self._jobs.extend(jobs.items())
            self._cond.notify_all()

    def _start(self) -> None:
        workers = []
        if self._pool is not None and self._target is not None:
            self._pool.lock.acquire()
            self._locked = True
            workers = [w for w in self._pool.started() if w.alive]
            for w in workers:
                w.poll_ready(0.0)
            workers = [w for w in workers if w.alive]
        self._workers = workers
        targets = [functools.partial(self._via, w) for w in workers]
        targets += [self._here] * self._threads
        for i, target in enumerate(targets):
            t = threading.Thread(target=target, name=f"fc-compile-{i}", daemon=True)
            t.start()
            self._started.append(t)

    def wait(self) -> dict:
        """Wait for every kernel added; returns ``failed``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._started:
            t.join()
        try:
            while self._jobs:       # left by workers that died after the others stopped
                self._do(*self._jobs.popleft())
        finally:
            if self._locked:
                self._locked = False
                self._pool.last_used = time.monotonic()
                self._pool.lock.release()
        return self.failed

    def _take(self, while_no_worker_ready: bool = False):
        """The next job; None once none is left (after ``wait``), or, for a thread that
        compiles only while no worker is ready, once one is."""
        with self._cond:
            while True:
                if while_no_worker_ready and any(w.ready for w in self._workers):
                    return None
                if self._jobs:
                    return self._jobs.popleft()
                if self._closed:
                    return None
                self._cond.wait()

    def _do(self, kernel, kernel_calls) -> None:
        if _DRIVER is not None:
            _DRIVER.join()
        try:
            self._run(kernel, kernel_calls)
        except Exception as exc:
            self.failed[kernel] = exc

    def _here(self) -> None:
        while (job := self._take(while_no_worker_ready=True)) is not None:
            self._do(*job)

    def _via(self, worker) -> None:
        while not worker.poll_ready(0.005):
            if not worker.alive or (self._closed and not self._jobs):
                return
        with self._cond:
            self._cond.notify_all()     # the threads compiling here stop taking kernels
        where = (self._target.backend, self._target.arch, self._target.warp_size)
        while worker.alive and (job := self._take()) is not None:
            kernel, kernel_calls = job
            if _DRIVER is not None:
                _DRIVER.join()
            path = kernel.fn.__code__.co_filename
            try:
                requests = [(path, kernel.fn.__name__,
                             *bind_for_target(kernel, args, kwargs, self._target), where)
                            for _, _, args, kwargs in kernel_calls]
            except Exception:           # compiled here instead, which reports the error
                requests = None
            if requests is not None:
                results = worker.compile(requests)
                if results is not None and not any(results):
                    with self._cond:
                        self._by_workers.add(kernel)
            self._do(kernel, kernel_calls)  # a cache hit where the worker compiled it


def _launch_key(values) -> tuple:
    """What tells two recorded launches of one kernel apart, as a hashable value: a stand-in
    by its dtype and address, anything else by its value."""
    return tuple((v.dtype, v.address) if isinstance(v, StandIn)
                 else _launch_key(v) if isinstance(v, (tuple, list)) else v for v in values)
