"""Thirty Hugging Face architectures, tiny and random, compiled against eager (CPU interpreter).

What a user compiling a model of their own meets: each family's norms, activations, rotary
embeddings, attention masks and pooling as transformers writes them. For each model the test
asserts the fused kernels by kind (the report's labels), that no norm or activation is left
on ATen, and the output against eager in bf16 (and in fp32 for one model of each kind of
layer); a sample also trains (forward and backward), with dropout too, and generates with a
KV cache (shapes changing every step).

Needs transformers (the `test` extra); a model its installed version lacks, or cannot run
eagerly, is skipped with the reason.
"""
import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch

import fusion_compiler
from helpers import as_tuple, assert_close, compile_and_run

T = pytest.importorskip("transformers")
# the module wrapping and dropout settings benchmarks/hf_zoo.py builds its models with
_SPEC = importlib.util.spec_from_file_location(
    "hf_zoo", Path(__file__).resolve().parents[1] / "benchmarks" / "hf_zoo.py")
HF_ZOO = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(HF_ZOO)

# Only on the CPU, in Triton's interpreter: on a GPU machine the examples' GPU tests cover the
# launch path (there the attention of some of these models is traced in another form).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")

DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=256, max_position_embeddings=128)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=256)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, image_size=32, patch_size=8)

