"""examples/gpt2.py, bert.py and fp8_mlp.py: the dump of each, and compiled against eager.

Tiny configs (2 layers, hidden 64) so each test runs in seconds in Triton's interpreter. The
dump tests run the CLI as it runs on a CPU machine: analysis only, no kernels launched. GPT-2
and BERT need transformers (the `examples` extra); their tests skip without it.
"""
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import fusion_compiler

from fusion_compiler.cli import main as cli_main
from helpers import assert_close, compile_and_run, leftover_aten

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAYERS = 2          # the tiny configs' default

def load_example(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dump_graph(capsys, monkeypatch, name):
    """The one graph of `fusion-compiler dump examples/NAME.py --format json`, analysis only."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")     # read per compile: plan, launch nothing
    rc = cli_main(["dump", str(EXAMPLES / f"{name}.py"), "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    (graph,) = json.loads(out)["graphs"]
    assert graph["kind"] == "inference"
    return graph


def labels(groups):
    return Counter(g["label"] for g in groups)


def aten_op_names(reports):
    """'aten.native_layer_norm.default' -> 'native_layer_norm', for every op left on ATen."""
    return {op.split(".")[1] for op in leftover_aten(reports)}


# The CPU comparisons run the kernels in Triton's interpreter; on a GPU machine (no
# interpreter) the gpu-marked tests compare on the GPU instead.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="interpreter test; the gpu-marked one runs here")


def compiled_vs_eager(make, dtype, device, **sizes):
    torch.manual_seed(0)
    model, inputs = make(device=device, dtype=dtype, **sizes)
    with torch.no_grad():
        expected = model(*inputs)
        out, reports = compile_and_run(model, inputs)
    assert not [r.error for r in reports if r.error]
    assert_close(out, expected, dtype=dtype)
    return reports


# Ops of the norms and activations; none may be left on ATen.
NORM_AND_ACTIVATION = {"mean", "rsqrt", "var_mean", "native_layer_norm", "erf", "tanh", "pow",
                       "sigmoid", "amax", "clamp"}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_without_transformers_the_factory_says_what_to_install(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "transformers", None)     # import transformers fails
    with pytest.raises(ImportError, match=r"pip install 'fusion-compiler\[examples\]'"):
        load_example(name).make_model_and_inputs()


# --------------------------------------------------------------------------- GPT-2

# Per layer: LayerNorm before attention and before the MLP, each with the residual add before
# it, and the tanh GELU after c_fc; per model: the final LayerNorm. The other groups are
# transformers' mask and position code, which varies between its versions.
GPT2_LABELS = {"layernorm": 2 * LAYERS + 1, "gelu": LAYERS}


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    return load_example("gpt2")


def test_gpt2_dump_fuses_layernorms_and_gelu(capsys, monkeypatch, gpt2):
    graph = dump_graph(capsys, monkeypatch, "gpt2")
    assert all(g["kernel"] for g in graph["groups"])
    assert labels(graph["groups"]) >= Counter(GPT2_LABELS), labels(graph["groups"])
    on_aten = {a["op"] for a in graph["aten_ops"]}
    assert "addmm" in on_aten and not on_aten & NORM_AND_ACTIVATION
    assert "embedding" not in on_aten       # gathered by the first LayerNorm's kernel


@INTERPRETER_ONLY
def test_gpt2_matches_eager(gpt2):
    reports = compiled_vs_eager(gpt2.make_model_and_inputs, torch.float32, "cpu", seq=13)
    assert labels(reports[0].kernels) >= Counter(GPT2_LABELS)
    assert not aten_op_names(reports) & NORM_AND_ACTIVATION


@INTERPRETER_ONLY
def test_gpt2_training_step_compiles_both_graphs_and_matches_eager(gpt2):
    """Forward and backward, fp32: neither graph falls back to ATen, with dropout (its mask
    an output read through getitem: a labelling bug once sent the forward graph to ATen
    silently) or without; the forward fuses GPT-2's norms and GELUs, and without dropout the
    gradients are eager's."""
    torch.manual_seed(0)
    model, (ids,) = gpt2.make_model_and_inputs(seq=13)
    model.train()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        torch.compile(model, backend="fusion")(ids).float().pow(2).mean().backward()
    assert [r.error for r in reports if r.error] == []
    assert sorted(r.kind for r in reports) == ["backward", "forward"]
    forward = next(r for r in reports if r.kind == "forward")
    assert labels(forward.kernels) >= Counter(GPT2_LABELS)

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.zero_grad(set_to_none=True)
    model(ids).float().pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        torch.compile(model, backend="fusion")(ids).float().pow(2).mean().backward()
    assert [r.error for r in reports if r.error] == []
    scale = max(g.abs().max().item() for g in want.values())
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n], atol=1e-4 * scale, rtol=1e-4, name=f"grad of {n}")


