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


def sin_cos(x, w):
    return (torch.sin(x * 2.0) * w).cos() * x


@pytest.mark.parametrize("recompute", [True, False])
def test_backward_recompute_saves_only_the_inputs(recompute, device):
    """config.backward_recompute (aot_autograd's min-cut partitioner): the backward computes the
    cheap forward values again instead of the forward saving them; here only x and w are saved,
    where saving keeps the four [37, 24] intermediates. Gradients are eager's either way."""
    x, w = torch.randn(37, 24, device=device), torch.randn(24, device=device)
    ours = [t.clone().requires_grad_() for t in (x, w)]
    ref = [t.clone().requires_grad_() for t in (x, w)]
    saved = []

    def pack(t):
        saved.append(t)
        return t
    torch._dynamo.reset()
    compiled = torch.compile(sin_cos, backend="fusion", fullgraph=True,
                             options={"backward_recompute": recompute})
    with fusion_compiler.capture_compiles() as reports:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(*ours)
        out.sum().backward()
    sin_cos(*ref).sum().backward()
    assert [r.kind for r in reports] == ["forward", "backward"]
    assert kernel_count(reports, "forward") == 1 and kernel_count(reports, "backward") == 1
    inputs = {t.data_ptr() for t in ours}
    made = [tuple(t.shape) for t in saved if t.data_ptr() not in inputs]
    assert made == ([] if recompute else [(37, 24)] * 4), made
    assert_close(out, sin_cos(*ref))
    for name, a, e in zip("xw", ours, ref):
        assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-4, name=f"grad {name}")


def test_embedding_gradient_stays_atens_embedding_backward(device):
    """An embedding's gradient is ATen's embedding_dense_backward, not the core decomposition's
    index_put (slow on repeated indices); here every index repeats, as BERT's token types do."""
    table = torch.randn(11, 24, device=device)
    ids = torch.tensor([[3, 3, 0, 7, 3], [0, 0, 3, 10, 3]], device=device)
    fn = lambda t, i: torch.nn.functional.layer_norm(  # noqa: E731
        torch.nn.functional.embedding(i, t) * 2.0, (24,))
    ours, ref = table.clone().requires_grad_(), table.clone().requires_grad_()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion", fullgraph=True)(ours, ids)
        out.square().sum().backward()
    expected = fn(ref, ids)
    expected.square().sum().backward()
    assert_close(out, expected)
    assert_close(ours.grad, ref.grad, atol=1e-4, rtol=1e-4, name="grad")
    left = leftover_aten(reports, "backward")
    assert "aten.embedding_dense_backward.default" in left and not [o for o in left if "index_put" in o]
    assert kernel_count(reports, "forward") >= 1 and kernel_count(reports, "backward") >= 1


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


