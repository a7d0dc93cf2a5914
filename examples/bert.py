"""BERT from Hugging Face transformers, random weights, compiled with the fusion backend.

No downloads: the model is built from a ``BertConfig``, never ``from_pretrained``. Each layer is
post-norm:

    h = LayerNorm(x + dense(attention(q(x), k(x), v(x))))      # bidirectional SDPA
    y = LayerNorm(h + down(gelu(up(h))))                        # exact (erf) GELU

Needs transformers:  pip install 'fusion-compiler[examples]'.
Run it:  python examples/bert.py   (on a GPU if there is one, else on the CPU; on the CPU set
TRITON_INTERPRET=1 to run the generated kernels in Triton's interpreter).

The CLI builds models through ``make_model_and_inputs(device, dtype, batch, seq, **config)``.
"""
import sys

import torch
import torch.nn as nn

TINY_CONFIG = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   intermediate_size=128, vocab_size=256, max_position_embeddings=128)

# BERT-base (110M parameters).
BENCH_CONFIG = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                    intermediate_size=3072, vocab_size=30522, max_position_embeddings=512)


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("examples/bert.py needs Hugging Face transformers: pip install "
                          "'fusion-compiler[examples]' (or pip install transformers)") from exc
    return transformers


class BertHidden(nn.Module):
    """A BertModel (no pooler) whose forward(input_ids) returns the last hidden state alone."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).last_hidden_state


def make_model_and_inputs(device="cpu", dtype=torch.float32, batch=2, seq=16, **config):
    """(model, (input_ids,)): a random-weight BERT encoder in eval mode and random token ids."""
    transformers = _transformers()
    cfg = transformers.BertConfig(attn_implementation="sdpa", **dict(TINY_CONFIG, **config))
    bert = transformers.BertModel(cfg, add_pooling_layer=False)
    model = BertHidden(bert).to(device=device, dtype=dtype).eval()
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return model, (input_ids,)


def bench_16x256(device="cpu", dtype=torch.bfloat16):
    """BERT-base, batch 16 x 256 tokens."""
    return make_model_and_inputs(device, dtype, batch=16, seq=256, **BENCH_CONFIG)


def main() -> int:
    from fusion_compiler.demo import run_example

    return run_example(make_model_and_inputs, "examples/bert.py", "hidden state")


if __name__ == "__main__":
    sys.exit(main())