@pytest.mark.gpu
def test_gpt2_matches_eager_on_gpu_bf16(gpt2):
    reports = compiled_vs_eager(gpt2.make_model_and_inputs, torch.bfloat16, "cuda")
    assert labels(reports[0].kernels) >= Counter(GPT2_LABELS)


# --------------------------------------------------------------------------- BERT

# Per layer: residual add + LayerNorm after attention and after the MLP, exact GELU after the
# up projection; per model: the embeddings' sum + LayerNorm. The other groups are transformers'
# mask code, which varies between its versions; and where the attention is traced in its math
# form (torch 2.11 on CUDA with transformers 5.17: bmm, masked softmax, bmm), one softmax per layer.
BERT_LABELS = {"layernorm": 2 * LAYERS + 1, "gelu": LAYERS}


def assert_bert_groups(got: Counter, on_aten: set):
    assert {k: got[k] for k in BERT_LABELS} == BERT_LABELS, got
    assert got["softmax"] == (LAYERS if "bmm" in on_aten else 0), (got, sorted(on_aten))
    assert not on_aten & NORM_AND_ACTIVATION


@pytest.fixture(scope="module")
def bert():
    pytest.importorskip("transformers")
    return load_example("bert")


def test_bert_dump_fuses_layernorms_and_gelu(capsys, monkeypatch, bert):
    graph = dump_graph(capsys, monkeypatch, "bert")
    assert all(g["kernel"] for g in graph["groups"])
    on_aten = {a["op"] for a in graph["aten_ops"]}
    assert "addmm" in on_aten and "embedding" not in on_aten    # the three: in one kernel
    assert_bert_groups(labels(graph["groups"]), on_aten)
    (first,) = [g for g in graph["groups"] if g["ops"].count("embedding") == 3]
    assert "mean.dim" in first["ops"]       # with their sum's LayerNorm


@INTERPRETER_ONLY
def test_bert_matches_eager(bert):
    reports = compiled_vs_eager(bert.make_model_and_inputs, torch.float32, "cpu", seq=13)
    assert_bert_groups(labels(reports[0].kernels), aten_op_names(reports))


@pytest.mark.gpu
def test_bert_matches_eager_on_gpu_bf16(bert):
    reports = compiled_vs_eager(bert.make_model_and_inputs, torch.bfloat16, "cuda")
    assert_bert_groups(labels(reports[0].kernels), aten_op_names(reports))


# --------------------------------------------------------------------------- FP8 MLP

# Per block: RMSNorm + per-token quant of its input (from the second block on, with the residual
# add of the block before), SwiGLU + quant; per model: the last residual add. Only the FP8 GEMMs
# stay on ATen.
FP8_LABELS = {"rmsnorm+quant": LAYERS, "swiglu+quant": LAYERS, "residual": 1}


@pytest.fixture(scope="module")
def fp8_mlp():
    return load_example("fp8_mlp")


def cpu_scaled_mm_takes_row_scales():
    """torch 2.13's CPU _scaled_mm takes per-row/per-column scales; 2.11's takes per-tensor only
    (an internal assert), so the example model cannot run on the CPU there."""
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


CPU_ROWWISE_FP8 = pytest.mark.skipif(
    not cpu_scaled_mm_takes_row_scales(),
    reason=f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")


@CPU_ROWWISE_FP8
def test_fp8_mlp_dump_fuses_norm_quant_and_swiglu_quant(capsys, monkeypatch, fp8_mlp):
    graph = dump_graph(capsys, monkeypatch, "fp8_mlp")
    assert all(g["kernel"] for g in graph["groups"])
    assert labels(graph["groups"]) == Counter(FP8_LABELS)
    assert [a["op"] for a in graph["aten_ops"]] == ["_scaled_mm"] * 2 * LAYERS


@INTERPRETER_ONLY
@CPU_ROWWISE_FP8
def test_fp8_mlp_matches_eager(fp8_mlp):
    """_scaled_mm runs on the CPU in torch 2.13, so the whole model runs here; 3 x 7 tokens."""
    reports = compiled_vs_eager(fp8_mlp.make_model_and_inputs, torch.bfloat16, "cpu",
                                batch=3, seq=7)
    assert labels(reports[0].kernels) == Counter(FP8_LABELS)
    assert aten_op_names(reports) == {"_scaled_mm"}


@pytest.mark.gpu
def test_fp8_mlp_matches_eager_on_gpu_bf16(fp8_mlp):
    reports = compiled_vs_eager(fp8_mlp.make_model_and_inputs, torch.bfloat16, "cuda")
    assert labels(reports[0].kernels) == Counter(FP8_LABELS)
    assert aten_op_names(reports) == {"_scaled_mm"}
