"""The label of each fused kernel (dump's `label` column): what the kernel computes, told apart
where two computations share ops (SiLU and SwiGLU both multiply by a sigmoid; tanh-GELU and a
soft-cap both take a tanh; LayerNorm and RMSNorm both take an rsqrt of a mean; a sigmoid
scaled by a number is neither)."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, compile_and_run

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


CASES = {
    "silu": lambda x, w: F.silu(x @ w),
    "quick_gelu": lambda x, w: (h := x @ w) * torch.sigmoid(1.702 * h),
    "swiglu": lambda x, w: F.silu(x @ w) * (x @ w.t()),
    "swiglu_halves": lambda x, w: (lambda g, u: F.silu(g) * u)(*(x @ w).chunk(2, -1)),
    "gelu_tanh": lambda x, w: F.gelu(x @ w, approximate="tanh"),
    "gelu_erf": lambda x, w: F.gelu(x @ w),
    "softcap": lambda x, w: 30.0 * torch.tanh((x @ w) / 30.0),
    "two_rmsnorms": lambda x, w: rmsnorm(rmsnorm(x @ w, w[0]) + x, w[1]),
    "layernorm": lambda x, w: F.layer_norm(x @ w, (x.shape[-1],), w[0], w[1]),
    "scaled_sigmoid": lambda x, w: torch.sigmoid(x @ w) * 3.0 - 1.0,
}
LABELS = {"silu": "silu", "quick_gelu": "silu", "swiglu": "swiglu", "swiglu_halves": "swiglu",
          "gelu_tanh": "gelu", "gelu_erf": "gelu", "softcap": "tanh",
          "two_rmsnorms": "rmsnorm", "layernorm": "layernorm", "scaled_sigmoid": "pointwise"}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_label_names_what_the_kernel_computes(name, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dtype)
    w = (torch.randn(48, 48, generator=g) / 7).to(dtype)
    out, reports = compile_and_run(CASES[name], (x, w))
    (report,) = reports
    assert [k["label"] for k in report.kernels] == [LABELS[name]]     # one kernel after the GEMMs
    assert_close(out, CASES[name](x, w), dtype=dtype)
