"""Hugging Face architectures beyond the examples, at the sizes of their base models, as
``fusion-compiler bench`` targets (random weights, no downloads; needs transformers).

    fusion-compiler bench benchmarks/hf_zoo.py:vit_base_32 benchmarks/hf_zoo.py:t5_base_16x256 \\
        ... --compare eager,inductor,fusion

Each factory takes (device, dtype) and returns (model, inputs): the model's forward takes the
inputs positionally and returns its last hidden state (and the pooled output where the model
has a pooler). ``TINY=1`` in the environment builds each with two layers of width 64 instead
(the same code, for a CPU check).
"""
import os

import torch

TINY = os.environ.get("TINY") == "1"


class Wrapped(torch.nn.Module):
    """forward(*tensors) -> the model's last hidden state, and its pooled output if it has
    one (so the pooler's ops are compiled, not dropped as unused). tests/test_zoo.py uses it
    too."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors):
        out = self.model(**dict(zip(self.names, tensors)))
        pooled = getattr(out, "pooler_output", None)
        return out.last_hidden_state if pooled is None else (out.last_hidden_state, pooled)


def set_dropout(cfg, p: float):
    """Every dropout probability of a transformers config set to ``p``; LayerDrop to 0 (a
    branch on a random value, which a full graph cannot hold)."""
    for key, value in list(vars(cfg).items()):
        if "drop" in key and isinstance(value, float):
            setattr(cfg, key, 0.0 if "layerdrop" in key else p)
    return cfg


def wrap(model, kw: dict):
    """(module, inputs): ``model`` taking the tensors of ``kw`` positionally (``Wrapped``),
    with its forward's defaults: a decoder builds its KV cache, as generation's prefill does
    (an earlier check meant to turn the cache off looked for ``use_cache`` in the code object
    of transformers' forward wrapper, so it never did: every zoo measurement ran this way)."""
    return Wrapped(model, list(kw)), tuple(kw.values())


def _make(cfg_name, model_name, config, tiny, inputs, device, dtype, attn=None):
    import transformers as T

    cfg = set_dropout(getattr(T, cfg_name)(**(dict(config, **tiny) if TINY else config)), 0.0)
    if attn:
        cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(T, model_name)(cfg).to(device=device, dtype=dtype).eval()
    return wrap(model, inputs(cfg, device, dtype))


def _ids(batch, seq, mask=False, decoder=0):
    def make(cfg, device, dtype):
        out = {"input_ids": torch.randint(1, cfg.vocab_size, (batch, seq), device=device)}
        if mask:
            m = torch.ones(batch, seq, dtype=torch.long, device=device)
            m[0, seq * 3 // 4:] = 0                # one padded sequence
            out["attention_mask"] = m
        if decoder:
            out["decoder_input_ids"] = torch.randint(1, cfg.vocab_size, (batch, decoder),
                                                     device=device)
        return out
    return make


def _pixels(batch, size):
    def make(cfg, device, dtype):
        return {"pixel_values": torch.randn(batch, 3, size, size, device=device, dtype=dtype)}
    return make


TINY_DEC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def mistral_4x1024(device="cpu", dtype=torch.bfloat16):
    """Mistral-style decoder, 8 layers of 2048 (GQA 16/4, sliding window 512)."""
    return _make("MistralConfig", "MistralModel",
                 dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, sliding_window=512,
                      vocab_size=32000), TINY_DEC, _ids(4, 1024 if not TINY else 16),
                 device, dtype)


def qwen3_4x1024(device="cpu", dtype=torch.bfloat16):
    """Qwen3-style decoder, 8 layers of 2048, RMSNorm on each head's queries and keys."""
    return _make("Qwen3Config", "Qwen3Model",
                 dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                      vocab_size=32000), dict(TINY_DEC, head_dim=16),
                 _ids(4, 1024 if not TINY else 16), device, dtype)


def gemma2_4x512(device="cpu", dtype=torch.bfloat16):
    """Gemma 2-style decoder, 8 layers of 2048, eager attention with tanh soft-capping, four
    RMSNorms a layer, tanh-GELU gate."""
    return _make("Gemma2Config", "Gemma2Model",
                 dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      vocab_size=32000), dict(TINY_DEC, head_dim=16),
                 _ids(4, 512 if not TINY else 16), device, dtype, attn="eager")


def mamba2_4x1024(device="cpu", dtype=torch.bfloat16):
    """Mamba2-style state-space model, 8 layers of 1024 (32 heads of 64, state 128, chunks of
    256), through transformers' PyTorch path (the one torch.compile traces): per chunk,
    ``segment_sum``'s ``cumsum(dim=-2)`` over [l, l] blocks, exp, einsums."""
    return _make("Mamba2Config", "Mamba2Model",
                 dict(hidden_size=1024, num_hidden_layers=8, num_heads=32, head_dim=64,
                      state_size=128, n_groups=1, chunk_size=256, expand=2, vocab_size=32000),
                 dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                      state_size=8, n_groups=1, chunk_size=16, expand=2, vocab_size=256),
                 _ids(4, 1024 if not TINY else 32), device, dtype)


