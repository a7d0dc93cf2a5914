"""The backend as users meet it: registration, packaging, CPU fallback, dynamic shapes, odd
inputs, configuration errors, training."""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import operator
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fusion_compiler
from fusion_compiler.config import Config, ConfigError
from helpers import (as_tuple, assert_close, compile_and_run, current_cache, kernel_count,
                     leftover_aten)

SUBPROCESS_TIMEOUT = 180


def keys_of(reports):
    return {k["key"] for r in reports for k in r.kernels}


# ------------------------------------------------------------------- registration, packaging
def test_backend_registered_by_entry_point():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    (ep,) = [e for e in eps if e.name == "fusion"]
    assert ep.value == "fusion_compiler.backend:fusion_backend"
    assert ep.load() is fusion_compiler.fusion_backend
    assert "fusion" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("fusion") is fusion_compiler.fusion_backend


def test_subpackages_import_through_package_dir_mapping():
    codegen = importlib.import_module("fusion_compiler.codegen")
    passes = importlib.import_module("fusion_compiler.passes")
    root = Path(fusion_compiler.__file__).resolve().parent.parent
    assert Path(codegen.__file__).resolve().parent == root / "codegen"
    assert Path(passes.__file__).resolve().parent == root / "passes"
    from fusion_compiler.codegen import cache, kernel_ir, render  # noqa: F401
    from fusion_compiler.passes import pipeline, shapes
    # Relative imports across the two mapped folders resolve to the same modules.
    assert kernel_ir.TensorInfo is shapes.TensorInfo
    assert pipeline.generate.generate is render.generate


