"""Pointwise kernels over 2-d tiles (codegen/tiles.py): an access walked along another dim than
the kernel's innermost one (a transposed output or input) gets tiles of that dim by the
innermost one, so each load and store walks contiguous memory."""
from __future__ import annotations

import pytest
import torch

from helpers import TOL, assert_close, compile_and_run, kernel_count, scan_device, scan_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TILED = "xo = tl.arange("


def silu_both_ways(x, b):
    """One value stored in two layouts: as computed, and with its last two dims swapped."""
    y = torch.nn.functional.silu(x + b)
    return y.transpose(-1, -2).contiguous(), y * 2


def chunked(x, d):
    """transformers 5.17's Mamba2 in small: [b, l, h, n] values stored as [b, h, n, l] (the
    chunked B and C of its scan), beside a scaled copy in their own layout; ``d`` a per-(h, l)
    decay read along the transposed dim."""
    y = x * torch.exp(d).transpose(1, 2).unsqueeze(-1)
    return y.permute(0, 2, 3, 1).contiguous(), y + 1


def sources(cache_dir) -> str:
    return "\n".join(p.read_text() for p in sorted(cache_dir.rglob("*.py")))


def check(fn, args, dtype, cache_dir, tiled: bool):
    out, reports = compile_and_run(fn, args)
    expected = fn(*args)
    assert kernel_count(reports) == 1
    for o, e in zip(out, expected):
        assert o.shape == e.shape and o.stride() == e.stride()
        assert_close(o, e, dtype)
    assert (TILED in sources(cache_dir)) == tiled
    return sources(cache_dir)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 64, 48), (2, 80, 96), (1, 128, 256)])
def test_a_transposed_output_is_written_in_tiles(cache_dir, device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    b = torch.randn(shape[-1], dtype=dtype, device=device)
    text = check(silu_both_ways, (x, b), dtype, cache_dir, tiled=True)
    assert "mask=" not in text.split("def launch")[0]        # tiles divide their dims


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scalar_dims_between_the_tiled_ones(cache_dir, device, dtype):
    """[b, l, h, n] -> [b, h, n, l]: h, between l and n, is one value a program."""
    x = torch.randn(2, 48, 3, 32, dtype=dtype, device=device)
    d = torch.randn(2, 3, 48, dtype=torch.float32, device=device)
    check(chunked, (x, d), dtype, cache_dir, tiled=True)


@pytest.mark.parametrize("shape", [(3, 40, 64), (3, 33, 64), (3, 64, 24)])
def test_dims_that_tiles_cannot_divide_stay_one_dimensional(cache_dir, device, shape):
    """A transposed dim of 40 or 33 (a power of two under 16 divides it) or an innermost dim
    of 24: the 1-d kernel, with its masks."""
    x = torch.randn(shape, dtype=torch.bfloat16, device=device)
    b = torch.randn(shape[-1], dtype=torch.bfloat16, device=device)
    check(silu_both_ways, (x, b), torch.bfloat16, cache_dir, tiled=False)


def chunks_read_back(x, y):
    """x [b, L, d] times y [b, c, d, l] read as [b, c * l, d]: y's index is (L // l, d,
    L % l), so L is split into two dims (tiles.Splits) and the tile takes l by d."""
    b, c, d, l = y.shape
    return x * y.permute(0, 1, 3, 2).reshape(b, c * l, d) + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [((2, 64, 48), (2, 4, 48, 16)), ((3, 96, 32), (3, 3, 32, 32))])
def test_a_dim_read_in_two_digits_is_split_for_the_tile(cache_dir, device, dtype, shapes):
    x = torch.randn(shapes[0], dtype=dtype, device=device)
    y = torch.randn(shapes[1], dtype=dtype, device=device)
    text = check(chunks_read_back, (x, y), dtype, cache_dir, tiled=True)
    accesses = [ln for ln in text.splitlines() if "tl.load(" in ln or "tl.store(" in ln]
    assert accesses and not any("//" in ln or "%" in ln for ln in accesses)    # affine


def two_shapes(a, b, s):
    """Siblings of different shapes sharing ``s``: a multi-part kernel (codegen/multipart.py)."""
    return (a * s).transpose(1, 2).contiguous(), torch.sigmoid(b + s)


