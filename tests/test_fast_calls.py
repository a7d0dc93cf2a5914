"""The ATen ops left in a compiled graph are called through torch's direct bindings
(passes/fast_calls.py); reports still name them as ATen ops, and the numbers do not change."""
import pytest
import torch

import fusion_compiler.backend as backend
from fusion_compiler.passes import fast_calls
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten


def _compiled_graph(monkeypatch, fn, args):
    """(outputs, reports, the one compiled graph module) of ``fn`` compiled for inference."""
    graphs = []
    compile_aten_graph = backend.compile_aten_graph
    monkeypatch.setattr(backend, "compile_aten_graph", lambda gm, kind, config, **kw: graphs.append(
        compile_aten_graph(gm, kind, config, **kw)) or graphs[-1])
    with torch.no_grad():
        out, reports = compile_and_run(fn, args)
    (gm,) = graphs
    return out, reports, gm


def model(x, w, b, y):
    h = torch.addmm(b, x.view(-1, x.shape[-1]), w.t())            # addmm, view, t
    h = (h.relu() * 2).view(x.shape[0], x.shape[1], -1)           # one fused kernel
    s = torch.bmm(h, h.transpose(1, 2).contiguous())              # bmm, transpose, clone
    return s.permute(0, 2, 1).unsqueeze(0) + y                    # permute, unsqueeze


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_over_aten_ops_use_direct_bindings(monkeypatch, device, dtype):
    x = torch.randn(3, 5, 7, device=device, dtype=dtype)
    w = torch.randn(9, 7, device=device, dtype=dtype)
    b = torch.randn(9, device=device, dtype=dtype)
    y = torch.randn(1, 3, 5, 5, device=device, dtype=dtype)
    out, reports, gm = _compiled_graph(monkeypatch, model, (x, w, b, y))
    with torch.no_grad():
        expected = model(x, w, b, y)
    assert_close(out, expected, dtype=dtype)
    assert kernel_count(reports) >= 1
    names = leftover_aten(reports)
    assert {"aten.addmm.default", "aten.bmm.default"} <= set(names), names
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {torch._C._nn.linear, torch.bmm} <= targets      # addmm of w.t(): one linear call
    assert torch.addmm not in targets and torch.t not in targets
    assert not targets & set(fast_calls.FAST), "an eligible ATen call was left on its overload"


def projections(x, wq, wk, wv, wo, b, y):
    # three GEMMs of the same view of x; wo's transpose feeds two GEMMs, so it must stay. (No
    # GEMM reads the fused kernel's bf16 output: a one-ulp difference there, over K = 7, could
    # exceed bf16's tolerance while every op is right.)
    h = x.view(-1, x.shape[-1])
    q, k, v = h @ wq.t(), h @ wk.t(), torch.nn.functional.linear(h, wv, b)
    wot = wo.t()
    return q, k, v, (q * k + v).relu(), h @ wot, y @ wot, x.view(-1, x.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_views_are_made_once_and_gemms_of_transposes_are_linear(monkeypatch, device,
                                                                          dtype):
    args = [torch.randn(3, 5, 7, device=device, dtype=dtype)] + [
        torch.randn(7, 7, device=device, dtype=dtype) for _ in range(4)] + [
        torch.randn(7, device=device, dtype=dtype), torch.randn(4, 7, device=device, dtype=dtype)]
    out, reports, gm = _compiled_graph(monkeypatch, projections, args)
    with torch.no_grad():
        expected = projections(*args)
    for i, (a, e) in enumerate(zip(out, expected)):
        assert_close(a, e, dtype=dtype, name=f"output {i}")
    assert kernel_count(reports) >= 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    linear = [n for n in calls if n.target is torch._C._nn.linear]
    assert len(linear) == 3, gm.code                    # q, k, and v with its bias
    # the three projections read one view of x (the graph output keeps its own)
    assert len({n.args[0] for n in linear}) == 1, gm.code
    # wo's transpose has two users: its GEMMs keep it
    assert len([n for n in calls if n.target is torch.mm]) == 2, gm.code


def test_a_view_that_is_a_graph_output_is_not_merged():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.view.default, (x, [6]))
    b = g.call_function(torch.ops.aten.view.default, (x, [6]))
    c = g.call_function(torch.ops.aten.view.default, (x, [6]))
    g.output((a, g.call_function(torch.ops.aten.add.Tensor, (b, c))))
    gm = torch.fx.GraphModule({}, g)
    fast_calls.run(gm)
    gm.recompile()      # the pass rewrites the graph; the caller compiles its code
    views = [n for n in gm.graph.nodes if n.target is torch.Tensor.view]
    assert len(views) == 2          # b and c merged; a, an output, kept
    x = torch.randn(2, 3)
    out, total = gm(x)
    assert torch.equal(out, x.view(6)) and torch.equal(total, 2 * x.view(6))


