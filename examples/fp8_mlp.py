"""A stack of residual FP8 MLP blocks in plain PyTorch, compiled with the fusion backend.

The memory-bound work around two FP8 GEMMs, as in FP8 inference of a Llama MLP:

    y = RMSNorm(x);              q1, s1 = quant(y)      # fused: one row-reduction kernel
    gu = _scaled_mm(q1, w1, s1, w1_scale)               # ATen: FP8 GEMM, bf16 out
    a = silu(gate) * up;         q2, s2 = quant(a)      # fused: SwiGLU + quant, one kernel
    h = x + _scaled_mm(q2, w2, s2, w2_scale)            # ATen: FP8 GEMM; the add fuses onward

quant is dynamic per-token FP8 (e4m3fn): scale = amax(|y|) / 448 per row, q = y / scale. The
weights are quantized once, per output channel. ``torch._scaled_mm`` runs on CUDA (shapes
divisible by 16, the second operand column-major: ``w.t()`` of a row-major [out, in] weight)
and, in torch 2.13, on the CPU too.

Run it:  python examples/fp8_mlp.py   (on a GPU if there is one, else on the CPU; on the CPU set
TRITON_INTERPRET=1 to run the generated kernels in Triton's interpreter).

The CLI builds models through ``make_model_and_inputs(device, dtype, batch, seq, **config)``.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max      # 448


@dataclass
class FP8MLPConfig:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    eps: float = 1e-6


def quantize_rows(y):
    """(q, scale): y as float8_e4m3fn with one fp32 scale per row, shape (rows, 1)."""
    y = y.float()
    scale = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (y / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class FP8Linear(nn.Module):
    """q @ w.t() in FP8, bf16 out: q scaled per row (the caller quantizes it), w per output
    channel (quantized here, once)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        weight, scale = quantize_rows(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.register_buffer("weight", weight)                  # [out, in], row-major
        self.register_buffer("scale", scale.t().contiguous())   # [1, out]: scale_b of _scaled_mm

    def forward(self, q, q_scale):
        return torch._scaled_mm(q, self.weight.t(), scale_a=q_scale, scale_b=self.scale,
                                out_dtype=torch.bfloat16)


class FP8MLPBlock(nn.Module):
    """h = x + w2(quant(swiglu(w1(quant(RMSNorm(x)))))), the GEMMs in FP8."""

    def __init__(self, cfg: FP8MLPConfig, dtype: torch.dtype):
        super().__init__()
        self.eps = cfg.eps
        self.norm_weight = nn.Parameter((1.0 + 0.1 * torch.randn(cfg.hidden_size)).to(dtype))
        self.gate_up = FP8Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down = FP8Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        gate, up = self.gate_up(*quantize_rows(y * self.norm_weight)).chunk(2, dim=-1)
        return x + self.down(*quantize_rows(F.silu(gate) * up)).to(x.dtype)


class FP8MLP(nn.Module):
    """FP8 MLP blocks over hidden states (batch, seq, hidden); _scaled_mm wants 2-D operands.

    ``dtype`` is that of the norm weights; ``model.to(dtype)`` would cast the FP8 weights too."""

    def __init__(self, cfg: FP8MLPConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(FP8MLPBlock(cfg, dtype) for _ in range(cfg.num_layers))

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        for block in self.blocks:
            h = block(h)
        return h.view(x.shape)


def make_model_and_inputs(device="cpu", dtype=torch.bfloat16, batch=2, seq=16, **config):
    """(model, (hidden_states,)): random FP8 MLP blocks and random hidden states of ``dtype``.

    The FP8 GEMMs return bf16, so bf16 is the natural ``dtype``; others add casts."""
    cfg = FP8MLPConfig(**config)
    model = FP8MLP(cfg, dtype).to(device)
    x = torch.randn(batch, seq, cfg.hidden_size, device=device).to(dtype)
    return model.eval(), (x,)


# The sizes of a Llama-7B MLP: hidden 4096, intermediate 11008.
BENCH_CONFIG = dict(hidden_size=4096, intermediate_size=11008, num_layers=4)


def bench_8x1024(device="cpu", dtype=torch.bfloat16):
    """8192 tokens (batch 8 x 1024) through 4 blocks."""
    return make_model_and_inputs(device, dtype, batch=8, seq=1024, **BENCH_CONFIG)


def main() -> int:
    from fusion_compiler.demo import run_example

    return run_example(make_model_and_inputs, "examples/fp8_mlp.py", "output", on_aten="the FP8 GEMMs", atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    sys.exit(main())
