"""aot_autograd's result kept on disk (fusion_compiler/aot_cache.py).

A second compile of the same training graph, in this process after ``dynamo.reset()`` or in a
new process, loads aot_autograd's forward and backward graphs instead of tracing and
partitioning again (an inference graph likewise); the passes run on them as before: the same
kernels, the same numbers as eager. Graphs it cannot keep (dynamic shapes, the option off)
compile as before.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import fusion_compiler
from fusion_compiler import aot_cache
from fusion_compiler.codegen import triton_lib
from fusion_compiler.passes import late_decompose
from helpers import TOL, assert_close, kernel_count

pytestmark = pytest.mark.skipif(aot_cache.available() is not None,
                                reason=f"this torch: {aot_cache.available()}")


class Block(torch.nn.Module):
    """A residual MLP block: the GELU, the LayerNorm and the residual add fuse, forward and
    backward (odd widths: 41 in, 97 hidden)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(41, 97)
        self.norm = torch.nn.LayerNorm(97)
        self.down = torch.nn.Linear(97, 41)

    def forward(self, x):
        return x + self.down(self.norm(torch.nn.functional.gelu(self.up(x), approximate="tanh")))


def step(model, x, **compile_args):
    """(output, [input grad, parameter grads...], reports) of one compiled forward + backward."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(model, backend="fusion", **compile_args)(x)
        out.float().square().sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())], reports


def eager_step(model, x):
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    out = model(x)
    out.float().square().sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


def cache_events() -> dict:
    """aot_autograd's cache counters (hits, misses, saves, bypasses) since counters.clear()."""
    return {k: v for k, v in counters["aot_autograd"].items() if "cache" in k}


def aot_entries(root: Path) -> list:
    return sorted(p for p in (root / "aot").rglob("*") if p.is_file()) if (root / "aot").exists() \
        else []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_compile_loads_the_graphs_and_matches_eager(cache_dir, device, dtype):
    model = Block().to(device, dtype)
    x = torch.randn(7, 41, device=device, dtype=dtype)
    counters.clear()
    out1, grads1, first = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1
    assert len(aot_entries(cache_dir)) == 1
    counters.clear()
    out2, grads2, second = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert counters["aot_autograd"]["autograd_cache_miss"] == 0
    for kind in ("forward", "backward"):
        assert kernel_count(second, kind) == kernel_count(first, kind) > 0, kind
    # the same kernels on the same inputs: the same bits
    assert torch.equal(out2, out1)
    for g2, g1 in zip(grads2, grads1):
        assert torch.equal(g2, g1)
    ref, ref_grads = eager_step(model, x)
    atol, rtol = TOL[dtype]
    assert_close(out2, ref, dtype=dtype)
    for k, (g, want) in enumerate(zip(grads2, ref_grads)):
        # gradients sum over the rows: bf16's tolerance scaled by the 7 rows
        assert_close(g, want, dtype=dtype, atol=atol * 8, rtol=rtol * 2, name=f"grad {k}")


CHILD = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_aot_cache import Block, step, eager_step
    from helpers import kernel_count
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(7, 41)
    out, grads, reports = step(model, x)
    ref, ref_grads = eager_step(model, x)
    print(json.dumps({"counters": dict(counters["aot_autograd"]),
                      "kernels": [kernel_count(reports, k) for k in ("forward", "backward")],
                      "error": max((a - b).abs().max().item()
                                   for a, b in zip([out, *grads], [ref, *ref_grads]))}))
