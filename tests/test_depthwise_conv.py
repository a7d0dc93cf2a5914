"""Depthwise 1-d convolutions with few taps as fused sums of shifted products
(passes/depthwise_conv.py): the Mamba family's causal convolution fused with the transpose
before it and the SiLU after it; strides, dilations, paddings, with and without a bias, one tap
to the most; what stays on ATen (2-d, grouped, a channel multiplier, too many taps, the option
off); training, the gradients through ATen's convolution backward. Values against eager on
random data, in each dtype."""
import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.passes import depthwise_conv, groups
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rewritten(reports) -> int:
    return sum(len(r.summary.get("depthwise_convs", [])) for r in reports)


def mamba_mixer_conv(x, w, b):
    """transformers' Mamba2 torch path: ``act(conv1d(x.transpose(1, 2))[..., :L].transpose(1,
    2))``, x [batch, L, C]."""
    length = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), w, b, padding=w.shape[-1] - 1, groups=x.shape[2])
    return F.silu(y[..., :length]).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 37, 19), (1, 8, 64), (3, 5, 1)], ids=str)
def test_mamba_causal_conv_is_one_kernel(shape, dtype, device):
    """The transposed input read in place, the taps, the bias, the slice, SiLU and the
    transpose back: one kernel, nothing on ATen."""
    torch.manual_seed(0)
    batch, length, channels = shape
    x = torch.randn(batch, length, channels, device=device, dtype=dtype)
    w = torch.randn(channels, 1, 4, device=device, dtype=dtype)
    b = torch.randn(channels, device=device, dtype=dtype)
    out, reports = compile_and_run(mamba_mixer_conv, (x, w, b))
    assert _rewritten(reports) == 1
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    want = mamba_mixer_conv(x, w, b)
    assert_close(out, want, dtype=dtype)
    # eager's layout: the graph's output copied back
    assert depthwise_conv._layout(out) == depthwise_conv._layout(want)



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_taps_weights_copied_apart_where_strided_reads_cost_more(dtype, device, cache_dir,
                                                                 monkeypatch):
    """The weight [C, 1, K] lies with its taps innermost; each tap reads its C weights at a
    stride of K. Where the cost of those strided reads over the whole output exceeds a launch
    (Mamba2's [4, 1024, 2304]: 82 us against 26 on the H100), the taps' transposed copy [K, C]
    is its own small kernel and the mixer reads it contiguously. At this test's size the reads
    cost nothing (one kernel, above); a read made 10^6 times dearer crosses the line."""
    monkeypatch.setattr(groups, "STRIDED_READ_TIME", 1e-6)
    torch.manual_seed(7)
    x = torch.randn(2, 13, 11, device=device, dtype=dtype)
    w = torch.randn(11, 1, 4, device=device, dtype=dtype)
    b = torch.randn(11, device=device, dtype=dtype)
    out, reports = compile_and_run(mamba_mixer_conv, (x, w, b))
    assert _rewritten(reports) == 1
    assert kernel_count(reports) == 2 and leftover_aten(reports) == []
    apart = [d for r in reports for d in r.decisions
             if not d["taken"] and "read across its grain (stride 4)" in d["reason"]]
    assert apart and "clone" in " ".join(apart[0]["producer"]), [r.decisions for r in reports]
    mixer = [k for r in reports for k in r.kernels if "silu" in k["label"]]
    assert len(mixer) == 1, [k["label"] for r in reports for k in r.kernels]
    text = open(mixer[0]["path"]).read()
    assert "(4 * (" not in text and "in2 + (33 + " in text, text     # taps 11 weights apart
    want = mamba_mixer_conv(x, w, b)
    assert_close(out, want, dtype=dtype)
    assert depthwise_conv._layout(out) == depthwise_conv._layout(want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("taps,stride,padding,dilation,bias", [
    (1, 1, 0, 1, True), (3, 1, 1, 1, False), (3, 2, 1, 1, True), (5, 3, 0, 2, True),
    (depthwise_conv.MAX_TAPS, 1, 7, 1, True), (2, 1, 4, 3, False)], ids=str)
def test_strides_dilations_paddings(taps, stride, padding, dilation, bias, dtype, device):
    """``conv1d(..., groups=C)`` of a contiguous input times 2: one kernel with the product
    before it, against eager's convolution."""
    torch.manual_seed(1)
    x = torch.randn(2, 7, 29, device=device, dtype=dtype)
    w = torch.randn(7, 1, taps, device=device, dtype=dtype)
    b = torch.randn(7, device=device, dtype=dtype) if bias else None

    def fn(x, w, b):
        return F.conv1d(x * 2, w, b, stride=stride, padding=padding, dilation=dilation,
                        groups=7)
    out, reports = compile_and_run(fn, (x, w, b))
    assert _rewritten(reports) == 1
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    want = fn(x, w, b)
    assert_close(out, want, dtype=dtype)
    assert depthwise_conv._layout(out) == depthwise_conv._layout(want)


def test_fp32_sums_the_taps_once_rounded(device):
    """bf16 operands, taps summed in fp32 and rounded once (as ATen's depthwise kernels and
    cuDNN accumulate): within one bf16 rounding of the fp64 convolution, where summing in bf16
    op by op is not (8 taps of values near 1 cancel in bf16)."""
    torch.manual_seed(2)
    x = (torch.rand(1, 16, 257, device=device) + 0.5).bfloat16()
    w = (torch.randn(16, 1, 8, device=device) * 0.3).bfloat16()

    def fn(x, w):
        return F.conv1d(x, w, None, padding=3, groups=16)
    out, reports = compile_and_run(fn, (x, w))
    assert _rewritten(reports) == 1 and kernel_count(reports) == 1
    exact = F.conv1d(x.double(), w.double(), None, padding=3, groups=16)
    err = (out.double() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 1e-6).all(), err.max()


@pytest.mark.parametrize("case", ["conv2d", "grouped", "multiplier", "too_many_taps"])
def test_what_stays_a_convolution(case, device):
    """Not depthwise 1-d with few taps: the convolution stays on ATen, its neighbours fused."""
    torch.manual_seed(3)
    if case == "conv2d":
        x, w, groups = torch.randn(2, 6, 9, 9, device=device), torch.randn(6, 1, 3, 3, device=device), 6
        conv = F.conv2d
    else:
        x, conv = torch.randn(2, 6, 21, device=device), F.conv1d
        w, groups = {"grouped": (torch.randn(6, 2, 3, device=device), 3),
                     "multiplier": (torch.randn(12, 1, 3, device=device), 6),
                     "too_many_taps": (torch.randn(6, 1, depthwise_conv.MAX_TAPS + 1,
                                                   device=device), 6)}[case]

    def fn(x, w):
        return conv(x.sin(), w, None, padding=1, groups=groups).relu()
    out, reports = compile_and_run(fn, (x, w))
    assert _rewritten(reports) == 0
    assert leftover_aten(reports) == ["aten.convolution.default"]
    assert kernel_count(reports) == 2
    assert_close(out, fn(x, w), atol=1e-4, rtol=1e-4)


def test_option_off_leaves_it_to_aten(device):
    x, w = torch.randn(2, 9, 6, device=device), torch.randn(6, 1, 4, device=device)
    b = torch.randn(6, device=device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(mamba_mixer_conv, backend="fusion", fullgraph=True,
                            options={"depthwise_conv": False})(x, w, b)
    assert _rewritten(reports) == 0
    assert leftover_aten(reports) == ["aten.convolution.default"]
    assert_close(out, mamba_mixer_conv(x, w, b), atol=1e-5, rtol=1e-5)


def mixer_rows(x, w, b):
    """The mixer's output as rows of L * C (as Mamba's next steps read it): eager copies, the
    rewrite's layout is that view already."""
    return mamba_mixer_conv(x, w, b).reshape(x.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [mixer_rows, mamba_mixer_conv], ids=["rows", "transposed"])
def test_training_gradients(fn, dtype, device):
    """Rewritten before aot_autograd, the shifted sum is differentiated as it stands: the
    input's gradient a sum of shifted products of the output's, the weight's and the bias's
    sums over batch and time; gradients as eager's, nothing on ATen. The slice ``[..., :L]``'s
    gradient is ATen's time-innermost zero pad, so the products lie time-innermost and the five
    sums over batch and time are over dims out of memory order (passes/memory_order.py): a row
    sum over time with the products' producers (the SiLU's gradient too in bf16), then a sum of
    the batch's partials, however the output is read."""
    torch.manual_seed(4)
    x0 = torch.randn(2, 11, 10, device=device, dtype=dtype)
    w0 = torch.randn(10, 1, 4, device=device, dtype=dtype)
    b0 = torch.randn(10, device=device, dtype=dtype)

    def run(f):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        out = f(x, w, b)
        out.float().square().sum().backward()
        return [out, x.grad, w.grad, b.grad]
    eager = run(fn)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        ours = run(torch.compile(fn, backend="fusion"))
    assert [r.error for r in reports if r.error] == []
    assert _rewritten([r for r in reports if r.kind == "forward"]) == 1
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "forward") == 2
    # the SiLU's gradient joins the row sums where the graph computes it at the padded shape;
    # fp32 on the CPU computes it before the pad ([2, 10, 11]: no row of the [2, 10, 14] sums),
    # in a pointwise kernel that also writes the input's gradient, its [2, 11, 10] transpose
    # (test_pointwise_layouts)
    assert kernel_count(reports, "backward") == 4
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 5e-2)}[dtype]
    for name, a, e in zip(["out", "x.grad", "w.grad", "b.grad"], ours, eager):
        assert_close(a, e, atol=tol[0], rtol=tol[1], name=name)


def test_strided_weight_and_bias(device):
    """Weight and bias that are strided views (every other tap of a wider filter, every other
    element of a longer vector): read as they lie, no copy, one kernel."""
    torch.manual_seed(5)
    x = torch.randn(2, 6, 30, device=device)
    wide, long = torch.randn(6, 1, 6, device=device), torch.randn(12, device=device)

    def fn(x, wide, long):
        return F.conv1d(x, wide[:, :, ::2], long[::2], padding=2, groups=6).tanh()
    out, reports = compile_and_run(fn, (x, wide, long))
    assert _rewritten(reports) == 1
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, fn(x, wide, long), atol=1e-5, rtol=1e-5)
