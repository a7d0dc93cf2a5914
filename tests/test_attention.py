"""Attention kept whole in inference graphs (fusion_compiler/attention.py).

On the CPU, aot_autograd already keeps SDPA fused (flash attention for CPU), so the rewrite is
only on for CUDA; these tests turn it on for the CPU too, to check the op, its stated output
layout and the kernels fused around it, against eager.
"""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler import attention
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten


@pytest.fixture
def rewrite_here(monkeypatch, device):
    monkeypatch.setattr(attention, "DEVICE_TYPES", ("cuda", "cpu"))


def block(q, k, v, mask, r):
    """Attention with a boolean mask, its output transposed back and reshaped (as Hugging Face
    models do), then a residual add: the add reads the op's output through its strides."""
    b, h, s, d = q.shape
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    return o.transpose(1, 2).reshape(b, s, h * d) * 2.0 + r


def inputs(device, dtype, b=2, h=3, s=7, d=16):
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    mask = torch.rand(b, 1, s, s, device=device) > 0.3
    mask[..., 0] = True          # no fully masked row (eager's kernels disagree on those)
    r = torch.randn(b, s, h * d, device=device, dtype=dtype)
    return q, k, v, mask, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_graph_keeps_sdpa_as_one_op(rewrite_here, device, dtype):
    args = inputs(device, dtype)
    with torch.no_grad():
        out, reports = compile_and_run(block, args)
        expected = block(*args)
    assert_close(out, expected, dtype=dtype)
    ops = leftover_aten(reports)
    assert any("fusion_compiler.sdpa" in op for op in ops), ops
    assert not any(name in op for op in ops for name in ("bmm", "softmax", "amax"))
    assert kernel_count(reports) == 1          # the * 2 + r behind it


def test_output_layout_is_what_the_fake_op_says(device):
    q, k, v, mask, _ = inputs(device, torch.float32, s=5)
    real = torch.ops.fusion_compiler.sdpa(q, k, v, mask, False, None, False)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.fusion_compiler.sdpa(*(mode.from_tensor(t) for t in (q, k, v, mask)),
                                              False, None, False)
    assert real.shape == fake.shape and real.stride() == fake.stride()
    assert_close(real, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_training_graph_keeps_aots_decomposition(rewrite_here, device):
    """Grad mode on: the op has no autograd formula, so nothing is replaced; gradients match."""
    q, k, v, mask, r = inputs(device, torch.float32)
    q.requires_grad_(True)
    torch._dynamo.reset()
    fn = torch.compile(block, backend="fusion")
    out = fn(q, k, v, mask, r)
    out.sum().backward()
    grad = q.grad.clone()
    q.grad = None
    block(q, k, v, mask, r).sum().backward()
    assert_close(grad, q.grad)


@pytest.mark.parametrize("kwargs", [{"dropout_p": 0.5}, {"is_causal": True}])
def test_random_or_causal_calls(rewrite_here, device, kwargs):
    """Dropout is random: left to aot. A causal call without a mask is kept whole."""
    q, k, v, _, _ = inputs(device, torch.float32)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    with torch.no_grad():
        out, reports = compile_and_run(fn, (q, k, v))
    kept = any("fusion_compiler.sdpa" in op for op in leftover_aten(reports))
    assert kept == ("dropout_p" not in kwargs)
    if "dropout_p" not in kwargs:
        assert_close(out, fn(q, k, v))
