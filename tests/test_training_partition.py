"""Training graphs: a forward value made from constants alone (a mask of aranges) is made
again in the backward instead of being saved (fusion_compiler/training_partition.py), and a
producer that loads nothing may be computed again in every kernel that reads it
(passes/recompute.py). Kernel counts and every gradient against eager."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fusion_compiler
from fusion_compiler import training_partition
from helpers import assert_close, segment_sum

aten = torch.ops.aten


def decayed(a, x):
    """The scan's intra-chunk decay applied to ``x`` [b, h, n, p]."""
    return (torch.exp(segment_sum(a))[..., None] * x[:, :, None]).sum(-2)


def _train(fn, args, grad):
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion", fullgraph=True)(*args)
        out.backward(grad)
    grads = [a.grad for a in args]
    for a in args:
        a.grad = None
    return out, grads, reports


def _decayed_step(monkeypatch, tmp_path, dtype, n, device):
    """Train ``decayed`` once against eager; (names moved to the backward, shapes the forward
    saved, reports)."""
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path))     # no aot_autograd hit
    moved, saved = [], []
    recompute = training_partition.recompute_constants

    def recording(fw, bw, num_fwd_outputs):
        moved.extend(recompute(fw, bw, num_fwd_outputs))
        outs = list(fw.graph.find_nodes(op="output"))[0].args[0][num_fwd_outputs:]
        saved.extend(tuple(o.meta["val"].shape) for o in outs
                     if isinstance(o.meta.get("val"), torch.Tensor))
        return moved
    monkeypatch.setattr(training_partition, "recompute_constants", recording)
    # negative, as Mamba2's decays are (dt * -exp(A_log)): the segment sums' exps lie in (0, 1]
    a = (-torch.rand(2, 3, n, device=device) - 0.05).to(dtype).requires_grad_()
    x = torch.randn(2, 3, n, 5, device=device, dtype=dtype).requires_grad_()
    g = torch.randn(2, 3, n, 5, device=device, dtype=dtype)
    out, grads, reports = _train(decayed, (a, x), g)
    want = decayed(a, x)
    want.backward(g)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    assert_close(out, want, **tol)
    for got, t in zip(grads, (a, x)):
        assert_close(got, t.grad, name="grad", **tol)
    return moved, saved, reports


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [17, 33])
def test_masks_of_aranges_are_made_in_the_backward(monkeypatch, tmp_path, dtype, n, device):
    """With aot_autograd's own op list, the min-cut partitioner saves Mamba2's segment-sum
    masks (their aranges are read on both sides of a cumsum, which that list calls
    unfusible): the forward wrote them in kernels of their own (4 kernels). Made in the
    backward, the forward's kernels compute them from their index (2) and so do the
    backward's (4; 5 when a kernel that loads nothing could not be computed again in each of
    its readers)."""
    monkeypatch.setattr(training_partition, "RECOMPUTABLE", ())
    moved, saved, reports = _decayed_step(monkeypatch, tmp_path, dtype, n, device)
    assert len(moved) == 2 and all(name.startswith("bitwise_not") for name in moved), moved
    assert (2, 3, n, n) in saved       # the cumsum's output, as the list has it
    assert [(r.kind, r.num_kernels) for r in reports] == [("forward", 2), ("backward", 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [17, 33])
def test_a_cumsum_is_recomputed_rather_than_its_large_output_saved(monkeypatch, tmp_path,
                                                                   dtype, n, device):
    """With cumsum on the list, the forward saves the segment sum's [.., n] input, not its
    [.., n, n] output; the backward computes it again (one kernel more there)."""
    moved, saved, reports = _decayed_step(monkeypatch, tmp_path, dtype, n, device)
    assert len(moved) == 2, moved
    assert not [s for s in saved if s[-2:] == (n, n)], saved
    assert [(r.kind, r.num_kernels) for r in reports] == [("forward", 2), ("backward", 5)]


def _graph(build):
    """A forward GraphModule of one input ``x`` [4] whose nodes carry fake ``val``s, as
    aot_autograd's do."""
    gm = torch.fx.GraphModule(torch.nn.Module(), build(torch.fx.Graph()))
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.empty(4)))
    return gm


def _forward(saved_op):
    """x -> (x + m, m) where m = saved_op(...): one user output, one saved value."""
    def build(g):
        x = g.placeholder("x")
        m = saved_op(g, x)
        y = g.call_function(aten.add.Tensor, (x, m))
        g.output((y, m))
        return g
    return build


def _backward(saved_name):
    g = torch.fx.Graph()
    m = g.placeholder(saved_name)
    t = g.placeholder("tangents_1")
    g.output((g.call_function(aten.mul.Tensor, (t, m)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _arange_mask(g, x):
    r = g.call_function(aten.arange.default, (4,), {"dtype": torch.float32})
    return g.call_function(aten.gt.Scalar, (r, 1.5))


def _from_input(g, x):
    return g.call_function(aten.sin.default, (x,))


def _random(g, x):
    return g.call_function(aten.rand.default, ([4],))


@pytest.mark.parametrize("op, moves", [(_arange_mask, True), (_from_input, False),
                                       (_random, False)], ids=["constant", "input", "random"])
def test_only_values_made_of_pure_ops_on_constants_move(op, moves):
    fw = _graph(_forward(op))
    saved = list(fw.graph.find_nodes(op="output"))[0].args[0][1]
    bw = _backward(saved.name)
    x, t = torch.randn(4), torch.randn(4)
    want = bw(fw(x)[1], t)
    moved = training_partition.recompute_constants(fw, bw, num_fwd_outputs=1)
    assert moved == ([saved.name] if moves else [])
    outs = fw(x)
    assert len(outs) == (1 if moves else 2)
    if moves:
        assert [n.op for n in bw.graph.nodes].count("placeholder") == 1
        assert torch.equal(bw(t)[0], want[0])
        assert any(n.target is aten.arange.default for n in bw.graph.nodes)


def test_a_value_also_returned_stays_saved():
    """Returned to the caller, the forward computes it anyway: nothing to move."""
    def build(g):
        x = g.placeholder("x")
        m = _arange_mask(g, x)
        g.output((g.call_function(aten.add.Tensor, (x, m)), m, m))
        return g
    fw = _graph(build)
    m = list(fw.graph.find_nodes(op="output"))[0].args[0][1]
    bw = _backward(m.name)
    assert training_partition.recompute_constants(fw, bw, num_fwd_outputs=2) == []
    assert len(fw(torch.randn(4))) == 3
    assert len(bw.graph.find_nodes(op="placeholder")) == 2


def test_the_op_list_is_aot_autograds_again_after_the_partition():
    """The list is extended only while the partitioner runs, an exception included."""
    from torch._functorch import partitioners
    original = partitioners.get_default_op_list
    with pytest.raises(RuntimeError, match="inside"):
        with training_partition._recomputable(training_partition.RECOMPUTABLE):
            assert aten.cumsum in partitioners.get_default_op_list().recomputable_ops
            raise RuntimeError("inside")
    assert partitioners.get_default_op_list is original
    assert aten.cumsum not in original().recomputable_ops
