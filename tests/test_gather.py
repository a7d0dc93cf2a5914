"""Embeddings gathered inside the kernels that read them (codegen/lower.py ``_embedding``):
GPT-2's token embedding + positions + LayerNorm, BERT's three embeddings + LayerNorm, each one
kernel. The table is read by rows (the cost model charges the rows, not the table), and an
index outside it is a device-side error as in eager's CUDA embedding."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, compile_and_run, kernel_count, leftover_aten

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gpt2_embeddings(ids, wte, wpe, w, b):
    h = F.embedding(ids, wte) + wpe[: ids.shape[1]]
    return F.layer_norm(h, (h.shape[-1],), w, b)


def bert_embeddings(ids, types, wte, wpe, wtt, w, b):
    pos = torch.arange(ids.shape[1], device=ids.device)
    h = F.embedding(ids, wte) + F.embedding(types, wtt) + F.embedding(pos, wpe)
    return F.layer_norm(h, (h.shape[-1],), w, b, eps=1e-12)


def _weights(n, dim, dtype, device):
    return torch.randn(n, dim, device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, vocab, dim", [((2, 7), 50, 24), ((3, 13), 1000, 80)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_token_embedding_positions_and_layernorm_are_one_kernel(dtype, shape, vocab, dim,
                                                               index_dtype, device):
    ids = torch.randint(0, vocab, shape, device=device, dtype=index_dtype)
    ids[0, 0], ids[-1, -1] = 0, vocab - 1                   # the table's first and last rows
    args = (ids, _weights(vocab, dim, dtype, device), _weights(32, dim, dtype, device),
            torch.randn(dim, device=device, dtype=dtype), torch.randn(dim, device=device, dtype=dtype))
    out, reports = compile_and_run(gpt2_embeddings, args)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, gpt2_embeddings(*args), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bert_embeddings_are_one_kernel(dtype, device):
    ids = torch.randint(0, 300, (3, 11), device=device)
    types = torch.randint(0, 2, (3, 11), device=device)
    args = (ids, types, _weights(300, 40, dtype, device), _weights(64, 40, dtype, device),
            _weights(2, 40, dtype, device), torch.randn(40, device=device, dtype=dtype),
            torch.randn(40, device=device, dtype=dtype))
    out, reports = compile_and_run(bert_embeddings, args)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, bert_embeddings(*args), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_into_pointwise_ops_and_alone(dtype, device):
    ids = torch.randint(0, 70, (5, 3, 2), device=device)
    table = _weights(70, 33, dtype, device)
    for fn in (lambda i, t: F.embedding(i, t) * 2.0 + 1.0, lambda i, t: F.embedding(i, t)):
        out, reports = compile_and_run(fn, (ids, table))
        assert kernel_count(reports) == 1 and leftover_aten(reports) == []
        assert_close(out, fn(ids, table), dtype=dtype)


def test_a_table_computed_in_the_graph_is_written_then_gathered(device):
    """The kernel must load the table: a table computed from other ops is not gathered from
    registers (the group that would do it is refused), and the numbers stay right."""
    ids = torch.randint(0, 20, (4, 6), device=device)
    table, scale = torch.randn(20, 16, device=device), torch.randn(16, device=device)

    def fn(i, t, s):
        return F.embedding(i, t * s).relu()
    out, reports = compile_and_run(fn, (ids, table, scale))
    assert_close(out, fn(ids, table, scale))
    assert kernel_count(reports) == 2 and leftover_aten(reports) == []


def test_the_table_is_charged_by_the_rows_read(device):
    """A 5000-row table, 14 indices: the fused group reads 14 rows of it, not the table."""
    ids = torch.randint(0, 5000, (2, 7), device=device)
    table = torch.randn(5000, 64, device=device)
    out, reports = compile_and_run(lambda i, t: F.embedding(i, t) * 3.0, (ids, table))
    (group,) = reports[0].summary["groups"]
    assert group["bytes_fused"] == 14 * 64 * 4 + ids.numel() * 8 + 14 * 64 * 4
    (kernel,) = reports[0].kernels
    source = open(kernel["path"]).read()
    # tested in the live lanes only
    assert "tl.device_assert(((0 <= x" in source \
        and "< 5000)) | ~(xmask), 'embedding: index out of range'" in source
    assert "debug=True" in source and "sanitize_overflow=False" in source


def test_gradients_through_a_fused_embedding(device):
    ids = torch.randint(0, 50, (2, 9), device=device)
    wte = torch.randn(50, 24, device=device, requires_grad=True)
    wpe = torch.randn(16, 24, device=device, requires_grad=True)
    w, b = torch.randn(24, device=device), torch.randn(24, device=device)
    torch._dynamo.reset()
    out = torch.compile(gpt2_embeddings, backend="fusion")(ids, wte, wpe, w, b)
    (out * out).sum().backward()
    got = wte.grad.clone(), wpe.grad.clone()
    wte.grad = wpe.grad = None
    expected = gpt2_embeddings(ids, wte, wpe, w, b)
    (expected * expected).sum().backward()
    assert_close(out, expected)
    assert_close(got[0], wte.grad, name="wte grad")
    assert_close(got[1], wpe.grad, name="wpe grad")


_OUT_OF_RANGE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    ids = torch.tensor([[0, 3, 50]], device="cuda")
    table = torch.randn(50, 16, device="cuda")
    f = lambda i, t: F.embedding(i, t) * 2.0                             # noqa: E731
    if GATHER == "index_select":
        f = lambda i, t: t.index_select(0, i.view(-1)) * 2.0             # noqa: E731
    if GATHER == "scatter":     # one index per row (slices.scatter_value): checked by a gather
        f = lambda i, t: (t[:3] * 2.0).scatter(1, i.view(3, 1), 1.0)   # noqa: E731
    out = torch.compile(f, backend="fusion")(ids, table)
    torch.cuda.synchronize()
    print("no error", out.sum().item())
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device-side assert needs a GPU")
@pytest.mark.parametrize("gather", ["embedding", "index_select", "scatter"])
def test_an_index_outside_the_table_is_a_device_side_error(gather):
    """As eager's CUDA embedding and index_select: a device-side assert (in a process of its
    own: it leaves the CUDA context unusable), never values read from outside the table."""
    proc = subprocess.run([sys.executable, "-c", f"GATHER = {gather!r}\n" + _OUT_OF_RANGE],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no error" not in proc.stdout, proc.stdout
    assert "index out of range" in proc.stderr or "device-side assert" in proc.stderr, \
        proc.stderr[-2000:]


def bert_token_types(ids, type_buffer, pos, wte, wtt, w, b):
    """Hugging Face BERT's token types when none are given: its zeros buffer gathered at the
    positions (``gather(buffer.expand(1, -1), 1, pos)``), then embedded, beside the words."""
    types = torch.gather(type_buffer.expand(1, -1), 1, pos).expand(ids.shape[0], -1)
    h = F.embedding(ids, wte) + F.embedding(types, wtt)
    return F.layer_norm(h, (h.shape[-1],), w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gather_of_the_indices_joins_the_kernel(dtype, device):
    ids = torch.randint(0, 90, (3, 10), device=device)
    type_buffer = torch.randint(0, 2, (1, 16), device=device)
    pos = torch.randperm(16, device=device)[:10].view(1, 10)
    args = (ids, type_buffer, pos, _weights(90, 24, dtype, device), _weights(2, 24, dtype, device),
            torch.randn(24, device=device, dtype=dtype), torch.randn(24, device=device, dtype=dtype))
    out, reports = compile_and_run(bert_token_types, args)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, bert_token_types(*args), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["gather", "index_select"])
@pytest.mark.parametrize("expanded", [False, True], ids=["dense", "expanded"])
def test_a_gather_into_a_cat_reads_each_part_only_where_the_index_names_it(op, expanded, dtype,
                                                                           device):
    """``cat([x, x * 2])`` read at a loaded index: each part's load is guarded by the part's
    range and the index's (a GPU fuzzer's find: the two loads had no mask, so each part was read
    at every index, 41 elements before its memory and past its end, an illegal address on the
    GPU). One kernel; values as eager's; every load at a loaded index is masked. An expanded
    source (stride 0: its address names no index) takes a block of addresses for its mask."""
    x = torch.randn(1 if expanded else 41, device=device, dtype=dtype).expand(41)
    idx = torch.randint(0, 82, (57,), device=device)

    def f(x, idx):
        both = torch.cat([x, x * 2])
        return torch.gather(both, 0, idx) if op == "gather" else both.index_select(0, idx)
    out, reports = compile_and_run(f, (x, idx))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x, idx), dtype=dtype)
    source = open(reports[0].kernels[0]["path"]).read()
    loads = [line for line in source.splitlines() if "tl.load(in0" in line]
    assert len(loads) == 2 and all("mask=" in line for line in loads), loads


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_along_any_dim_of_a_computed_source(dim, device):
    """The source is computed at the gathered positions (no intermediate); along the last dim
    of a row kernel the index is per element, and so is what it addresses."""
    a = torch.randn(7, 13, device=device)
    idx = torch.randint(0, a.shape[dim], (5, 13) if dim == 0 else (7, 9), device=device)

    def fn(a, i):
        g = torch.gather(a.exp() * 2.0, dim, i)
        return g / g.sum(-1, keepdim=True)
    out, reports = compile_and_run(fn, (a, idx))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, fn(a, idx))


def swin_position_bias(table, idx, mask):
    """Swin's relative position bias: rows of a table picked by a position index, laid out
    per head, added to the window mask (the attention mask SDPA gets)."""
    bias = table[idx].view(7, 7, -1).permute(2, 0, 1).contiguous()
    return bias.unsqueeze(0) + mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_rows_picked_by_an_index_tensor_are_a_gather_in_the_kernel(dtype, index_dtype, device):
    """``table[idx]`` (aten.index.Tensor) joins its reader's kernel as a gather of rows (it was
    an ATen index kernel, then a copy), with eager's values, negative indices counting from
    the end as eager's do."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(13, 3, generator=g).to(device=device, dtype=dtype)
    mask = torch.randn(2, 1, 7, 7, generator=g).to(device=device, dtype=dtype)
    for idx in (torch.randint(0, 13, (49,), generator=g), torch.randint(-13, 13, (49,), generator=g)):
        idx = idx.to(device=device, dtype=index_dtype)
        out, reports = compile_and_run(swin_position_bias, (table, idx, mask))
        assert kernel_count(reports) == 1 and not leftover_aten(reports)
        assert "aten.embedding.default" in reports[0].kernels[0]["ops"]
        assert torch.equal(out, swin_position_bias(table, idx, mask))


