"""Reductions over several trailing dimensions (passes/trailing_dims.py): merged into one
dimension by a view and reduced as rows, fused with their producers; where the dimensions do
not merge, the reduction stays on ATen. Kernel counts and values against eager, odd sizes,
each dtype with its tolerance."""
import pytest
import torch

from helpers import assert_close, aten_reasons, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pool(x, r):
    """ConvNeXt's end: the residual add, then the global average pool over H and W."""
    h = x + r
    return h, h.mean([-2, -1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_channels_last_pool_is_fused_with_its_add(dtype, device):
    x = randn((3, 5, 7, 9), dtype, device).to(memory_format=torch.channels_last)
    r = randn((3, 5, 7, 9), dtype, device).to(memory_format=torch.channels_last)
    (h, pooled), reports = compile_and_run(_pool, (x, r))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    eh, ep = _pool(x, r)
    assert_close(h, eh, dtype=dtype, name="sum")
    assert_close(pooled, ep, dtype=dtype, name="pool")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [((7, 1), (0,), False), ((2, 9, 1, 1), (1,), True),
                                  ((3, 5, 1), (1,), False)], ids=str)
def test_dims_of_size_one_kept_after_the_reduced_ones(case, dtype, device):
    """A reduction whose kept dims after the reduced ones all have size 1 (``x.sum(0)`` of an
    [n, 1] tensor; the fuzzer's find) reduces over them too, as rows, viewed back to the
    result's shape: one kernel, not ATen's sum."""
    shape, dims, keepdim = case
    x = randn(shape, dtype, device)
    f = lambda a: (a * 2).sum(dims, keepdim=keepdim)  # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "amax", "amin", "mean"])
def test_reductions_over_the_last_three_dims(op, dtype, device):
    x = randn((4, 3, 5, 11), dtype, device)
    x[1, 2, 4, 10] = float("nan")
    f = lambda a: getattr(torch, op)(a * 2 - 1, dim=(1, 2, 3), keepdim=True)  # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert out.shape == (4, 1, 1, 1)
    # a sum over 165 terms in another order than ATen's
    assert_close(out, f(x), dtype=dtype, rtol=0.02 if dtype != torch.float32 else None)


def test_dims_that_do_not_merge_stay_on_aten(device):
    x = randn((6, 9, 8), torch.float32, device)
    f = lambda a: (a + 1)[:, :, :7].mean([-2, -1])      # noqa: E731  strides (72, 8, 1): gaps
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and len(leftover_aten(reports)) == 1
    assert_close(out, f(x))
    assert aten_reasons(f, x) == [
        "reduction over trailing dims: the reduced dims are no view of one dimension (their strides)"]


def test_symbolic_sizes_stay_on_aten(device):
    x = randn((4, 6, 5), torch.float32, device)
    f = lambda a: (a * 3).sum([-2, -1])         # noqa: E731
    out, reports = compile_and_run(f, (x,), dynamic=True)
    assert len(leftover_aten(reports)) == 1
    assert_close(out, f(x))
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    assert aten_reasons(f, x) == ["reduction over trailing dims: symbolic sizes (dynamic shapes)"]
