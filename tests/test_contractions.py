"""Summed broadcast products that are matrix products (passes/contractions.py): run as bmm, the
operands' copies and the sum's readers fused around it. Mamba2's four contractions (transformers'
PyTorch path), odd sizes, keepdim, gradients; and what stays a fused reduction (bf16, a product
by a vector, TF32 matmuls, a product read elsewhere). Values against eager on random data."""
import pytest
import torch

import fusion_compiler
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten


def _randn(*shape, device):
    return torch.randn(*shape, device=device)


def g_of_c_b(C, B, L):
    """G = C B^T per chunk and head, then the decay mask: [b, c, l, s, h]."""
    G = (C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(dim=-1)
    return G * L


def y_diag(M, x):
    """The intra-chunk output: M [b, c, l, s, h] applied to x [b, c, s, h, p] over s."""
    return (M[..., None] * x[:, :, None]).sum(dim=3)


def states(B, decay, x):
    """Each chunk's state: [b, c, h, p, n], summed over the chunk's positions."""
    B_decay = B * decay.permute(0, -2, -1, 1)[..., None]
    return (B_decay[..., None, :] * x[..., None]).sum(dim=2)


def y_off(C, st, decay):
    """The state's output per position: C [b, c, l, h, n] times st [b, c, h, p, n] over n."""
    return (C[..., None, :] * st[:, :, None, ...]).sum(-1) * decay.permute(0, 2, 3, 1)[..., None]


def _check(fn, args, contractions, kernels):
    with fusion_compiler.capture_compiles() as reports:
        torch._dynamo.reset()
        out = torch.compile(fn, backend="fusion", fullgraph=True)(*args)
    bmm = [op for op in leftover_aten(reports) if op == "aten.bmm.default"]
    assert len(bmm) == contractions, leftover_aten(reports)
    assert sum(len(r.summary["contractions"]) for r in reports) == contractions
    assert kernel_count(reports) == kernels, [k["ops"] for r in reports for k in r.kernels]
    outs, wants = (out, fn(*args)) if isinstance(out, tuple) else ((out,), (fn(*args),))
    for got, want in zip(outs, wants, strict=True):
        assert_close(got, want, atol=1e-4, rtol=1e-4)
    return reports


@pytest.mark.parametrize("b,c,l,h,n", [(1, 2, 16, 2, 16), (2, 1, 17, 3, 19)], ids=str)
def test_mamba2_g_is_a_bmm(b, c, l, h, n, device):
    """Two operand copies (one multi-part kernel), the bmm, the mask's product (one kernel)."""
    C, B, L = (_randn(b, c, l, h, n, device=device), _randn(b, c, l, h, n, device=device),
               _randn(b, c, l, l, h, device=device))
    _check(g_of_c_b, (C, B, L), contractions=1, kernels=2)


@pytest.mark.parametrize("b,c,l,h,p", [(1, 2, 16, 2, 16), (2, 1, 23, 2, 17)], ids=str)
def test_mamba2_y_diag_and_states_are_bmms(b, c, l, h, p, device):
    M, x = _randn(b, c, l, l, h, device=device), _randn(b, c, l, h, p, device=device)
    _check(y_diag, (M, x), contractions=1, kernels=2)
    Bm, decay = _randn(b, c, l, h, 16, device=device), _randn(b, h, c, l, device=device)
    _check(states, (Bm, decay, x), contractions=1, kernels=2)


def test_mamba2_y_off_is_a_bmm_with_its_decay_fused_after(device):
    C, st = _randn(2, 2, 16, 2, 32, device=device), _randn(2, 2, 2, 16, 32, device=device)
    decay = _randn(2, 2, 2, 16, device=device)
    _check(y_off, (C, st, decay), contractions=1, kernels=2)


def test_keepdim_and_a_size_one_dim_keep_the_sums_shape(device):
    """[3, 1, 20, 1, 16] x [3, 1, 1, 18, 16] over the last, kept: [3, 1, 20, 18, 1]. Both
    operands are views of [batch, M, K] and [batch, K, N] (no copies): one kernel, the add."""
    def fn(a, b):
        return (a[:, :, :, None, :] * b[:, :, None, :, :]).sum(-1, keepdim=True) + 1
    a, b = _randn(3, 1, 20, 16, device=device), _randn(3, 1, 18, 16, device=device)
    _check(fn, (a, b), contractions=1, kernels=1)


@pytest.mark.parametrize("b,c,l,h,n", [(1, 2, 16, 2, 16), (2, 1, 17, 3, 19)], ids=str)
def test_gradients_through_the_bmm_match_and_are_bmms(b, c, l, h, n, device):
    """The backward of G = sum(C * B) sums dG * expand(B) and dG * expand(C): autograd writes
    the broadcast out as an ``expand`` (the forward let ``mul`` broadcast). Both are bmms too,
    not reductions that read dG again for each element of C and B (transformers 5.17's Mamba2
    backward: 14.9 ms a layer on an H100 as reductions)."""
    C = _randn(b, c, l, h, n, device=device).requires_grad_()
    B = _randn(b, c, l, h, n, device=device).requires_grad_()
    L = _randn(b, c, l, l, h, device=device)
    g = _randn(b, c, l, l, h, device=device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(g_of_c_b, backend="fusion")(C, B, L)
        out.backward(g)
    backward = [r for r in reports if r.kind == "backward"]
    assert len(backward) == 1
    assert len(backward[0].summary["contractions"]) == 2
    assert leftover_aten(backward) == ["aten.bmm.default"] * 2
    assert kernel_count(backward) == 3     # dG and the operands in one, the grads back
    got = C.grad.clone(), B.grad.clone()
    C.grad = B.grad = None
    g_of_c_b(C, B, L).backward(g)
    assert_close(out, g_of_c_b(C, B, L), atol=1e-4, rtol=1e-4)
    assert_close(got[0], C.grad, atol=1e-4, rtol=1e-4, name="C.grad")
    assert_close(got[1], B.grad, atol=1e-4, rtol=1e-4, name="B.grad")


def _stays_a_reduction(fn, args, dtype, why=None):
    """One fused kernel, no bmm; ``why``: the reason the dump gives for keeping the matrix
    product a reduction (None: no matrix product, nothing to say)."""
    out, reports = compile_and_run(fn, args)
    assert "aten.bmm.default" not in leftover_aten(reports)
    assert not any(r.summary["contractions"] for r in reports)
    kept = [c["reason"] for r in reports for c in r.summary["contractions_kept"]]
    assert (kept == []) if why is None else (len(kept) == 1 and why in kept[0]), kept
    assert kernel_count(reports) == 1
    assert_close(out, fn(*args), dtype=dtype)
    return reports


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_products_stay_a_fused_reduction(dtype, device):
    """Eager rounds each product to the dtype before the sum; a bmm would not."""
    C, B = (torch.randn(1, 2, 16, 2, 16, device=device, dtype=dtype) for _ in range(2))
    L = torch.randn(1, 2, 16, 16, 2, device=device, dtype=dtype)
    reports = _stays_a_reduction(g_of_c_b, (C, B, L), dtype, why="not fp32: eager rounds")
    kept = reports[0].summary["contractions_kept"]
    assert [(c["batch"], c["m"], c["k"], c["n"]) for c in kept] == [(4, 16, 16, 16)]


def test_a_product_by_a_vector_stays_a_fused_reduction(device):
    """N of 1: each operand read once by the reduction kernel, no GEMM to win."""
    def fn(a, v):
        return (a * v[:, None, :]).sum(-1)
    _stays_a_reduction(fn, (_randn(4, 32, 64, device=device), _randn(4, 64, device=device)),
                       torch.float32)


def test_tf32_matmuls_keep_the_fp32_sum(device):
    """With TF32 allowed a bmm would round the operands to 10 bits of mantissa."""
    C, B, L = (_randn(1, 2, 16, 2, 16, device=device), _randn(1, 2, 16, 2, 16, device=device),
               _randn(1, 2, 16, 16, 2, device=device))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        _stays_a_reduction(g_of_c_b, (C, B, L), torch.float32, why="TF32 matmuls allowed")
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_product_read_elsewhere_stays(device):
    def fn(a, b):
        p = a[:, :, None, :] * b[:, None, :, :]
        return p.sum(-1), p.amax(-1)
    a, b = _randn(2, 16, 16, device=device), _randn(2, 16, 16, device=device)
    out, reports = compile_and_run(fn, (a, b))
    assert "aten.bmm.default" not in leftover_aten(reports)
    assert [c["reason"] for r in reports for c in r.summary["contractions_kept"]] == [
        "the product is read by more than the sum"]
    assert kernel_count(reports) == 1      # the sum and the max of one product
    for got, want in zip(out, fn(a, b)):
        assert_close(got, want)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_sum_over_a_dim_of_size_one_is_a_pointwise_copy(dtype, keepdim, device):
    """Mamba2's ``M = (G[..., None] * L[..., None]).sum(-1)``: one pointwise kernel, no
    reduction, the product's values in the sum's layout, bit-equal (signs of zeros too)."""
    g, l = (torch.randn(2, 17, 9, device=device, dtype=dtype),
            torch.randn(2, 9, 17, device=device, dtype=dtype))
    g[0, 0, 0], l[0, 0, 0] = -0.0, 1.0      # ATen's sum of one -0.0 is +0.0

    def fn(g, l):
        return (g[..., None] * l.permute(0, 2, 1)[..., None]).sum(-1, keepdim=keepdim)
    out, reports = compile_and_run(fn, (g, l))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for r in reports for k in r.kernels] == ["pointwise"]
    want = fn(g, l)
    assert out.stride() == want.stride()
    assert torch.equal(out, want) and torch.equal(out.signbit(), want.signbit())


@pytest.mark.parametrize("shape", [(2, 16, 3, 16), (3, 19, 2, 17)], ids=str)
def test_an_operand_read_by_two_contractions_is_copied_once(shape, device):
    """``a`` [b, l, h, n] is the [b*h, l, n] operand of both sums: one contiguous copy of it,
    through either sum's own views, where each made its own (Mamba2's backward reads its
    forward's operands again). (With a batch of 1 the operands are strided views: no copy.)"""
    def fn(a, b, c):
        return ((a[:, :, None] * b[:, None]).sum(-1),
                (a.view(bsz, l, 1, h, n) * c.unsqueeze(1)).sum(-1))
    bsz, l, h, n = shape
    a = _randn(*shape, device=device)
    b, c = _randn(bsz, l + 1, h, n, device=device), _randn(bsz, l + 2, h, n, device=device)
    reports = _check(fn, (a, b, c), contractions=2, kernels=3)
    copies = [op for r in reports for k in r.kernels for op in k["ops"] if "clone" in op]
    assert len(copies) == 5, copies     # a, b and c in; each sum's result out


def chunk_scan(C, B, x, L, decay):
    """transformers 5.17's Mamba2 chunked scan, its four contractions written as products of
    broadcast operands (the intra-chunk output and the chunk states' output)."""
    return y_diag(g_of_c_b(C, B, L), x) + y_off(C, states(B, decay, x), decay)


def test_the_chunked_scans_training_step_runs_its_contractions_as_bmms(device):
    """Four contractions forward, eight in the backward (each operand's gradient is one more,
    through autograd's expands); every gradient against eager."""
    b, c, l, h, n, p = 2, 2, 16, 3, 16, 17
    C, B = (_randn(b, c, l, h, n, device=device).requires_grad_() for _ in range(2))
    x = _randn(b, c, l, h, p, device=device).requires_grad_()
    L, decay = _randn(b, c, l, l, h, device=device), _randn(b, h, c, l, device=device)
    g = _randn(b, c, l, h, p, device=device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(chunk_scan, backend="fusion")(C, B, x, L, decay)
        out.backward(g)
    got = [t.grad.clone() for t in (C, B, x)]
    for t in (C, B, x):
        t.grad = None
    want = chunk_scan(C, B, x, L, decay)
    want.backward(g)
    assert [r.kind for r in reports] == ["forward", "backward"]
    assert [len(r.summary["contractions"]) for r in reports] == [4, 8]
    assert [leftover_aten([r]).count("aten.bmm.default") for r in reports] == [4, 8]
    # forward 4, not 5: one pointwise kernel writes outputs of two shapes that are views of
    # one another (test_pointwise_layouts)
    assert [r.num_kernels for r in reports] == [4, 5]
    assert_close(out, want, atol=1e-4, rtol=1e-4)
    for t, grad in zip((C, B, x), got):
        assert_close(grad, t.grad, atol=1e-4, rtol=1e-4, name="grad")
