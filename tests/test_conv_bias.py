"""passes/conv_bias.py: where ATen would add a convolution's bias in a second kernel (its
cuDNN path), the graph adds it, and the add joins the convolution's consumer's kernel.

On the CPU, ATen's backend (MKLDNN) adds the bias inside the convolution, so the pass leaves
it there; these tests widen the pass's devices and backends to the CPU's to check the rewrite
itself (its values then differ from eager's by the one rounding MKLDNN skips, within each
dtype's tolerance). On a GPU they run as they are: cuDNN's path, the same arithmetic.

The channels-last rewrite (passes/channels_last.py) is off here: it would copy an NCHW input
first, a kernel these counts are not about; the channels-last cases give the convolutions
channels-last inputs themselves."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.passes import conv_bias
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten


@pytest.fixture(autouse=True)
def _as_traced(monkeypatch):
    monkeypatch.setenv("FUSION_COMPILER_CHANNELS_LAST", "0")


@pytest.fixture
def any_backend(monkeypatch, device):
    if device == "cpu":
        monkeypatch.setattr(conv_bias, "DEVICES", ("cpu",))
        monkeypatch.setattr(conv_bias, "BACKENDS", conv_bias.BACKENDS + ("Mkldnn", "Slow2d"))


def split_here(x, w, b, padding, groups) -> bool:
    """Whether the pass splits this convolution: ATen's backend for it is one of the pass's
    (on a GPU, cuDNN for bf16 depthwise convolutions, its own kernel for fp32 ones)."""
    backend = torch._C._select_conv_backend(x, w, b, [1, 1], [padding] * 2, [1, 1], False,
                                            [0, 0], groups)
    return x.device.type in conv_bias.DEVICES and backend.name in conv_bias.BACKENDS


def block(x, w, b, nw, nb):
    """ConvNeXt's depthwise convolution with bias, then its LayerNorm over the channels."""
    y = F.conv2d(x, w, b, padding=3, groups=x.shape[1])
    return F.layer_norm(y.permute(0, 2, 3, 1), (x.shape[1],), nw, nb, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_bias_joins_the_layernorm(dtype, channels_last, device, any_backend):
    g = torch.Generator().manual_seed(0)
    c = 24
    x = torch.randn(3, c, 9, 11, generator=g).to(device=device, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = (torch.randn(c, 1, 7, 7, generator=g) / 7).to(device, dtype), torch.randn(c, generator=g).to(device, dtype)
    nw, nb = torch.randn(c, generator=g).to(device, dtype), torch.randn(c, generator=g).to(device, dtype)
    out, reports = compile_and_run(block, (x, w, b, nw, nb))
    assert kernel_count(reports) == 1                       # the LayerNorm, with the bias add
    adds = reports[0].kernels[0]["ops"].count("aten.add.Tensor")
    assert adds == 2 + split_here(x, w, b, 3, c)        # the norm's eps and its own bias; + ours
    assert [op for op in leftover_aten(reports) if "convolution" not in op] == []
    assert_close(out, block(x, w, b, nw, nb), dtype=dtype)
    if device == "cuda":        # cuDNN's path: the same convolution call, the same add
        y = F.conv2d(x, w, b, padding=3, groups=c)
        fy, _ = compile_and_run(lambda x, w, b: F.conv2d(x, w, b, padding=3, groups=c), (x, w, b))
        assert torch.equal(fy, y)


def test_convolution_output_with_bias_keeps_its_layout(device, any_backend):
    """A convolution whose biased output is returned: the add writes it in the layout the
    convolution's output had (channels-last here), as ATen's in-place add does."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 5, 7, generator=g).to(device).to(memory_format=torch.channels_last)
    w, b = torch.randn(16, 8, 3, 3, generator=g).to(device), torch.randn(16, generator=g).to(device)
    f = lambda x, w, b: F.conv2d(x, w, b, padding=1)     # noqa: E731
    out, reports = compile_and_run(f, (x, w, b))
    expected = f(x, w, b)
    assert out.stride() == expected.stride()
    assert split_here(x, w, b, 1, 1)
    assert kernel_count(reports) == 1 and reports[0].kernels[0]["ops"] == ["aten.add.Tensor"]
    assert_close(out, expected, dtype=torch.float32)
    if device == "cuda":
        assert torch.equal(out, expected)


def test_cpu_convolutions_keep_their_bias(device):
    """MKLDNN adds the bias inside the convolution: nothing to split, nothing fused."""
    if device != "cpu":
        pytest.skip("the CPU's backend")
    x, w, b = torch.randn(2, 4, 6, 6), torch.randn(4, 4, 3, 3), torch.randn(4)
    f = lambda x, w, b: F.conv2d(x, w, b) * 2     # noqa: E731
    out, reports = compile_and_run(f, (x, w, b))
    assert kernel_count(reports) == 1                   # the multiply; the add stayed inside
    assert reports[0].kernels[0]["ops"] == ["aten.mul.Tensor"]
    assert_close(out, f(x, w, b), dtype=torch.float32)
