"""The Llama-style decoder of examples/llama.py, compiled with the fusion backend, against eager.

Small sizes (2 layers, hidden 64, seq 16) so that every test runs in seconds in Triton's
interpreter. Kernels run on the GPU when there is one.
"""
import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import fusion_compiler
from fusion_compiler import backend

from conftest import HAS_CUDA
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten

_spec = importlib.util.spec_from_file_location(
    "examples_llama", Path(__file__).resolve().parents[1] / "examples" / "llama.py")
llama = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)

# Generated kernels per decoder layer (fp32 forward), from the report's kernels[i]["label"] and
# ["ops"]. Attention (SDPA) and the GEMMs stay on ATen; everything between them is generated:
#
#   1  row reduction  previous layer's residual add + attn_norm RMSNorm (pow, mean, add, rsqrt,
#                     mul, mul); in layer 0 the RMSNorm of the embedding alone
#   2  multi-part     RoPE of q: q*cos + cat(-q2, q1)*sin (chunk became slices / as_strided
#                     views); as a second part RoPE of k; as a third the contiguous copy of v:
#                     siblings of other shapes (the first two share cos and sin, all three
#                     feed attention), one launch. Where the attention kernel takes grouped
#                     key/value heads (passes/grouped_attention.py: the CPU's flash, cuDNN,
#                     Flash) k and v keep their grouped heads; else (fp32 on a GPU) the parts
#                     write repeat_kv's expanded copies
#   3  row reduction  residual add (attention) + mlp_norm RMSNorm
#   4  pointwise      SwiGLU: silu(gate) * up (sigmoid, mul, mul)
#
# plus one per model: the last residual add + final RMSNorm (a row reduction), so a model of L
# layers has 4 * L + 1 forward kernels.
EXPECTED_PER_LAYER = 4
EXPECTED_PER_MODEL = 1

# ATen ops allowed to stay in the forward graph: GEMMs, attention, embedding.
ALLOWED_ATEN = {"mm", "addmm", "bmm", "baddbmm", "embedding"}
POINTWISE_NAMES = {"add", "mul", "sub", "div", "rsqrt", "pow", "mean", "sum", "exp", "neg", "cat",
                   "_to_copy", "convert_element_type", "sigmoid", "silu", "clone", "where", "amax"}


def make(num_layers=2, dtype=torch.float32, seq=16):
    torch.manual_seed(0)
    return llama.make_model_and_inputs(device="cuda" if HAS_CUDA else "cpu", dtype=dtype,
                                       batch=2, seq=seq, num_layers=num_layers)


def op_name(target: str) -> str:
    """'aten.add.Tensor' -> 'add', 'prims.convert_element_type.default' -> 'convert_element_type'"""
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def ops_left_on_aten(reports, kind):
    """What runs on ATen: report.aten_ops plus, to be safe, the ops of groups that were not
    generated (reports once left those out of aten_ops)."""
    return leftover_aten(reports, kind) + [op for r in reports if r.kind == kind
                                           for ops, _ in r.groups_not_generated for op in ops]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inference_matches_eager(dtype):
    model, inputs = make(dtype=dtype)
    with torch.no_grad():
        expected = model(*inputs)
        out, reports = compile_and_run(model, inputs)
    assert [r.kind for r in reports] == ["inference"]
    assert kernel_count(reports) > 0
    assert_close(out, expected, dtype=dtype, name="logits")


def _train_step(model, inputs, compiled):
    """Logits and the reports of the forward and backward graphs (backward compiles lazily)."""
    fn = torch.compile(model, backend="fusion", fullgraph=True) if compiled else model
    with fusion_compiler.capture_compiles() as reports:
        logits = fn(*inputs)
        logits.float().square().mean().backward()
    return logits, reports


def _training_reports():
    model, inputs = make()
    reference = copy.deepcopy(model)          # identical weights, never compiled
    torch._dynamo.reset()
    logits, reports = _train_step(model, inputs, compiled=True)
    expected, _ = _train_step(reference, inputs, compiled=False)
    return model, reference, logits, expected, reports