def test_cudagraphs_are_not_used_for_a_graph_that_writes_a_callers_tensor():
    """The backend keeps writes into inputs in the graph (keep_inference_input_mutations): a
    replay would write its own copy of a caller's tensor, so such a graph is not captured; a
    write into a buffer (a static input, captured in place) is no reason."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from fusion_compiler import cudagraphs
    captured = {}

    def grab(gm, example_inputs):
        def keep(g, _):
            captured["g"] = g
            return g
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep,
                                     keep_inference_input_mutations=True)

    def f(x, buf):
        buf.mul_(0.5)
        return x + 1
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(f, backend=grab)(torch.randn(3), torch.randn(3))
    assert "writes into its input" in cudagraphs.why_not(captured["g"], "inference", [])
    assert "writes into" not in cudagraphs.why_not(captured["g"], "inference", [0, 1])


def test_young_gc_freezes_what_exists_and_still_collects_what_compiling_makes():
    import gc
    import weakref

    from fusion_compiler.backend import young_gc

    if gc.get_freeze_count() or not gc.isenabled():
        pytest.skip("this process manages its collector itself")

    class Node:
        pass
    with young_gc():
        assert gc.get_freeze_count() > 0            # the objects that existed are frozen
        with young_gc():                            # nested (backward compile in forward's)
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0            # the inner exit left the outer's freeze
        a, b = Node(), Node()
        a.other, b.other = b, a                     # a cycle made while compiling
        ref = weakref.ref(a)
        del a, b
        gc.collect()
        assert ref() is None                        # collected inside the window
    assert gc.get_freeze_count() == 0               # everything handed back on exit


def test_young_gc_leaves_a_process_that_froze_objects_or_disabled_the_collector(monkeypatch):
    import gc

    from fusion_compiler.backend import young_gc

    if gc.get_freeze_count() or not gc.isenabled():
        pytest.skip("this process manages its collector itself")
    calls = []      # young_gc's own freeze and unfreeze calls: the frozen count alone can drop
    # while it runs, when a frozen object dies (CI, 4bf60ee: 687701 frozen, then 687699)
    for name in ("freeze", "unfreeze"):
        monkeypatch.setattr(gc, name, lambda inner=getattr(gc, name), name=name:
                            calls.append(name) or inner())
    gc.freeze()
    try:
        del calls[:]
        with young_gc():
            pass
        assert calls == []                          # the process's own freeze stands
        assert gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        gc.unfreeze()
    gc.disable()
    try:
        with young_gc():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_young_gc_nested_does_not_ask_for_the_freeze_count(monkeypatch):
    """A graph's compile inside the backend call is nested: it must not walk the frozen
    objects (gc.get_freeze_count does, ~30 ms after freezing a process)."""
    import gc

    from fusion_compiler import backend as B

    if gc.get_freeze_count() or not gc.isenabled():
        pytest.skip("this process manages its collector itself")
    with B.young_gc():
        def walked():
            raise AssertionError("the nested young_gc counted the frozen objects")
        monkeypatch.setattr(gc, "get_freeze_count", walked)
        with B.young_gc():
            pass
        monkeypatch.undo()
        assert gc.get_freeze_count() > 0            # the outer freeze still stands
    assert gc.get_freeze_count() == 0


def test_report_times_the_passes_by_phase(device):
    """Each graph's report gives the time of its passes (compile_seconds) and of their phases:
    the fusion decisions, the kernel sources, the ATen graph rebuilt (and Triton's compiles
    where they run at compile time), within the whole."""
    def f(x, w):
        return torch.nn.functional.rms_norm(x * 2 + 1, (x.shape[-1],), w).relu()

    args = (torch.randn(7, 33, device=device), torch.randn(33, device=device))
    out, reports = compile_and_run(f, args)
    assert_close(out, f(*args))
    assert kernel_count(reports) == 1
    (report,) = reports
    phases = report.phase_seconds
    assert {"analyze", "sources", "partition"} <= phases.keys(), phases
    assert all(v >= 0 for v in phases.values()), phases
    assert 0 < sum(phases.values()) <= report.compile_seconds, (phases, report.compile_seconds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_baddbmm_stays_one_gemm_and_its_softmax_fuses(dtype, device):
    """BLOOM's ALiBi scores: baddbmm(bias, q, k) then softmax. The core decomposition would
    make the GEMM an fp32 bmm of upcast operands (slower on the GPU, numerics not eager's);
    it stays one ATen baddbmm and the softmax after it is one kernel."""
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(6, 1, 37, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(6, 37, 16, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(6, 16, 37, generator=g).to(device=device, dtype=dtype)

    def scores(bias, q, k):
        s = torch.baddbmm(bias, q, k, beta=1.0, alpha=0.25)
        return torch.softmax(s, -1, dtype=torch.float32).to(dtype)

    out, reports = compile_and_run(scores, (bias, q, k))
    assert [op.split(".")[1] for op in leftover_aten(reports)] == ["baddbmm"]
    assert kernel_count(reports) == 1
    assert_close(out, scores(bias, q, k), dtype=dtype)


def test_each_graph_is_called_through_its_compiled_forward(device, monkeypatch):
    """aot_autograd calls each graph's compiled forward itself: its code compiled once, after
    the passes (``backend.with_code``), not a lazy module's forward that would check for a
    recompile and go through ``nn.Module.__call__`` on every call; forward and backward."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from fusion_compiler import backend

    handed = []
    boxed = backend.boxed

    def record(gm):
        handed.append(boxed(gm))
        return handed[-1]
    monkeypatch.setattr(backend, "boxed", record)

    def fn(x, w):
        return torch.nn.functional.layer_norm(x * 2.0, (37,), w).relu()

    x = torch.randn(9, 37, device=device, requires_grad=True)
    w = torch.randn(37, device=device, requires_grad=True)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion", fullgraph=True)(x, w)
        out.sum().backward()
    assert [r.kind for r in reports] == ["forward", "backward"] and kernel_count(reports) >= 2
    assert len(handed) == 2
    for call in handed:
        forward = call.func                             # a partial of the bound forward
        assert call._boxed_call and not call.args
        assert forward.__func__ is not _LazyGraphModule._lazy_forward
        assert forward.__func__ is type(forward.__self__).forward
        assert "launch" in forward.__self__.code      # a generated kernel in each
    gx, gw = x.grad, w.grad
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    fn(x2, w2).sum().backward()
    assert_close(out, fn(x.detach(), w.detach()))
    assert_close(gx, x2.grad)
    assert_close(gw, w2.grad)


def test_a_compiled_graph_frees_each_input_after_its_last_use():
    """The code aot_autograd calls takes the argument list itself and empties it, so an input
    dies after its last use inside the graph (a backward's saved activations, one by one), not
    when the call returns."""
    import weakref

    from fusion_compiler import backend as B
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first = graph.call_function(torch.add, (a, 1))
    seen = []

    def probe(x):
        seen.append(dead())         # a's last use is behind us
        return x * 2
    later = graph.call_function(probe, (b,))
    graph.output((first, later))
    gm = torch.fx.GraphModule({}, graph)
    fn = B.boxed(B.with_code(gm))
    x, y = torch.randn(5), torch.randn(5)
    ref = weakref.ref(x)

    def dead():
        return ref() is None
    args = [x, y]
    want = (x + 1, y * 2)
    del x
    out = fn(args)
    assert args == [] and seen == [True] and fn._boxed_call
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
