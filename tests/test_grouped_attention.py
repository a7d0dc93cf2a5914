"""Attention on repeated key/value heads (grouped-query attention's repeat_kv) reads the grouped
heads instead (passes/grouped_attention.py), where the attention kernel takes them; every other
repeat, and every attention with a mask, dropout or a backward, keeps the graph's copies.

Each test reads which attention op the compiled graph calls and how many key heads it is given
(the graph the passes leave, ``measure.recording``), and checks the values and the kernel count
against eager."""
import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_CUDA
from fusion_compiler.measure import recording
from fusion_compiler.passes.grouped_attention import GROUPED_KERNELS
from helpers import assert_close, compile_and_run, kernel_count
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16]
# Kernels: one for the pointwise ops on q, k and v before the attention (a multi-part kernel of
# q's and k/v's shapes), one for the scaling after it
KERNELS = 2


def attention_calls(rec):
    """(op, heads of its key) of each attention op in the recorded graphs, after the passes."""
    return [(n.target, n.args[1].meta["val"].shape[1]) for t in rec.targets
            for n in t.gm.graph.nodes if "scaled_dot_product" in str(n.target)]


def repeat_kv(x, rep, form):
    """x's heads each repeated ``rep`` times: head h of the result is x's head h // rep."""
    b, n, s, d = x.shape
    if form == "hf":            # Hugging Face's repeat_kv
        return x[:, :, None, :, :].expand(b, n, rep, s, d).reshape(b, n * rep, s, d)
    if form == "interleave":    # gpt-fast's
        return x.repeat_interleave(rep, dim=1)
    return x.unsqueeze(2).expand(b, n, rep, s, d).reshape(b, n * rep, s, d)


def tile_kv(x, rep):
    """x's heads tiled ``rep`` times: head h is x's head h % n (not what GQA means)."""
    b, n, s, d = x.shape
    return x[:, None].expand(b, rep, n, s, d).reshape(b, rep * n, s, d)


def gqa(q, k, v, rep=3, form="hf", causal=True):
    k, v = repeat_kv(k * 0.5, rep, form), repeat_kv(v + 1.0, rep, form)
    return F.scaled_dot_product_attention(q * 2.0, k, v, is_causal=causal) * 3.0


def run(f, args):
    """(outputs, reports, [(attention op, key heads)]) of ``f`` compiled, on ``args``."""
    with torch.no_grad(), recording() as rec:
        out, reports = compile_and_run(f, args)
    return out, reports, attention_calls(rec)


def qkv(dtype, device, b=2, heads=6, kv_heads=2, s=9, d=16):
    return (randn((b, heads, s, d), dtype, device), randn((b, kv_heads, s, d), dtype, device),
            randn((b, kv_heads, s, d), dtype, device))


def expect_grouped(calls, kv_heads, heads):
    """Each call got the grouped heads where its kernel takes them, else the repeated ones."""
    assert calls
    for op, got in calls:
        assert got == (kv_heads if op in GROUPED_KERNELS else heads), (op, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["hf", "unsqueeze", "interleave"])
@pytest.mark.parametrize("heads, kv_heads, s", [(6, 2, 9), (4, 1, 41), (8, 4, 1)],
                         ids=["gqa", "mqa", "one-token"])
def test_attention_reads_grouped_heads(dtype, device, form, heads, kv_heads, s):
    """With one key/value head (MQA) the expand-and-reshape repeat is a view of stride 0, no
    copy: nothing to drop, and it is left as it is; repeat_interleave copies even then."""
    q, k, v = qkv(dtype, device, heads=heads, kv_heads=kv_heads, s=s)
    rep = heads // kv_heads
    f = lambda q, k, v: gqa(q, k, v, rep, form)       # noqa: E731
    out, reports, calls = run(f, (q, k, v))
    expect_grouped(calls, kv_heads if kv_heads > 1 or form == "interleave" else heads, heads)
    if device == "cpu" or dtype == torch.bfloat16:      # CPU's flash, and cuDNN / Flash
        assert all(op in GROUPED_KERNELS for op, _ in calls)
    assert kernel_count(reports) == KERNELS
    with torch.no_grad():
        assert_close(out, f(q, k, v), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_heads_give_eagers_values_without_causal_mask(dtype, device):
    q, k, v = qkv(dtype, device, b=3, heads=9, kv_heads=3, s=33, d=8)
    f = lambda q, k, v: gqa(q, k, v, 3, causal=False)     # noqa: E731
    out, reports, calls = run(f, (q, k, v))
    expect_grouped(calls, 3, 9)
    assert kernel_count(reports) == KERNELS
    with torch.no_grad():
        assert_close(out, f(q, k, v), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiled_heads_are_not_grouped_heads(dtype, device):
    """Head h of a tile is head h % n, not h // rep: with as many repeats as heads the two
    repeats have one shape, and only the grouping may be read as grouped heads."""
    q, k, v = qkv(dtype, device, heads=4, kv_heads=2)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, tile_kv(k * 0.5, 2), tile_kv(v + 1.0, 2),
                                              is_causal=True) * 3.0
    out, reports, calls = run(f, (q, k, v))
    assert [got for _, got in calls] == [4]
    assert kernel_count(reports) == KERNELS
    with torch.no_grad():
        assert_close(out, f(q, k, v), dtype=dtype)


def _masked(q, k, v):
    mask = (q[..., :1] > 0) & (k.new_ones(1, 1, 1, q.shape[2]) > 0)
    return F.scaled_dot_product_attention(q, repeat_kv(k, 3, "hf"), repeat_kv(v, 3, "hf"),
                                          attn_mask=mask) * 3.0


def _repeat_also_returned(q, k, v):
    k4 = repeat_kv(k * 0.5, 3, "hf")
    return F.scaled_dot_product_attention(q, k4, repeat_kv(v, 3, "hf")) * 3.0, k4 + 1.0


def _only_key_repeated(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k * 0.5, 3, "hf"), v + 1.0) * 3.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# the repeat returned: its copy, v's, and k4 + 1 (in the attention's [b, h, s, d], a view of
# the repeat's [b, kv, 3, s, d]) are one kernel (test_pointwise_layouts)
@pytest.mark.parametrize("f, kernels", [(_masked, 2), (_repeat_also_returned, 2),
                                        (_only_key_repeated, 2)],
                         ids=["mask", "repeat-read-elsewhere", "value-not-repeated"])