# name: (config class, model class, config, inputs, fused kernels by label in fp32 inference).
# Labels of kernels that only move data (pointwise, residual, reduction: mask code and the
# like, which varies between transformers versions) are not counted.
ZOO = {
    "llama": ("LlamaConfig", "LlamaModel", dict(DECODER, num_key_value_heads=2), "ids",
              {"rmsnorm": 5, "rope": 4, "swiglu": 2}),
    "mistral": ("MistralConfig", "MistralModel", dict(DECODER, num_key_value_heads=2,
                                                      sliding_window=8), "ids",
                {"rmsnorm": 5, "rope": 4, "swiglu": 2}),
    "qwen2": ("Qwen2Config", "Qwen2Model", dict(DECODER, num_key_value_heads=2), "ids",
              {"rmsnorm": 5, "rope": 4, "swiglu": 2}),
    # per-head q and k norms: four more RMSNorms
    # q's and k's norms over each head take in the rope after them, in [b, h, s, d] of the
    # norms' [b, s, h] rows (codegen row_outputs.traced)
    "qwen3": ("Qwen3Config", "Qwen3Model", dict(DECODER, num_key_value_heads=2, head_dim=16),
              "ids", {"rmsnorm": 5, "rmsnorm+rope": 4, "swiglu": 2}),
    "gemma": ("GemmaConfig", "GemmaModel", dict(DECODER, num_key_value_heads=2, head_dim=16),
              "ids", {"rmsnorm": 5, "rope": 4, "gelu": 2}),
    # eager attention: the scores' tanh soft-capping joins the softmax
    "gemma2": ("Gemma2Config", "Gemma2Model", dict(DECODER, num_key_value_heads=2, head_dim=16,
                                                   attn_implementation="eager"), "ids",
               {"rmsnorm": 5, "rope": 4, "softmax+tanh": 2, "gelu": 2}),
    # gate and up projections as one GEMM, split in the SwiGLU kernel
    "phi3": ("Phi3Config", "Phi3Model", dict(DECODER, num_key_value_heads=2, pad_token_id=0),
             "ids", {"rmsnorm": 5, "rope": 4, "swiglu": 2}),
    "phi": ("PhiConfig", "PhiModel", DECODER, "ids", {"layernorm": 3, "rope": 2, "gelu": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", DECODER, "ids",
                 {"layernorm": 3, "rope": 2, "gelu": 2}),
    # mixture of experts: the router's softmax and top-k; the experts' GEMMs stay on ATen;
    # the cumsums of the tokens each expert takes are scans (codegen/lower.py: _scan)
    "mixtral": ("MixtralConfig", "MixtralModel", dict(DECODER, num_key_value_heads=2,
                                                      num_local_experts=4,
                                                      num_experts_per_tok=2), "ids",
                {"rmsnorm": 5, "rope": 4, "softmax": 2, "swiglu": 2, "cumsum": 2}),
    "olmo": ("OlmoConfig", "OlmoModel", DECODER, "ids", {"layernorm": 5, "rope": 2,
                                                          "swiglu": 2}),
    "stablelm": ("StableLmConfig", "StableLmModel", dict(DECODER, num_key_value_heads=4), "ids",
                 {"layernorm": 5, "rope": 2, "swiglu": 2}),
    "opt": ("OPTConfig", "OPTModel", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                          num_attention_heads=4, vocab_size=256,
                                          word_embed_proj_dim=64,
                                          max_position_embeddings=128), "ids+mask",
            {"layernorm": 5, "cumsum": 1}),
    # ALiBi attention in its math form: one softmax a layer; the ALiBi positions, a cumsum
    # of the padding mask, a scan
    "bloom": ("BloomConfig", "BloomModel", dict(hidden_size=64, n_layer=2, n_head=4,
                                                vocab_size=256), "ids+mask",
              {"layernorm": 5, "softmax": 2, "gelu": 2, "cumsum": 1}),
    # eager attention asked for: transformers 5.25 gives Falcon SDPA by default (5.24 did not),
    # and the softmax of its eager form is what this entry counts. One rope kernel a layer: it
    # writes q and the transposed, repeated k ([b, h, s, d] and [b, h, d, s]) together
    "falcon": ("FalconConfig", "FalconModel", dict(hidden_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=256,
                                                   attn_implementation="eager"),
               "ids", {"layernorm": 3, "rope": 2, "softmax": 2, "gelu": 2}),
    "gptj": ("GPTJConfig", "GPTJModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                             rotary_dim=8, n_positions=128), "ids",
             {"layernorm": 3, "rope": 2, "gelu": 2}),
    "distilbert": ("DistilBertConfig", "DistilBertModel", dict(dim=64, hidden_dim=128,
                                                               n_layers=2, n_heads=4,
                                                               vocab_size=256), "ids+mask",
                   {"layernorm": 5, "gelu": 2}),
    # the pooler's tanh; the position ids, a cumsum of the tokens that are not padding
    "roberta": ("RobertaConfig", "RobertaModel", ENCODER, "ids+mask",
                {"layernorm": 5, "gelu": 2, "tanh": 1, "cumsum": 1}),
    "electra": ("ElectraConfig", "ElectraModel", dict(ENCODER, embedding_size=32), "ids+mask",
                {"layernorm": 5, "gelu": 2}),
    # disentangled attention in its math form
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", ENCODER, "ids+mask",
                   {"layernorm": 5, "softmax": 2, "gelu": 2}),
    "albert": ("AlbertConfig", "AlbertModel", dict(ENCODER, embedding_size=32), "ids+mask",
               {"layernorm": 5, "gelu": 2, "tanh": 1}),
    "t5": ("T5Config", "T5EncoderModel", dict(d_model=64, d_ff=128, num_layers=2, num_heads=4,
                                              d_kv=16, vocab_size=256), "ids+mask",
           {"rmsnorm": 5}),
    "t5_gated_gelu": ("T5Config", "T5EncoderModel", dict(d_model=64, d_ff=128, num_layers=2,
                                                         num_heads=4, d_kv=16, vocab_size=256,
                                                         feed_forward_proj="gated-gelu"),
                      "ids+mask", {"rmsnorm": 5, "gelu": 2}),
    # encoder and decoder, cross-attention
    "bart": ("BartConfig", "BartModel", dict(d_model=64, encoder_ffn_dim=128,
                                             decoder_ffn_dim=128, encoder_layers=2,
                                             decoder_layers=2, encoder_attention_heads=4,
                                             decoder_attention_heads=4, vocab_size=256,
                                             max_position_embeddings=128), "ids+mask+dec",
             {"layernorm": 12, "gelu": 4}),
    "vit": ("ViTConfig", "ViTModel", VISION, "pixels", {"layernorm": 5, "gelu": 2, "tanh": 1}),
    # QuickGELU, x * sigmoid(1.702 x)
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", VISION, "pixels",
                    {"layernorm": 5, "silu": 2}),
    # channels-last LayerNorms between convolutions; the pooling mean over H, W fused with
    # the residual add (passes/trailing_dims.py)
    "convnext": ("ConvNextConfig", "ConvNextModel", dict(hidden_sizes=[16, 32, 48, 64],
                                                         depths=[1, 1, 1, 1], image_size=32),
                 "pixels", {"layernorm": 9, "gelu": 4}),
    # BatchNorm (eval: a per-channel scale and shift) with its ReLU and the residual add, the
    # shortcut's BN in the same kernel as the block's last; the pooling mean over H, W
    "resnet": ("ResNetConfig", "ResNetModel", dict(embedding_size=16, hidden_sizes=[16, 32],
                                                   depths=[1, 1], layer_type="basic"),
               "pixels", {"batchnorm": 4, "batchnorm+maxpool": 1}),
    # window partitions: a LayerNorm's output written as windows (statistics and normalisation
    # in two kernels); the pooling mean over the tokens is a row reduction
    "swin": ("SwinConfig", "SwinModel", dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                             image_size=32, patch_size=4, window_size=4),
             "pixels", {"layernorm": 6, "gelu": 2}),
    "whisper": ("WhisperConfig", "WhisperModel", dict(d_model=64, encoder_layers=2,
                                                      decoder_layers=2,
                                                      encoder_attention_heads=4,
                                                      decoder_attention_heads=4,
                                                      encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                      num_mel_bins=16, max_source_positions=16,
                                                      max_target_positions=32, vocab_size=256,
                                                      pad_token_id=0, bos_token_id=1,
                                                      eos_token_id=2,
                                                      decoder_start_token_id=1), "audio",
                {"gelu": 5, "layernorm+gelu": 2, "layernorm": 10}),
    # NoNorm (x * w + b) and ReLU: elementwise kernels only; the pooler's tanh
    "mobilebert": ("MobileBertConfig", "MobileBertModel", dict(ENCODER, intermediate_size=64,
                                                               embedding_size=32,
                                                               intra_bottleneck_size=32,
                                                               true_hidden_size=32),
                   "ids+mask", {"tanh": 1}),
}
# kernels that move data only; their number follows transformers' mask code
UNCOUNTED = {"pointwise", "residual", "reduction"}
# ops of norms, activations and the vision models' pooling: none may be left on ATen
# (``mean``: ConvNeXt's pool over H and W, Swin's adaptive pool over the tokens, reductions
# over trailing dimensions merged into one: passes/trailing_dims.py)
NORM_AND_ACTIVATION = {"rsqrt", "var_mean", "native_layer_norm", "erf", "tanh", "pow",
                       "sigmoid", "gelu", "silu", "relu", "_softmax", "amax", "mean"}