def test_subpackages_import_outside_the_checkout(tmp_path):
    """From another folder (the checkout not on sys.path) the installed mapping is what works."""
    code = ("import fusion_compiler.codegen.cache, fusion_compiler.passes.pipeline, sys; "
            "import torch; assert 'fusion' in torch._dynamo.list_backends(); "
            "print(fusion_compiler.codegen.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith(os.path.join("codegen", "__init__.py"))


# ---------------------------------------------------------------------------- CPU fallback
CPU_CHILD = textwrap.dedent('''
    import json, logging, os
    import torch
    import fusion_compiler
    from fusion_compiler import backend

    records = []

    class Sink(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("fusion_compiler")
    log.setLevel(logging.INFO)
    log.addHandler(Sink())

    def f(x):
        return torch.softmax(x * 2, -1) + 1

    def g(x, y):
        return (x * y).relu() - y

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with fusion_compiler.capture_compiles() as reports:
        ok_f = torch.allclose(torch.compile(f, backend="fusion")(x), f(x), atol=1e-6)
        torch._dynamo.reset()
        ok_g = torch.allclose(torch.compile(g, backend="fusion")(x, y), g(x, y), atol=1e-6)
    cache_dir = backend.kernel_cache(fusion_compiler.Config.from_env()).root
    print("RESULT " + json.dumps({
        "ok": [ok_f, ok_g],
        "reports": [[r.kind, r.ran_kernels, r.num_kernels] for r in reports],
        "cpu_messages": sum("CPU tensors run the ATen graph" in m for m in records),
        "generated": sum(c.generated for c in backend._caches.values()),
        # kernel sources only: the fusion decisions (graphs/) are cached on the CPU too
        "cache_files": sorted(str(p) for p in cache_dir.rglob("*.py")) if cache_dir.exists() else [],
        "interpret": os.environ.get("TRITON_INTERPRET"),
    }))
''')


def test_cpu_fallback_without_interpreter(tmp_path):
    script = tmp_path / "cpu_child.py"
    script.write_text(CPU_CHILD)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSION_COMPILER_CACHE_DIR"] = str(tmp_path / "cache")
    env["FUSION_COMPILER_STRICT"] = "1"
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    assert res["interpret"] is None
    assert res["ok"] == [True, True]
    assert [r[0] for r in res["reports"]] == ["inference", "inference"]
    assert all(not ran and n == 0 for _, ran, n in res["reports"]), res["reports"]
    assert res["cpu_messages"] == 1, "the CPU message is logged once per process"
    assert res["generated"] == 0 and res["cache_files"] == []


# --------------------------------------------------------------------------- dynamic shapes
def _rowwise(x, w):
    return torch.softmax(x * w, dim=-1) * 3 + x.sigmoid()


def test_dynamic_true_reuses_kernels_across_batch_and_seq(cache_dir, device):
    w = torch.randn(16, device=device)
    torch._dynamo.reset()
    fn = torch.compile(_rowwise, backend="fusion", dynamic=True, fullgraph=True)
    with fusion_compiler.capture_compiles() as reports:
        x = torch.randn(2, 5, 16, device=device)
        assert_close(fn(x, w), _rowwise(x, w))
    assert len(reports) == 1 and kernel_count(reports) >= 1 and not leftover_aten(reports)
    keys, generated = keys_of(reports), current_cache().generated
    with fusion_compiler.capture_compiles() as more:
        for batch, seq in [(7, 3), (3, 111), (9, 37)]:      # rows 21, 333, 333 ...
            x = torch.randn(batch, seq, 16, device=device)
            assert_close(fn(x, w), _rowwise(x, w), name=f"{batch}x{seq}")
    assert more == [], "a new batch/sequence length recompiled"
    assert current_cache().generated == generated

    # Size 1: dynamo specializes sizes 0 and 1 (even with dynamic=True), so batch=seq=1 is a
    # recompile with static 1s in the graph; its kernels have another IR, hence new keys.
    with fusion_compiler.capture_compiles() as ones:
        x = torch.randn(1, 1, 16, device=device)
        assert_close(fn(x, w), _rowwise(x, w), name="1x1")
    assert len(ones) == 1, "size 1 is expected to recompile (0/1 specialization)"
    assert ones[0].ran_kernels and not keys_of(ones) & keys
    assert current_cache().generated > generated


def test_mark_dynamic_reuses_kernels_across_rows(cache_dir, device):
    w = torch.randn(16, device=device)
    torch._dynamo.reset()
    fn = torch.compile(_rowwise, backend="fusion", fullgraph=True)
    with fusion_compiler.capture_compiles() as reports:
        x = torch.randn(4, 16, device=device)
        torch._dynamo.mark_dynamic(x, 0)
        assert_close(fn(x, w), _rowwise(x, w))
    assert len(reports) == 1 and kernel_count(reports) >= 1
    keys, generated = keys_of(reports), current_cache().generated
    with fusion_compiler.capture_compiles() as more:
        for rows in (7, 333):
            x = torch.randn(rows, 16, device=device)
            torch._dynamo.mark_dynamic(x, 0)
            assert_close(fn(x, w), _rowwise(x, w), name=f"rows={rows}")
    assert more == [] and current_cache().generated == generated

    # rows=1: mark_dynamic does not stop the 0/1 specialization here (no error is raised,
    # dynamo just compiles a graph for rows == 1 with its own kernels).
    with fusion_compiler.capture_compiles() as ones:
        x = torch.randn(1, 16, device=device)
        torch._dynamo.mark_dynamic(x, 0)
        assert_close(fn(x, w), _rowwise(x, w), name="rows=1")
    assert len(ones) == 1 and not keys_of(ones) & keys


# Regression: a size-1 dim before the reduced one used to split softmax into 3 kernels
# (broadcasting indexed the size-1 dim of the keepdim result at 0, the row loop at r0).
@pytest.mark.parametrize("shape", [(1, 16), (7, 1, 16), (1, 7, 16)])
def test_softmax_with_size_one_dim_is_one_kernel(shape, device):
    x = torch.randn(*shape, device=device)

    def softmax(a):
        return torch.softmax(a, -1)
    out, reports = compile_and_run(softmax, (x,))
    assert_close(out, softmax(x))
    assert kernel_count(reports) == 1, [r.decisions for r in reports]


# ---------------------------------------------------------------------------- odd inputs
_x = lambda *s, **kw: torch.randn(*s, **kw)  # noqa: E731

CASES = {
    # name: (fn, inputs(device), kernels expected)
    "transposed": (lambda a: (a * 2 + 1).relu(), lambda d: (_x(16, 24, device=d).t(),), 1),
    "transposed-softmax": (lambda a: torch.softmax(a, -1) * 2,
                           lambda d: (_x(16, 24, device=d).t(),), 1),
    "step-slice": (lambda a, b: (a * 2 + b).sigmoid(),
                   lambda d: (_x(16, 24, device=d)[:, ::3], _x(8, device=d)), 1),
    "step-slice-2d-softmax": (lambda a: torch.softmax(a * 2, -1),
                              lambda d: (_x(16, 24, device=d)[::2, 1::3],), 1),
    "offset-slice": (lambda a: a.exp() - 1, lambda d: (_x(10, 12, device=d)[3:, 2:9],), 1),
    "0-dim-scalar-operand": (lambda a, s: a * s + s,
                             lambda d: (_x(4, 6, device=d), torch.tensor(1.5, device=d)), 1),
    "0-dim-only": (lambda s: (s * 2).exp() + 1, lambda d: (torch.tensor(0.3, device=d),), 1),
    "0-dim-int": (lambda s, t: s * 3 + t,
                  lambda d: (torch.tensor(4, device=d), torch.tensor(-5, device=d)), 1),
    "int32": (lambda a, b: (a * 3 - b).abs() + 1,
              lambda d: (torch.randint(-50, 50, (8, 12), dtype=torch.int32, device=d),
                         torch.randint(-50, 50, (8, 12), dtype=torch.int32, device=d)), 1),
    "int64-large": (lambda a: a * 2 + 7,
                    lambda d: (torch.randint(-2**40, 2**40, (8, 12), device=d),), 1),
    "int-compare-where": (lambda a: torch.where(a > 0, a, -a) * 2,
                          lambda d: (torch.randint(-9, 9, (8, 12), device=d),), 1),
    "int8": (lambda a: a + a, lambda d: (torch.randint(-60, 60, (8, 12), dtype=torch.int8,
                                                       device=d),), 1),
    "int-to-float": (lambda a: a.float() * 0.5 + 1,
                     lambda d: (torch.randint(-9, 9, (8, 12), dtype=torch.int32, device=d),), 1),
    "bool-where": (lambda m, v: torch.where(m, v, v * 2).relu(),
                   lambda d: (_x(8, 12, device=d) > 0, _x(8, 12, device=d)), 1),
    "bool-compare-out": (lambda a, b: (a > b) & (a > 0),
                         lambda d: (_x(8, 12, device=d), _x(8, 12, device=d)), None),
    "bool-logic": (lambda a, c: (a & c) | ~a,
                   lambda d: (_x(8, 12, device=d) > 0, _x(8, 12, device=d) > 0), None),
    "bool-to-int": (lambda m: m.int() * 3 + 1, lambda d: (_x(8, 12, device=d) > 0,), 1),
    "fp64": (lambda a: (a * 2).exp() + a.tanh(),
             lambda d: (_x(8, 12, device=d, dtype=torch.float64),), 1),
    "fp64-softmax": (lambda a: torch.softmax(a, -1),
                     lambda d: (_x(8, 12, device=d, dtype=torch.float64),), None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_odd_inputs_match_eager(name, device):
    fn, make, kernels = CASES[name]
    args = make(device)
    out, reports = compile_and_run(fn, args)
    for k, (a, e) in enumerate(zip(as_tuple(out), as_tuple(fn(*args)))):
        assert_close(a, e, name=f"{name} output {k}")
    assert len(reports) == 1 and reports[0].ran_kernels
    if kernels is not None:
        assert kernel_count(reports) == kernels, reports[0].groups_not_generated


def test_ops_of_groups_not_generated_are_reported_as_aten(device):
    x = torch.randn(8, 12, device=device, dtype=torch.float64)
    out, reports = compile_and_run(lambda a: torch.softmax(a, -1), (x,))
    assert_close(out, torch.softmax(x, -1))
    assert reports[0].groups_not_generated            # fp64 reductions stay on ATen ...
    assert "aten.amax.default" in leftover_aten(reports)   # ... and should be listed there


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("value", ["abc", "-1", "0", "1.5"])
def test_bad_max_persistent_block_is_a_config_error(value, monkeypatch, device):
    monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", value)
    with pytest.raises(ConfigError, match="FUSION_COMPILER_MAX_PERSISTENT_BLOCK"):
        Config.from_env()
    # Through torch.compile the error reaches the caller (wrapped by dynamo) and names it.
    x = torch.randn(4, 8, device=device)
    with pytest.raises(Exception) as info:
        compile_and_run(lambda a: a.relu() + 1, (x,))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(c, ConfigError) for c in chain), [type(c).__name__ for c in chain]
    assert "FUSION_COMPILER_MAX_PERSISTENT_BLOCK" in str(info.value)


def test_compile_threads_may_be_zero_but_not_negative():
    assert Config.from_env({"FUSION_COMPILER_COMPILE_THREADS": "0"}).compile_threads == 0
    with pytest.raises(ConfigError, match="COMPILE_THREADS='-1': expected an integer >= 0"):
        Config.from_env({"FUSION_COMPILER_COMPILE_THREADS": "-1"})


def test_bad_bool_is_a_config_error(monkeypatch):
    monkeypatch.setenv("FUSION_COMPILER_DISABLE", "maybe")
    with pytest.raises(ConfigError, match="FUSION_COMPILER_DISABLE"):
        Config.from_env()


def test_disable_runs_eager_without_kernels(monkeypatch, cache_dir, device):
    monkeypatch.setenv("FUSION_COMPILER_DISABLE", "1")
    x, w = torch.randn(6, 16, device=device), torch.randn(16, device=device)
    out, reports = compile_and_run(_rowwise, (x, w))
    assert_close(out, _rowwise(x, w))
    assert kernel_count(reports) == 0
    assert not any(r.ran_kernels for r in reports)
    assert current_cache().generated == 0 and not cache_dir.exists()


# --------------------------------------------------------------------------------- training
def test_training_gradients_match_eager(device):
    def fn(x, w, b):
        return torch.nn.functional.gelu(torch.softmax(x * w, -1) + b) * x

    leaves = [torch.randn(6, 32, device=device), torch.randn(32, device=device),
              torch.randn(32, device=device)]
    ours = [t.clone().requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]
    grad_out = torch.randn(6, 32, device=device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion", fullgraph=True)(*ours)
        out.backward(grad_out)
    expected = fn(*ref)
    expected.backward(grad_out)
    assert_close(out, expected)
    for name, a, e in zip("xwb", ours, ref):
        assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-4, name=f"grad {name}")
    kinds = [r.kind for r in reports]
    assert kinds == ["forward", "backward"], kinds
    assert kernel_count(reports, "forward") >= 1
    assert kernel_count(reports, "backward") >= 1
    assert all(r.ran_kernels for r in reports)


# ----------------------------------------------------------- torch.compile's mode= and options=
def test_compile_mode_and_options_set_the_config():
    from fusion_compiler.config import with_compile_args
    base = Config.from_env({})
    assert with_compile_args(base, "reduce-overhead").cudagraphs is True
    assert with_compile_args(base, "default").cudagraphs is False
    cfg = with_compile_args(base, None, {"cudagraphs": True, "max_group_ops": 7})
    assert cfg.cudagraphs is True and cfg.max_group_ops == 7
    assert cfg.cudagraph_copy_outputs is False        # the graph's memory, as Inductor's
    assert with_compile_args(base, None, {"cudagraph_copy_outputs": True}).cudagraph_copy_outputs
    assert Config.from_env({"FUSION_COMPILER_CUDAGRAPH_COPY_OUTPUTS": "1"}).cudagraph_copy_outputs


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "turbo"}, "mode='turbo'"),
    ({"options": {"cuda_graphs": True}}, "unknown option"),
    ({"options": {"max_group_ops": "7"}}, "expected int"),
    ({"options": {"cudagraphs": 1}}, "expected bool"),
    ({"options": {"max_persistent_block": -4}}, "expected a positive integer"),
    ({"options": {"compile_threads": -1}}, "expected an integer >= 0"),
])
def test_bad_compile_mode_or_option_is_a_clear_error(kwargs, match, device):
    torch._dynamo.reset()
    fn = torch.compile(lambda a: a.relu() + 1, backend="fusion", **kwargs)
    with pytest.raises(Exception) as info:
        fn(torch.randn(4, 8, device=device))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    errors = [c for c in chain if isinstance(c, ConfigError)]
    assert errors and re.search(match, str(errors[0])), [str(c) for c in chain]