@pytest.mark.parametrize("multipart", [False, True], ids=["one part", "multi-part"])
def test_the_option_turns_tiles_off(cache_dir, device, monkeypatch, multipart):
    """``FUSION_COMPILER_TILES=0``: 1-d kernels, a multi-part kernel's parts too; it is part of
    the kernel's cache key, so the tiled kernel cached first is not reused."""
    if multipart:
        fn, args = two_shapes, [torch.randn(4, 32, 64), torch.randn(7, 64), torch.randn(64)]
    else:
        fn, args = silu_both_ways, [torch.randn(3, 64, 48), torch.randn(48)]
    args = [a.to(device=device, dtype=torch.bfloat16) for a in args]
    check(fn, args, torch.bfloat16, cache_dir, tiled=True)
    monkeypatch.setenv("FUSION_COMPILER_TILES", "0")
    out, reports = compile_and_run(fn, args)
    for o, e in zip(out, fn(*args)):
        assert_close(o, e, torch.bfloat16)
    (kernel,) = [k for r in reports for k in r.kernels]
    text = open(kernel["path"]).read()
    assert TILED not in text and "BLOCK = min" not in text
    assert ("_multipart_kernel" in text) == multipart


def test_the_launcher_caps_the_block_at_the_tiles(cache_dir, device):
    """A transposed dim of 16 and an innermost one of 64: tiles of at most 16 x 64, so the
    launcher holds BLOCK (2048 by the pointwise rule) to 1024."""
    x = torch.randn(5, 16, 64, dtype=torch.float32, device=device)
    b = torch.randn(64, dtype=torch.float32, device=device)
    text = check(silu_both_ways, (x, b), torch.float32, cache_dir, tiled=True)
    assert "BLOCK = min(BLOCK, 1024)" in text


def test_a_tiled_part_of_a_multipart_kernel(cache_dir, device):
    """The tiled part's cap holds the multi-part kernel's shared BLOCK."""
    a = torch.randn(4, 32, 64, dtype=torch.bfloat16, device=device)
    b = torch.randn(7, 64, dtype=torch.bfloat16, device=device)
    s = torch.randn(64, dtype=torch.bfloat16, device=device)
    text = check(two_shapes, (a, b, s), torch.bfloat16, cache_dir, tiled=True)
    assert "_multipart_kernel" in text
    assert "BLOCK = min(BLOCK, 2048)" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_through_tiled_kernels(cache_dir, device, dtype):
    x = torch.randn(2, 48, 3, 32, dtype=dtype, device=device, requires_grad=True)
    d = torch.randn(2, 3, 48, dtype=torch.float32, device=device, requires_grad=True)

    def loss(a, b):
        return a.float().sin().sum() + (b.float() ** 2).sum()
    torch._dynamo.reset()
    compiled = torch.compile(chunked, backend="fusion", fullgraph=True)
    got = compiled(x, d)
    gx, gd = torch.autograd.grad(loss(*got), (x, d))
    want = chunked(x, d)
    wx, wd = torch.autograd.grad(loss(*want), (x, d))
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    assert_close(gx, wx, dtype)
    atol, rtol = TOL[dtype]
    assert_close(gd, wd, dtype, atol=atol * 100, rtol=rtol * 10)    # sums over 32 x 2
    # the forward's kernel is tiled; the backward's sum over (b, l) is a row kernel
    assert sources(cache_dir).count(TILED) == 1


# Row kernels (tiles.RowTile): a persistent row kernel whose rows are read or written along
# another row dim than its innermost one takes tiles of rows of both dims
ROWS_TILED = "r = tl.arange(0, XBLOCK)"
SWAPPED = "fl.swap_rows("


def segment_sums(x):
    """Mamba2's segment sum in small: x [b, l2, l, h] (h contiguous) summed along l2 over rows
    [b, h, l]; stored as [b, h, l, l2] and, exponentiated, as [b, h, l2, l] (l contiguous)."""
    y = torch.cumsum(x.permute(0, 3, 2, 1), dim=-1)
    return y.contiguous(), torch.exp(y).transpose(-1, -2).contiguous()


def norm_stored_along_rows(x, w):
    """An RMSNorm over p of rows [b, l, h], stored as computed and as [b, h, p, l]."""
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    return y.permute(0, 2, 3, 1).contiguous(), y


