"""Values computed from constants alone are computed when the graph is compiled
(passes/constant_fold.py): GPT-2's mask from its positions, a factory's tensor, an embedding of
consecutive positions (a slice of the weight). Random ops, returned tensors and tensors over the
size limit are left to run on every call. The numbers are eager's, on every call."""
import pytest
import torch
import torch.nn.functional as F

import fusion_compiler.backend as backend
from fusion_compiler.passes import constant_fold
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten

DTYPES = [torch.float32, torch.bfloat16]


def _compiled(monkeypatch, fn, args, grad=False):
    """(outputs, reports, compiled graph modules) of ``fn``."""
    graphs = []
    compile_aten_graph = backend.compile_aten_graph
    monkeypatch.setattr(backend, "compile_aten_graph", lambda gm, kind, config, **kw: graphs.append(
        compile_aten_graph(gm, kind, config, **kw)) or graphs[-1])
    with torch.set_grad_enabled(grad):
        out, reports = compile_and_run(fn, args)
    return out, reports, graphs


def _calls(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def _constants(gm):
    return [n for n in gm.graph.nodes if n.op == "get_attr"
            and n.target.startswith(constant_fold.PREFIX)]


def gpt2_mask_attention(x):
    """Hugging Face GPT-2's mask, built from the positions alone (no attention_mask given):
    packed-sequence starts, their cumsum, a causal and a same-sequence test, where."""
    b, s = x.shape[:2]
    pos = torch.arange(s, device=x.device).unsqueeze(0).expand(b, -1)
    starts = torch.cat([pos[:, :1] - 1, pos], -1)
    seq = ((starts[:, 1:] - starts[:, :-1]) != 1).cumsum(-1)
    keep = (pos[:, None, :] <= pos[:, :, None]) & (seq[:, None, :] == seq[:, :, None])
    mask = torch.where(keep, 0.0, float("-inf")).to(x.dtype)
    return (torch.bmm(x, x.transpose(1, 2)) + mask).softmax(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 5), (3, 33, 8)])
def test_a_mask_built_from_positions_is_computed_once(monkeypatch, device, dtype, shape):
    x = torch.randn(*shape, device=device, dtype=dtype)
    out, reports, (gm,) = _compiled(monkeypatch, gpt2_mask_attention, (x,))
    assert_close(out, gpt2_mask_attention(x), dtype=dtype)
    calls = _calls(gm)
    assert not calls & {torch.ops.aten.cumsum.default, torch.ops.aten.arange.start_step,
                        torch.ops.aten.arange.default, torch.ops.aten.where.self}, gm.code
    assert len(_constants(gm)) == 1, gm.code             # the mask, [b, s, s]
    assert kernel_count(reports) == 1                    # mask add + softmax
    assert leftover_aten(reports) == ["aten.bmm.default"]
    (report,) = reports
    assert [c["bytes"] for c in report.summary["constants"]] == [
        shape[0] * shape[1] ** 2 * x.element_size()]
    x2 = torch.randn_like(x)                             # the kept mask serves the next call
    with torch.no_grad():
        assert_close(gm.forward([x2])[0], gpt2_mask_attention(x2), dtype=dtype)