def test_cudagraphs_are_not_used_where_unsafe():
    """The reasons are checked on the CPU: a training graph, a CPU graph, a random op."""
    from fusion_compiler import cudagraphs
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    assert "inference" in cudagraphs.why_not(gm, "forward")
    captured = {}

    def grab(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified
        def keep(g, _):
            captured["g"] = g
            return g
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda x: torch.rand_like(x) + x, backend=grab)(torch.randn(3))
    assert "rand" in cudagraphs.why_not(captured["g"], "inference")
    with torch.no_grad():
        torch.compile(lambda x: torch.var_mean(x * 2 + x), backend=grab)(torch.randn(3))
    assert any(n.target is operator.getitem for n in captured["g"].graph.nodes)
    assert "cpu tensor" in cudagraphs.why_not(captured["g"], "inference")   # getitem is fine


def test_direct_relaunch_calls_tritons_c_launch_function_or_goes_through_run():
    """A kernel without scratch memory whose launcher is the C function is relaunched through
    that function; any other goes through the compiled kernel's `run`, with the same arguments
    Triton's own launch passes."""
    from fusion_compiler.codegen.launch import direct_entry

    calls = []

    class Launcher:
        launch, global_scratch_size, profile_scratch_size = max, 0, 0
        launch_cooperative_grid, launch_pdl = 0, 1

    class Compiled:
        function, packed_metadata = 1234, (4, 1, 0)
        run = Launcher()
    entry = direct_entry(Compiled())
    assert entry[0] is max and entry[1:5] == (1234, False, True, (4, 1, 0))

    class Scratch(Launcher):             # scratch memory: Triton's __call__ allocates it
        global_scratch_size = 128

        def __call__(self, *args):
            calls.append(args)

    class CompiledScratch(Compiled):
        run = Scratch()
    entry = direct_entry(CompiledScratch())
    assert entry[0] is not max
    entry[0](7, 1, 1, "stream", entry[1], entry[2], entry[3], None, None, entry[4], None, None,
             None, 111, 222)
    assert calls == [(7, 1, 1, "stream", 1234, (4, 1, 0), None, None, None, 111, 222)]