def test_calls_with_other_keywords_keep_their_overload():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    e = g.call_function(torch.ops.aten.expand.default, (x, [2, 3]), {"implicit": True})
    v = g.call_function(torch.ops.aten.view.default, (x, [3]))
    g.output((e, v))
    gm = torch.fx.GraphModule({}, g)
    assert fast_calls.run(gm) == 1
    gm.recompile()
    assert e.target is torch.ops.aten.expand.default and v.target is torch.Tensor.view
    x = torch.randn(1, 3)
    expanded, viewed = gm(x)
    assert torch.equal(expanded, x.expand(2, 3)) and torch.equal(viewed, x.view(3))


def _view_targets():
    """The view ops as a compiled graph calls them: ATen overloads, or their direct bindings."""
    return set(fast_calls.CHAIN_VIEWS) | {fast_calls.FAST[op][0] for op in fast_calls.FAST
                                          if op in fast_calls.CHAIN_VIEWS}


def _view_chains_left(gm):
    """Views whose input is itself a view, outside the chains that end in graph outputs."""
    views = _view_targets()
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    kept = set()
    todo = list(output.all_input_nodes)
    while todo:                             # the chains that end in outputs
        n = todo.pop()
        if n.op == "call_function" and n.target in views:
            kept.add(n)
            todo.append(n.args[0])
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in views
            and n not in kept and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].op == "call_function" and n.args[0].target in views]


def attention_block(x, w_qkv, b_qkv, w_o, y):
    """GPT-2's attention layout: one GEMM for q, k and v, split and reshaped into heads, SDPA,
    heads merged back, a GEMM; then a residual add (fused)."""
    bsz, seq, dim = x.shape
    qkv = torch.addmm(b_qkv, x.view(-1, dim), w_qkv).view(bsz, seq, 3 * dim)
    q, k, v = qkv.split(dim, dim=2)
    heads = lambda t: t.view(bsz, seq, 4, dim // 4).permute(0, 2, 1, 3)
    a = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v),
                                                         is_causal=True)
    a = a.permute(0, 2, 1, 3).reshape(bsz, seq, dim).view(-1, dim)
    return (a @ w_o).view(bsz, seq, dim) * 0.5 + y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chains_of_views_are_one_call(monkeypatch, device, dtype):
    """q, k and v's split-and-permute and the merge after attention: each chain is one
    ``_reinterpret_tensor`` call from its root (the GEMM, the attention output); the numbers are
    eager's."""
    # heads of 8: every SDPA kernel takes them (fp32: memory-efficient; bf16: flash or cuDNN),
    # so attention is one ATen call on the GPU as on the CPU
    args = [torch.randn(2, 13, 32, device=device, dtype=dtype),
            torch.randn(32, 96, device=device, dtype=dtype) * 0.2,
            torch.randn(96, device=device, dtype=dtype),
            torch.randn(32, 32, device=device, dtype=dtype) * 0.2,
            torch.randn(2, 13, 32, device=device, dtype=dtype)]
    out, reports, gm = _compiled_graph(monkeypatch, attention_block, args)
    with torch.no_grad():
        assert_close(out, attention_block(*args), dtype=dtype)
    assert kernel_count(reports) == 1
    calls = [n for n in gm.graph.nodes if n.target is fast_calls.REINTERPRET]
    assert len(calls) >= 4, gm.code                 # q, k, v and the merged heads
    assert not _view_chains_left(gm), gm.code