def three_layers(x):
    """GPT-2's mask built again by each of three layers (as Hugging Face's model, compiled,
    builds it in each of its twelve), each layer's attention reading its own copy."""
    for _ in range(3):
        x = gpt2_mask_attention(x) @ x
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 5), (3, 33, 8)])
def test_a_mask_built_in_every_layer_is_kept_once(monkeypatch, device, dtype, shape):
    """The same computation of the same constants is computed and kept once (dedupe.py's rule,
    applied while folding): one [b, s, s] mask for the three layers, not three."""
    x = torch.randn(*shape, device=device, dtype=dtype) / shape[-1] ** 0.5
    out, reports, (gm,) = _compiled(monkeypatch, three_layers, (x,))
    assert_close(out, three_layers(x), dtype=dtype)
    assert len(_constants(gm)) == 1, gm.code
    (report,) = reports
    assert [c["bytes"] for c in report.summary["constants"]] == [
        shape[0] * shape[1] ** 2 * x.element_size()]
    assert kernel_count(reports) == 3                    # mask add + softmax, per layer
    assert leftover_aten(reports).count("aten.bmm.default") == 6
    x2 = torch.randn_like(x) / shape[-1] ** 0.5          # the kept mask serves the next call
    with torch.no_grad():
        assert_close(gm.forward([x2])[0], three_layers(x2), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_made_from_constants_are_made_once(monkeypatch, device, dtype):
    """``full`` with constant arguments is a literal of the kernel that reads it; a mask made
    of aranges that only kernels read is computed by them from their index, not kept; a
    tensor returned to the caller, or a view of one, is made on each call (the caller may
    write to it): here by the kernel that adds to it."""
    def fn(x, ids):
        pos = torch.arange(0, x.shape[1], device=x.device)
        mask = pos[None, :] <= pos[:, None]                       # causal, from constants
        rows = torch.index_select(x, 0, ids)                      # stays on ATen
        scale = torch.full((), 0.5, device=x.device, dtype=x.dtype)
        steps = torch.arange(6, device=x.device)
        return (rows * scale).masked_fill(~mask[: x.shape[0]], 0.0), steps + 1, steps.view(2, 3)

    x = torch.randn(7, 7, device=device, dtype=dtype)
    ids = torch.randint(0, 7, (7,), device=device)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x, ids))
    # nothing kept: the mask is computed from the kernel's index; the scale (a full the kernel
    # reads) and masked_fill's fill value are literals in the kernel; steps is returned
    assert torch.ops.aten.full.default not in _calls(gm) and len(_constants(gm)) == 0, gm.code
    assert torch.ops.aten.scalar_tensor.default not in _calls(gm)
    assert torch.ops.aten.arange.start not in _calls(gm)
    assert torch.ops.aten.arange.default not in _calls(gm)
    assert kernel_count(reports) == 2                    # scale and mask; steps and steps + 1
    sources = [open(k["path"]).read() for r in reports for k in r.kernels]
    assert sum("iota" in src for src in sources) == 2
    expected = fn(x, ids)
    for a, e in zip(out, expected):
        assert_close(a, e, dtype=a.dtype if a.is_floating_point() else None)
    out[1].add_(100)                                     # the caller's own tensors
    out[2].add_(100)
    with torch.no_grad():
        again = gm.forward([x, ids])                               # the compiled graph, called again
    for a, e in zip(again, expected):
        assert_close(a, e, dtype=a.dtype if a.is_floating_point() else None)


def test_random_tensors_are_made_on_every_call(monkeypatch, device):
    def fn(x):
        return x + torch.rand(x.shape[-1], device=x.device) * torch.ones(x.shape[-1], device=x.device)

    x = torch.randn(4, 9, device=device)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x,))
    with torch.no_grad():
        again = gm.forward([x])[0]
    noise = torch.stack([out - x, again - x])
    assert ((noise >= 0) & (noise < 1)).all()
    assert not torch.equal(noise[0], noise[1]), "the random tensor was kept"
    assert kernel_count(reports) == 1


def test_constants_over_the_size_limit_are_made_on_every_call(monkeypatch, device):
    def fn(x):
        return x * torch.ones(x.shape[-1], device=x.device).cumsum(0)

    x = torch.randn(3, 40, device=device)
    monkeypatch.setattr(constant_fold, "MAX_BYTES", 40 * 4 - 1)
    out, _, (gm,) = _compiled(monkeypatch, fn, (x,))
    # made on every call, by a kernel (the scan of a constant, codegen/lower.py: _scan)
    assert not _constants(gm) and torch.ops.aten.cumsum.default not in _calls(gm), gm.code
    assert_close(out, fn(x))
    monkeypatch.setattr(constant_fold, "MAX_BYTES", 40 * 4)
    out, _, (gm,) = _compiled(monkeypatch, fn, (x,))
    assert len(_constants(gm)) == 1 and torch.ops.aten.cumsum.default not in _calls(gm), gm.code
    assert_close(out, fn(x))


