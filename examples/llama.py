"""A small Llama-style decoder in plain PyTorch, compiled with the fusion backend.

No downloads: random weights, a self-written model. Each decoder layer is

    h = x + o_proj(attention(rope(q), rope(k), v))      # RMSNorm first, GQA, causal SDPA
    y = h + down(silu(gate(h')) * up(h'))               # h' = RMSNorm(h), SwiGLU MLP

Run it:  python examples/llama.py   (on a GPU if there is one, else on the CPU; on the CPU set
TRITON_INTERPRET=1 to run the generated kernels in Triton's interpreter).

The CLI builds models through ``make_model_and_inputs(device, dtype, batch, seq, **config)``.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back, then scaled by a weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotary position embedding, rotate-half form; cos/sin are (seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention: num_kv_heads key/value heads shared by num_heads query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def _repeat_kv(self, x):
        """(b, n_kv, s, d) -> (b, n_heads, s, d) by expand + reshape."""
        b, n_kv, s, d = x.shape
        rep = self.n_heads // n_kv
        return x[:, :, None].expand(b, n_kv, rep, s, d).reshape(b, n_kv * rep, s, d)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token embedding, decoder layers, final RMSNorm, lm_head -> logits (b, s, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        freqs = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)           # (max_seq_len, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        x = self.embed(input_ids)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def make_model_and_inputs(device="cpu", dtype=torch.float32, batch=2, seq=16, **config):
    """(model, (input_ids,)): a random-weight Llama and a batch of random token ids."""
    cfg = LlamaConfig(**config)
    model = Llama(cfg).to(device=device, dtype=dtype)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return model, (input_ids,)


# The benchmark sizes of the performance issue: 8 layers, hidden 2048, GQA 16/4 heads.
BENCH_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=8,
                    num_heads=16, num_kv_heads=4, max_seq_len=1024)


def bench_4x1024(device="cpu", dtype=torch.bfloat16):
    """The throughput case: batch 4 x 1024 tokens."""
    return make_model_and_inputs(device, dtype, batch=4, seq=1024, **BENCH_CONFIG)


def bench_1x128(device="cpu", dtype=torch.bfloat16):
    """The launch-bound case: batch 1 x 128 tokens."""
    return make_model_and_inputs(device, dtype, batch=1, seq=128, **BENCH_CONFIG)


class CausalLMLoss(nn.Module):
    """The training objective of a causal LM, inside the compiled graph as Hugging Face's
    models compute it when given labels: next-token cross entropy over the fp32 logits."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids)[:, :-1].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def train_4x1024_lm(device="cpu", dtype=torch.bfloat16):
    """The throughput case with its loss: `bench --mode training` then trains through the
    cross entropy (its gradient over 4 x 1023 x 32000 logits), not a loss over the logits."""
    model, (ids,) = bench_4x1024(device, dtype)
    return CausalLMLoss(model), (ids, ids.clone())


def main() -> int:
    from fusion_compiler.demo import run_example

    return run_example(make_model_and_inputs, "examples/llama.py", "logits")


if __name__ == "__main__":
    sys.exit(main())
