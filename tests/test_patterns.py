"""Each memory-bound pattern becomes exactly one generated kernel and matches eager.

Kernels run on the GPU when there is one, else in Triton's interpreter on small shapes.
"""
import pytest
import torch

import fusion_compiler

from helpers import (as_tuple, assert_close, assert_fp8_matches, compile_and_run, kernel_count,
                     leftover_aten)
from patterns import PATTERNS, make_args, randn, rope

ROW_PATTERNS = ["add_rmsnorm", "add_layernorm", "swiglu", "bias_gelu", "bias_gelu_erf",
                "rmsnorm_fp8", "rmsnorm_dynamic_fp8", "dequant_add", "softmax_scale"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# rows x N: odd sizes, a long row (looped kernel) and a single row
SHAPES = [(1, 9), (7, 41), (333, 9), (7, 4231), (1, 65536), (3, 65536)]
SMALL_SHAPES = [(7, 41), (333, 9)]


def check_outputs(name, out, ref, dtype):
    for i, (a, e) in enumerate(zip(as_tuple(out), as_tuple(ref))):
        if e.dtype == torch.float8_e4m3fn:
            assert_fp8_matches(a, e)
        else:
            assert_close(a, e, dtype=dtype if e.dtype == dtype else e.dtype, name=f"{name}[{i}]")


def assert_one_kernel(reports):
    assert kernel_count(reports) == 1, [r.kernels for r in reports]
    assert leftover_aten(reports) == [], leftover_aten(reports)


@pytest.mark.parametrize("rows,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ROW_PATTERNS)
def test_pattern_is_one_kernel(name, dtype, rows, n, device):
    if name == "dequant_add" and dtype != torch.bfloat16:
        pytest.skip("dequant_add is defined in bf16")
    if n == 65536 and rows * n > 100_000 and device == "cpu":
        pytest.skip("interpreter: one long-row case is enough on the CPU")
    args = make_args(name, rows, n, dtype, device)
    out, reports = compile_and_run(PATTERNS[name], args)
    assert_one_kernel(reports)
    check_outputs(name, out, PATTERNS[name](*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ROW_PATTERNS)
def test_pattern_strided_input(name, dtype, device):
    if name == "dequant_add" and dtype != torch.bfloat16:
        pytest.skip("dequant_add is defined in bf16")
    args = make_args(name, 7, 41, dtype, device, strided=True)
    assert not args[0].is_contiguous()
    out, reports = compile_and_run(PATTERNS[name], args)
    assert_one_kernel(reports)
    check_outputs(name, out, PATTERNS[name](*args), dtype)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", ["add_rmsnorm", "add_layernorm", "swiglu", "bias_gelu",
                                  "softmax_scale", "dequant_add"])
def test_pattern_training(name, dynamic, device):
    """Forward is one kernel; gradients match eager; backward runs through the pipeline."""
    dtype = torch.float32 if name != "dequant_add" else torch.bfloat16
    args = make_args(name, 7, 41, dtype, device, grad=True)
    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out, reports = compile_and_run(PATTERNS[name], args, dynamic=dynamic)
    ref = PATTERNS[name](*ref_args)
    assert kernel_count(reports, "forward") == 1
    assert leftover_aten(reports, "forward") == []
    check_outputs(name, out, ref, dtype)
    grad_out = torch.randn_like(as_tuple(ref)[0])
    params = [a for a in args if a.requires_grad]
    ref_params = [a for a in ref_args if a.requires_grad]
    with fusion_compiler.capture_compiles() as bw_reports:
        grads = torch.autograd.grad(as_tuple(out)[0], params, grad_out)
    ref_grads = torch.autograd.grad(as_tuple(ref)[0], ref_params, grad_out)
    # weight gradients reduce over rows (on ATen) in another order: fp32 rounding differs
    for i, (g, e) in enumerate(zip(grads, ref_grads)):
        assert_close(g, e, atol=1e-4 if dtype == torch.float32 else None,
                     rtol=1e-4 if dtype == torch.float32 else None, name=f"grad[{i}]")
    # the backward is fused too: only reductions over rows (weight/bias grads) stay on ATen
    assert set(leftover_aten(bw_reports, "backward")) <= {"aten.sum.dim_IntList"}


ROPE_SHAPES = [(1, 1, 1, 8), (2, 3, 7, 64), (1, 2, 33, 9)]


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_is_one_kernel(shape, dtype, device):
    b, h, s, d = shape
    args = (randn(shape, dtype, device), randn((s, d), dtype, device), randn((s, d), dtype, device))
    out, reports = compile_and_run(rope, args)
    assert_one_kernel(reports)
    assert_close(out, rope(*args), dtype=dtype)


def test_rope_strided_query(device):
    """q as attention produces it: [b, s, h, d] transposed to [b, h, s, d] (not contiguous)."""
    q = randn((2, 7, 3, 64), torch.float32, device).transpose(1, 2)
    cos, sin = randn((7, 64), torch.float32, device), randn((7, 64), torch.float32, device)
    out, reports = compile_and_run(rope, (q, cos, sin))
    assert_one_kernel(reports)
    assert_close(out, rope(q, cos, sin))


@pytest.mark.parametrize("dynamic", [False, True])
def test_rope_training(dynamic, device):
    q = randn((2, 3, 7, 16), torch.float32, device, requires_grad=True)
    cos, sin = randn((7, 16), torch.float32, device), randn((7, 16), torch.float32, device)
    out, reports = compile_and_run(rope, (q, cos, sin), dynamic=dynamic)
    assert kernel_count(reports, "forward") == 1
    q_ref = q.detach().clone().requires_grad_()
    ref = rope(q_ref, cos, sin)
    g = torch.randn_like(ref)
    assert_close(torch.autograd.grad(out, q, g)[0], torch.autograd.grad(ref, q_ref, g)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dynamic", [False, True])
def test_channels_last_pointwise_walks_memory_in_order(dtype, dynamic, device):
    """ConvNeXt's layer scale and residual: NCHW values stored channels-last. The kernel's
    linear index walks the output's memory, so the store and the same-layout loads are
    contiguous (`out0 + xindex`), not strided by the channel count."""
    x = randn((3, 24, 5, 7), dtype, device).to(memory_format=torch.channels_last)
    r = randn((3, 24, 5, 7), dtype, device).to(memory_format=torch.channels_last)
    gamma = randn((24,), dtype, device)

    def layer_scale(x, r, gamma):
        return r + gamma[:, None, None] * x

    out, reports = compile_and_run(layer_scale, (x, r, gamma), dynamic=dynamic)
    assert_one_kernel(reports)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, layer_scale(x, r, gamma), dtype=dtype)
    if not dynamic:     # with symbolic strides the logical order stays
        (kernel,) = reports[0].kernels
        source = open(kernel["path"]).read()
        assert "tl.store(out0 + xindex," in source, source
        assert "x1 = tl.load(in0 + xindex," in source or "tl.load(in1 + xindex," in source


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dynamic", [False, True])
def test_layernorm_over_nchw_channels_takes_many_rows_a_program(dtype, dynamic, device):
    """ConvNeXt's LayerNorm over the channels of an NCHW tensor: a row's elements lie H*W
    apart and consecutive rows side by side. The launcher asks for strided-row settings
    (more rows a program, so each column is read as a contiguous run); a norm over contiguous
    rows does not. Odd sizes, a row length that is not a power of two."""
    from fusion_compiler.codegen import launch as L
    x = randn((3, 40, 5, 7), dtype, device)
    w, b = randn((40,), dtype, device), randn((40,), dtype, device)

    def norm(x, w, b):
        return torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (40,), w, b, 1e-6)

    def plain(x, w, b):
        return torch.nn.functional.layer_norm(x, (40,), w, b)

    out, reports = compile_and_run(norm, (x, w, b), dynamic=dynamic)
    assert_one_kernel(reports)
    assert_close(out, norm(x, w, b), dtype=dtype)
    (kernel,) = reports[0].kernels
    source = open(kernel["path"]).read()
    # a norm: its outputs are computed from the row's reductions (statements.strided_kind)
    assert "STRIDED = 1\n" in source and "row_settings(R, N, 16384, STRIDED)" in source, source
    nhwc = x.permute(0, 2, 3, 1).contiguous()
    out, reports = compile_and_run(plain, (nhwc, w, b), dynamic=dynamic)
    assert_close(out, plain(nhwc, w, b), dtype=dtype)
    assert all("STRIDED" not in open(k["path"]).read() for k in reports[0].kernels)
    # the settings at ConvNeXt-T's stages (batch 32, 132 SMs): more rows a program than the
    # element budget gives contiguous rows, while the grid keeps 4 programs an SM; 4 warps for
    # a norm or a single load's statistics (1), 8 for the others (2)
    sms = L._sm_count()
    assert L.row_settings(32 * 3136, 96, 16384) == (16, 128, False, 4)
    if sms == 132:
        assert L.row_settings(32 * 3136, 96, 16384, 1) == (64, 128, False, 4)
        assert L.row_settings(32 * 3136, 96, 16384, 2) == (64, 128, False, 8)
        assert L.row_settings(32 * 196, 384, 16384, True) == (8, 512, False, 4)
        assert L.row_settings(32 * 49, 768, 16384, True) == (2, 1024, False, 4)
    assert L.row_settings(3, 768, 16384, True)[0] <= 4      # never more rows than there are


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_activations_gradient_beside_its_bias_gradient_is_strided_kind_2(dtype, device):
    """GPT-2's MLP backward: the tanh GELU's gradient (a value an element, from no reduction)
    and the bias gradient (its column sum) are one strided-row kernel of ``STRIDED = 2``: 8
    warps at 8192 elements, where 4 made GPT-2's and BERT's training steps slower (session
    54); a norm's outputs are 1 (above). Values against eager's, odd sizes."""
    x = randn((300, 48), dtype, device).requires_grad_()
    b = randn((48,), dtype, device).requires_grad_()
    g = randn((300, 48), dtype, device)

    def f(x, b):
        return torch.nn.functional.gelu(x + b, approximate="tanh")
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        torch.compile(f, backend="fusion")(x, b).backward(g)
    grads = x.grad, b.grad
    x.grad = b.grad = None
    f(x, b).backward(g)
    assert_close(grads[0], x.grad, dtype=dtype, name="x.grad")
    assert_close(grads[1], b.grad, dtype=dtype, name="b.grad")
    (backward,) = [r for r in reports if r.kind == "backward"]
    kinds = sorted(line for k in backward.kernels for line in open(k["path"]).read().splitlines()
                   if line.startswith("STRIDED"))
    assert backward.num_kernels == 2 and kinds == ["STRIDED = 1", "STRIDED = 2"], kinds