def test_other_index_forms_stay_on_aten(device):
    """A boolean mask, or two index tensors, is not a pick along one dimension: left on ATen,
    eager's values."""
    x = torch.randn(6, 5, device=device)
    keep = torch.tensor([True, False, True, True, False, True], device=device)
    rows, cols = torch.tensor([1, 5, 0], device=device), torch.tensor([4, 0, 2], device=device)
    for f in (lambda x: x[keep] * 2, lambda x: x[rows, cols] * 2):
        out, reports = compile_and_run(f, (x,))
        assert "aten.index.Tensor" in leftover_aten(reports)
        assert torch.equal(out, f(x))


def hf_mask(mask, scores):
    """Hugging Face's mask (masking_utils): the padding mask picked as
    ``padding_mask[batch_idx, kv_idx]`` by aranges, with the causal test, applied to scores."""
    b, s = mask.shape
    batch = torch.arange(b, device=mask.device)[:, None, None, None]
    kv = torch.arange(s, device=mask.device)[None, None, None, :]
    q = torch.arange(s, device=mask.device)[None, None, :, None]
    keep = (kv <= q) & mask.bool()[batch, kv]
    return torch.where(keep, scores, float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (1, 16)], ids=str)
def test_a_pick_by_constant_index_tensors_is_one_gather(shape, dtype, device):
    """``x[i0, i1]`` by constant index tensors on adjacent dims (Hugging Face's padding mask):
    one gather of the merged dims in the kernel that reads it; before, an ATen index and a
    kernel of its own for the mask's conversion to bool. Values exactly eager's."""
    g = torch.Generator().manual_seed(1)
    mask = torch.randint(0, 2, shape, generator=g).to(device)
    scores = torch.randn(shape[0], 2, shape[1], shape[1], generator=g).to(device=device,
                                                                          dtype=dtype)
    out, reports = compile_and_run(hf_mask, (mask, scores))
    assert kernel_count(reports) == 1 and not leftover_aten(reports)
    assert "aten.index_select.default" in reports[0].kernels[0]["ops"]
    assert torch.equal(out, hf_mask(mask, scores))