def test_repeats_it_cannot_drop_are_kept(dtype, device, f, kernels):
    q, k, v = qkv(dtype, device)
    v = randn((2, 6, 9, 16), dtype, device) if f is _only_key_repeated else v
    out, reports, calls = run(f, (q, k, v))
    assert [got for _, got in calls] == [6]
    assert kernel_count(reports) == kernels
    with torch.no_grad():
        expected = f(q, k, v)
    for a, e in zip(out if isinstance(out, tuple) else (out,),
                    expected if isinstance(expected, tuple) else (expected,)):
        assert_close(a, e, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_repeat_as_key_and_value(dtype, device):
    q, k, _ = qkv(dtype, device)

    def f(q, k):
        kv = repeat_kv(k * 0.5, 3, "hf")
        return F.scaled_dot_product_attention(q, kv, kv) * 3.0
    out, reports, calls = run(f, (q, k))
    expect_grouped(calls, 2, 6)
    assert kernel_count(reports) == KERNELS
    with torch.no_grad():
        assert_close(out, f(q, k), dtype=dtype)


def test_the_option_turns_it_off(device):
    q, k, v = qkv(torch.bfloat16, device)
    torch._dynamo.reset()
    with torch.no_grad(), recording() as rec:
        out = torch.compile(gqa, backend="fusion", options={"grouped_attention": False})(q, k, v)
    assert [got for _, got in attention_calls(rec)] == [6]
    with torch.no_grad():
        assert_close(out, gqa(q, k, v), dtype=torch.bfloat16)


def test_training_keeps_the_repeats_and_gradients_match(device):
    """A training forward saves the attention's log-sum-exp for a backward traced on the
    repeated heads: the repeats stay, and the gradients are eager's."""
    q, k, v = (t.float().requires_grad_() for t in qkv(torch.float32, device))
    torch._dynamo.reset()
    with recording() as rec:
        out = torch.compile(gqa, backend="fusion")(q, k, v)
        out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    gqa(q, k, v).square().sum().backward()
    calls = attention_calls(rec)
    assert calls and all(got == 6 for _, got in calls)
    for g, t in zip(grads, (q, k, v)):
        assert_close(g, t.grad, dtype=torch.float32)


@pytest.mark.skipif(not HAS_CUDA, reason="cuDNN and Flash attention need a CUDA GPU")
@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION"])
def test_each_gpu_kernel_takes_grouped_heads(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = qkv(torch.bfloat16, "cuda", b=2, heads=16, kv_heads=4, s=129, d=64)
    f = lambda q, k, v: gqa(q, k, v, 4)       # noqa: E731
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        out, reports, calls = run(f, (q, k, v))
        with torch.no_grad():
            expected = f(q, k, v)
    assert [got for _, got in calls] == [4] and all(op in GROUPED_KERNELS for op, _ in calls)
    assert kernel_count(reports) == KERNELS
    assert_close(out, expected, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_grouped_heads_are_copied_contiguous(dtype, device):
    """k and v as a projection leaves them, [b, s, heads, d] seen as [b, heads, s, d]: the
    attention gets contiguous copies of the grouped heads (the layout the repeat's copy had)."""
    q = randn((2, 6, 11, 16), dtype, device)
    k, v = randn((2, 11, 2, 16), dtype, device), randn((2, 11, 2, 16), dtype, device)

    def f(q, k, v):
        k, v = repeat_kv(k.transpose(1, 2), 3, "hf"), repeat_kv(v.transpose(1, 2), 3, "hf")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad(), recording() as rec:
        out, reports = compile_and_run(f, (q, k, v))
    nodes = [n for t in rec.targets for n in t.gm.graph.nodes
             if "scaled_dot_product" in str(n.target)]
    assert len(nodes) == 1
    grouped = nodes[0].target in GROUPED_KERNELS
    for arg in nodes[0].args[1:3]:
        val = arg.meta["val"]
        assert val.shape[1] == (2 if grouped else 6) and val.is_contiguous()
    assert kernel_count(reports) == 1           # the two copies, one kernel
    with torch.no_grad():
        assert_close(out, f(q, k, v), dtype=dtype)


def test_symbolic_sizes_keep_the_repeats(device):
    """With symbolic sizes the repeat's shape cannot be compared without guards: left alone."""
    q, k, v = qkv(torch.float32, device, s=13)
    with torch.no_grad(), recording() as rec:
        out, reports = compile_and_run(gqa, (q, k, v), dynamic=True)
    assert [got for _, got in attention_calls(rec)] == [6]
    assert kernel_count(reports) == KERNELS
    with torch.no_grad():
        assert_close(out, gqa(q, k, v), dtype=torch.float32)
