"""Pointwise kernels whose outputs have different shapes that are views of one another
(codegen/row_outputs.py ``pointwise_shape``, ``moved``): a copy in one layout returned
beside a value computed from it in another (transformers 5.17's Mamba2 keeps a bmm's output in
the layout its scan reads and computes its decay mask in the bmm's own) is one kernel, each
output stored where the views put each element of the iteration. Kernel counts and values
against eager on random data, odd shapes, each dtype with its tolerance."""
import pytest
import torch

from helpers import as_tuple, assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(fn, args, dtype, kernels, dynamic=False):
    out, reports = compile_and_run(fn, args, dynamic=dynamic)
    assert kernel_count(reports) == kernels and leftover_aten(reports) == []
    for i, (a, e) in enumerate(zip(as_tuple(out), as_tuple(fn(*args)))):
        assert a.shape == e.shape and a.stride() == e.stride(), f"output {i}"
        assert_close(a, e, dtype=dtype, name=f"output {i}")
    return reports


def copy_and_read_back(x):
    """A copy of x in another layout, and a value of it read back in x's: outputs of shapes
    [B, C, L] and [B, L, C]."""
    z = x.permute(0, 2, 1).contiguous()
    w = (torch.sigmoid(z.permute(0, 2, 1)) * 2 + 1).contiguous()
    return z, w


def through_unit_dims(x, y):
    """The iteration is the shape of a value neither output has ([1, 5, 4, 7, 1]): one output
    is pulled to it by unsqueezes, the other pushed from it by a permute and a clone."""
    z = (x * y).permute(1, 0, 2).contiguous()
    w = torch.exp(z.unsqueeze(0).unsqueeze(-1)) - z[None, :, :, :, None]
    return z, w.permute(0, 2, 1, 3, 4).contiguous()


def scan_layouts(scores, decay):
    """Mamba2's chunked scan, as 5.17 writes it: the bmm's [c * h, l, s] scores copied to the
    [c, l, s, h] layout the scan reads, and their masked, decayed form in the bmm's own."""
    c, h = decay.shape[:2]
    l = scores.shape[-1]
    g = scores.view(c, h, l, l).permute(0, 2, 3, 1).contiguous()
    mask = torch.ones(l, l, dtype=torch.bool, device=scores.device).tril()
    m = torch.where(mask, g.permute(0, 3, 1, 2) * torch.exp(decay), 0.0).contiguous()
    return g, m


def computed_in_another_layout(x, y):
    """x * 2, and a value computed from its transpose ([6, 4, 5] of [4, 5, 6]) and y: no view of
    x * 2, but each element computed from one of it (row_outputs.traced; x * 2 is also read by
    the transpose, so the kernel could as well iterate over [6, 4, 5]: ``pulled``)."""
    a = x * 2
    return a, torch.sigmoid(a.permute(2, 0, 1)) * y


def scan_then_permuted(a, s):
    """A cumsum along rows [h, c, l] and its exp scaled in the [c, l, h] layout, as Mamba2's
    segment sums are decayed: a row kernel whose output is computed in a permuted layout."""
    return (torch.exp(torch.cumsum(a, -1).permute(1, 2, 0)) * s).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 5), (3, 37, 19), (2, 130, 67)])
def test_a_copy_and_its_value_in_another_layout_are_one_kernel(shape, dtype, device):
    _check(copy_and_read_back, (randn(shape, dtype, device),), dtype, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_iteration_may_be_a_shape_no_output_has(dtype, device):
    args = (randn((4, 5, 7), dtype, device), randn((4, 5, 7), dtype, device))
    _check(through_unit_dims, args, dtype, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c, h, l", [(2, 3, 17), (3, 5, 32)])
def test_scan_scores_in_two_layouts_are_one_kernel(c, h, l, dtype, device):
    scores = randn((c * h, l, l), dtype, device)
    decay = -randn((c, h, l, l), dtype, device).abs()
    _check(scan_layouts, (scores, decay), dtype, kernels=1)


def test_dynamic_sizes(device):
    for shape in [(2, 9, 13), (3, 11, 6)]:
        _check(copy_and_read_back, (randn(shape, torch.float32, device),), torch.float32,
               kernels=1, dynamic=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_output_that_is_no_view_of_the_other_stays_apart(dtype, device):
    """A broadcast is no view that holds each element once: written from the broadcast's
    iteration, x * 2 would be stored three times over. Two kernels."""
    def fn(x):
        y = x * 2
        return y, (y.expand(3, *x.shape) + 1).contiguous()
    _check(fn, (randn((4, 5), dtype, device),), dtype, kernels=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 5, 6), (3, 17, 33)])
def test_a_value_computed_from_a_transpose_is_stored_beside_it(shape, dtype, device):
    y = randn((shape[2], shape[0], shape[1]), dtype, device)
    _check(computed_in_another_layout, (randn(shape, dtype, device), y), dtype, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h, c, l", [(3, 2, 16), (5, 3, 37)])
def test_a_row_kernel_computes_an_output_in_a_permuted_layout(h, c, l, dtype, device):
    a = -randn((h, c, l), dtype, device).abs() * 0.1
    _check(scan_then_permuted, (a, randn((c, l, h), dtype, device)), dtype, kernels=1)


def centered_then_permuted(a, s):
    """Rows centered on their max, exponentiated and scaled in the [c, l, h] layout."""
    return (torch.exp(a - a.amax(-1, keepdim=True)).permute(1, 2, 0) * s).contiguous()


def test_a_row_kernels_permuted_output_at_dynamic_sizes(device):
    for h, c, l in [(3, 2, 16), (5, 3, 37)]:
        a, s = randn((h, c, l), torch.float32, device), randn((c, l, h), torch.float32, device)
        _check(centered_then_permuted, (a, s), torch.float32, kernels=1, dynamic=True)
