"""torch.roll (Swin's cyclic window shift): its decomposition's index_select by a constant
rotation becomes a roll (passes/roll.py), which kernels do by index arithmetic: read at the
rotated index, or, after a row kernel, stored there (codegen/row_outputs.py ``layout_chain``).
Kernel counts and values against eager, odd sizes, each dtype with its tolerance."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.passes import roll as roll_pass
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16]


def ops_of(reports):
    return [op for r in reports for k in r.kernels for op in k["ops"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_roll_is_read_at_the_rotated_index(dtype, device):
    x = randn((2, 9, 11, 5), dtype, device)
    f = lambda x: torch.roll(x, shifts=(-3, 13), dims=(1, 2)) * 2 + 1     # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert ops_of(reports).count("aten.roll.default") == 2       # one per rolled dimension
    assert_close(out, f(x), dtype=dtype)
    assert torch.equal(out, f(x))                   # a copy and one rounding: bit-equal


def _shifted_windows(x, r, w, b, shift=-2):
    """Swin's shifted block start: LayerNorm of the residual stream, the cyclic shift, the
    window partition (windows of 3 x 4 over 6 x 8 positions)."""
    h = x + r
    y = F.layer_norm(h, (h.shape[-1],), w, b).view(h.shape[0], 6, 8, -1)
    y = torch.roll(y, shifts=(shift, shift), dims=(1, 2))
    y = y.view(h.shape[0], 2, 3, 2, 4, -1).permute(0, 1, 3, 2, 4, 5)
    return y.contiguous().view(-1, 12, h.shape[-1]), h


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_norm_stores_its_rows_rolled_into_windows(dtype, device):
    x, r = randn((3, 48, 21), dtype, device), randn((3, 48, 21), dtype, device)
    w, b = randn((21,), dtype, device), randn((21,), dtype, device)
    out, reports = compile_and_run(_shifted_windows, (x, r, w, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    (windows, h), (exp_windows, exp_h) = out, _shifted_windows(x, r, w, b)
    assert windows.shape == exp_windows.shape and windows.stride() == exp_windows.stride()
    assert_close(windows, exp_windows, dtype=dtype)
    assert torch.equal(h, exp_h)
    # each row is the unshifted kernel's row, only stored elsewhere: bit-equal
    (plain, _), _ = compile_and_run(lambda x, r, w, b: _shifted_windows(x, r, w, b, shift=0),
                               (x, r, w, b))
    rows = plain.view(3, 2, 2, 3, 4, 21).permute(0, 1, 3, 2, 4, 5).reshape(3, 6, 8, 21)
    relaid = torch.roll(rows, shifts=(-2, -2), dims=(1, 2)).view(3, 2, 3, 2, 4, 21)
    assert torch.equal(windows, relaid.permute(0, 1, 3, 2, 4, 5).reshape(-1, 12, 21))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_norm_of_a_rolled_input_and_a_rolled_norm(dtype, device):
    """Swin's shifted block end (windows merged back, the reverse shift, the residual add, the
    next LayerNorm) and a norm whose output is rolled in its own shape."""
    a, r = randn((2, 5, 7, 13), dtype, device), randn((2, 35, 13), dtype, device)
    w, b = randn((13,), dtype, device), randn((13,), dtype, device)

    def end(a, r, w, b):
        h = r + torch.roll(a, shifts=(2, 3), dims=(1, 2)).reshape(2, 35, 13)
        return F.layer_norm(h, (13,), w, b), h

    def rolled(a, w, b):
        return torch.roll(F.layer_norm(a, (13,), w, b), shifts=(1, -4), dims=(1, 2))

    out, reports = compile_and_run(end, (a, r, w, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    for got, exp in zip(out, end(a, r, w, b)):
        assert_close(got, exp, dtype=dtype)
    out, reports = compile_and_run(rolled, (a, w, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, rolled(a, w, b), dtype=dtype)


def test_other_constant_indices_are_a_gather(device):
    """An index_select by a constant index that is not a rotation stays an index_select, which
    the kernel does as a gather of the index it loads."""
    x = randn((4, 6, 5), torch.float32, device)
    idx = torch.tensor([0, 2, 1, 5, 4, 3], device=device)
    f = lambda x: (x * 3).index_select(1, idx) + 1      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert "aten.index_select.default" in ops_of(reports)
    assert "aten.roll.default" not in ops_of(reports)
    assert_close(out, f(x), dtype=torch.float32)


def test_a_rolled_norm_trains(device):
    """The backward of a roll is a roll the other way: it is fused there too, and the gradients
    are eager's."""
    x = randn((2, 6, 8, 5), torch.float32, device).requires_grad_()
    w = randn((5,), torch.float32, device).requires_grad_()

    def f(x, w):
        y = torch.roll(F.layer_norm(x, (5,), w), shifts=(-2, 3), dims=(1, 2))
        return (y * y).sum()
    torch._dynamo.reset()
    import fusion_compiler
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion")(x, w)
        out.backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected = f(x, w)
    expected.backward()
    assert_close(out, expected, dtype=torch.float32)
    assert_close(got[0], x.grad, dtype=torch.float32, name="x grad")
    assert_close(got[1], w.grad, dtype=torch.float32, name="w grad")
    # forward: the norm with its rolled store, the sum; backward: one kernel, and the weight's
    # gradient summed over the rows in a second (passes/column_sums.py); the forward's sum of
    # every element is a reduction of the flat squares, in the kernel that squares them
    assert [r.num_kernels for r in reports] == [2, 2]
    assert leftover_aten(reports) == []
    # the gradient's roll back (one per rolled dimension), read by both backward kernels
    assert sum(op == "aten.roll.default" for r in reports[1:] for k in r.kernels
               for op in k["ops"]) == 4


def test_rotation_detection():
    assert roll_pass.rotation(torch.tensor([3, 4, 0, 1, 2]), 5) == 3
    assert roll_pass.rotation(torch.arange(7), 7) == 0
    assert roll_pass.rotation(torch.tensor([3, 4, 0, 1]), 5) is None        # not all of it
    assert roll_pass.rotation(torch.tensor([3, 4, 1, 0, 2]), 5) is None
    assert roll_pass.rotation(torch.tensor([[0, 1], [1, 0]]), 2) is None     # not 1-d
    assert roll_pass.rotation(torch.tensor([0.0, 1.0]), 2) is None          # not integers