def test_lean_launch_table_is_kept_only_without_launch_hooks(monkeypatch):
    """The GPU path stores compiled kernels for direct relaunch; a Triton launch hook (a
    profiler) must keep every launch going through Triton instead."""
    from triton import knobs

    from fusion_compiler.codegen import launch
    monkeypatch.setattr(launch, "LEAN", True)

    class Compiled:
        function = object()
        packed_metadata = (4, 1, 0)
        run = type("Launcher", (), {"launch": max, "global_scratch_size": 0,
                                    "profile_scratch_size": 0, "launch_cooperative_grid": False,
                                    "launch_pdl": False})()
    table = {}
    launch.remember(table, ("k",), Compiled())
    assert ("k",) in table
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):                  # Triton 3.5+: a chain of hooks, empty by default
        fn = lambda *a: None  # noqa: E731
        hook.add(fn)
        try:
            table.clear()
            launch.remember(table, ("k",), Compiled())
            assert table == {}
        finally:
            hook.remove(fn)
    monkeypatch.setattr(launch, "LEAN", False)    # the interpreter: never stored
    launch.remember(table, ("i",), Compiled())
    assert ("i",) not in table


class _Meta:
    """Triton 3.6-like kernel metadata (a namedtuple there)."""
    name, num_warps, shared, num_ctas = "k_fn", 4, 1024, 1
    global_scratch_size, profile_scratch_size = 0, 0
    launch_cooperative_grid, launch_pdl = False, False