''')


def test_a_new_process_loads_the_graphs(cache_dir):
    env = dict(os.environ, FUSION_COMPILER_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="1")
    tests = str(Path(__file__).parent)

    def run():
        done = subprocess.run([sys.executable, "-c", CHILD, tests], env=env, text=True,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["counters"].get("autograd_cache_saved") == 1, first
    assert second["counters"].get("autograd_cache_hit") == 1, second
    assert "autograd_cache_miss" not in second["counters"], second
    assert second["kernels"] == first["kernels"] and min(first["kernels"]) > 0
    assert first["error"] < 1e-4 and second["error"] < 1e-4, (first, second)


def test_option_off_and_dynamic_shapes_keep_nothing(cache_dir, device):
    model = Block().to(device)
    x = torch.randn(7, 41, device=device)
    ref, ref_grads = eager_step(model, x)
    counters.clear()
    out, grads, reports = step(model, x, options={"aot_cache": False})
    assert not aot_entries(cache_dir) and not cache_events()
    assert kernel_count(reports, "backward") > 0
    assert_close(out, ref)
    torch._dynamo.reset()
    with torch.no_grad():
        assert_close(torch.compile(model, backend="fusion", options={"aot_cache": False})(x), ref)
    assert not aot_entries(cache_dir) and not cache_events()
    # dynamic shapes: compiled and run as before, not stored
    out, grads, _ = step(model, x, dynamic=True)
    assert_close(out, ref)
    for g, want in zip(grads, ref_grads):
        assert_close(g, want, atol=1e-4, rtol=1e-4)
    assert not aot_entries(cache_dir)
    assert counters["aot_autograd"]["autograd_cache_bypass"] >= 1


def infer(model, x, **compile_args):
    """(output, reports) of one compiled call under no_grad, after ``dynamo.reset()``."""
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports, torch.no_grad():
        out = torch.compile(model, backend="fusion", **compile_args)(x)
    return out, reports


def cold_then_warm(fn, x, grad: bool, loss) -> list:
    """[(outputs, x's gradient, reports)] of two compiles of ``fn`` on x (a leaf that requires
    grad where ``grad``, ``loss`` of the outputs backpropagated), each after
    ``dynamo.reset()``: the first saves aot_autograd's entry, the second loads it and runs as
    many kernels."""
    runs = []
    for events in ({"autograd_cache_miss": 1, "autograd_cache_saved": 1},
                   {"autograd_cache_hit": 1}):
        torch._dynamo.reset()
        counters.clear()
        leaf = x.detach().requires_grad_(grad)
        with fusion_compiler.capture_compiles() as reports:
            outs = torch.compile(fn, backend="fusion", fullgraph=True)(leaf)
        if grad:
            loss(outs).backward()
        assert cache_events() == events
        runs.append((outs, leaf.grad, reports))
    assert kernel_count(runs[1][2]) == kernel_count(runs[0][2]) > 0
    return runs


def weighted_sum(outs):
    return sum((o.float() * (k + 1)).sum() for k, o in enumerate(outs))


def ramp_sum(out):
    return (out.float() * torch.arange(out.numel(), device=out.device).view(out.shape)).sum()


def flattened_views(x):
    """A copy of a strided input (reshape of a transpose: clone + ``_unsafe_view``) returned
    with a view of it: aot_autograd rebuilds the view from the copy by replaying its views."""
    flat = x.t().reshape(-1)
    return flat * 3.0, flat.unsqueeze(0), flat, torch.tanh(x)


def first_token(x):
    """A matmul of a 3-d input (``_unsafe_view`` of the mm) returned with its first token, as
    a model returning its hidden states and a pooled slice of them does."""
    h = x @ x[0, :5].t()
    return torch.tanh(h), h[:, 0], h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("fn, shape", [(flattened_views, (41, 7)), (first_token, (3, 13, 24))],
                         ids=["reshape", "matmul"])
def test_a_loaded_entry_rebuilds_a_view_of_an_unsafe_view(cache_dir, device, dtype, grad, fn,
                                                          shape):
    """torch (up to 2.13 at least: pytorch#185630) pickles an ``_unsafe_view`` ViewMeta's
    shape from freed memory; a loaded entry replayed it to a garbage shape ("shape
    '[94098577407092]' is invalid", found by the fuzzer). The entry is stored without that
    sequence, and the loaded graph rebuilds the view from its base's layout."""
    x = torch.randn(shape, device=device, dtype=dtype)
    runs = cold_then_warm(fn, x, grad, weighted_sum)
    leaf = x.detach().requires_grad_(grad)
    ref = fn(leaf)
    if grad:
        weighted_sum(ref).backward()
    outs, x_grad = runs[1][0], runs[1][1]
    for k, (out, want) in enumerate(zip(outs, ref)):
        assert out.shape == want.shape and out.stride() == want.stride(), k
        assert_close(out.detach(), want.detach(), dtype=dtype, name=f"output {k}")
    # as in eager, the second output is a view into the third
    assert outs[1]._base is not None
    assert outs[1].untyped_storage().data_ptr() == outs[2].untyped_storage().data_ptr()
    if grad:
        atol, rtol = TOL[dtype]
        assert_close(x_grad, leaf.grad, dtype=dtype, atol=atol * 8, rtol=rtol * 2,
                     name="input grad")


# sums (and a pick) over dims with one of size 1 among them, of inputs whose other reduced dims
# do not merge: [8, 1, 30, 5] of strides (5, *, 40, 1), [6, 3, 1, 8] of (24, 1, *, 3)
SIZE_ONE_SUMS = {
    "leading": (lambda x: (x * 2).sum([0, 1, 2]),
                lambda: torch.randn(30, 8, 5).transpose(0, 1).unsqueeze(1)),
    "trailing": (lambda x: (x * 2).sum([-3, -2, -1]),
                 lambda: torch.randn(6, 8, 3).transpose(1, 2).unsqueeze(2)),
    "outer": (lambda x: (x * 2).sum([0, 2, 3, 4]),
              lambda: torch.randn(5, 4, 8, 3).transpose(2, 3).unsqueeze(3)),
    "picks": (lambda x: picks(x) * 2, lambda: torch.randn(48).as_strided((2, 4, 1, 3),
                                                                           (24, 6, 6, 1))),
}


def picks(x):
    """``x[:, i, j, k]`` by constant index tensors on dims of sizes 4, 1, 3 and strides 6, 6,
    1 (passes/constant_fold.py's picks merge such dims where their strides allow)."""
    i = torch.arange(4, device=x.device)[:, None, None]
    j = torch.zeros(1, 1, 1, dtype=torch.long, device=x.device)
    k = (torch.arange(3, device=x.device) * 2 % 3)[None, None, :]
    return x[:, i, j, k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("form", sorted(SIZE_ONE_SUMS))
def test_dims_that_do_not_merge_around_a_size_one_dim_are_kept_apart(cache_dir, device, dtype,
                                                                     grad, form):
    """The passes merged reduced (or picked) dims around one of size 1 without comparing their
    strides (a fuzzer's find): the view they emitted got wrong strides from torch's Python view
    in the cold compile, and raised where a loaded graph was compiled, so every later process
    missed the cache (a bypass). Both compiles now keep such dims apart: the second loads the
    graphs, runs the same kernels, and matches eager."""
    fn, make = SIZE_ONE_SUMS[form]
    x = make().to(device=device, dtype=dtype)
    runs = cold_then_warm(fn, x, grad, ramp_sum)
    assert [r.error for r in runs[0][2] + runs[1][2]] == [""] * (len(runs[0][2]) * 2)
    leaf = x.detach().requires_grad_(grad)
    want = fn(leaf)
    if grad:
        ramp_sum(want).backward()
    for out, x_grad, _ in runs:
        assert_close(out.detach(), want.detach(), dtype=dtype, rtol=TOL[dtype][1] * 4)
        if grad:
            assert torch.equal(x_grad, leaf.grad)     # a broadcast of the weights, times 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_inference_graph_is_kept_and_loaded(cache_dir, device, dtype):
    """Under no_grad aot_autograd makes one inference graph; a second compile loads it and
    the passes make the same kernels: the same bits, eager's numbers."""
    model = SplitHeads().to(device, dtype)
    x = torch.randn(3, 7, 24, device=device, dtype=dtype)
    counters.clear()
    late_decompose._template.cache_clear()
    out1, first = infer(model, x)
    assert cache_events() == {"autograd_cache_miss": 1, "autograd_cache_saved": 1}
    assert len(aot_entries(cache_dir)) == 1
    # the trace kept the softmax, the gelu and the layer norm whole; the entry holds them
    # decomposed, so the loaded graph needs no template
    assert late_decompose._template.cache_info().misses == 3
    late_decompose._template.cache_clear()
    counters.clear()
    out2, second = infer(model, x)
    assert cache_events() == {"autograd_cache_hit": 1}
    assert late_decompose._template.cache_info().misses == 0
    assert [r.kind for r in second] == ["inference"]
    keys = [sorted(k["key"] for r in reports for k in r.kernels) for reports in (first, second)]
    assert keys[0] == keys[1] and kernel_count(second) == kernel_count(first) > 0
    assert torch.equal(out2, out1)
    with torch.no_grad():
        assert_close(out2, model(x), dtype=dtype)
    # a training step of the same model is keyed apart (grad mode, the inputs' requires_grad)
    counters.clear()
    out, grads, _ = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    ref, ref_grads = eager_step(model, x)
    assert_close(out, ref, dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_loaded_inference_graph_replays_in_a_cuda_graph(cache_dir, monkeypatch):
    """With ``cudagraphs`` on, the loaded graph is captured like a compiled one, with the same
    static inputs (the parameters, kept with the entry): new inputs give eager's numbers."""
    from fusion_compiler import cudagraphs

    runners = []
    made = cudagraphs.CudaGraphRunner.__init__

    def recording(self, *args, **kwargs):
        made(self, *args, **kwargs)
        runners.append(self)
    monkeypatch.setattr(cudagraphs.CudaGraphRunner, "__init__", recording)
    model = SplitHeads().cuda()
    options = {"cudagraphs": True, "cudagraph_copy_outputs": True}
    infer(model, torch.randn(3, 7, 24, device="cuda"), options=options)
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion", options=options)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 7, 24, device="cuda")
            assert_close(compiled(x), model(x))
    assert cache_events() == {"autograd_cache_hit": 1}
    first, loaded = runners
    assert loaded.static_inputs == first.static_inputs and len(loaded.static_inputs) == 4
    assert loaded.captures == 1 and loaded.graph is not None


def test_each_partitioner_has_its_own_entries(cache_dir, device, monkeypatch):
    """The ATen graphs depend on the partitioner (``backward_recompute``) and on the
    decomposition table, which torch's key does not see: they name the entries' folder."""
    assert aot_cache.namespace(cache_dir, "min_cut") != aot_cache.namespace(cache_dir, "default")
    model = Block().to(device)
    x = torch.randn(7, 41, device=device)
    step(model, x)
    monkeypatch.setenv("FUSION_COMPILER_BACKWARD_RECOMPUTE", "0")
    counters.clear()
    out, _, _ = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    assert len({p.relative_to(cache_dir / "aot").parts[0] for p in aot_entries(cache_dir)}) == 2
    assert_close(out, eager_step(model, x)[0])


def test_the_convolution_backends_are_in_the_key(cache_dir, device, monkeypatch):
    """A convolution's traced output layout follows the backend ATen picks (cuDNN's
    channels-last, the native kernels' contiguous with cuDNN off): a graph kept with cuDNN on
    does not serve a compile with it off, and back. TF32 off: cuDNN's TF32 rounds otherwise in
    each layout."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(6, 5, 1)).to(device)
    x = torch.randn(2, 3, 7, 6, device=device)
    step(model, x)
    for enabled in (False, True):
        monkeypatch.setattr(torch.backends.cudnn, "enabled", enabled)
        counters.clear()
        out, grads, _ = step(model, x)
        assert cache_events().get("autograd_cache_hit", 0) == int(enabled), cache_events()
        want, want_grads = eager_step(model, x)
        assert_close(out, want)
        for got, expected in zip(grads, want_grads):
            assert_close(got, expected)


@pytest.mark.skipif(not triton_lib.LANGUAGE_INTERPRETED,
                    reason="Triton was imported without its interpreter (a GPU machine): "
                           "TRITON_INTERPRET=1 set now cannot run kernels")
def test_a_graph_traced_where_no_kernel_runs_does_not_serve_the_interpreter(cache_dir,
                                                                            monkeypatch):
    """On the CPU without Triton's interpreter, composite ops keep ATen's kernels in the trace
    (decompositions._kernels_run: a BatchNorm stays whole). Its entries are apart: the same
    model compiled with the interpreter on (or for `dump`) traces again and fuses the norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6),
                                torch.nn.ReLU())
    x = torch.randn(2, 3, 7, 6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, _, plain = step(model, x)
    assert any("batch_norm" in op for r in plain for op in r.aten_ops), \
        [r.aten_ops for r in plain]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    counters.clear()
    out, grads, reports = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    assert [op for r in reports for op in r.aten_ops] == [
        "aten.convolution.default", "aten.convolution_backward.default"]
    assert kernel_count(reports) > 0
    want, want_grads = eager_step(model, x)
    assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        assert_close(got, expected)


def test_a_pass_that_fails_on_a_loaded_graph_leaves_it_on_aten(cache_dir, device, monkeypatch):
    from fusion_compiler.passes import fuse

    model = Block().to(device)
    x = torch.randn(7, 41, device=device)
    step(model, x)

    def broken(gm, ctx):
        raise RuntimeError("pass broke here")
    monkeypatch.setattr(fuse, "run", broken)
    monkeypatch.delenv("FUSION_COMPILER_STRICT")
    counters.clear()
    out, grads, reports = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert {r.error for r in reports} == {"RuntimeError: pass broke here"}
    ref, ref_grads = eager_step(model, x)
    assert_close(out, ref)
    for g, want in zip(grads, ref_grads):
        assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_a_damaged_entry_is_compiled_again(cache_dir, device):
    """An entry that does not load (cut short, here) is a miss: the graph is traced and compiled
    again, and the entry written anew."""
    model = Block().to(device)
    x = torch.randn(7, 41, device=device)
    step(model, x)
    (entry,) = aot_entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[:100])
    counters.clear()
    out, grads, reports = step(model, x)
    assert "autograd_cache_hit" not in cache_events()
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1
    assert kernel_count(reports, "backward") > 0
    ref, ref_grads = eager_step(model, x)
    assert_close(out, ref)
    for g, want in zip(grads, ref_grads):
        assert_close(g, want, atol=1e-4, rtol=1e-4)
    counters.clear()
    step(model, x)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_the_miss_callback_runs_before_a_trace_only(cache_dir, device, monkeypatch):
    """``context``'s ``on_miss`` (the backend starts its compile workers with it) runs once the
    key is known and no entry is stored under it: on the first compile, and on every compile of
    a graph that is not kept (dynamic shapes); not on a compile that loads the entry."""
    calls = []
    context = aot_cache.context
    monkeypatch.setattr(aot_cache, "context", lambda folder, finish, on_miss=None: context(
        folder, finish, on_miss=lambda: calls.append(1)))
    model = Block().to(device)
    x = torch.randn(7, 41, device=device)
    counters.clear()
    out, _, reports = step(model, x)
    assert calls == [1] and cache_events()["autograd_cache_miss"] == 1
    calls.clear()
    counters.clear()
    again, _, loaded = step(model, x)
    assert calls == [] and cache_events()["autograd_cache_hit"] == 1
    assert kernel_count(loaded, "forward") == kernel_count(reports, "forward") > 0
    assert torch.equal(again, out)
    assert_close(again, eager_step(model, x)[0])
    for _ in range(2):          # (the callback may run more than once: starting is idempotent)
        calls.clear()
        counters.clear()
        step(model, torch.randn(9, 41, device=device), dynamic=True)
        assert calls and "autograd_cache_hit" not in cache_events()


@pytest.mark.gpu
def test_a_loaded_graph_starts_no_compile_workers(cache_dir, monkeypatch):
    """On the GPU a compile that loads its graph from the AOT cache starts no compile workers:
    its kernels are in Triton's cache (eight processes starting Triton would only compete with
    it). The first compile starts them."""
    import os

    from fusion_compiler.codegen import compile_pool

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("FUSION_COMPILER_COMPILE_WORKERS", "2")
    monkeypatch.setattr(compile_pool, "_POOL", None)
    model = Block().cuda().to(torch.bfloat16)
    x = torch.randn(7, 41, device="cuda", dtype=torch.bfloat16)
    try:
        step(model, x)
        assert compile_pool.current() is not None
    finally:
        if compile_pool.current() is not None:
            compile_pool.current().close()
        monkeypatch.setattr(compile_pool, "_POOL", None)
    counters.clear()
    out, _, reports = step(model, x)
    assert cache_events()["autograd_cache_hit"] == 1
    assert compile_pool.current() is None
    assert kernel_count(reports, "backward") > 0
    assert_close(out, eager_step(model, x)[0], dtype=torch.bfloat16)


def test_tensor_constants_are_keyed_by_value():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    gm.table = torch.arange(6.0)
    before = aot_cache._constant_values(gm)
    gm.table = torch.arange(6.0) * 2
    assert aot_cache._constant_values(gm) != before
    gm.scale = torch.tensor(0.5)                         # 0-dim, and a view of a larger tensor
    gm.row = torch.arange(12.0).view(3, 4)[:, 1]
    with_scale = aot_cache._constant_values(gm)
    gm.scale = torch.tensor(0.25)
    assert aot_cache._constant_values(gm) != with_scale
    gm.table = torch.empty(aot_cache.MAX_CONSTANT_BYTES // 4 + 1)
    with pytest.raises(aot_cache.BypassAOTAutogradCache, match="constants exceed"):
        aot_cache._constant_values(gm)


def test_values_are_kept_as_layouts_and_made_fake_again():
    """A node's value is stored as its layout (sizes, strides, storage offset, dtype, device)
    and made a fake tensor of the loading graph's mode again: views with offsets, transposed,
    empty and 0-dim tensors, tuples of them, and the plain values beside them."""
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.fake_tensor import FakeTensor

    base = torch.randn(7, 12)
    values = (base[2:5, 3:11:2], base.t(), base[:, :0], torch.tensor(2.5, dtype=torch.bfloat16),
              torch.zeros(3, dtype=torch.int64)[1:], None, 3, 1.5, True)
    stored = aot_cache._layouts([values, base])
    assert not any(isinstance(v, torch.Tensor) for v in stored[0])
    mode = FakeTensorMode()
    made = aot_cache._fakes(stored, mode)
    for want, got in zip([*values, base], [*made[0], made[1]]):
        if not isinstance(want, torch.Tensor):
            assert got == want
            continue
        assert isinstance(got, FakeTensor) and got.fake_mode is mode
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype, got.device) == \
            (want.shape, want.stride(), want.storage_offset(), want.dtype, want.device)
    with mode:      # the passes run ops on them
        assert torch.ops.aten.sum.dim_IntList(made[0][0], [-1]).shape == (3,)
    with pytest.raises(TypeError, match="Generator"):
        aot_cache._layouts(torch.Generator())


class SplitHeads(torch.nn.Module):
    """q, k and v sliced out of one projection (views at storage offsets, transposed), a
    softmax over their product, and a norm: values whose layouts the entry keeps."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(24, 72)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, x):
        q, k, v = self.qkv(x).split(24, dim=-1)
        attn = torch.softmax((q * 0.5) @ k.transpose(-1, -2), dim=-1)
        return self.norm(x + torch.nn.functional.gelu(attn @ v, approximate="tanh"))


def test_a_loaded_graph_makes_the_same_kernels(cache_dir, device):
    """The passes make the same decisions on the loaded graph (values rebuilt from their
    layouts) as on aot_autograd's: the same kernel keys, forward and backward, and the same
    bits."""
    model = SplitHeads().to(device)
    x = torch.randn(2, 5, 24, device=device)
    counters.clear()
    out1, grads1, first = step(model, x)
    counters.clear()
    out2, grads2, second = step(model, x)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    for kind in ("forward", "backward"):
        keys = [sorted(k["key"] for r in reports if r.kind == kind for k in r.kernels)
                for reports in (first, second)]
        assert keys[0] == keys[1] and keys[0], kind
    assert torch.equal(out2, out1)
    assert all(torch.equal(a, b) for a, b in zip(grads2, grads1))
    ref, ref_grads = eager_step(model, x)
    assert_close(out2, ref)
    for k, (g, want) in enumerate(zip(grads2, ref_grads)):
        assert_close(g, want, atol=1e-4, rtol=1e-4, name=f"grad {k}")


class MaskedScores(torch.nn.Module):
    """Scores under a causal mask built from constants: constant folding computes the mask
    at compile time, rewriting the graph in place (9 rows: an odd size)."""

    def forward(self, x):
        n = x.shape[-2]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)
        return torch.softmax(x @ x.transpose(-1, -2) + mask, dim=-1) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kept_graph_is_the_one_before_the_passes(cache_dir, device, dtype, monkeypatch):
    """The graph is pickled while its kernels compile, after the passes have rewritten it in
    place: what is kept is a copy taken before them. A second compile loads the graph the
    first compile was handed (same ops, same order), folds and fuses it the same way, and
    matches eager."""
    from fusion_compiler import backend

    handed = []
    compile_aten_graph = backend.compile_aten_graph

    def spy(gm, kind, config, **kw):
        handed.append([(n.op, str(n.target)) for n in gm.graph.nodes])
        return compile_aten_graph(gm, kind, config, **kw)
    monkeypatch.setattr(backend, "compile_aten_graph", spy)
    x = torch.randn(3, 9, 16, device=device, dtype=dtype)
    outs, kernels = [], []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad(), fusion_compiler.capture_compiles() as reports:
            outs.append(torch.compile(MaskedScores(), backend="fusion")(x))
        kernels.append(sorted(k["key"] for r in reports for k in r.kernels))
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert len(handed) == 2 and handed[0] == handed[1]
    assert any("triu" in target or "full" in target for _, target in handed[0]), handed[0]
    assert kernels[0] == kernels[1] and kernel_count(reports) >= 1
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[1], MaskedScores()(x), dtype=dtype)