def row_check(fn, args, dtype, cache_dir, tiled: bool, swapped: bool | None = None):
    out, reports = compile_and_run(fn, args)
    assert kernel_count(reports) == 1
    for o, e in zip(out, scan_reference(fn, *args)):
        assert o.shape == e.shape and o.stride() == e.stride()
        assert_close(o, e, dtype)
    text = sources(cache_dir)
    assert (ROWS_TILED in text) == tiled
    if swapped is not None:
        assert (SWAPPED in text) == swapped
    return text


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 32, 64, 16), (3, 40, 24, 8), (1, 256, 16, 32)])
def test_a_row_kernel_read_along_another_row_dim_takes_tiles(cache_dir, device, dtype, shape):
    """Rows [b, h, l] of l2, read with h contiguous and written with l2 and with l
    contiguous: tiles of l by h, the read in the h-inner order and reordered (a row of 40:
    masked columns). Inputs scaled so that the exp of a sum of 256 stays in fp16's range."""
    x = torch.randn(shape, dtype=dtype, device=device) * 0.25
    text = row_check(segment_sums, (x,), dtype, cache_dir, tiled=True, swapped=True)
    assert "XBLOCK = min(max(XBLOCK, " in text


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_stored_along_a_row_dim_alone(cache_dir, device, dtype):
    """No access runs along the innermost row dim (h): a program takes rows of l alone, one
    h, so the rows' order walks l already and nothing is reordered."""
    x = torch.randn(2, 64, 8, 48, dtype=dtype, device=device)
    w = torch.randn(48, dtype=dtype, device=device)
    row_check(norm_stored_along_rows, (x, w), dtype, cache_dir, tiled=True, swapped=False)


def sums_stored_along_rows(x):
    """Rows [b, h, l] of l2 (x [b, h, l, l2], read along the rows), summed along them, stored
    with h contiguous ([b, l2, l, h]: along the row dim Y) and, exponentiated, with l
    contiguous ([b, h, l2, l]: along X)."""
    y = torch.cumsum(x, dim=-1)
    return y.permute(0, 3, 2, 1).contiguous(), torch.exp(y).transpose(-1, -2).contiguous()


# (shape, fp32 or half precision): (the least rows a program, whether 8 warps at least)
SECTOR_TILES = {((2, 16, 64, 32), 4): (8 * 8, False), ((2, 16, 64, 32), 2): (16 * 16, False),
                ((1, 8, 16, 256), 4): (8 * 8, True), ((1, 8, 16, 256), 2): (8 * 8, True),
                ((1, 16, 8, 40), 4): (8 * 8, False), ((1, 16, 8, 40), 2): (8 * 16, False)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 16, 64, 32), (1, 8, 16, 256), (1, 16, 8, 40)], ids=str)
def test_a_store_along_another_row_dim_takes_a_sector_of_it(cache_dir, device, dtype, shape):
    """A store along Y (h) gets a tile side of 32 bytes of h where h has them and the tile
    holds at most tiles.ROW_SECTOR_ELEMS elements (part sectors cost a read of memory each):
    l by 8 of h in fp32, by 16 in half precision, 8 of each where rows of 256 would pass
    16384 elements; at least 8 warps past 8192 elements a program. Rows of 40 columns: masked.
    Inputs scaled so that the exp of a sum of 256 stays in fp16's range."""
    x = torch.randn(shape, dtype=dtype, device=device) * 0.05
    text = row_check(sums_stored_along_rows, (x,), dtype, cache_dir, tiled=True, swapped=True)
    least, warps = SECTOR_TILES[shape, x.element_size()]
    assert f"XBLOCK = min(max(XBLOCK, {least}), " in text
    assert ("num_warps = max(num_warps, 8)" in text) == warps


def test_loads_along_another_row_dim_keep_the_least_tile(cache_dir, device):
    """Loads along Y (h) alone keep ROW_MIN_YT values of h (wider tiles measured no faster
    for Mamba2's segment sums, tiles.ROW_SECTOR_ELEMS) and the launcher's warps."""
    from fusion_compiler.codegen import tiles
    x = torch.randn(1, 256, 16, 32, dtype=torch.float32, device=device) * 0.25
    text = row_check(segment_sums, (x,), torch.float32, cache_dir, tiled=True, swapped=True)
    assert f"XBLOCK = min(max(XBLOCK, {8 * tiles.ROW_MIN_YT}), " in text
    assert "num_warps = max(" not in text


@pytest.mark.parametrize("shape", [(2, 32, 64, 6), (2, 32, 12, 3)])
def test_row_dims_tiles_cannot_divide_keep_consecutive_rows(cache_dir, device, shape):
    """h of 6 or 3 (no power of two of at least 4 divides it): XBLOCK consecutive rows."""
    x = torch.randn(shape, dtype=torch.float32, device=device)
    row_check(segment_sums, (x,), torch.float32, cache_dir, tiled=False)


