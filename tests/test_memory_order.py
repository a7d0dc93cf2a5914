"""Reductions over dims out of memory order (passes/memory_order.py): rewritten as the same
reduction over the input permuted to its memory order, which outer_dims, column_sums or
trailing_dims then make row kernels with the input's producers. Kernel counts, nothing on
ATen, values against eager on random data at odd shapes, in each dtype."""
import pytest
import torch

from fusion_compiler.passes import memory_order
from helpers import aten_reasons, assert_close, compile_and_run, kernel_count, leftover_aten

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# sums of up to a few hundred terms in another order than ATen's
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def randn(shape, dtype, device):
    return torch.randn(shape, device=device).to(dtype)


def _rewritten(f, x, monkeypatch) -> int:
    """How many reductions the pass rewrote in ``f``'s graph (it runs on the graph alone)."""
    seen, run = [], memory_order.run
    monkeypatch.setattr(memory_order, "run", lambda gm, ctx: seen.append(run(gm, ctx)) or seen[-1])
    compile_and_run(f, (x,))
    monkeypatch.setattr(memory_order, "run", run)
    return sum(seen)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 37, 19), (2, 5, 33), (1, 7, 3)], ids=str)
def test_sum_over_batch_and_time_of_time_innermost_rows(shape, dtype, device):
    """[N, L, C] lying time-innermost (Mamba's tap products in training) summed over batch and
    time: a row sum over time with the producer, then the batch's partials summed (one kernel
    where the batch is 1)."""
    n, length, c = shape
    x = randn((n, c, length), dtype, device).transpose(1, 2)      # strides (C*L, 1, L)
    f = lambda x: (x * 2 + 1).sum([0, 1])      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert leftover_aten(reports) == []
    assert kernel_count(reports) == (1 if n == 1 else 2)
    assert_close(out, f(x), atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mean_keepdim(dtype, device):
    """A mean with keepdim: the rewritten mean viewed back to [1, 1, C]."""
    x = randn((3, 23, 41), dtype, device).transpose(1, 2)
    f = lambda x: x.exp().mean([0, 1], keepdim=True)     # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert leftover_aten(reports) == [] and kernel_count(reports) == 2
    assert out.shape == (1, 1, 23)
    assert_close(out, f(x), atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_amax_over_transposed_trailing_dims(dtype, device):
    """An amax over [H, W] of [N, H, W] lying [N, W, H]: one row kernel over rows of W x H
    elements, exact."""
    x = randn((5, 9, 7), dtype, device).transpose(1, 2)
    f = lambda x: (x - 1).amax([1, 2])      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert leftover_aten(reports) == [] and kernel_count(reports) == 1
    assert torch.equal(out, f(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_norm_sums_over_transposed_spatial_dims(dtype, device):
    """sum([0, 2, 3]) of [N, C, H, W] lying [N, C, W, H]: rows over W x H, then over N."""
    x = randn((3, 6, 11, 5), dtype, device).transpose(2, 3)
    f = lambda x: (x * x).sum([0, 2, 3])    # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert leftover_aten(reports) == [] and kernel_count(reports) == 2
    assert_close(out, f(x), atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_reductions_rewritten_as_they_stand_are_left_to_the_other_passes(device, monkeypatch):
    """Contiguous, or dims that merge as they lie (a channels-last BatchNorm sum): not this
    pass's."""
    x = randn((4, 6, 5), torch.float32, device)
    assert _rewritten(lambda x: (x * 2).sum([0, 1]), x, monkeypatch) == 0
    y = randn((2, 3, 4, 5), torch.float32, device).to(memory_format=torch.channels_last)
    assert _rewritten(lambda y: (y * 2).sum([0, 2, 3]), y, monkeypatch) == 0
    z = randn((4, 6, 5), torch.float32, device).transpose(1, 2)
    assert _rewritten(lambda z: (z * 2).sum([0, 1]), z, monkeypatch) == 1


def test_kept_dims_out_of_order_stay_on_aten(device, monkeypatch):
    """In memory order the kept dims would come transposed (the result would need a copy after):
    left on ATen, with column_sums's reason."""
    g = randn((300, 8, 5, 16), torch.float32, device).permute(1, 0, 3, 2)
    f = lambda g: (g * 2).sum([0, 1])       # noqa: E731
    assert _rewritten(f, g, monkeypatch) == 0
    assert aten_reasons(f, g) == ["sum or mean over leading dims: the summed dims are no view of "
                                  "one dimension (their strides)"]
