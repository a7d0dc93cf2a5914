"""passes/pad_gemm.py: GEMMs whose rows break cuBLAS's 16-byte alignment are padded with zeros,
the result cut back and laid out as the graph promised; values equal eager's."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_module_simplified

from fusion_compiler.passes import pad_gemm
from fusion_compiler.passes.cost_model import PROFILES
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten

aten = torch.ops.aten


class Ctx:
    # a slow matmul unit, so that these CPU-sized GEMMs are worth padding
    profile = dataclasses.replace(PROFILES["h200"], peak_flops=1e10)


def _padded(fn, args, devices=("cpu",)):
    """(number padded, ATen graph after the pass, outputs of the padded graph)."""
    seen = []

    def inner(gm, example_inputs):
        seen.append(pad_gemm.run(gm, Ctx, devices))
        seen.append(gm)
        gm.recompile()      # the pass rewrites the graph, not its code
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=lambda gm, ex: aot_module_simplified(
            gm, ex, fw_compiler=inner), fullgraph=True)(*args)
    return seen[0], seen[1], out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_unaligned_columns_and_inner_dim(bias):
    # K = 765 and N = 1003, both odd: a is padded along K, the weight before its transpose
    x = torch.randn(1024, 765)
    w = torch.randn(1003, 765)
    b = torch.randn(1003) if bias else None
    fn = lambda x, w, b: F.linear(x, w, b).relu()
    count, gm, out = _padded(fn, (x, w, b))
    assert count == 1
    targets = _targets(gm)
    assert targets.count(aten.constant_pad_nd.default) == 2 + bias
    assert aten.slice.Tensor in targets and aten.clone.default in targets
    (gemm,) = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert gemm.meta["val"].shape == (1024, 1004)           # fp32: rows of 4-element multiples
    expected = fn(x, w, b)
    assert out.stride() == expected.stride()
    assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_result_that_only_leaves_the_graph_is_not_copied(dtype):
    """GPT-2's logits: the GEMM's result goes to the output through a view only, so the caller
    gets the cut view (rows N' apart) and no clone runs; values and stride order are eager's."""
    x = torch.randn(2, 511, 765).to(dtype)
    w = (torch.randn(1003, 765) * 0.05).to(dtype)
    fn = lambda x, w: F.linear(x, w)
    count, gm, out = _padded(fn, (x, w))
    assert count == 1
    assert aten.clone.default not in _targets(gm)
    expected = fn(x, w)
    wide = 1004 if dtype == torch.float32 else 1008
    assert out.shape == expected.shape
    assert out.stride() == (511 * wide, wide, 1)
    assert_close(out, expected, dtype)
    # the graph's recorded layout says the same as what it returns
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert output.args[0][0].meta["val"].stride() == out.stride()
    # and the view merges back as eager's does
    assert_close(out.view(-1, 1003), expected.view(-1, 1003), dtype)


def test_a_result_with_other_users_keeps_its_layout():
    """Returned and also used (here by a softmax): the clone stays, one contiguous copy."""
    x, w = torch.randn(1024, 765), torch.randn(1003, 765)
    fn = lambda x, w: (lambda y: (y, y.softmax(-1)))(F.linear(x, w))
    count, gm, out = _padded(fn, (x, w))
    assert count == 1 and aten.clone.default in _targets(gm)
    for a, e in zip(out, fn(x, w)):
        assert a.stride() == e.stride()
        assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(64, 48), (61, 48), (64, 45)])
def test_a_column_major_a_is_padded_along_m(dtype, k, n):
    """A weight gradient, t(grad)[M, K] @ h[K, N] with grad [K, M] contiguous: a's columns are
    M = 1003 apart. grad is padded along M before the transpose, the result's first M rows are
    cut off (a contiguous view, no clone); with K or N unaligned too, those are padded as well.
    The values and layout are eager's."""
    grad = torch.randn(k, 1003).to(dtype)
    h = torch.randn(k, n).to(dtype)
    fn = lambda g, h: (g.t() @ h) * 2.0       # noqa: E731
    count, gm, out = _padded(fn, (grad, h))
    assert count == 1
    targets = _targets(gm)
    (gemm,) = [n_ for n_ in gm.graph.nodes if n_.target == aten.mm.default]
    align = 16 // grad.element_size()
    wide = (1003 + -1003 % align, n + -n % align)
    assert tuple(gemm.meta["val"].shape) == wide
    assert (aten.clone.default in targets) == bool(n % align)
    expected = fn(grad, h)
    assert out.shape == expected.shape and out.stride() == expected.stride()
    assert_close(out, expected, dtype, atol=1e-3 if dtype == torch.float32 else None,
                 rtol=1e-3 if dtype == torch.float32 else None)


def test_aligned_small_and_gpu_only_gemms_are_left_alone():
    x, w = torch.randn(1024, 768), torch.randn(1024, 768)
    assert _padded(lambda x, w: x @ w.t(), (x, w))[0] == 0               # aligned
    x, w = torch.randn(3, 9), torch.randn(9, 5)
    assert _padded(lambda x, w: x @ w, (x, w))[0] == 0                  # too small to pay
    x, w = torch.randn(1024, 765), torch.randn(765, 1003)
    assert _padded(lambda x, w: x @ w, (x, w), devices=("cuda",))[0] == 0   # CPU GEMMs


def test_worth_padding_follows_the_cost_model():
    h200 = PROFILES["h200"]
    # GPT-2's LM head: ~0.5 ms of aligned GEMM against ~0.25 ms of copies
    assert pad_gemm.worth_padding(4096, 768, 50257, 0, 7, 2, h200)
    # one token through the same head: the weight's copy costs more than the GEMM
    assert not pad_gemm.worth_padding(1, 768, 50257, 0, 7, 2, h200)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_head_on_the_gpu(dtype, caplog):
    x = torch.randn(2, 1000, 768, dtype=dtype, device="cuda")
    w = torch.randn(50257, 768, dtype=dtype, device="cuda") * 0.05
    fn = lambda x, w: F.linear(x, w)
    with caplog.at_level("INFO", logger="fusion_compiler"):
        out, reports = compile_and_run(fn, (x, w))
    assert "padded GEMM [2000, 768] @ [768, 50257] to [2000, 768] @ [768, 50264]" in caplog.text
    assert "aten.mm.default" in leftover_aten(reports)
    expected = fn(x, w)
    # the logits only leave the graph: the cut view, no copy (as Inductor returns them)
    assert out.stride() == (1000 * 50264, 50264, 1)
    assert_close(out, expected, atol=2e-2, rtol=2e-2)


# ------------------------------------------------ constant_pad_nd in a kernel (the padded copies)
PADS = [((37, 300), (0, 4)), ((37, 300), (0, 4, 0, 3)), ((5, 7, 9), (2, 1, 0, 0, 1, 1)),
        ((300,), (3, 0)), ((8, 50), (0, 0))]


@pytest.mark.parametrize("shape, pads", PADS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_constant_pad_is_one_kernel(shape, pads, dtype, device):
    """A pad (the copies pad_gemm adds: ATen fills the output, then copies into it) is one
    kernel with its neighbours: here the input's scaling before and an add after. Pad value
    zero and not, odd shapes; the values are eager's."""
    from helpers import kernel_count

    def fn(x, y):
        return F.pad(x * 2.0, pads, value=0.0) + 1.0, F.pad(y, pads, value=-1.5)

    x = torch.randn(shape, device=device).to(dtype)
    y = torch.randn(shape, device=device).to(dtype)
    out, reports = compile_and_run(fn, (x, y))
    for i, (a, e) in enumerate(zip(out, fn(x, y))):
        assert_close(a, e, dtype, name=f"output {i}")
    assert 1 <= kernel_count(reports) <= 2
    assert not {op for op in leftover_aten(reports) if "pad" in op}


def test_negative_pad_is_a_crop_in_the_kernel(device):
    """A negative pad crops: decomposed into a slice and the pad that is left
    (fusion_compiler/slices.py), it is index arithmetic in the one kernel; the values are
    eager's. (Before session 48 the pad stayed on ATen.)"""
    def fn(x):
        return F.pad(x * 2.0, (1, -2)) * 3.0

    x = torch.randn(6, 9, device=device)
    out, reports = compile_and_run(fn, (x,))
    assert_close(out, fn(x))
    assert leftover_aten(reports) == [] and kernel_count(reports) == 1, leftover_aten(reports)


def test_emit_takes_meta_values_that_match_the_fake_modes(monkeypatch):
    """``emit``'s meta-kernel values (``META_OPS``, static layouts) have the layout, dtype and
    device the fake mode's dispatch gives: views at storage offsets, transposed, sums over the
    last dim of a permuted view, a dtype conversion; a symbolic size goes through the mode."""
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode()
    base = torch.randn(6, 10, 12, dtype=torch.bfloat16)
    cases = [(base[1:4, 2:9], aten.permute.default, ([2, 0, 1],)),
             (base[1:4, 2:9], aten.sum.dim_IntList, ([-1],)),
             (base.permute(2, 0, 1), aten.sum.dim_IntList, ([-1],)),
             (base[2], aten.view.default, ([5, 2, 12],)),
             (base[:, 3], aten.view.default, ([6, 3, 4],)),
             (base.transpose(0, 2), aten.permute.default, ([1, 2, 0],)),
             (base[1:, :, 4:], torch.ops.prims.convert_element_type.default, (torch.float32,))]
    for real, op, rest in cases:
        gm = torch.fx.GraphModule({}, torch.fx.Graph())
        x = gm.graph.placeholder("x")
        x.meta["val"] = mode.from_tensor(real)
        assert op in pad_gemm.META_OPS
        assert pad_gemm._meta_value(op, [x.meta["val"], *rest], mode) is not None, op
        fast = pad_gemm.emit(gm, op, (x, *rest), mode).meta["val"]
        with mode:
            want = op(x.meta["val"], *rest)
        assert isinstance(fast, FakeTensor) and fast.fake_mode is mode
        assert (fast.shape, fast.stride(), fast.storage_offset(), fast.dtype, fast.device) == \
            (want.shape, want.stride(), want.storage_offset(), want.dtype, want.device), op
        # inside a fake mode (a cold compile runs in aot_autograd's) the same value, and the
        # mode's dispatch is not entered
        dispatched = []
        dispatch = FakeTensorMode.dispatch
        with monkeypatch.context() as patch:
            patch.setattr(FakeTensorMode, "dispatch", lambda self, *a, **k:
                          dispatched.append(a[0]) or dispatch(self, *a, **k))
            with mode:
                inside = pad_gemm.emit(gm, op, (x, *rest), mode).meta["val"]
        assert not dispatched, dispatched
        assert (inside.shape, inside.stride(), inside.storage_offset(), inside.dtype) == \
            (want.shape, want.stride(), want.storage_offset(), want.dtype), op
    dynamic = FakeTensorMode(shape_env=ShapeEnv())
    gm = torch.fx.GraphModule({}, torch.fx.Graph())
    x = gm.graph.placeholder("x")
    x.meta["val"] = dynamic.from_tensor(torch.randn(5, 8), symbolic_context=(
        StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])))
    assert pad_gemm._meta_value(aten.sum.dim_IntList, [x.meta["val"], [-1]], dynamic) is None
    out = pad_gemm.emit(gm, aten.sum.dim_IntList, (x, [-1]), dynamic).meta["val"]
    assert not isinstance(out.shape[0], int) and out.shape[0] == x.meta["val"].shape[0]
