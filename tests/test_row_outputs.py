"""A row kernel's per-row outputs (a norm's statistics, a row's amax) are stored 1-d
(triton_lib.store_rows): Triton 3.6 failed to compile [XBLOCK, 1] stores of per-row values whose
chains share an op ("PassManager::run failed" in TritonGPURemoveLayoutConversions; the GPU
gradient fuzzer's ``tanh(amin(x, 0))`` program, session 55). Values against eager, each dtype
with its tolerance, odd shapes, one kernel; on the GPU the kernels compile for real."""
import re

import pytest
import torch

from helpers import TOL, assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def chains(op):
    """m, f(m - f(m)), f(m) again (a second node: Triton's CSE merges it with the first), and
    f(f(m)) of a row's min m: the stores Triton 3.6 misordered (5 of 6 block shapes failed)."""
    def f(x):
        m = x.amin(-1, keepdim=True)
        a = op(m)
        return m, op(m - a), op(m.contiguous()), op(a)
    return f


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 41), (5, 37), (300, 129), (3, 5001)],
                         ids=["one-row", "short-rows", "many-rows", "long-rows"])
@pytest.mark.parametrize("op", [torch.exp, torch.tanh], ids=["exp", "tanh"])
def test_per_row_values_that_share_an_op_are_stored_one_d(op, shape, dtype, device):
    x = randn(shape, dtype, device)
    fn = chains(op)
    out, reports = compile_and_run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    source = "".join(open(k["path"]).read() for r in reports for k in r.kernels)
    assert source.count("fl.store_rows(") == 4
    assert not re.search(r"tl\.store\(out\d", source)
    for name, got, want in zip(["m", "f(m - f(m))", "f(m)", "f(f(m))"], out, fn(x)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, dtype=dtype, name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_norm_keeps_its_statistics_for_the_backward(dtype, device):
    """A LayerNorm trained: its forward stores each row's mean and reciprocal deviation (per-row
    outputs, stored 1-d) beside the normalized rows; the gradients match eager's."""
    x = randn((7, 45), dtype, device).requires_grad_()
    norm = torch.nn.LayerNorm(45).to(device, dtype)
    torch._dynamo.reset()
    import fusion_compiler
    with fusion_compiler.capture_compiles() as reports:
        y = torch.compile(norm, backend="fusion")(x)
        (y * y).sum().backward()
    got = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    (norm(x) ** 2).sum().backward()
    forward = "".join(open(k["path"]).read() for k in reports[0].kernels)
    assert forward.count("fl.store_rows(") == 2
    atol, rtol = TOL[dtype]
    assert_close(got[0], x.grad, dtype=dtype, name="x grad")
    assert_close(got[1], norm.weight.grad, atol=atol * 45, rtol=rtol, name="weight grad")


def test_a_per_row_value_that_is_a_block_of_one_trains(device):
    """The GPU gradient fuzzer's find: ``where(x1 <= x1, x1, x2)`` of two 0-d inputs beside
    ``x0 + x1`` of a [3, 12] expanded input; the backward's row kernel sums x1's gradient and
    stores the where's gradients, blocks of one ([1]: a constant met scalar loads), per row.
    store_rows broadcast them with a rank they do not have ("Cannot broadcast, rank
    mismatch"); now they take the rows' shape."""
    x0 = randn((1, 12), torch.float32, device).expand(3, 12)
    x1, x2 = randn((1,), torch.float32, device)[0], randn((1,), torch.float32, device)[0]

    def f(x0, x1, x2):
        return x0 + x1, torch.where(x1 <= x1, x1, x2)
    ours = [t.detach().clone().requires_grad_() for t in (x0, x1, x2)]
    ref = [t.detach().clone().requires_grad_() for t in (x0, x1, x2)]
    torch._dynamo.reset()
    import fusion_compiler
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion", fullgraph=True)(*ours)
        ((out[0] * 2).sum() + (out[1] * 3).sum()).backward()
    expected = f(*ref)
    ((expected[0] * 2).sum() + (expected[1] * 3).sum()).backward()
    assert {r.kind for r in reports} == {"forward", "backward"}
    assert not [r.error for r in reports if r.error]
    for name, a, e in zip(["x0 + x1", "where"], out, expected):
        assert_close(a, e, dtype=torch.float32, name=name)
    for name, a, e in zip(["x0", "x1", "x2"], ours, ref):
        assert_close(a.grad, e.grad, dtype=torch.float32, name=f"grad of {name}")
