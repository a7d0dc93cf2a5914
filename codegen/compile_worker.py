"""A compile worker (codegen/compile_pool.py): a process that compiles generated Triton kernels
into Triton's on-disk cache, where the parent process's compile then finds them.

Run as a script, by path, without TRITON_INTERPRET: it imports Triton only, neither torch nor
this package, so it is ready (Triton imported, its key known, one small kernel compiled so that
Triton's lazy imports and first-compile set-up are done) 0.4-0.9 s after it starts on the H200
device's host. The parent starts its
workers as the backend starts, before aot_autograd traces.

    python compile_worker.py TRITON_LIB_PATH ARCH

Messages are pickles. On the protocol's own pipe (the process's standard output at start; the
standard output itself then goes to standard error, so nothing Triton prints can corrupt it):
    ("ready", seconds)                  once, when warm
    ("done", [error or None, ...])      per request, in order
On standard input, requests: a list of
    (path, kernel name, signature, constexprs, attrs, options, (backend, arch, warp size))
as ``precompile.bind_for_target`` makes them. End of input ends the worker.
"""
import ast
import os
import pickle
import sys
import time
import traceback
import types

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.compiler.compiler import compile as triton_compile

LAUNCHER_IMPORTS = ("torch", "fusion_compiler.codegen.launch")   # what a launcher needs


def kernel_code(path: str):
    """The generated module at ``path``, compiled without its launcher's imports (torch, the
    launch helpers): everything else, at the same lines, so that Triton reads each kernel's
    source, and its starting line, back from the file exactly as the parent does."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    keep = []
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name in LAUNCHER_IMPORTS for a in node.names):
            continue
        if isinstance(node, ast.ImportFrom) and node.module in LAUNCHER_IMPORTS:
            continue
        keep.append(node)
    return compile(ast.Module(keep, type_ignores=[]), path, "exec")


def load_helpers(path: str) -> None:
    """The generated kernels' ``fl`` helpers (codegen/triton_lib.py), from their file, under
    the name the kernels import, without importing this package (whose __init__ imports torch)."""
    import importlib.util

    for name in ("fusion_compiler", "fusion_compiler.codegen"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    spec = importlib.util.spec_from_file_location("fusion_compiler.codegen.triton_lib", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.modules["fusion_compiler.codegen"].triton_lib = module


@triton.jit
def warm_up(x, y, n, BLOCK: tl.constexpr):
    """Compiled first, so that Triton's lazy imports and set-up are done before any request."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n, other=0.0)
    tl.store(y + i, tl.exp(v) + tl.sum(v, 0), mask=i < n)


def main() -> int:
    started = time.perf_counter()
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                   # anything printed goes to standard error
    lib_path, arch = sys.argv[1], int(sys.argv[2])
    from triton.runtime import cache

    key = os.environ.get("FUSION_COMPILER_TRITON_KEY", "")
    if key.startswith(triton.__version__):
        cache.triton_key = lambda: key      # the parent's stored key (codegen/triton_key.py)
    cache.triton_key()
    load_helpers(lib_path)
    triton_compile(ASTSource(warm_up, {"x": "*fp32", "y": "*fp32", "n": "i32",
                                       "BLOCK": "constexpr"}, {(3,): 128}, {}),
                   target=GPUTarget("cuda", arch, 32))
    pickle.dump(("ready", time.perf_counter() - started), channel)
    channel.flush()

    modules: dict = {}
    while True:
        try:
            requests = pickle.load(sys.stdin.buffer)
        except EOFError:
            return 0
        results = []
        for path, name, signature, constexprs, attrs, options, target in requests:
            try:
                module = modules.get(path)
                if module is None:
                    module = types.ModuleType(f"fusion_kernel_worker_{len(modules)}")
                    module.__file__ = path
                    exec(kernel_code(path), module.__dict__)
                    modules[path] = module
                source = ASTSource(module.__dict__[name], signature, constexprs, attrs)
                triton_compile(source, target=GPUTarget(*target), options=options)
                results.append(None)
            except Exception:       # the parent compiles it itself, and reports its error
                results.append(traceback.format_exc(limit=3))
        pickle.dump(("done", results), channel)
        channel.flush()


if __name__ == "__main__":
    sys.exit(main())