def test_the_option_turns_row_tiles_off(cache_dir, device, monkeypatch):
    monkeypatch.setenv("FUSION_COMPILER_TILES", "0")
    x = torch.randn(2, 32, 64, 16, dtype=torch.bfloat16, device=device)
    text = row_check(segment_sums, (x,), torch.bfloat16, cache_dir, tiled=False)
    assert "XBLOCK = min(max(" not in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_through_tiled_row_kernels(cache_dir, device, dtype):
    """Gradients through a tiled forward. The backward's reversed cumsum reads and writes
    along its rows and along l, its innermost row dim: its rows stay consecutive."""
    x = (torch.randn(2, 32, 64, 16, dtype=dtype, device=device) * 0.25).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(segment_sums, backend="fusion", fullgraph=True)
    got = compiled(x)
    weights = [torch.randn_like(g) for g in got]

    def loss(outs):
        return sum((o.float() * w.to(o.device).float()).sum() for o, w in zip(outs, weights))
    (gx,) = torch.autograd.grad(loss(got), (x,))
    xr = x.detach().to(scan_device(x)).requires_grad_()     # eager's reference
    want = segment_sums(xr)
    (wx,) = torch.autograd.grad(loss(want), (xr,))
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    atol, rtol = TOL[dtype]
    assert_close(gx, wx, dtype, atol=atol * 10, rtol=rtol * 4)     # reversed sums of 32
    assert sources(cache_dir).count(ROWS_TILED) == 1


@pytest.mark.parametrize("y,itemsize,row,steps,want", [
    (32, 4, 256, (32, 8192), True),     # Mamba2's G: h of 32 fp32, rows of 256 (8 x 8 tiles)
    (32, 2, 256, (32, 8192), False),    # in bf16 a sector of h needs 8 x 16 x 256 elements
    (4, 4, 256, (4, 32), True),         # all of h, l stepping over it: runs of 4 x 8
    (4, 4, 256, (64, 1024), False),     # all of h, nothing stepping over it: 16-byte runs
    (12, 4, 64, (12, 12), False),       # no power of two of 8 divides 12, nor is 12 one
    (2, 4, 64, (2, 2), False),          # under ROW_MIN_YT: no tile at all
    (64, 4, 4096, (64, 1), False),      # rows of 4096: no tile fits
])
def test_which_stores_along_a_row_dim_a_tile_writes_in_sectors(y, itemsize, row, steps, want):
    """tiles.row_sector_reachable, by which read_beside refuses a layout copy a row kernel
    would write in part sectors (Lowering._check_beside_runs)."""
    from fusion_compiler.codegen import tiles
    assert tiles.row_sector_reachable(y, itemsize, row, steps) is want


def three_layouts(G, A, B):
    """Mamba2's backward product in small (transformers 5.17): G [b, c, l, s, h] (h
    contiguous) and A [b, h, c, l, s] times each other in [b, c, h, l, s], and B times A
    transposed along (l, s): three dims that accesses walk contiguously (h, s and l)."""
    Ap = A.permute(0, 2, 1, 3, 4)
    return ((G.permute(0, 1, 4, 2, 3) * Ap).contiguous(), B * Ap,
            (B.mT * Ap.mT).contiguous())


@pytest.mark.parametrize("dtype,shape,tile", [
    (torch.float32, (1, 2, 8, 16), 3), (torch.float32, (2, 3, 16, 32), 3),
    (torch.float32, (1, 2, 12, 16), 2), (torch.bfloat16, (2, 3, 8, 32), 2),
    (torch.float16, (1, 2, 16, 16), 2)], ids=str)
def test_a_third_dim_walked_contiguously_gets_a_3d_tile(cache_dir, device, dtype, shape, tile):
    """h, s and l each walked contiguously by some access: fp32 takes a tile of a sector (8)
    of each (Z: h, of 8 or 16); h of 12 (4 divides it) or 2-byte values (16 of each side
    would be 4096 elements) keep the 2-d tile of (l, s), h one value a program."""
    b, c, h, l = shape
    G = torch.randn(b, c, l, l, h, dtype=dtype, device=device)
    A = torch.randn(b, h, c, l, l, dtype=dtype, device=device)
    B = torch.randn(b, c, h, l, l, dtype=dtype, device=device)
    text = check(three_layouts, (G, A, B), dtype, cache_dir, tiled=True)
    assert ("zo = tl.arange(0, 8)[None, None, :]" in text) == (tile == 3)
    assert "mask=" not in text.split("def launch")[0]
