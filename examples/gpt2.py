"""GPT-2 from Hugging Face transformers, random weights, compiled with the fusion backend.

No downloads: the model is built from a ``GPT2Config``, never ``from_pretrained``. Each block is

    h = x + c_proj(attention(c_attn(LayerNorm(x))))     # causal SDPA, biases on every Linear
    y = h + c_proj(gelu_tanh(c_fc(LayerNorm(h))))        # the GELU MLP

Needs transformers:  pip install 'fusion-compiler[examples]'.
Run it:  python examples/gpt2.py   (on a GPU if there is one, else on the CPU; on the CPU set
TRITON_INTERPRET=1 to run the generated kernels in Triton's interpreter).

The CLI builds models through ``make_model_and_inputs(device, dtype, batch, seq, **config)``.
"""
import sys

import torch
import torch.nn as nn

TINY_CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)

# GPT-2 small (124M parameters).
BENCH_CONFIG = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("examples/gpt2.py needs Hugging Face transformers: pip install "
                          "'fusion-compiler[examples]' (or pip install transformers)") from exc
    return transformers


class GPT2Logits(nn.Module):
    """A GPT2LMHeadModel whose forward(input_ids) returns the logits tensor alone."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def make_model_and_inputs(device="cpu", dtype=torch.float32, batch=2, seq=16, **config):
    """(model, (input_ids,)): a random-weight GPT-2 in eval mode and random token ids."""
    transformers = _transformers()
    options = dict(TINY_CONFIG, **config)
    last_token = options["vocab_size"] - 1      # GPT-2's <|endoftext|> id is its last one
    cfg = transformers.GPT2Config(bos_token_id=last_token, eos_token_id=last_token,
                                  attn_implementation="sdpa", **options)
    model = GPT2Logits(transformers.GPT2LMHeadModel(cfg)).to(device=device, dtype=dtype).eval()
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return model, (input_ids,)


def bench_8x512(device="cpu", dtype=torch.bfloat16):
    """GPT-2 small, batch 8 x 512 tokens."""
    return make_model_and_inputs(device, dtype, batch=8, seq=512, **BENCH_CONFIG)


def main() -> int:
    from fusion_compiler.demo import run_example

    return run_example(make_model_and_inputs, "examples/gpt2.py", "logits")


if __name__ == "__main__":
    sys.exit(main())