# a slice's gradient (rotary embeddings' rotate_half, Swin's patch merging:
# fusion_compiler/slices.py), picks by constant index tensors (Hugging Face's masks:
# passes/constant_fold.py): none may be left on ATen either (a ``full`` may: Swin's bias
# table gradient is an index_put into zeros)
SLICES_AND_PICKS = {"slice_scatter", "slice_backward", "index"}
# cumulative sums along the last dim (positions from padding masks, expert routing): scans
SCANS = {"cumsum", "flip"}

# models whose peak memory is at these kernels, each of which writes its output over its input
# (passes/inplace.py): the vision models' MLP GELUs over their GEMM outputs, BLOOM's attention
# softmax over its scores
IN_PLACE = {"convnext": "gelu", "vit": "gelu", "swin": "gelu", "bloom": "softmax"}
# norm kernels of a training forward where they differ from inference's: ResNet's six
# BatchNorms, channels-last (passes/channels_last.py), with the batch's statistics as column
# sums of chunks (a chunk's rows, then their combination), or, where a channel's values fit
# one row at this size, statistics and normalisation in one kernel
TRAINING_NORMS = {"resnet": 10}
# buffers a training forward writes from its kernels (passes/input_writes.py): each BN's
# running mean, running variance and batch count; the other models update none
INPUT_WRITES = {"resnet": 6 * 3}
TRAINED = ["llama", "gemma2", "phi3", "gpt_neox", "bloom", "roberta", "t5", "bart", "vit",
           "convnext", "resnet", "swin"]