def bloom_8x512(device="cpu", dtype=torch.bfloat16):
    """BLOOM-560m: 24 layers of 1024, ALiBi attention in its math form (softmax kernels)."""
    return _make("BloomConfig", "BloomModel",
                 dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=32000),
                 dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256),
                 _ids(8, 512 if not TINY else 16, mask=True), device, dtype)


def t5_base_16x256(device="cpu", dtype=torch.bfloat16):
    """T5-base encoder: 12 layers of 768, RMSNorm, relative position bias."""
    return _make("T5Config", "T5EncoderModel",
                 dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64,
                      vocab_size=32128),
                 dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=256),
                 _ids(16, 256 if not TINY else 16, mask=True), device, dtype)


def bart_base_16x256(device="cpu", dtype=torch.bfloat16):
    """BART-base: 6 + 6 layers of 768, post-LayerNorm, GELU, cross-attention."""
    return _make("BartConfig", "BartModel",
                 dict(d_model=768, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                      encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                      decoder_attention_heads=12, vocab_size=50265),
                 dict(d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2,
                      decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                      vocab_size=256),
                 _ids(16, 256 if not TINY else 16, mask=True,
                      decoder=128 if not TINY else 8), device, dtype)


def vit_base_32(device="cpu", dtype=torch.bfloat16):
    """ViT-B/16 at 224: 12 layers of 768, 197 tokens, batch 32."""
    return _make("ViTConfig", "ViTModel",
                 dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, image_size=224, patch_size=16),
                 dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, image_size=32, patch_size=8),
                 _pixels(32, 224 if not TINY else 32), device, dtype)


def convnext_tiny_32(device="cpu", dtype=torch.bfloat16):
    """ConvNeXt-T at 224, batch 32: depthwise convolutions, channels-last LayerNorms, GELU."""
    return _make("ConvNextConfig", "ConvNextModel",
                 dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3], image_size=224),
                 dict(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], image_size=32),
                 _pixels(32, 224 if not TINY else 32), device, dtype)


def convnext_tiny_64_train(device="cpu", dtype=torch.bfloat16):
    """``convnext_tiny_32`` in train mode at batch 64, for ``bench --mode training``: the
    LayerNorms over NCHW channels (the downsampling layers') and over channels-last rows, and
    their backward sums, in a step whose GPU work outlasts the host's."""
    model, _ = convnext_tiny_32(device, dtype)
    size = 224 if not TINY else 32
    return model.train(), (torch.randn(64 if not TINY else 4, 3, size, size, device=device,
                                       dtype=dtype),)


def resnet50_32(device="cpu", dtype=torch.bfloat16):
    """ResNet-50 at 224, batch 32: bottleneck blocks, BatchNorm (statistics of the batch in
    training), ReLU, residual adds."""
    return _make("ResNetConfig", "ResNetModel",
                 dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                      layer_type="bottleneck"),
                 dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                      layer_type="basic"),
                 _pixels(32, 224 if not TINY else 32), device, dtype)


def resnet50_32_train(device="cpu", dtype=torch.bfloat16):
    """``resnet50_32`` in train mode, for ``bench --mode training``: BatchNorm normalises with
    the batch's statistics and updates its running ones, as a training step does."""
    model, inputs = resnet50_32(device, dtype)
    return model.train(), inputs


def resnet50_128_train(device="cpu", dtype=torch.bfloat16):
    """``resnet50_32_train`` at batch 128, where the GPU's work outlasts the host's (at 32 every
    backend's step is bound by its host: about 17 ms of Python and launches, session 45)."""
    model, _ = resnet50_32(device, dtype)
    return model.train(), (torch.randn(128 if not TINY else 4, 3, 224 if not TINY else 32,
                                       224 if not TINY else 32, device=device, dtype=dtype),)


def resnet50_128_train_cl(device="cpu", dtype=torch.bfloat16):
    """``resnet50_128_train`` with the model and the image channels-last, as PyTorch's
    performance guide advises for convolution networks: every BatchNorm's statistics and the
    backward's sums over [0, 2, 3] read channels-last activations."""
    model, (x,) = resnet50_128_train(device, dtype)
    return model.to(memory_format=torch.channels_last), \
        (x.contiguous(memory_format=torch.channels_last),)


def swin_tiny_32(device="cpu", dtype=torch.bfloat16):
    """Swin-T at 224, batch 32: window attention, patch merging."""
    return _make("SwinConfig", "SwinModel",
                 dict(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                      image_size=224, patch_size=4, window_size=7),
                 dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], image_size=32,
                      patch_size=4, window_size=4),
                 _pixels(32, 224 if not TINY else 32), device, dtype)


ALL = ["mistral_4x1024", "qwen3_4x1024", "gemma2_4x512", "bloom_8x512", "t5_base_16x256",
       "bart_base_16x256", "vit_base_32", "convnext_tiny_32", "resnet50_32", "swin_tiny_32"]