def _compiled(signature, **meta):
    md = type("Meta", (_Meta,), meta)()
    src = type("Src", (), {"signature": signature})()
    return type("Compiled", (), {"metadata": md, "src": src,
                                 "metadata_group": {"k_fn.json": "/c/k.json",
                                                    "k_fn.cubin": "/c/k.cubin"}})()


@pytest.fixture
def static_launcher(monkeypatch):
    """torch's static launcher, faked: records loads and launches."""
    from fusion_compiler.codegen import launch
    calls = {"load": [], "launch": [], "registers": 40}

    class Static:
        @staticmethod
        def _load_kernel(path, name, shared, device):
            calls["load"].append((path, name, shared, device))
            return ("module", "function", calls["registers"], 0)    # torch 2.12+: module first

        @staticmethod
        def _launch_kernel(*args):
            calls["launch"].append(args)
    monkeypatch.setattr(launch, "_STATIC", Static)
    monkeypatch.setattr(launch, "launch_static", Static._launch_kernel)
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "raw_stream", lambda dev: 77)
    monkeypatch.setattr(launch, "_max_shared", lambda dev: 232448)
    return calls


SIG = {"in0": "*bf16", "out0": "*bf16", "R": "i32", "N": "i32", "XBLOCK": "constexpr",
       "RBLOCK": "constexpr", "INDEX64": "constexpr"}


def test_static_launch_entry_types_and_scratch_pointers(static_launcher):
    from fusion_compiler.codegen import launch
    entry = launch.static_entry(_compiled(SIG), 4)
    assert entry[0] is None and entry[1:5] == ("function", 4, 1024, "OOiiOO")
    assert entry[5] == (None, None)         # a null pointer per kind of scratch memory
    assert static_launcher["load"] == [("/c/k.cubin", "k_fn", 1024, 0)]
    # an older Triton without scratch arguments: none appended
    old = _compiled(SIG)
    old.metadata = type("Meta", (), {k: getattr(_Meta, k) for k in (
        "name", "num_warps", "shared", "num_ctas")})()
    assert launch.static_entry(old, 4)[4:6] == ("OOii", ())