def test_constant_picks_with_negative_indices_on_middle_dims(device):
    """``x[:, i, j]`` with broadcast constant indices, negative ones among them, on dims 1
    and 2 of four: the dims where eager puts them, eager's values."""
    x = torch.randn(2, 5, 6, 3, device=device)

    def f(x):
        i = (torch.arange(3, device=x.device) * 2 - 4)[:, None]     # -4, -2, 0
        j = torch.arange(4, device=x.device) * 3 - 6                # -6, -3, 0, 3
        return x[:, i, j] * 2 + 1
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and not leftover_aten(reports)
    assert torch.equal(out, f(x))


def test_a_constant_index_out_of_range_keeps_atens_error(device):
    """A constant index past its dim: the pick stays ATen's op, and raises ATen's error. On the
    CPU: CUDA's eager reports it by a device-side assert, asynchronously, which ends the
    process's CUDA context (every later test of the worker fails)."""
    if device != "cpu":
        pytest.skip("CUDA's index error is a device-side assert that ends the CUDA context")
    x = torch.randn(3, 7, device=device)

    def f(x):
        return x[torch.arange(3, device=x.device)[:, None], torch.arange(8, device=x.device)] + 1
    with pytest.raises(Exception, match="out of bounds"):
        f(x)
    with pytest.raises(Exception, match="out of bounds"):
        compile_and_run(f, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("form", ["cols", "last", "2d", "rows3d"])
def test_a_pick_along_any_dimension_is_a_gather(dtype, index_dtype, form, device):
    """``x[:, idx]``, ``x[..., idx]``, a 2-d index, rows of a 3-d tensor: an index_select in the
    kernel that reads it, negative indices counting from the end, the dims where eager puts
    them."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 7, 9, generator=g).to(device=device, dtype=dtype)
    n = {"cols": 7, "last": 9, "2d": 7, "rows3d": 4}[form]
    idx = torch.randint(-n, n, (2, 3) if form == "2d" else (5,), generator=g)
    idx = idx.to(device=device, dtype=index_dtype)
    pick = {"cols": lambda x, i: x[:, i], "last": lambda x, i: x[..., i],
            "2d": lambda x, i: x[:, i], "rows3d": lambda x, i: x[i]}[form]
    f = lambda x, i: pick(x.sigmoid(), i) * 2 + 1        # noqa: E731
    out, reports = compile_and_run(f, (x, idx))
    assert kernel_count(reports) == 1 and not leftover_aten(reports)
    assert "aten.index_select.default" in reports[0].kernels[0]["ops"]
    assert out.shape == f(x, idx).shape
    assert_close(out, f(x, idx), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select_is_a_gather_in_the_kernel(dtype, index_dtype, dim, device):
    """``index_select(src, dim, idx)`` (a 1-d index, repeats allowed) joins the kernels on both
    sides of it: the source computed at the positions it names, the result used in place."""
    g = torch.Generator().manual_seed(dim % 3)
    a = torch.randn(5, 7, 9, generator=g).to(device=device, dtype=dtype)
    idx = torch.randint(0, a.shape[dim], (11,), generator=g).to(device=device, dtype=index_dtype)

    def fn(a, i):
        return (a.sigmoid() * 2).index_select(dim, i) + 1
    out, reports = compile_and_run(fn, (a, idx))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert "aten.index_select.default" in reports[0].kernels[0]["ops"]
    assert_close(out, fn(a, idx), dtype=dtype)


@pytest.mark.parametrize("dim", [0, 1])
def test_index_select_of_rows_and_of_columns_in_a_row_kernel(dim, device):
    """In a softmax's row kernel: picking rows (per row) or columns (per element, so what
    it addresses is too)."""
    a = torch.randn(6, 13, device=device)
    idx = torch.randint(0, a.shape[dim], (6 if dim == 0 else 13,), device=device)

    def fn(a, i):
        return torch.softmax(a.index_select(dim, i) * 0.5, dim=-1)
    out, reports = compile_and_run(fn, (a, idx))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, fn(a, idx))


def test_index_select_by_a_0d_index_stays_on_aten(device):
    """Only a 1-d index is a gather here; ATen's index_select says what else it takes."""
    a = torch.randn(4, 6, device=device)
    idx = torch.tensor(2, device=device)        # a 0-d index: ATen takes it as one element
    out, reports = compile_and_run(lambda a, i: a.index_select(1, i) * 2, (a, idx))
    assert "aten.index_select.default" in leftover_aten(reports)
    assert torch.equal(out, a.index_select(1, idx) * 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["slice_scatter", "pad"])