def embeddings(ids, wte, wpe, start):
    s = ids.shape[1]
    consecutive = F.embedding(torch.arange(start, start + s, device=ids.device), wpe)
    flipped = F.embedding(torch.arange(s, device=ids.device).flip(0), wpe)
    return F.embedding(ids, wte) + consecutive, flipped * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 3])
def test_an_embedding_of_consecutive_positions_is_a_slice_of_the_weight(monkeypatch, device,
                                                                        dtype, start):
    """GPT-2's position embedding: no gather, the weight's rows read in place by the add's
    kernel. A constant index that is not consecutive stays a gather (in a kernel)."""
    ids = torch.randint(0, 50, (2, 11), device=device)
    wte = torch.randn(50, 24, device=device, dtype=dtype)
    wpe = torch.randn(16, 24, device=device, dtype=dtype)
    out, reports, (gm,) = _compiled(monkeypatch, embeddings, (ids, wte, wpe, start))
    for a, e in zip(out, embeddings(ids, wte, wpe, start)):
        assert_close(a, e, dtype=dtype)
    assert leftover_aten(reports) == [] and kernel_count(reports) == 1
    (ops,) = [k["ops"] for k in reports[0].kernels]
    # of the three embeddings, one kernel gathers by ids and by the flipped positions; the
    # consecutive positions are the weight's rows read in place (a slice, inlined)
    assert ops.count("aten.embedding.default") == 2, ops
    assert len(_constants(gm)) == 1                      # the flipped positions


def test_gradients_through_a_consecutive_embedding(monkeypatch, device):
    ids = torch.randint(0, 50, (2, 11), device=device)
    wte = torch.randn(50, 24, device=device, requires_grad=True)
    wpe = torch.randn(16, 24, device=device, requires_grad=True)
    out, reports, _ = _compiled(monkeypatch, embeddings, (ids, wte, wpe, 2), grad=True)
    (out[0] * out[0]).sum().backward()
    got = wte.grad.clone(), wpe.grad.clone()
    wte.grad = wpe.grad = None
    expected = embeddings(ids, wte, wpe, 2)
    assert_close(out[0], expected[0])
    (expected[0] * expected[0]).sum().backward()
    assert_close(got[0], wte.grad, name="wte grad")
    assert_close(got[1], wpe.grad, name="wpe grad")
    assert kernel_count(reports, "forward") >= 1