@pytest.mark.parametrize("why, compiled, nargs", [
    ("scratch memory", _compiled(SIG, global_scratch_size=64), 4),
    ("profile scratch", _compiled(SIG, profile_scratch_size=8), 4),
    ("two CTAs", _compiled(SIG, num_ctas=2), 4),
    ("cooperative", _compiled(SIG, launch_cooperative_grid=True), 4),
    ("too much shared memory", _compiled(SIG, shared=300000), 4),
    ("an argument specialized to a constant (== 1)", _compiled(dict(SIG, N="constexpr")), 4),
    ("an odd argument type", _compiled(dict(SIG, N="nvTmaDesc")), 4),
])
def test_kernels_torchs_launcher_cannot_take_go_through_triton(static_launcher, why, compiled,
                                                               nargs):
    from fusion_compiler.codegen import launch
    assert launch.static_entry(compiled, nargs) is None, why


def test_kernel_with_more_registers_than_a_block_has_goes_through_triton(static_launcher):
    from fusion_compiler.codegen import launch
    assert launch.static_entry(_compiled(SIG, num_warps=32), 4) is not None   # 40 x 1024 fit
    static_launcher["registers"] = 80                                        # 80 x 1024 do not
    assert launch.static_entry(_compiled(SIG, num_warps=32), 4) is None


def test_first_launch_launches_through_torch_and_keeps_the_entry(static_launcher):
    from fusion_compiler.codegen import launch
    warmed = []

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            warmed.append((args, grid, kwargs))
            return _compiled(SIG)

        def __getitem__(self, grid):
            raise AssertionError("Triton's launch path taken")
    x = torch.empty(3, 5)
    table = {}
    launch.first_launch(table, ("key",), Kernel(), 6, x, x, 3, 5, XBLOCK=1, num_warps=4)
    assert warmed == [((x, x, 3, 5), (6,), {"XBLOCK": 1, "num_warps": 4})]
    entry = table[("key",)]
    assert entry[0] is None
    assert static_launcher["launch"] == [("function", 6, 1, 1, 4, 1024, "OOiiOO",
                                          (x.data_ptr(), x.data_ptr(), 3, 5, None, None), 77)]
    # with a Triton launch hook set (a profiler), Triton launches it and it is not kept
    from triton import knobs
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        launched = []

        class Traced(Kernel):
            def __getitem__(self, grid):
                return lambda *a, **kw: launched.append(grid)
        fn = lambda *a: None  # noqa: E731
        hook.add(fn)
        try:
            table.clear()
            launch.first_launch(table, ("key",), Traced(), 6, x, x, 3, 5, XBLOCK=1)
        finally:
            hook.remove(fn)
        assert launched == [(6,)] and table == {}


def test_relaunch_key_holds_each_runtime_integers_width(cache_dir, device):
    """The direct relaunch passes integers as the kernel was compiled for them (i32 below
    2**31, i64 from it, as Triton's own key tells apart): every integer the launcher passes
    that is not fixed in the kernel has its width in the key; fixed sizes need none."""
    from helpers import compile_and_run
    from patterns import PATTERNS, make_args

    def sources():
        return {p: p.read_text() for p in cache_dir.rglob("*.py")}
    args = make_args("add_rmsnorm", 37, 40, torch.float32, device)
    compile_and_run(PATTERNS["add_rmsnorm"], args)                    # static shapes
    (static,) = sources().values()
    assert "R > 2147483647" not in static and "N > 2147483647" not in static
    compile_and_run(PATTERNS["add_rmsnorm"], args, dynamic=True)      # rows and length symbolic
    (dynamic,) = [t for t in sources().values() if t != static]
    keys = [ln.strip() for ln in dynamic.splitlines() if ln.strip().startswith("key = (")]
    assert keys and all("R > 2147483647" in k and "N > 2147483647" in k for k in keys)
    x = torch.randn(3, 70, device=device)
    compile_and_run(PATTERNS["swiglu"], (x, x.clone()), dynamic=True)
    (pointwise,) = [t for t in sources().values() if t not in (static, dynamic)]
    assert "numel > 2147483647" in pointwise