@pytest.mark.parametrize("n", [37, 41])
@pytest.mark.parametrize("block", [None, "8"], ids=["persistent", "chunks"])
def test_a_gathered_select_is_computed_per_element(source, n, block, dtype, device, monkeypatch):
    """A source chosen under predicates of its index (a slice_scatter's strided range, a pad's
    edges) read at a loaded index in a softmax's row kernel: the predicates name the loaded
    index, so the choice is made per element, after the load (a fuzzer's find: the choice was
    placed before the row's chunks as a per-row value, and named an index not yet loaded). The
    row whole, and in chunks of 8 (a resident or looped kernel, where the order matters)."""
    if block:
        monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", block)
    x = torch.randn(3, n, device=device, dtype=dtype)
    width = n + 5 if source == "pad" else n
    idx = torch.randint(0, width, (3, n), device=device)

    def fn(x, idx):
        if source == "pad":
            src = F.pad(x, (2, 3), value=1.5)
        else:
            src = torch.slice_scatter(x, x[..., 10:33:3] * 2, -1, 10, 33, 3)
        return torch.softmax(x, -1), torch.gather(src, -1, idx)
    out, reports = compile_and_run(fn, (x, idx))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    for name, got, want in zip(("softmax", "gather"), out, fn(x, idx)):
        assert_close(got, want, dtype=dtype, name=name)