# dropout where each family puts it: attention and MLP (Llama, RoBERTa, T5), embeddings and
# patches (ViT, Swin), stochastic depth (ConvNeXt); the other trained models run the same
# graph machinery (each case 8-25 s in the interpreter, the suite's largest share)
DROPOUT = ["llama", "roberta", "t5", "vit", "convnext", "swin"]
# (model, its LM class, dtype): one model a position scheme (rotary, partial rotary, ALiBi),
# bf16 for two of them (each case takes 20-40 s in the interpreter, three compiles)
GENERATED = [("llama", "LlamaForCausalLM", torch.bfloat16),
             ("gpt_neox", "GPTNeoXForCausalLM", torch.bfloat16),
             ("bloom", "BloomForCausalLM", torch.float32)]
# inference in bf16 for every model; in fp32 too for one of each family's kind of layer (the
# fused groups are the same in both dtypes; what fp32 adds is its own tolerance, which the
# pattern tests check for each fusion in every dtype)
FP32 = ["llama", "gemma2", "phi", "mixtral", "bloom", "roberta", "deberta_v2", "t5", "bart",
        "convnext", "swin", "whisper"]
INFERENCE = [(n, torch.bfloat16) for n in ZOO] + [(n, torch.float32) for n in FP32]


def build(name, dtype, model_class=None, dropout=False):
    cfg_name, model_name, options, _, _ = ZOO[name]
    if not hasattr(T, cfg_name) or not hasattr(T, model_class or model_name):
        pytest.skip(f"transformers {T.__version__} has no {model_class or model_name}")
    options = dict(options)
    attn = options.pop("attn_implementation", None)
    cfg = getattr(T, cfg_name)(**options)
    HF_ZOO.set_dropout(cfg, 0.1 if dropout else 0.0)     # none: eager and compiled agree
    if attn:
        cfg._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(T, model_class or model_name)(cfg).to(dtype)


def inputs(name, dtype):
    kind = ZOO[name][3]
    g = torch.Generator().manual_seed(1)
    if kind == "pixels":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g).to(dtype)}
    if kind == "audio":
        return {"input_features": torch.randn(2, 16, 32, generator=g).to(dtype),
                "decoder_input_ids": torch.randint(0, 256, (2, 5), generator=g)}
    out = {"input_ids": torch.randint(1, 256, (2, 13), generator=g)}
    if "mask" in kind:       # the second sequence padded: masks reach the kernels
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[1, 9:] = 0
        out["attention_mask"] = mask
    if "dec" in kind:
        out["decoder_input_ids"] = torch.randint(1, 256, (2, 7), generator=g)
    return out


def wrapped(name, dtype, dropout=False):
    model = build(name, dtype, dropout=dropout)
    module, args = HF_ZOO.wrap(model, inputs(name, dtype))
    try:
        with torch.no_grad():
            module.eval()(*args)
    except Exception as exc:        # noqa: BLE001 - not ours to test
        pytest.skip(f"{name} does not run eagerly with transformers {T.__version__}: {exc}")
    return module, args


def loss(outputs):
    return sum(o.pow(2).mean() for o in outputs)


def fused_labels(reports, kind=None):
    got = Counter(k["label"] for r in reports if kind in (None, r.kind) for k in r.kernels)
    return {k: v for k, v in got.items() if k not in UNCOUNTED}


def left_on_aten(reports):
    return {op.split(".")[1] for r in reports for op in r.aten_ops}


@pytest.mark.parametrize("name, dtype", INFERENCE,
                         ids=[f"{'bf16' if d == torch.bfloat16 else 'fp32'}-{n}"
                              for n, d in INFERENCE])
def test_inference_matches_eager(name, dtype):
    module, args = wrapped(name, dtype)
    module.eval()
    with torch.no_grad():
        expected = module(*args)
        out, reports = compile_and_run(module, args)
    assert [r.error for r in reports if r.error] == []
    assert len(reports) == 1
    assert fused_labels(reports) == ZOO[name][4]
    left = left_on_aten(reports)
    assert not left & (NORM_AND_ACTIVATION | SLICES_AND_PICKS | SCANS), sorted(left)
    if name in IN_PLACE:
        label = IN_PLACE[name]
        groups = {k["group"] for k in reports[0].kernels if k["label"] == label}
        written = [w for w in reports[0].summary["inplace"] if w["group"] in groups]
        assert len(written) == ZOO[name][4][label], reports[0].summary["inplace"]
    for i, (a, e) in enumerate(zip(as_tuple(out), as_tuple(expected))):
        assert_close(a, e, dtype=dtype, name=f"output {i}")


