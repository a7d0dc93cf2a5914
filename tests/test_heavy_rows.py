"""Row kernels whose elements are too heavy for a thread to hold a whole row of them
(codegen/launch.py ``row_limits``): the looped kernel, in shorter steps; and a looped kernel's
per-element outputs that no reduction feeds, stored in its first pass (codegen/lower.py)."""
import re

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.codegen import launch
from helpers import TOL, assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _sources(reports, kind=None) -> str:
    return "\n".join(open(k["path"]).read() for r in reports
                     if kind is None or r.kind == kind for k in r.kernels)


def _looped(text: str) -> str:
    start = text.index("def _looped_kernel")
    return text[start:text.index("\ndef ", start + 1)]


def test_row_limits_rule():
    """ResNet-50's stem backward (16 registers an element compared in int32, 19 in int64;
    rows of 12544) loops in steps of 1024; the zoo's usual rows keep their blocks."""
    assert launch.row_limits(12544, 16, 16384) == (8192, 1024)
    assert launch.row_limits(12544, 19, 16384) == (8192, 1024)
    assert launch.row_limits(4096, 3, 16384) == (16384, launch.LOOPED_RBLOCK)
    assert launch.row_limits(16384, 12, 16384) == (16384, launch.LOOPED_RBLOCK)
    assert launch.row_limits(16384, 13, 16384) == (8192, 1024)
    assert launch.row_limits(None, 40, 16384) == (16384, 512)      # symbolic rows: the step
    assert launch.row_limits(50000, 100, 16384) == (16384, 256)     # 256 columns at least
    assert launch.row_settings(8, 12544, 8192, False, 1024) == (1, 1024, True, 8)


def _relu_and_sum(x):
    y = torch.relu(x) * 2
    return y, y.float().sum(-1)


def _scaled_and_mean(x, w):
    y = x * w
    return y.float().mean(-1, keepdim=True), (y + 1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn,shape", [(_relu_and_sum, (5, 43)), (_scaled_and_mean, (3, 7, 37))],
                         ids=["relu-sum", "mean-3d"])
def test_output_no_reduction_feeds_is_stored_in_the_first_pass(fn, shape, dtype, small_steps,
                                                               device):
    """A looped kernel reads its row once where its per-element outputs need no reduction."""
    x = randn(shape, dtype, device)
    args = (x,) if fn is _relu_and_sum else (x, randn(shape[-1:], dtype, device))
    out, reports = compile_and_run(fn, args)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert len(re.findall(r"for off in range\(", _looped(_sources(reports)))) == 1
    expected = fn(*args)
    for o, e in zip(out, expected):
        assert_close(o, e, dtype=o.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_output_a_reduction_feeds_keeps_its_second_pass(dtype, small_steps, device):
    """RMSNorm's output needs the row's sum of squares: a second pass, as before."""
    x = randn((4, 50), dtype, device)

    def f(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype), x * 3
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1
    assert len(re.findall(r"for off in range\(", _looped(_sources(reports)))) == 2
    for o, e in zip(out, f(x)):
        assert_close(o, e, dtype=dtype)


def _stem(x, w, b):
    return F.max_pool2d(F.relu(F.batch_norm(x, None, None, w, b, training=True)), 3, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stem_backward_loops_in_short_steps(dtype, device):
    """ResNet's stem (BatchNorm with batch statistics, ReLU, 3 x 3 pool at stride 2) at its
    112 x 112 resolution: the backward's row kernel (the pool's four windows read for each
    element, BatchNorm's two sums) loops in steps of 1024, one pass, where held whole it
    spilled; gradients as close to float64's as eager's."""
    torch.manual_seed(0)
    x64 = torch.randn(2, 2, 112, 112, dtype=torch.float64, device=device)
    w64 = torch.rand(2, dtype=torch.float64, device=device) + 0.5
    b64 = torch.randn(2, dtype=torch.float64, device=device)
    g64 = torch.randn(2, 2, 56, 56, dtype=torch.float64, device=device)

    def step(fn, dt):
        x, w, b = (t.to(dt).clone().requires_grad_() for t in (x64, w64, b64))
        out = fn(x, w, b)
        out.backward(g64.to(dt))
        return [out, x.grad, w.grad, b.grad]

    exact = step(_stem, torch.float64)
    eager = step(_stem, dtype)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        ours = step(torch.compile(_stem, backend="fusion"), dtype)
    assert [r.error for r in reports if r.error] == []
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "backward") == 3, [r.num_kernels for r in reports]
    heavy = [open(k["path"]).read() for r in reports if r.kind == "backward"
             for k in r.kernels if "looped_block=1024" in open(k["path"]).read()]
    assert len(heavy) == 1 and "def _persistent_kernel" not in heavy[0]
    assert len(re.findall(r"for off in range\(", _looped(heavy[0]))) == 1
    atol, rtol = TOL[dtype]
    for name, o, e, x in zip(["output", "x grad", "w grad", "b grad"], ours, eager, exact):
        ours_err = (o.double() - x).abs().max().item()
        eager_err = (e.double() - x).abs().max().item()
        assert ours_err <= max(2 * eager_err, atol + rtol * x.abs().max().item()), \
            f"{name}: error {ours_err:.3g} against float64's, eager's {eager_err:.3g}"
