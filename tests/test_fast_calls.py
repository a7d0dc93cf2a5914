"""The ATen ops left in a compiled graph are called through torch's direct bindings
(passes/fast_calls.py); reports still name them as ATen ops, and the numbers do not change."""
import pytest
import torch

import fusion_compiler.backend as backend
from fusion_compiler.passes import fast_calls
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten


def model(x, w, b, y):
    h = torch.addmm(b, x.view(-1, x.shape[-1]), w.t())            # addmm, view, t
    h = (h.relu() * 2).view(x.shape[0], x.shape[1], -1)           # one fused kernel
    s = torch.bmm(h, h.transpose(1, 2).contiguous())              # bmm, transpose, clone
    return s.permute(0, 2, 1).unsqueeze(0) + y                    # permute, unsqueeze


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_over_aten_ops_use_direct_bindings(monkeypatch, device, dtype):
    graphs = []
    compile_aten_graph = backend.compile_aten_graph
    monkeypatch.setattr(backend, "compile_aten_graph",
                        lambda gm, kind, config: graphs.append(compile_aten_graph(gm, kind, config)) or graphs[-1])
    x = torch.randn(3, 5, 7, device=device, dtype=dtype)
    w = torch.randn(9, 7, device=device, dtype=dtype)
    b = torch.randn(9, device=device, dtype=dtype)
    y = torch.randn(1, 3, 5, 5, device=device, dtype=dtype)
    with torch.no_grad():
        out, reports = compile_and_run(model, (x, w, b, y))
        expected = model(x, w, b, y)
    assert_close(out, expected, dtype=dtype)
    assert kernel_count(reports) >= 1
    names = leftover_aten(reports)
    assert {"aten.addmm.default", "aten.bmm.default"} <= set(names), names
    (gm,) = graphs
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {torch.addmm, torch.bmm} <= targets
    assert not targets & set(fast_calls.FAST), "an eligible ATen call was left on its overload"


def test_calls_with_other_keywords_keep_their_overload():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    e = g.call_function(torch.ops.aten.expand.default, (x, [2, 3]), {"implicit": True})
    v = g.call_function(torch.ops.aten.view.default, (x, [3]))
    g.output((e, v))
    gm = torch.fx.GraphModule({}, g)
    assert fast_calls.run(gm) == 1
    assert e.target is torch.ops.aten.expand.default and v.target is torch.Tensor.view
    x = torch.randn(1, 3)
    expanded, viewed = gm(x)
    assert torch.equal(expanded, x.expand(2, 3)) and torch.equal(viewed, x.view(3))