@pytest.mark.parametrize("name", TRAINED)
def test_training_step_matches_eager(name):
    """fp32 forward and backward: the loss's gradients against eager's, each parameter's
    within a thousandth of the largest gradient of the model (fp32 summation orders differ;
    near-zero gradients, such as a query bias's under softmax, are all rounding)."""
    module, args = wrapped(name, torch.float32)
    module.train()
    module.zero_grad(set_to_none=True)
    expected = as_tuple(module(*args))
    loss(expected).backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:       # backward compiles on first use
        out = as_tuple(torch.compile(module, backend="fusion", fullgraph=True)(*args))
        loss(out).backward()
    assert [r.error for r in reports if r.error] == []
    assert {r.kind for r in reports} == {"forward", "backward"}
    forward, backward = fused_labels(reports, "forward"), fused_labels(reports, "backward")
    norms = sum(v for k, v in ZOO[name][4].items() if "norm" in k)
    assert sum(v for k, v in forward.items() if "norm" in k) == TRAINING_NORMS.get(name, norms), \
        forward
    assert sum(r.num_kernels for r in reports if r.kind == "backward") >= norms, backward
    left = left_on_aten(reports)
    assert not left & (NORM_AND_ACTIVATION | SLICES_AND_PICKS | SCANS), sorted(left)
    writes = [w for r in reports for w in r.summary["input_writes"]]
    assert len(writes) == INPUT_WRITES.get(name, 0), writes
    assert "aten.copy_.default" not in [op for r in reports for op in r.aten_ops]
    assert_step_matches(module, out, expected, want)


def assert_step_matches(module, out, expected, want):
    """A training step's fp32 outputs against eager's, and each parameter's gradient against
    ``want`` (eager's) within a thousandth of the largest (benchmarks/zoo_sweep.py too)."""
    for i, (a, e) in enumerate(zip(out, expected)):
        assert_close(a, e, dtype=torch.float32, name=f"output {i}")
    scale = max(g.abs().max().item() for g in want.values())
    got = dict(module.named_parameters())
    for n, g in want.items():
        assert got[n].grad is not None, f"{n}: no gradient"
        assert_close(got[n].grad, g, atol=1e-3 * scale, rtol=1e-4, name=f"grad of {n}")


@pytest.mark.parametrize("name", DROPOUT)
def test_training_with_dropout_compiles_both_graphs(name):
    """Fine-tuning as users run it, dropout on (its masks and scaling in the graphs, read
    through getitem): both graphs compile, the forward fuses the model's norms, nothing of a
    norm or activation stays on ATen, and the gradients are finite. Random masks differ from eager's, so values are not compared."""
    module, args = wrapped(name, torch.float32, dropout=True)
    module.train()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = as_tuple(torch.compile(module, backend="fusion", fullgraph=True)(*args))
        loss(out).backward()
    assert [r.error for r in reports if r.error] == []
    assert sorted(r.kind for r in reports) == ["backward", "forward"]
    norms = sum(v for k, v in ZOO[name][4].items() if "norm" in k)
    forward = fused_labels(reports, "forward")
    # every norm fused; at least as many kernels (Swin's embedding dropout parts two
    # LayerNorms that share a kernel without it)
    assert sum(v for k, v in forward.items() if "norm" in k) >= norms, forward
    assert not left_on_aten(reports) & NORM_AND_ACTIVATION
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name, lm, dtype", GENERATED,
                         ids=[f"{n}-{str(d)[6:]}" for n, _, d in GENERATED])
def test_greedy_generation_with_kv_cache_matches_eager(name, lm, dtype):
    """Six greedy steps with a KV cache: a graph for the prompt, then shapes that grow each
    step (a dynamic-shape recompile); the tokens and every step's scores as eager's."""
    model = build(name, dtype, lm).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 256, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                          # left padding
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(**options)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="fusion")
        with fusion_compiler.capture_compiles() as reports:
            got = model.generate(**options)
    assert [r.error for r in reports if r.error] == []
    # the prompt, the first step, then one graph with dynamic shapes for every later step
    assert 2 <= len(reports) <= 3 and all(r.num_kernels > 0 for r in reports), len(reports)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, e) in enumerate(zip(got.scores, expected.scores)):
        assert_close(a, e, dtype=dtype, name=f"scores of step {step}")
