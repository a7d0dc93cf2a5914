"""passes/layout_checks.py: convolution outputs whose real strides are not the traced ones are
copied into the traced layout (a warning once), the others pass through untouched."""
import logging

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fusion_compiler.passes import layout_checks
from helpers import assert_close

aten = torch.ops.aten


def _conv(x, w):
    return aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1) * 2


def _conv_backward(g, x, w):
    gx, gw, _ = aten.convolution_backward.default(g, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                  [0, 0], 1, [True, True, False])
    return gx + 1, gw + 1


def _lie_about(node):
    """The trace says channels-last where the CPU's convolution gives contiguous."""
    val = node.meta["val"]
    node.meta["val"] = val.to(memory_format=torch.channels_last)


def test_a_convolution_whose_layout_is_not_the_traced_one_is_copied(caplog):
    x, w = torch.randn(2, 5, 7, 6), torch.randn(3, 5, 3, 3)
    gm = make_fx(_conv)(x, w)
    conv = next(n for n in gm.graph.nodes if n.target is aten.convolution.default)
    _lie_about(conv)
    assert layout_checks.run(gm) == 1
    gm.recompile()
    checked = next(n for n in gm.graph.nodes if n.target is layout_checks.as_traced)
    assert checked.args[0] is conv and list(conv.users) == [checked]
    layout_checks._warned.clear()
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        for _ in range(2):
            x = torch.randn(2, 5, 7, 6)
            out = gm(x, w)
            assert out.is_contiguous(memory_format=torch.channels_last)     # the copy's layout
            assert_close(out, _conv(x, w))
    said = [r for r in caplog.records if "aten.convolution returned" in r.getMessage()]
    assert len(said) == 1, said


def test_the_backward_gradients_are_checked_each():
    g, x, w = torch.randn(2, 3, 7, 6), torch.randn(2, 5, 7, 6), torch.randn(3, 5, 3, 3)
    gm = make_fx(_conv_backward)(g, x, w)
    items = [n for n in gm.graph.nodes if n.op == "call_function" and n.args
             and getattr(n.args[0], "target", None) is aten.convolution_backward.default]
    _lie_about(items[0])
    assert layout_checks.run(gm) == 2       # the third gradient is not asked for: no reader
    gm.recompile()
    for got, want in zip(gm(g, x, w), _conv_backward(g, x, w)):
        assert_close(got, want)


def test_a_tensor_in_the_traced_layout_is_not_copied():
    t = torch.randn(4, 3, 5, 1)
    assert layout_checks.as_traced(t, t.stride(), "op") is t
    # a size-1 dimension's stride addresses nothing
    other = (t.stride()[0], t.stride()[1], t.stride()[2], 99)
    assert layout_checks.as_traced(t, other, "op") is t
