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

import concurrent.futures
import re
import types

import torch
from triton.runtime.jit import MockTensor

from ..passes.shapes import hint
from .launch import fits_static


class StandIn(MockTensor):
    """In place of a tensor: its dtype, and an address as aligned as the tensor's will be."""

    def __init__(self, dtype, address: int = 0):
        super().__init__(dtype)
        self.address = address

    def data_ptr(self) -> int:
        return self.address

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
    types.FunctionType(launch.func.__code__, env, "launch")(device, *inputs, *syms)
    return calls


def stand_ins(group, hints: dict) -> tuple:
    """(inputs, size values) for ``group``'s launcher at the size hints."""
    inputs = []
    for node in group.inputs:
        info = node.meta["fc_tensor"]
        inputs.append(StandIn(info.dtype, hint(info.storage_offset, hints) * info.itemsize))
    return inputs, [hint(s, hints) for s in group.graph_symbols]


def compile_for_target(kernel, args, kwargs, target):
    """Compile one recorded launch with Triton's own compiler (front end, MLIR, LLVM, ptxas)
    for ``target`` (a ``GPUTarget``), on a machine without that GPU: the steps of
    ``JITFunction.run`` up to its compile (argument binding and specialization, options), with
    the backend made for ``target`` instead of the current device's. The CPU tests compile the
    generated kernels this way for sm_90, where Triton's interpreter would hide a kernel the
    real compiler rejects. Returns Triton's ``CompiledKernel``."""
    from triton import knobs
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.compiler.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton_compile(source, target=target, options=options.__dict__)


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


def compile_launches(calls: list, device: torch.device, threads: int) -> dict:
    """Compile the recorded launches, ``threads`` at a time; return {kernel: exception} for the
    kernels Triton could not compile."""
    by_kernel: dict = {}
    for call in calls:
        by_kernel.setdefault(call[0], []).append(call)

    def work(kernel_calls):
        # a thread starts on device 0: Triton compiles for, and caches under, the current one
        with torch.cuda.device(device):
            for kernel, grid, args, kwargs in kernel_calls:
                compiled = kernel.warmup(*args, grid=grid, **kwargs)
                if fits_static(compiled, len(args)) is not None:
                    continue        # torch's launcher will launch it (launch.first_launch)
                # on its first launch Triton would also load the binary and build the kernel's
                # C launcher (a C compiler run per argument signature, cached on disk); done
                # here it runs beside the others, and "out of shared memory" shows up now
                load = getattr(compiled, "_init_handles", None)
                if load is not None:
                    load()

    failed = {}
    workers = max(1, min(threads, len(by_kernel)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fc-compile") as pool:
        futures = {pool.submit(work, c): k for k, c in by_kernel.items()}
        for future in concurrent.futures.as_completed(futures):
            if future.exception() is not None:
                failed[futures[future]] = future.exception()
    return failed