def test_view_chains_from_an_offset_input_and_to_an_output(monkeypatch, device):
    """A chain's offset is taken relative to its root's own (an input that is a slice of a
    larger tensor); a chain that ends in a graph output keeps its views."""
    def fn(x, w):
        y = x[1:].view(4, 6)[:, 1:].t()             # read by a GEMM: a chain of views
        return torch.mm(y, w), x.view(5, 5).t().unsqueeze(0)

    base = torch.randn(30, device=device)
    x = base[5:]                                    # storage offset 5
    w = torch.randn(4, 3, device=device)
    out, _, gm = _compiled_graph(monkeypatch, fn, (x, w))
    expected = fn(x, w)
    for a, e in zip(out, expected):
        assert_close(a, e, atol=1e-5, rtol=1e-5)
    assert out[1]._base is not None and out[1].stride() == expected[1].stride()
    assert [n for n in gm.graph.nodes if n.target is fast_calls.REINTERPRET], gm.code


def test_chains_from_untrusted_roots_are_left_alone():
    """The root's strides are trusted only for inputs, kernels' outputs, GEMMs, embeddings and
    attention; a chain from another op's result (here cumsum) keeps its views."""
    aten = torch.ops.aten
    x = torch.randn(4, 6)
    g = torch.fx.Graph()
    p = g.placeholder("x")
    with torch._subclasses.FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        c = g.call_function(aten.cumsum.default, (p, 1))
        v = g.call_function(aten.view.default, (c, [24]))
        u = g.call_function(aten.unsqueeze.default, (v, 0))
        s = g.call_function(aten.mul.Tensor, (u, 2.0))
        p.meta["val"] = fx
        c.meta["val"] = aten.cumsum.default(fx, 1)
        v.meta["val"] = aten.view.default(c.meta["val"], [24])
        u.meta["val"] = aten.unsqueeze.default(v.meta["val"], 0)
    g.output((s,))
    gm = torch.fx.GraphModule({}, g)
    fast_calls.run(gm)
    gm.recompile()      # the pass rewrites the graph; the caller compiles its code
    assert not [n for n in gm.graph.nodes if n.target is fast_calls.REINTERPRET]
    assert torch.equal(gm(x)[0], (x.cumsum(1).view(24).unsqueeze(0) * 2.0))


def test_a_view_of_a_collapsed_chain_is_collapsed_too(monkeypatch, device):
    """A chain's end read both by an op and by another view: the end becomes one call, and the
    view after it one call from there (its traced layout is certain too)."""
    def fn(x):
        h = x[1:].view(6, 4)
        return torch.mm(h.t(), h) * 2.0

    x = torch.randn(25, device=device)
    out, reports, gm = _compiled_graph(monkeypatch, fn, (x,))
    assert_close(out, fn(x), atol=1e-5, rtol=1e-5)
    assert kernel_count(reports) == 1
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(fast_calls.REINTERPRET) == 2, gm.code        # h, and h.t() from it
    assert not set(calls) & _view_targets(), gm.code


def test_an_allocation_of_a_value_with_no_elements_is_a_direct_call(monkeypatch, device):
    """passes/empty_values' allocation runs through torch.empty_strided, not its overload
    (6.0 against 1.2 us of host time on the development CPU), with eager's layout."""
    x = torch.randn(0, 6, 5, device=device, dtype=torch.bfloat16)

    def fn(a):
        return torch.softmax(a.float() * 0.125, dim=-1).to(a.dtype)
    out, reports, gm = _compiled_graph(monkeypatch, fn, (x,))
    want = fn(x)
    assert (out.shape, out.stride(), out.dtype, out.device) == (want.shape, want.stride(),
                                                                 want.dtype, want.device)
    assert kernel_count(reports) == 0 and leftover_aten(reports) == ["aten.empty_strided.default"]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.empty_strided]


def test_a_convolution_is_a_direct_call(monkeypatch, device):
    """ConvNeXt's convolutions stay ATen ops: called through torch.convolution, the same
    ATen op without the overload's Python dispatch; the result is eager's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 9, 7, generator=g).to(device)
    w, b = torch.randn(6, 1, 3, 3, generator=g).to(device), torch.randn(6, generator=g).to(device)

    def fn(x, w, b):
        return torch.nn.functional.conv2d(x, w, b, padding=1, groups=6).relu()
    out, reports, gm = _compiled_graph(monkeypatch, fn, (x, w, b))
    assert_close(out, fn(x, w, b), dtype=torch.float32)
    assert "aten.convolution.default" in leftover_aten(reports)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.convolution in targets and torch.ops.aten.convolution.default not in targets
