"""Nearest upsampling by powers of two (passes/nearest_upsample.py): index arithmetic in the
kernel that reads the output, and a backward that sums the output gradient's strided slices in
one kernel, instead of an index with computed index vectors forward and zeros plus an
index_put backward on ATen. Values against eager, kernel counts, the forms left alone."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

CASES = {   # name: (input shape, interpolate's keyword arguments)
    "2x": ((2, 3, 5, 7), dict(scale_factor=2)),
    "4x": ((1, 2, 3, 4), dict(scale_factor=4.0)),
    "size 2x4": ((2, 3, 5, 7), dict(size=(10, 28))),
    "per-dim (1, 2)": ((2, 3, 5, 7), dict(scale_factor=(1, 2))),
    "1-d": ((2, 3, 9), dict(scale_factor=2)),
    "3-d": ((1, 2, 3, 4, 5), dict(scale_factor=2)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_nearest_upsampling_forward_and_backward(case, dtype, device):
    """Forward exactly eager's (each element one read of x), one kernel with what computes its
    input and what reads it; backward one kernel, nothing on ATen either way; the input's
    gradient (a sum of s_h * s_w gradients, here in the dtype, eager's in fp32) within the
    dtype's tolerance."""
    shape, kw = CASES[case]
    x = randn(shape, dtype, device).requires_grad_()

    def f(x):
        return F.interpolate(x * 2, mode="nearest", **kw) + 1
    out, reports = compile_and_run(f, (x,))
    g = randn(out.shape, dtype, device)
    out.backward(g)
    got, x.grad = x.grad, None
    want = f(x)
    want.backward(g)
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "forward") == 1 and kernel_count(reports, "backward") == 1, \
        [(r.kind, r.num_kernels) for r in reports]
    assert torch.equal(out, want)
    assert_close(got, x.grad, dtype=dtype, name="x grad")


def test_negative_zero_and_nan_are_copied(device):
    """The padding adds -0.0, which leaves every value as it was: -0.0 stays -0.0, NaN and
    infinities pass through (inference)."""
    x = torch.tensor([[[[-0.0, 1.0], [float("nan"), float("-inf")]]]], device=device)
    with torch.no_grad():
        out, reports = compile_and_run(lambda x: F.interpolate(x, scale_factor=2), (x,))
        want = F.interpolate(x, scale_factor=2)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert torch.equal(out.signbit(), want.signbit())
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("kw", [dict(scale_factor=3), dict(scale_factor=2.0001),
                                dict(scale_factor=2, mode="nearest-exact"),
                                dict(scale_factor=2, mode="bilinear")], ids=str)
def test_other_upsamplings_keep_pytorchs_form(kw, device, monkeypatch):
    """A factor that is no power of two, a scale_factor that is not exactly the factor, other
    modes: not rewritten (PyTorch's decomposition, its index), values as PyTorch's
    decomposition gives them (aot_eager's). For scale_factor=2.0001 that is not eager's: the
    decomposition and ATen's CPU kernel pick different source rows, with or without this
    backend (torch 2.13)."""
    from fusion_compiler import backend

    rewritten = []
    run = backend.nearest_upsample.run
    monkeypatch.setattr(backend.nearest_upsample, "run",
                        lambda gm: rewritten.append(run(gm)) or rewritten[-1])
    x = randn((2, 3, 5, 7), torch.float32, device)
    f = lambda x: F.interpolate(x * 2, **kw) + 1            # noqa: E731
    with torch.no_grad():
        out, reports = compile_and_run(f, (x,))
    assert rewritten == [0]
    assert [r.error for r in reports if r.error] == []
    torch._dynamo.reset()
    with torch.no_grad():
        assert_close(out, torch.compile(f, backend="aot_eager")(x))


def test_the_rewrite_is_counted(device, monkeypatch):
    """The same hook sees the power-of-two case rewritten (the check above can fail)."""
    from fusion_compiler import backend

    rewritten = []
    run = backend.nearest_upsample.run
    monkeypatch.setattr(backend.nearest_upsample, "run",
                        lambda gm: rewritten.append(run(gm)) or rewritten[-1])
    x = randn((2, 3, 5, 7), torch.float32, device)
    with torch.no_grad():
        compile_and_run(lambda x: F.interpolate(x * 2, scale_factor=2) + 1, (x,))
    assert rewritten == [1]