def test_sizes_from_the_inputs_are_not_constants(monkeypatch, device):
    """With dynamic shapes, ``arange(x.shape[1])`` depends on the input: nothing is folded,
    and each size gets its own right mask."""
    graphs = []
    compile_aten_graph = backend.compile_aten_graph
    monkeypatch.setattr(backend, "compile_aten_graph", lambda gm, kind, config, **kw: graphs.append(
        compile_aten_graph(gm, kind, config, **kw)) or graphs[-1])
    x = torch.randn(2, 7, 5, device=device)
    with torch.no_grad():
        out, _ = compile_and_run(gpt2_mask_attention, (x,), dynamic=True)
        assert_close(out, gpt2_mask_attention(x))
        fn = torch.compile(gpt2_mask_attention, backend="fusion", dynamic=True, fullgraph=True)
        y = torch.randn(3, 12, 5, device=device)
        assert_close(fn(y), gpt2_mask_attention(y))
    assert graphs and all(not _constants(gm) for gm in graphs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_integer_and_selection_ops_are_computed_on_the_host(monkeypatch, device, dtype):
    """The GPT-2 mask's chain (arange, cat, sub, ne, cumsum, le, eq, and: integers and
    booleans; where: a selection) runs on the CPU, where it gives the device's bits, and only
    the kept values are moved to the device; an op with float arithmetic (mul, exp) runs on
    the device, its input moved there."""
    def fn(x):
        scale = torch.arange(x.shape[1], device=x.device, dtype=torch.float32).mul(0.1).exp()
        return gpt2_mask_attention(x) * scale.to(x.dtype)

    ran_on = {}         # op -> the devices its folded calls ran on
    evaluate = constant_fold._evaluate

    def recorded(node, values):
        value = evaluate(node, values)
        if value is not None:
            ran_on.setdefault(str(node.target), set()).add(value.device.type)
        return value
    monkeypatch.setattr(constant_fold, "_evaluate", recorded)
    x = torch.randn(3, 9, 5, device=device, dtype=dtype)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x,))
    assert_close(out, fn(x), dtype=dtype)
    # mul and exp do float arithmetic; the cast to a narrower dtype reads exp's result, which
    # is already on the device (float32 has no cast)
    on_device = {"aten.exp.default", "aten.mul.Tensor"} \
        | ({"aten._to_copy.default"} if dtype != torch.float32 else set())
    assert {"aten.cumsum.default", "aten.cat.default", "aten.ne.Scalar", "aten.eq.Tensor",
            "aten.bitwise_and.Tensor", "aten.where.self"} <= ran_on.keys(), ran_on
    for op, devices in ran_on.items():
        if op not in on_device | {"aten.arange.start_step"}:
            assert devices == {"cpu"}, (op, ran_on)
    assert all(ran_on[op] == {device} for op in on_device), ran_on
    # the integer arange on the CPU, the float one (mul's input) on the device
    assert ran_on["aten.arange.start_step"] == {"cpu", device}, ran_on
    assert len(_constants(gm)) == 2, gm.code            # the mask and the scale
    assert kernel_count(reports) == 1 and leftover_aten(reports) == ["aten.bmm.default"]
    for n in _constants(gm):
        assert getattr(gm, n.target).device.type == device


def test_a_kept_view_keeps_its_layout_on_the_device():
    """``placed`` copies a value's whole storage and takes the same view of it: an expanded
    tensor (stride 0) and a view at an offset keep their strides, not a dense copy's. On a
    machine without a GPU the meta device stands in (layouts only)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "meta")

    class Node:     # what placed reads of a graph node: its traced value's device
        meta = {"val": torch.empty(0, device=device)}
    base = torch.arange(24, dtype=torch.int64).view(4, 6)
    for value in (base[:, 2:5], base[1].expand(3, 6), base.t(), torch.tensor(True).expand(2, 2)):
        moved = constant_fold.placed(value, Node)
        assert moved.device.type == device.type
        assert (moved.shape, moved.stride(), moved.storage_offset()) \
            == (value.shape, value.stride(), value.storage_offset())
        if device.type == "cuda":
            assert torch.equal(moved.cpu(), value)


ARANGE_CALLS = {torch.ops.aten.arange.default, torch.ops.aten.arange.start,
                torch.ops.aten.arange.start_step}


def _sources(reports):
    return [open(k["path"]).read() for r in reports for k in r.kernels]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [37, 64])
def test_causal_masks_of_aranges_are_computed_by_their_kernel(monkeypatch, device, dtype, n):
    """``tril(ones)`` / ``triu(ones)`` masks (traced as aranges compared) read only by kernels:
    computed from the kernel's index, no [n, n] constant loaded (Mamba2's segment sum loaded
    two; on an H100 the index compares took its kernel from 62 to 48 us, segk.py)."""
    def fn(x):
        below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1)
        upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=2)
        s = x.masked_fill(~below, 0).cumsum(-1)
        return s.masked_fill(upper, -torch.inf).softmax(-1)
    x = torch.randn(3, n, n, device=device, dtype=dtype)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x,))
    assert len(_constants(gm)) == 0 and not _calls(gm) & ARANGE_CALLS, gm.code
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert all("iota" in src for src in _sources(reports))
    assert_close(out, fn(x), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_integer_aranges_with_start_and_step_are_kernel_values(monkeypatch, device, dtype):
    """``arange(start, end, step)`` of integers read by kernels: ``start + step * i`` of the
    kernel's index, in a pointwise kernel and along a row kernel's row. Integer arithmetic of
    an arange read by the graph (``c * 3 - 1``) stays a folded constant (on an H100 a max
    pool's positions computed in its kernel gave wrong bf16 gradients, not understood)."""
    def fn(x, y):
        r = torch.arange(3, 3 + 2 * x.shape[-1], 2, device=x.device, dtype=dtype)
        c = torch.arange(-5, y.shape[0] - 5, device=x.device, dtype=dtype)
        return (x + r).sum(-1), y * (c[:, None] * 3 - 1), r * 7
    x = torch.randn(5, 41, device=device)
    y = torch.randn(9, 4, device=device)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x, y))
    assert not _calls(gm) & ARANGE_CALLS, gm.code
    # three shapes, no input shared: a row kernel and two pointwise kernels; r's two readers
    # compute it, c * 3 - 1 is loaded
    assert kernel_count(reports) == 3 and leftover_aten(reports) == []
    assert sorted("iota" in src for src in _sources(reports)) == [False, True, True]
    assert len(_constants(gm)) == 1
    for a, e in zip(out, fn(x, y)):
        assert a.dtype == e.dtype
        if a.is_floating_point():
            assert_close(a, e)
        else:
            assert torch.equal(a, e)


