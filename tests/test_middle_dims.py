"""Reductions over one middle dimension (passes/middle_dims.py): reduced as rows of a permuted
view, fused with their producers; where consecutive rows lie side by side in runs too short to
read in vectors, the reduction stays on ATen. Kernel counts and values against eager, odd
sizes, each dtype with its tolerance."""
import pytest
import torch

import fusion_compiler
from helpers import (TOL, assert_close, aten_reasons, compile_and_run, kernel_count,
                     leftover_aten)
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layer_norm_2d(x, w, b):
    """The ConvNeXt repository's channels-first LayerNorm (Segment Anything's LayerNorm2d)."""
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    x = (x - u) / torch.sqrt(s + 1e-6)
    return w[:, None, None] * x + b[:, None, None]


@pytest.mark.parametrize("shape", [(3, 37, 7, 9), (2, 16, 16, 16)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_channels_first_layer_norm_is_one_kernel(dtype, shape, device):
    """Both means and the normalisation in one row kernel over the channels (rows of 37 lying
    63 apart, 7 x 9 positions side by side), which stores the [N, C, H, W] output where it
    reads x (codegen/row_outputs.alongside); before, the means ran on ATen beside two
    pointwise kernels. [2, 16, 16, 16] permuted is its own shape: its rows take a leading dim
    of 1 (trailing_dims.rows_of), else the normalisation went to a second kernel."""
    x = randn(shape, dtype, device)
    w, b = randn((shape[1],), dtype, device), randn((shape[1],), dtype, device)
    out, reports = compile_and_run(_layer_norm_2d, (x, w, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for k in reports[0].kernels] == ["layernorm"]
    assert_close(out, _layer_norm_2d(x, w, b), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_each_reduction_over_a_middle_dim_is_fused_with_its_producer(op, keepdim, dtype,
                                                                     device):
    x = randn((4, 13, 5, 17), dtype, device)
    x[1, 7, 2, 3] = float("nan")
    f = lambda a: getattr(torch, op)(a * 2 - 1, 1, keepdim=keepdim)  # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    want = f(x)
    assert out.shape == want.shape and out.stride() == want.stride()
    assert_close(out, want, dtype=dtype)


CHANNEL_OPS = {
    "softmax": (lambda x: torch.softmax(x, 1), "softmax"),
    "log_softmax": (lambda x: torch.log_softmax(x * 2, 1), "softmax"),
    "rmsnorm": (lambda x: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6), "rmsnorm"),
}


@pytest.mark.parametrize("shape", [(2, 19, 5, 7), (3, 24, 24)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CHANNEL_OPS)
def test_row_ops_over_the_channels_are_one_kernel(case, dtype, shape, device):
    """A softmax, a log-softmax and an RMSNorm over dim 1 of [N, C, H, W] (a segmentation
    head's softmax over classes), and over the middle dim of a square [N, C, C]: each one
    kernel, its output stored at the positions the rows read."""
    fn, label = CHANNEL_OPS[case]
    x = randn(shape, dtype, device)
    out, reports = compile_and_run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for k in reports[0].kernels] == [label]
    assert out.stride() == fn(x).stride()
    assert_close(out, fn(x), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_channels_last_tensor_reduces_contiguous_rows(dtype, device):
    """The reduced dimension has stride 1 (channels-last): the permuted rows are contiguous."""
    x = randn((2, 19, 5, 3), dtype, device).to(memory_format=torch.channels_last)
    f = lambda a: torch.sigmoid(a).sum(1)       # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_through_a_channels_first_layer_norm(dtype, device):
    """The backward graph's sums over the channels (the broadcast means' gradients) are
    rewritten too; the gradients are eager's."""
    x = randn((2, 21, 6, 5), dtype, device)
    w, b = randn((21,), dtype, device), randn((21,), dtype, device)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    g = randn((2, 21, 6, 5), dtype, device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(_layer_norm_2d, backend="fusion")(*leaves)
        (out * g).sum().backward()
    want = _layer_norm_2d(*ref)
    (want * g).sum().backward()
    assert_close(out, want, dtype=dtype)
    atol, rtol = TOL[dtype]
    for name, got, exp in zip("xwb", leaves, ref):
        # sums over 60-126 terms in other orders than eager's
        assert_close(got.grad, exp.grad, dtype=dtype, atol=8 * atol, rtol=8 * rtol, name=name)
    assert leftover_aten(reports, "forward") == []
    # the three sums over the channels became row kernels; the weight's and the bias's
    # gradients, sums over [0, 2, 3], row sums over H x W then over N (passes/outer_dims.py)
    assert leftover_aten(reports, "backward") == []
    assert kernel_count(reports, "backward") >= 1


def test_rows_side_by_side_in_short_runs_stay_on_aten(device):
    """Over dim 1 of [6, 40, 3]: consecutive rows lie side by side 3 at a time; ATen's
    reduction picks its own order there."""
    x = randn((6, 40, 3), torch.float32, device)
    f = lambda a: (a + 1).mean(1)               # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and len(leftover_aten(reports)) == 1
    assert_close(out, f(x))
    assert aten_reasons(f, x) == [
        "reduction over a middle dim: its rows lie side by side in runs under 16 elements, "
        "and it reduces over more than 8"]


def _transposed(shape, dtype, device):
    """A tensor of ``shape`` whose last dim has the largest stride (a bmm's transposed output):
    runs of consecutive rows are 1 element long."""
    t = randn(shape[:-2] + shape[-2:][::-1], dtype, device)
    return t.transpose(-1, -2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_a_small_middle_dim_in_short_runs_is_added_elementwise(k, op, keepdim, dtype, device):
    """Over dim 2 (k elements) of [3, 5, k, 7, 11] whose last dim has stride 7: the k slices
    combined in one pointwise kernel with the producer; NaN propagates as in eager."""
    x = _transposed((3, 5, k, 7, 11), dtype, device)
    x[1, 2, k - 1, 3, 4] = float("nan")
    f = lambda a: getattr(torch, op)(a * 3 + 1, 2, keepdim=keepdim)     # noqa: E731
    assert x.stride(-1) != 1
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    ops = [o.split(".")[1] for o in reports[0].kernels[0]["ops"]]
    assert not {"sum", "mean", "amax", "amin"} & set(ops), ops      # the slices combined
    want = f(x)
    assert out.shape == want.shape and out.is_contiguous() and want.is_contiguous()
    assert_close(out, want, dtype=dtype)
    assert torch.isnan(out.reshape(3, 5, 7, 11)[1, 2, 3, 4])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_small_middle_dim_sum_is_saved_in_the_traced_layout(dtype, device):
    """The mean over dim 1 of a [4, 3, 5] input of strides (1, 4, 12), returned and saved for
    a product's gradient: the slices combined were written in their own layout, (1, 20, 4),
    where the trace (and eager) has (5, 5, 1), and the backward, reading the saved value by
    the trace's strides, got the weight's gradient wrong by up to 1.8 (a fuzzer's find). Now
    in the trace's layout: eager's strides and gradients."""
    x = randn((5, 3, 4), dtype, device).permute(2, 1, 0)
    w = randn((4, 1, 5), dtype, device)

    def f(x, w):
        y = x.mean(1, keepdim=True)
        return (y * w).tanh(), y

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in (x, w)]
        outs = fn(*leaves)
        sum((o.float() * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        return outs, [t.grad for t in leaves]
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        outs, grads = step(torch.compile(f, backend="fusion"))
    want, want_grads = step(f)
    assert kernel_count(reports) >= 2 and leftover_aten(reports, "forward") == []
    for out, ref in zip(outs, want):
        assert out.stride() == ref.stride() == (5, 5, 1)
        assert_close(out.detach(), ref.detach(), dtype=dtype)
    for got, ref, name in zip(grads, want_grads, ("x", "w")):
        assert_close(got, ref, dtype=dtype, name=f"grad of {name}")


def test_a_reduction_over_one_element_is_a_new_tensor(device):
    """``x.sum(1)`` of [3, 1, 3]: the one slice copied by a kernel, never a view of x (which
    would alias the caller's tensor, as eager's result does not)."""
    x = randn((3, 1, 3), torch.float32, device)
    out, reports = compile_and_run(lambda a: a.sum(1), (x,))
    assert kernel_count(reports) == 1 and torch.equal(out, x.sum(1))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_a_small_middle_dim_rounds_once_in_low_precision(device):
    """bf16 halves of a sum that cancel: added in fp32 and rounded once, as ATen's sum,
    not rounded after each add."""
    a = torch.full((2, 1, 3, 5), 256.0, dtype=torch.bfloat16, device=device)
    b = torch.full((2, 1, 3, 5), 1.0, dtype=torch.bfloat16, device=device)
    c = torch.full((2, 1, 3, 5), -256.0, dtype=torch.bfloat16, device=device)
    x = torch.cat([a, b, c], 1).transpose(-1, -2)       # [2, 3, 5, 3], last dim stride 5
    f = lambda t: (t * 1).sum(1)                        # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert torch.equal(out, f(x)) and (out == 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_query_key_gradient_by_bmm_stays_off_aten(dtype, device):
    """Gemma 2's eager attention: keys repeated over 2 query groups (expand + reshape), scores
    by bmm. The keys' gradient is a sum over the group dim of the bmm's transposed output;
    it ran on ATen, now it is a pointwise kernel."""
    b, kv, g, s, dh = 2, 3, 2, 9, 16
    q = randn((b, kv * g, s, dh), dtype, device).requires_grad_()
    key = randn((b, kv, s, dh), dtype, device).requires_grad_()

    def f(q, key):
        k = key[:, :, None].expand(b, kv, g, s, dh).reshape(b, kv * g, s, dh)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1).sum()

    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion", fullgraph=True)(q, key)
        out.backward()
    got = (q.grad, key.grad)
    q.grad = key.grad = None
    f(q, key).backward()
    left = leftover_aten(reports, "backward")
    assert left and all(op.split(".")[1] == "bmm" for op in left), left
    atol, rtol = TOL[dtype]
    for name, g_, e in zip(("q", "key"), got, (q.grad, key.grad)):
        assert_close(g_, e, dtype=dtype, atol=4 * atol, rtol=4 * rtol, name=name)


def test_symbolic_sizes_and_dtypes_stay_on_aten(device):
    x = randn((4, 6, 20), torch.float32, device)
    f = lambda a: (a * 3).sum(1)                # noqa: E731
    out, reports = compile_and_run(f, (x,), dynamic=True)
    assert len(leftover_aten(reports)) == 1
    assert_close(out, f(x))
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 2)
    assert aten_reasons(f, x) == ["reduction over a middle dim: symbolic sizes (dynamic shapes)"]
    g = lambda a: (a * 3).sum(1, dtype=torch.float64).float()       # noqa: E731
    out, reports = compile_and_run(g, (x,))
    assert_close(out, g(x))
    assert any("dtype=" in r for r in aten_reasons(g, x))


def test_the_benchmark_target_is_one_kernel_over_the_convolution(device):
    """benchmarks/channels_first.py's small target, as `dump` and `bench` load it: the
    LayerNorm2d after a 1x1 convolution, one kernel written over the convolution's output."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parent.parent / "benchmarks" / "channels_first.py"
    spec = importlib.util.spec_from_file_location("channels_first", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, inputs = module.layer_norm_2d_small(device, torch.float32)
    with torch.no_grad():
        out, reports = compile_and_run(model, inputs)
        want = model(*inputs)
    assert kernel_count(reports) == 1 and [k["label"] for k in reports[0].kernels] == ["layernorm"]
    assert reports[0].inplace == 1
    assert_close(out, want)