def _window_norm(pad):
    def norm(x, r, w, b):
        """Swin's LayerNorm, then its window partition (a zero padding, a view into windows, a
        permute, a copy), and the residual stream."""
        h = x + r
        y = torch.nn.functional.layer_norm(h, (h.shape[-1],), w, b)
        y = torch.nn.functional.pad(y.view(h.shape[0], 6, 10, -1), (0, 0, 0, pad, 0, 0))
        y = y.view(h.shape[0], 2, 3, 2, (10 + pad) // 2, -1).permute(0, 1, 3, 2, 4, 5)
        return y.contiguous().view(-1, 3 * ((10 + pad) // 2), h.shape[-1]), h
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_stores_its_rows_in_window_order(dtype, device):
    """The window partition after a LayerNorm joins the norm's kernel: each element of a row
    is stored where the windows' layout puts it (codegen/row_outputs.py ``layout_chain``), the values
    bit-equal to the same kernel's output laid out into windows afterwards. Odd sizes."""
    x, r = randn((3, 60, 24), dtype, device), randn((3, 60, 24), dtype, device)
    w, b = randn((24,), dtype, device), randn((24,), dtype, device)
    norm = _window_norm(0)
    out, reports = compile_and_run(norm, (x, r, w, b))
    assert_one_kernel(reports)
    (windows, h), (exp_windows, exp_h) = out, norm(x, r, w, b)
    assert windows.shape == exp_windows.shape and windows.stride() == exp_windows.stride()
    assert_close(windows, exp_windows, dtype=dtype)
    assert torch.equal(h, exp_h)

    def plain(x, r, w, b):
        h = x + r
        return torch.nn.functional.layer_norm(h, (h.shape[-1],), w, b)
    rows, _ = compile_and_run(plain, (x, r, w, b))
    relaid = rows.view(3, 2, 3, 2, 5, 24).permute(0, 1, 3, 2, 4, 5).reshape(-1, 15, 24)
    assert torch.equal(windows, relaid)


def test_a_padded_window_partition_is_not_a_row_layout(device):
    """With a padding that is not zero the windows hold elements no row computes: the
    partition stays a kernel of its own, eager's values."""
    x, r = randn((3, 60, 24), torch.float32, device), randn((3, 60, 24), torch.float32, device)
    w, b = randn((24,), torch.float32, device), randn((24,), torch.float32, device)
    norm = _window_norm(2)
    out, reports = compile_and_run(norm, (x, r, w, b))
    assert kernel_count(reports) == 2
    for a, e in zip(out, norm(x, r, w, b)):
        assert_close(a, e, dtype=torch.float32)