def test_a_float_arange_is_not_a_kernel_value(monkeypatch, device):
    """ATen rounds ``start + i * step`` of a float arange its own way: made by ATen, once."""
    def fn(x):
        return x * torch.arange(0.0, 0.1 * x.shape[-1] - 0.05, 0.1, device=x.device)
    x = torch.randn(4, 30, device=device)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x,))
    assert not any("iota" in src for src in _sources(reports))
    assert kernel_count(reports) == 1
    assert_close(out, fn(x))


def test_a_gather_by_an_arange_checks_its_index_in_live_lanes_only(monkeypatch, device):
    """``index_select`` by an arange: the index computed from the kernel's index, its range
    check (``tl.device_assert``) tested in the lanes that hold elements only: the 7 lanes past
    the 25 elements hold indices past the 9 rows (the GPU's device assert fired; the
    interpreter now tests asserts too, interpreter_patch.live_asserts)."""
    def fn(x):
        return torch.index_select(x, 0, torch.arange(0, x.shape[0], 2, device=x.device)) * 2
    x = torch.randn(9, 5, device=device)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x,))
    assert not _calls(gm) & ARANGE_CALLS, gm.code
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    (source,) = _sources(reports)
    assert "iota" in source and "| ~(xmask)" in source
    assert_close(out, fn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float_masks_are_computed_and_numbers_of_aranges_are_loaded(monkeypatch, device, dtype):
    """``where(causal, 0, -inf)`` and a mask cast to float are selections of a boolean mask:
    computed by the kernel; ``arange(n).float()`` is a number made of an arange: kept, loaded
    (``constant_fold._mask``)."""
    def fn(x):
        n = x.shape[-1]
        i = torch.arange(n, device=x.device)
        keep = i[None, :] <= i[:, None]
        additive = torch.where(keep, 0.0, float("-inf")).to(x.dtype)
        return (x + additive).softmax(-1) + keep.to(x.dtype), x * i.to(x.dtype)
    x = torch.randn(3, 20, 20, device=device, dtype=dtype)
    out, reports, (gm,) = _compiled(monkeypatch, fn, (x,))
    (kept,) = _constants(gm)
    assert tuple(kept.meta["val"].shape) in ((20,), (1, 20)) and kept.meta["val"].dtype == dtype
    assert not _calls(gm) & ARANGE_CALLS, gm.code
    assert leftover_aten(reports) == []
    assert any("iota" in src for src in _sources(reports))
    for a, e in zip(out, fn(x)):
        assert_close(a, e, dtype=dtype)
