"""On the GPU: the patterns at realistic sizes, FP8 outputs checked bit for bit.

The interpreter (CPU) runs the same kernels on small shapes; these use real Triton compilation,
the hardware fp8 conversion, and sizes where rows are split across many programs.
"""
import pytest
import torch

from helpers import as_tuple, assert_close, assert_fp8_matches, compile_and_run, kernel_count
from patterns import PATTERNS, make_args

pytestmark = pytest.mark.gpu

LARGE = [(2048, 4096), (333, 11008), (64, 65536)]


@pytest.mark.parametrize("rows,n", LARGE)
@pytest.mark.parametrize("name", ["add_rmsnorm", "add_layernorm", "swiglu", "bias_gelu",
                                  "rmsnorm_fp8", "rmsnorm_dynamic_fp8", "dequant_add",
                                  "softmax_scale"])
def test_pattern_large_bf16(name, rows, n):
    args = make_args(name, rows, n, torch.bfloat16, "cuda")
    out, reports = compile_and_run(PATTERNS[name], args)
    assert kernel_count(reports) == 1
    for i, (a, e) in enumerate(zip(as_tuple(out), as_tuple(PATTERNS[name](*args)))):
        if e.dtype == torch.float8_e4m3fn:
            assert_fp8_matches(a, e, min_equal=0.999)
        else:
            assert_close(a, e, name=f"{name}[{i}]")


class AddEps(torch.nn.Module):
    """A float attribute: with dynamic=True dynamo passes it as a 0-dim CPU tensor."""

    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def test_cpu_scalar_joins_gpu_kernel():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    out, reports = compile_and_run(AddEps(), (x,), dynamic=True)
    assert kernel_count(reports) == 1
    assert_close(out, AddEps()(x))
