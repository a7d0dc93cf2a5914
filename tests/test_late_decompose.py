"""Composite ops that aot_autograd's trace keeps whole in inference graphs with static sizes,
decomposed after it (passes/late_decompose.py): the kernels are the ones the trace's own
decomposition gives (same keys), kernel counts and values against eager, odd sizes, each
dtype with its tolerance; training and dynamic graphs decompose in the trace as before."""
import logging

import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.passes import late_decompose
from helpers import assert_close, assert_outputs_close, compile_and_run, kernel_count, \
    leftover_aten
from patterns import randn

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ln_gelu(x, w, b):
    return F.gelu(F.layer_norm(x, x.shape[-1:], w, b, 1e-5) + x)


def softmaxes_silu(x):
    return torch.softmax(F.silu(x) * 2, -1), torch.log_softmax(x, -1)


def gelu_tanh(x):
    """gelu's approximate="tanh" is a keyword argument of the ATen call."""
    return F.gelu(x + 1, approximate="tanh")


def ln_stats(x, w, b):
    """native_layer_norm's mean and rstd used, not only its output."""
    out, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    return out, mean * 2, rstd + 1


def ln_no_affine_of_a_transpose(x):
    return F.layer_norm(x.transpose(0, 1), x.shape[-1:]) * 3


@pytest.fixture
def late_calls(monkeypatch):
    """The DEFERRED calls late_decompose.run found, each time it ran (once before the AOT
    cache keeps a graph, once in the pipeline: the second finds none left)."""
    seen = []
    run = late_decompose.run

    def counting(gm, ctx):
        seen.append(sum(len(gm.graph.find_nodes(op="call_function", target=op))
                        for op in late_decompose.DEFERRED))
        return run(gm, ctx)
    monkeypatch.setattr(late_decompose, "run", counting)
    return seen


def _trace_decomposes(monkeypatch):
    monkeypatch.setattr(late_decompose, "deferred", lambda gm, example_inputs: ())


CASES = [
    (ln_gelu, lambda dt, dev: (randn((3, 41), dt, dev), randn((41,), dt, dev),
                               randn((41,), dt, dev)), 2, 1),
    (softmaxes_silu, lambda dt, dev: (randn((9, 37), dt, dev),), 3, 1),
    (gelu_tanh, lambda dt, dev: (randn((5, 31), dt, dev),), 1, 1),
    (ln_stats, lambda dt, dev: (randn((2, 5, 33), dt, dev), randn((33,), dt, dev),
                                randn((33,), dt, dev)), 1, 1),
    (ln_no_affine_of_a_transpose, lambda dt, dev: (randn((7, 3, 19), dt, dev),), 1, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn, make, calls, kernels", CASES, ids=[c[0].__name__ for c in CASES])
def test_deferred_ops_give_the_traces_kernels(fn, make, calls, kernels, dtype, device,
                                              late_calls, monkeypatch, tmp_path):
    args = make(dtype, device)
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path / "late"))
    out, reports = compile_and_run(fn, args)
    assert sum(late_calls) == calls, "the trace did not keep the ops whole"
    late_calls.clear()
    assert kernel_count(reports) == kernels and leftover_aten(reports) == []
    assert_outputs_close(out, fn(*args))

    _trace_decomposes(monkeypatch)
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path / "trace"))
    out2, reports2 = compile_and_run(fn, args)
    assert late_calls and sum(late_calls) == 0
    assert [k["key"] for r in reports2 for k in r.kernels] == \
        [k["key"] for r in reports for k in r.kernels], "other kernels than the trace's"
    assert [g["ops"] for r in reports2 for g in r.summary["groups"]] == \
        [g["ops"] for r in reports for g in r.summary["groups"]]
    for got, want in zip(out if isinstance(out, tuple) else (out,),
                         out2 if isinstance(out2, tuple) else (out2,)):
        assert torch.equal(got, want)


def test_a_training_graph_decomposes_in_the_trace(device, late_calls):
    x = randn((4, 23), torch.float32, device).requires_grad_()
    w, b = randn((23,), torch.float32, device), randn((23,), torch.float32, device)
    out, reports = compile_and_run(ln_gelu, (x, w, b))
    expected = ln_gelu(x, w, b)
    assert_close(out, expected)
    grad = randn(out.shape, torch.float32, device)
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(expected, x, grad)
    assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert late_calls and sum(late_calls) == 0
    assert kernel_count(reports, "forward") == 1


def test_dynamic_sizes_decompose_in_the_trace(device, late_calls):
    x = randn((5, 29), torch.bfloat16, device)
    w, b = randn((29,), torch.bfloat16, device), randn((29,), torch.bfloat16, device)
    out, reports = compile_and_run(ln_gelu, (x, w, b), dynamic=True)
    assert late_calls and sum(late_calls) == 0
    assert kernel_count(reports) == 1
    assert_close(out, ln_gelu(x, w, b), dtype=torch.bfloat16)


def test_deferred_only_for_inference_with_static_sizes():
    seen = {}

    def backend(gm, example_inputs):
        seen.setdefault("ops", []).append(late_decompose.deferred(gm, example_inputs))
        return gm.forward

    x, w = torch.randn(3, 8), torch.randn(8)
    fn = lambda x, w: F.layer_norm(x, (8,), w) # noqa: E731
    torch.compile(fn, backend=backend)(x, w)
    with torch.no_grad():
        torch.compile(fn, backend=backend)(x, w.requires_grad_())
    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(x, w)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True)(x, w.detach())
    assert seen["ops"] == [late_decompose.DEFERRED, late_decompose.DEFERRED, (), ()]


def test_a_decomposition_that_does_not_trace_stays_an_aten_op(cache_dir, device, monkeypatch,
                                                             caplog):
    """Where the decomposition fails to trace, FUSION_COMPILER_STRICT raises; otherwise the
    call runs on ATen with a warning (eager's numbers, the rest still fused), and the failure
    is not cached: the next compile traces again."""
    def failing(op, args, kwargs):
        raise RuntimeError("no trace")
    monkeypatch.setattr(late_decompose, "_template", failing)
    x = randn((3, 41), torch.float32, device)
    w, b = randn((41,), torch.float32, device), randn((41,), torch.float32, device)
    with pytest.raises(Exception, match="no trace"):
        compile_and_run(ln_gelu, (x, w, b))
    monkeypatch.setenv("FUSION_COMPILER_STRICT", "0")
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        out, reports = compile_and_run(ln_gelu, (x, w, b))
    assert "left to ATen unfused" in caplog.text
    assert leftover_aten(reports) == ["aten.native_layer_norm.default", "aten.gelu.default"]
    assert kernel_count(reports) == 1          # the residual add between them
    assert_close(out, ln_gelu(x, w, b))
