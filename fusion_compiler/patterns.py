"""The memory-bound patterns every release must fuse to one kernel each.

The definitions are the ones of the anchor measurements (eager and Inductor on an H200), so the
tests, `fusion-compiler bench` and the reference numbers measure the same work. ``FLOOR_BYTES``
gives the bytes each must move at least (inputs read once, outputs written once).
"""
import torch
import torch.nn.functional as F


def rmsnorm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def add_rmsnorm(x, r, w):
    h = x + r
    return rmsnorm(h, w), h


def add_layernorm(x, r, w, b):
    h = x + r
    return F.layer_norm(h, (h.shape[-1],), w, b), h


def swiglu(g, u):
    return F.silu(g) * u


def bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


def bias_gelu_erf(x, b):
    return F.gelu(x + b)


def rmsnorm_fp8(x, w, scale):
    y = rmsnorm(x, w)
    return (y.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def rmsnorm_dynamic_fp8(x, w):
    y = rmsnorm(x, w).float()
    s = y.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (y / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def dequant_add(q, s, r):
    return q.to(torch.bfloat16) * s + r


def softmax_scale(x):
    return torch.softmax(x.float() * 0.125, dim=-1).to(x.dtype)


def rope(q, cos, sin):
    q1, q2 = q.chunk(2, dim=-1)
    return q * cos + torch.cat((-q2, q1), dim=-1) * sin


def randn(shape, dtype, device, strided=False, requires_grad=False):
    """Random data; ``strided`` gives a non-contiguous view with the same values layout rules."""
    if strided and len(shape) >= 2:
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device).to(dtype).transpose(-1, -2)
    else:
        t = torch.randn(*shape, device=device).to(dtype)
    return t.requires_grad_(requires_grad) if requires_grad else t


def make_args(name, rows, n, dtype, device, strided=False, grad=False):
    """Inputs of pattern ``name`` for a [rows, n] problem (first input strided if asked)."""
    def x(shape=(rows, n), first=False, g=grad):
        return randn(shape, dtype, device, strided and first, g)
    if name in ("add_rmsnorm",):
        return (x(first=True), x(), x((n,)))
    if name == "add_layernorm":
        return (x(first=True), x(), x((n,)), x((n,)))
    if name == "swiglu":
        return (x(first=True), x())
    if name in ("bias_gelu", "bias_gelu_erf"):
        return (x(first=True), x((n,)))
    if name == "rmsnorm_fp8":
        return (x(first=True, g=False), x((n,), g=False), torch.tensor(0.05, device=device))
    if name == "rmsnorm_dynamic_fp8":
        return (x(first=True, g=False), x((n,), g=False))
    if name == "dequant_add":
        q = torch.randint(-127, 127, (rows, n), dtype=torch.int8, device=device)
        if strided:
            q = torch.randint(-127, 127, (n, rows), dtype=torch.int8, device=device).t()
        s = randn((n,), torch.bfloat16, device)
        return (q, s, randn((rows, n), torch.bfloat16, device, requires_grad=grad))
    if name == "softmax_scale":
        return (x(first=True),)
    raise KeyError(name)


PATTERNS = {
    "add_rmsnorm": add_rmsnorm, "add_layernorm": add_layernorm, "swiglu": swiglu,
    "bias_gelu": bias_gelu, "bias_gelu_erf": bias_gelu_erf, "rmsnorm_fp8": rmsnorm_fp8,
    "rmsnorm_dynamic_fp8": rmsnorm_dynamic_fp8, "dequant_add": dequant_add,
    "softmax_scale": softmax_scale, "rope": rope,
}


def floor_bytes(name, args, outputs) -> int:
    """Bytes a pattern must move: each input read once, each output written once."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return sum(t.numel() * t.element_size() for t in (*tensors, *outs))


# Sizes of the anchor measurements: [rows, N] per pattern (bf16).
ANCHOR_SIZES = {
    "add_rmsnorm": (16384, 4096), "add_layernorm": (16384, 4096), "swiglu": (16384, 11008),
    "bias_gelu": (16384, 11008), "bias_gelu_erf": (16384, 11008), "rmsnorm_fp8": (16384, 4096),
    "rmsnorm_dynamic_fp8": (16384, 4096), "dequant_add": (16384, 4096),
    "softmax_scale": (256 * 4096, 1024), "rope": None,
}
