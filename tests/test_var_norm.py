"""var, std and the 2-norm (fusion_compiler/decompositions.py): decomposed into a mean and a
sum of squared deviations, or a sum of squares and a square root, they fuse with their
producers and consumers as row kernels (F.normalize, a custom norm's std), where ATen's op had
stayed between kernels. Kernel counts and values against eager, odd shapes, each dtype with
its tolerance; gradients; what stays on ATen."""
import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from helpers import TOL, assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

CASES = {
    "var": lambda x: x.var(-1, keepdim=True) + x,
    "var over dim 1, no correction": lambda x: torch.var(x * 2, 1, correction=0) - 1,
    "std": lambda x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5),
    "normalize": lambda x: F.normalize(x * 3, dim=-1),
    "normalize over dim 1": lambda x: F.normalize(x, dim=1) + 1,
    "cosine similarity": lambda x: F.cosine_similarity(x, x * x + 1, dim=-1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_each_is_one_kernel_with_what_reads_it(case, dtype, device):
    fn = CASES[case]
    x = randn((3, 21, 5, 17), dtype, device)
    x[1, 2, 3] = 0          # a row of zeros: its norm is clamped, its var is 0
    out, reports = compile_and_run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    want = fn(x)
    assert out.shape == want.shape and out.stride() == want.stride()
    # sums over 17-21 terms in another order than ATen's
    atol, rtol = TOL[dtype]
    assert_close(out, want, dtype=dtype, atol=2 * atol, rtol=2 * rtol)


def test_a_row_of_one_element_has_eager_s_nan_var(device):
    x = randn((4, 1), torch.float32, device)
    f = lambda a: (a * 2).var(-1)       # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert torch.isnan(out).all() and torch.isnan(f(x)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_through_normalize_and_std(dtype, device):
    """The backward formulas are autograd's, above the decomposition: a row of zeros gets
    normalize's zero gradient, as in eager."""
    x = randn((6, 33), dtype, device)
    x[2] = 0
    g = randn((6, 33), dtype, device)

    def f(a):
        return F.normalize(a, dim=-1) * 2 + a / (a.std(-1, keepdim=True) + 1)
    leaf, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion")(leaf)
        (out * g).sum().backward()
    want = f(ref)
    (want * g).sum().backward()
    atol, rtol = TOL[dtype]
    assert_close(out, want, dtype=dtype, atol=2 * atol, rtol=2 * rtol)
    assert_close(leaf.grad, ref.grad, dtype=dtype, atol=4 * atol, rtol=4 * rtol, name="grad")
    assert kernel_count(reports, "forward") >= 1 and kernel_count(reports, "backward") >= 1
    assert not [op for op in leftover_aten(reports) if "norm" in op or "var" in op]


def test_other_norms_stay_on_aten(device):
    """The 1-norm, the max norm and a norm with dtype= are ATen's op, with eager's values."""
    x = randn((5, 19), torch.float32, device)
    for f in (lambda a: torch.linalg.vector_norm(a * 2, 1, dim=-1),
              lambda a: torch.linalg.vector_norm(a * 2, float("inf"), dim=-1),
              lambda a: torch.linalg.vector_norm(a * 2, dim=-1, dtype=torch.float64)):
        out, reports = compile_and_run(f, (x,))
        assert leftover_aten(reports) == ["aten.linalg_vector_norm.default"]
        assert_close(out, f(x))
