"""Row ops over the channels of an [N, C, H, W] tensor, written out (passes/middle_dims.py,
codegen/row_outputs.alongside): targets for `dump` and `bench`.

    fusion-compiler dump benchmarks/channels_first.py:layer_norm_2d_small
    fusion-compiler bench benchmarks/channels_first.py:layer_norm_2d_32 --compare eager,inductor,fusion

``layer_norm_2d``: the ConvNeXt repository's channels-first LayerNorm (Segment Anything's
LayerNorm2d) after a 1x1 convolution, at ConvNeXt-T's first stage (32 x 96 x 56 x 56);
``softmax_2d``: a segmentation head's softmax over 150 classes at 128 x 128.
"""
import torch


class LayerNorm2d(torch.nn.Module):
    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels) + torch.randn(channels) / 10)
        self.bias = torch.nn.Parameter(torch.randn(channels) / 10)
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNorm(torch.nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, c_out, 1)
        self.norm = LayerNorm2d(c_out)

    def forward(self, x):
        return self.norm(self.conv(x))


class SoftmaxHead(torch.nn.Module):
    def __init__(self, c_in: int, classes: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, classes, 1)

    def forward(self, x):
        return torch.softmax(self.conv(x), 1)


def _make(module, shape, device, dtype):
    torch.manual_seed(0)
    model = module.to(device=device, dtype=dtype).eval()
    return model, (torch.randn(*shape, device=device, dtype=dtype),)


def layer_norm_2d_small(device="cpu", dtype=torch.float32):
    return _make(ConvNorm(5, 48), (2, 5, 9, 11), device, dtype)


def layer_norm_2d_32(device="cpu", dtype=torch.bfloat16):
    return _make(ConvNorm(96, 96), (32, 96, 56, 56), device, dtype)


def softmax_2d_8(device="cpu", dtype=torch.bfloat16):
    return _make(SoftmaxHead(64, 150), (8, 64, 128, 128), device, dtype)
