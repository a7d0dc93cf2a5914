"""passes/sdpa_mask.py: an SDPA mask whose last dimension is not at stride 1 (Hugging Face BERT's,
compiled) is copied to contiguous memory once, so SDPA's fused CUDA kernels take it; query rows
with every key masked still give eager's (the math form's) zeros."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.passes import sdpa_mask
from helpers import TOL, assert_close, compile_and_run, leftover_aten


def two_layers(q, k, v, keep):
    # BERT's compiled mask: a per-query vector expanded over keys, strides (0, q, 1, 0)
    b, _, s, _ = q.shape
    mask = keep[None, None, :, None].expand(b, 1, s, s)
    h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(h, k, v, mask)        # positional mask, same node


def _dynamo_graph(fn, args, devices=None):
    """(Dynamo's graph of ``fn``, compiled ``fn``'s outputs): with ``devices``, the graph went
    through the pass before it ran."""
    graphs = []

    def backend(gm, example_inputs):
        if devices is not None:
            graphs.append(sdpa_mask.run(gm, devices))
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs, out


def _args(dtype=torch.float32, device="cpu", s=7):
    q, k, v = (torch.randn(2, 3, s, 8, dtype=dtype, device=device) for _ in range(3))
    keep = torch.rand(s, device=device) > 0.3
    keep[0], keep[1] = True, False          # row 1: every key masked
    return q, k, v, keep


def test_one_copy_per_distinct_mask_and_same_values():
    args = _args()
    (copied, gm), out = _dynamo_graph(two_layers, args, devices=("cpu",))
    assert copied == 1
    methods = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert methods.count("contiguous") == 1 and methods.count("any") == 1
    (copy,) = [n for n in gm.graph.nodes if n.target == "contiguous"]
    sdpa = [n for n in gm.graph.nodes if n.target in sdpa_mask.SDPA]
    assert len(sdpa) == 2
    assert sdpa[0].kwargs["attn_mask"] is copy and sdpa[1].args[3] is copy
    assert copy.meta["example_value"].stride(-1) == 1
    for node in sdpa:       # each result reaches its users only through the fully-masked guard
        assert [u.target for u in node.users] == [torch.where]
    expected = two_layers(*args)
    assert expected[:, :, 1].abs().max() == 0       # eager's math form: zeros for row 1
    assert_close(out, expected)


def test_float_mask_rows_of_minus_inf():
    q, k, v, keep = _args()
    bias = torch.zeros(7).masked_fill(~keep, float("-inf"))
    fn = lambda q, k, v, bias: F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias[None, None, :, None].expand(2, 1, 7, 7))
    (copied, gm), out = _dynamo_graph(fn, (q, k, v, bias), devices=("cpu",))
    assert copied == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"].count("ne") == 1
    assert_close(out, fn(q, k, v, bias))


def test_leaves_good_masks_and_cpu_alone():
    args = _args()
    (copied, _), _ = _dynamo_graph(two_layers, args, devices=("cuda",))
    assert copied == 0                          # CPU attention takes any mask
    contiguous = lambda q, k, v, keep: F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep[None, None, None, :].expand(2, 1, 7, 7))    # keys at stride 1
    assert _dynamo_graph(contiguous, args, devices=("cpu",))[0][0] == 0
    no_mask = lambda q, k, v, keep: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert _dynamo_graph(no_mask, args, devices=("cpu",))[0][0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [64, 333])
def test_cuda_attention_stays_fused(dtype, s):
    args = _args(dtype, "cuda", s)
    out, reports = compile_and_run(two_layers, args)
    aten = leftover_aten(reports)
    assert any("attention" in op for op in aten), aten
    assert not any(op.startswith(("aten.bmm", "aten._softmax", "aten._safe_softmax"))
                   for op in aten), aten
    assert_close(out, two_layers(*args), atol=TOL[dtype][0] * 2)