def test_training_matches_eager():
    model, reference, logits, expected, reports = _training_reports()
    assert [r.kind for r in reports] == ["forward", "backward"]
    assert all(r.num_kernels > 0 for r in reports)
    assert_close(logits, expected, name="logits")
    params = dict(reference.named_parameters())
    wrong = []
    for name, p in model.named_parameters():
        try:
            # gradients are ~1e-3 here: TOL's fp32 atol (1e-5) would hide wrong ones
            assert_close(p.grad, params[name].grad, atol=1e-6, rtol=1e-4, name=f"{name}.grad")
        except AssertionError as exc:
            wrong.append(str(exc))
    assert not wrong, "\n".join(wrong)


def test_causal_lm_loss_trains_without_scatter():
    """Training through the next-token cross entropy (examples/llama.py's CausalLMLoss): the
    target's one-hot is computed in the softmax backward's kernel (fusion_compiler/slices.py),
    no ``scatter`` or zeros on ATen; the loss and every gradient as eager's."""
    model, (ids,) = make()
    reference = copy.deepcopy(model)
    lm, ref = llama.CausalLMLoss(model), llama.CausalLMLoss(reference)
    labels = ids.clone()
    labels[0, 3] = -100                     # an ignored position
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        loss = torch.compile(lm, backend="fusion")(ids, labels)
        loss.backward()
    want = ref(ids, labels)
    want.backward()
    left = leftover_aten(reports)
    assert not {"aten.scatter.value", "aten.full.default", "aten.scatter.src"} & set(left), left
    assert_close(loss, want, atol=1e-5, rtol=1e-5, name="loss")
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, params[name].grad, atol=1e-6, rtol=1e-4, name=f"{name}.grad")


def test_training_report_lists_every_aten_op():
    """Ops of groups that were not generated run on ATen and must be in report.aten_ops (on the
    CPU the embedding backward leaves bool bitwise_and/bitwise_not ungenerated)."""
    *_, reports = _training_reports()
    backward = [r for r in reports if r.kind == "backward"]
    not_generated = [op for r in backward for ops, _ in r.groups_not_generated for op in ops]
    if not not_generated:
        pytest.skip("every group of the backward graph was generated")
    missing = [op for op in not_generated if op not in leftover_aten(backward)]
    assert not missing, f"ops left on ATen but not in report.aten_ops: {missing}"


def _forward_kernels(num_layers, grad):
    model, inputs = make(num_layers=num_layers)
    if grad:       # training: the forward graph of a forward/backward pair
        _, reports = compile_and_run(model, inputs)
        kind = "forward"
    else:
        with torch.no_grad():
            _, reports = compile_and_run(model, inputs)
        kind = "inference"
    return kernel_count(reports, kind), reports, kind


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_kernels_per_layer(grad):
    k1, reports1, kind = _forward_kernels(1, grad)
    k2, reports2, _ = _forward_kernels(2, grad)
    labels = [k["label"] for k in reports2[0].kernels]
    assert k2 - k1 == EXPECTED_PER_LAYER, labels
    assert k1 == EXPECTED_PER_LAYER + EXPECTED_PER_MODEL, labels
    for reports in (reports1, reports2):
        # what runs on ATen: aten_ops, plus the ops of groups that could not be generated
        left = {op_name(op) for op in ops_left_on_aten(reports, kind)}
        unexpected = {op for op in left
                      if op not in ALLOWED_ATEN and not op.startswith("_scaled_dot_product")}
        assert not unexpected, f"unexpected ops on ATen: {sorted(unexpected)}"
        assert not left & POINTWISE_NAMES
        assert not [g for r in reports for g in r.groups_not_generated]


def test_dynamic_seq_len_reuses_kernels():
    model, (ids,) = make()
    compiled = torch.compile(model, backend="fusion", dynamic=True, fullgraph=True)
    longer = torch.randint(0, model.cfg.vocab_size, (2, 24), device=ids.device)
    with torch.no_grad(), fusion_compiler.capture_compiles() as reports:
        out1 = compiled(ids)
        generated = sum(c.generated for c in backend._caches.values())
        n_reports = len(reports)
        out2 = compiled(longer)
        assert sum(c.generated for c in backend._caches.values()) == generated, \
            "a new kernel source was generated for another sequence length"
        assert len(reports) == n_reports == 1, "recompiled for another sequence length"
        assert kernel_count(reports) == 2 * EXPECTED_PER_LAYER + EXPECTED_PER_MODEL
        assert_close(out1, model(ids), name="logits (seq 16)")
        assert_close(out2, model(longer), name="logits (seq 24)")
