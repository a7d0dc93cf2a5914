"""Pointwise kernels over 2-d (or 3-d) tiles, where some of their memory is walked along another
dim.

A pointwise kernel's linear index walks its iteration dims in one order (the largest output's
memory order, kernel_source.memory_order). An access whose stride-1 dim is another one (an
output stored transposed, as transformers 5.17's Mamba2 stores its chunked B and C in
[c, h, n, l] from a [c, l, h, n] iteration) then touches one element per 32-byte sector in
each warp's access: on the H100 such a kernel of 221 MB ran 655 us, its bytes 75 us.

Here the kernel takes tiles of ``BLOCK // XT`` values of that dim (Y) by ``XT`` of the
innermost one (X), every other dim one value a program. Each dim's index is its own variable
(``i0``, ``i1``, ...), so every address is affine in them and Triton sees which axis of the
tile each access walks contiguously: its coalescing gives each load and store the layout of
its own, and the transposition goes through shared memory. Tiles divide their dims exactly
(the launcher caps BLOCK at ``cap``), so a tiled kernel has no masks and as many programs as
the 1-d kernel, as a part of a multi-part kernel too. Where a third dim (Z) is walked
contiguously by enough of the bytes, the tile is [Y, X, Z], a sector of each (``_third_dim``).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from torch.utils._sympy.functions import FloorDiv, Mod, ModularIndexing, PythonMod

from .indexing import affine_coeffs, digits
from .statements import all_stores

XT_MAX = 64         # X values a tile: 256 bytes of fp32, 128 of bf16 contiguous a row
MIN_RUN = 16        # contiguous elements a tile must give each access along X and along Y
MIN_SHARE = 8       # the transposed accesses' share of the kernel's bytes, at least 1 / this
TILE3_SECTOR = 32   # bytes: each side of a 3-d tile (``_third_dim``)
TILE3_MAX = 1024    # elements of a 3-d tile of a sector a side, at most
_COLS = sympy.Symbol("cols", integer=True, nonnegative=True)   # kernel_source.COLS


@dataclass(frozen=True)
class Tile:
    """A tiled pointwise kernel over ``dims`` ((sym, size), outermost first): ``x`` (the
    innermost) walked ``xt`` a tile, ``y`` walked ``BLOCK // xt`` (at most ``cap // xt``);
    ``names``: each dim's variable; ``splits``: the kernel's dims split in two."""
    dims: tuple
    x: sympy.Symbol
    y: sympy.Symbol
    xt: int
    cap: int
    names: dict
    splits: "Splits"
    z: sympy.Symbol | None = None       # a third dim (``plan``), walked ``zt`` a tile
    zt: int = 1

    def apply(self, e):
        """The kernel's expression ``e`` in the tile's variables."""
        return self.splits.apply(e).xreplace(self.names)

    @property
    def vector(self) -> set:
        """The variables that are blocks of the tile (the others one value a program)."""
        return {self.names[d] for d in (self.x, self.y, self.z) if d is not None}


def _pow2_divisor(n: int) -> int:
    return n & -n


class Splits:
    """Dims an access reads in two digits (a view of [b, 1024, d] as [b, 4, 256, d] reads
    ``(L // 256, L % 256)``), each split into two dims (``hi``, ``lo``): every address is then
    affine in the new dims, and a tile may take either. ``dims``: {dim: (k, hi, lo)}, the dim
    equal to ``k * hi + lo``; one digit boundary a dim (a dim read at several is kept)."""

    def __init__(self, syms: list, size: dict, exprs: list):
        bounds = {}
        for e in exprs:
            for atom in sympy.sympify(e).atoms(FloorDiv, ModularIndexing, Mod, PythonMod,
                                               sympy.Mod):
                d = digits(atom)
                if d is None or d[0] not in size:
                    continue
                x, lo, hi = d
                bounds.setdefault(x, set()).update(
                    b for b in (lo, hi) if b is not None and 1 < b < size[x])
        self.dims = {}
        for x, ks in bounds.items():
            if len(ks) == 1 and size[x] % next(iter(ks)) == 0:
                self.dims[x] = (next(iter(ks)),
                                sympy.Symbol(f"{x.name}_hi", integer=True, nonnegative=True),
                                sympy.Symbol(f"{x.name}_lo", integer=True, nonnegative=True))
        self.syms = [t for x in syms for t in (self.dims[x][1:] if x in self.dims else (x,))]
        self.size = {}
        for x in syms:
            if x in self.dims:
                k, hi, lo = self.dims[x]
                self.size[hi], self.size[lo] = size[x] // k, k
            else:
                self.size[x] = size[x]

    def apply(self, e):
        """``e`` in the split dims (exact: each split dim is ``k * hi + lo``, 0 <= lo < k)."""
        e = sympy.sympify(e)
        if not self.dims or not e.free_symbols & set(self.dims):
            return e

        def digit(atom):
            x, lo_b, hi_b = digits(atom)
            k, hi, lo = self.dims[x]
            if (lo_b, hi_b) == (1, k):                  # x % k
                return lo
            if lo_b == k and (hi_b is None or hi_b >= k * self.size[hi]):   # x // k
                return hi
            return atom.xreplace({x: k * hi + lo})      # any other digits: as they were
        e = e.replace(lambda a: (digits(a) or (None,))[0] in self.dims, digit)
        return e.xreplace({x: k * hi + lo for x, (k, hi, lo) in self.dims.items()})


def plan(lk, syms: list, sizes: list, subs: dict):
    """The tiling of the pointwise kernel ``lk`` over its coalesced dims ``syms`` of
    ``sizes`` (``subs``: the dims coalescing dropped, as 0), or None: static sizes, an
    innermost dim and a transposed one each at least ``MIN_RUN`` in powers of two, and
    accesses along the transposed dim at least 1 / ``MIN_SHARE`` of the bytes."""
    if not all(sympy.sympify(n).is_Integer for n in sizes):
        return None
    splits, accesses = _accesses(lk, syms, sizes, subs)
    syms, size = splits.syms, splits.size
    if len(syms) < 2:
        return None
    x = syms[-1]
    xt = min(XT_MAX, _pow2_divisor(size[x]))
    if xt < MIN_RUN:
        return None
    total, across = 0, {}
    for _, co, _, nbytes, unit, _ in accesses:
        total += nbytes
        if unit is not None and unit != x and co.get(x, 0) != 0:
            across[unit] = across.get(unit, 0) + nbytes
    if not across:
        return None
    y = max(across, key=across.get)
    yt = _pow2_divisor(size[y])
    if yt < MIN_RUN or across[y] * MIN_SHARE < total:
        return None
    names = {s: sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k, s in enumerate(syms)}
    dims = tuple((s, size[s]) for s in syms)
    third = _third_dim(accesses, size, x, y, total)
    if third is not None:
        # each side a sector of its accesses (X and Z fixed, Y the rest of BLOCK)
        z, xt, zt = third
        return Tile(dims, x, y, xt, yt * xt * zt, names, splits, z, zt)
    return Tile(dims, x, y, xt, yt * xt, names, splits)


def _sector_side(accesses, unit) -> int:
    """Elements of a 32-byte sector of the narrowest access walking ``unit`` contiguously."""
    return max(TILE3_SECTOR // itemsize for itemsize, _, _, _, u, _ in accesses if u == unit)


def _third_dim(accesses, size: dict, x, y, total: int):
    """(Z, X's side, Z's side): a dim Z besides a tile's X and Y that accesses of at least
    1 / ``MIN_SHARE`` of the bytes walk contiguously while stepping along X or Y (each element
    of a [Y, X] tile then its own sector), and a sector of X and of Z; or None. Mamba2's
    backward (transformers 5.17, 8 x 1024 at 4 x 1024) multiplies a [.., l, s, h] operand (h
    contiguous) into [.., h, l, s] outputs beside two operands read transposed along (s, l):
    805 MB, each kernel file alone on the H100
    (benchmarks/kernel_files.py, session 70, outputs identical), us: tiled over (l, s) 416,
    this tile of [16, 8, 8] (l, s, h) on 4 warps 384; hand-written [32, 8, 8] on 8 warps 370,
    [16, 8, 32] 389, [8, 8, 32] 404-422, [8, 8, 8] 404 (the floor: 267). Z, X and Y each
    take a sector a tile: Z and X sides powers of two dividing their dims, the tile at most
    ``TILE3_MAX`` elements for the least Y side of a sector."""
    bytes_by = {}
    for itemsize, co, _, nbytes, unit, _ in accesses:
        if unit is not None and unit not in (x, y) and (co.get(x, 0) or co.get(y, 0)):
            bytes_by[unit] = bytes_by.get(unit, 0) + nbytes
    if not bytes_by:
        return None
    z = max(bytes_by, key=bytes_by.get)
    if bytes_by[z] * MIN_SHARE < total:
        return None
    walked = {u for _, _, _, _, u, _ in accesses}
    if not {x, y} <= walked:        # (Z is walked: it was picked so)
        return None
    sides = {d: _sector_side(accesses, d) for d in (x, y, z)}
    if any(_pow2_divisor(size[d]) < n for d, n in sides.items()) \
            or sides[x] * sides[y] * sides[z] > TILE3_MAX:
        return None
    return z, sides[x], sides[z]


def _accesses(lk, syms: list, sizes: list, subs: dict, cols: int = 1):
    """(Splits of the dims ``syms`` of ``sizes``, [(itemsize, {dim: coefficient}, whether
    predicated, bytes, the dim of coefficient 1 or None, whether a store)] of each load and
    store of ``lk`` affine in the split dims; a row kernel's column ``cols`` among the
    coefficients, its ``cols`` columns among the bytes)."""
    accesses = [(lk.ir.inputs[in_id].dtype.itemsize, off, bool(ps))
                for _, in_id, off, ps in lk.loads]
    loads = len(accesses)
    accesses += [(lk.ir.values[lk.ir.outputs[st[1]]].dtype.itemsize, st[3], False)
                 for st in all_stores(lk)]
    offs = [sympy.sympify(off).xreplace(subs) for _, off, _ in accesses]
    splits = Splits(list(syms), {s: int(n) for s, n in zip(syms, sizes)}, offs)
    size = {**splits.size, _COLS: cols}
    out = []
    for k, ((itemsize, _, guarded), off) in enumerate(zip(accesses, offs)):
        co = affine_coeffs(splits.apply(off), set(size))
        if co is None:
            continue
        nbytes = itemsize
        for s, n in size.items():
            if co.get(s, 0) != 0:
                nbytes *= n
        unit = next((s for s in splits.syms if co.get(s, 0) == 1), None)
        out.append((itemsize, co, guarded, nbytes, unit, k >= loads))
    return splits, out


def index_lines(tile: Tile) -> list:
    """Lines giving each dim's variable from ``pid``: X's, Y's (and Z's) blocks of the tile,
    the other dims' scalars, taken innermost first."""
    n = dict(tile.dims)
    if tile.z is None:
        yb = f"(BLOCK // {tile.xt})"
        aranges = [f"xo = tl.arange(0, {tile.xt})[None, :]", f"yo = tl.arange(0, {yb})[:, None]"]
        shape = f"[{yb}, {tile.xt}]"
    else:
        yb = f"(BLOCK // {tile.xt * tile.zt})"
        aranges = [f"xo = tl.arange(0, {tile.xt})[None, :, None]",
                   f"yo = tl.arange(0, {yb})[:, None, None]",
                   f"zo = tl.arange(0, {tile.zt})[None, None, :]"]
        shape = f"[{yb}, {tile.xt}, {tile.zt}]"
    blocks = {tile.x: (str(n[tile.x] // tile.xt), str(tile.xt), [(tile.names[tile.x], "xo")]),
              tile.y: (f"({n[tile.y]} // {yb})", yb, [(tile.names[tile.y], "yo")])}
    if tile.z is not None:
        blocks[tile.z] = (str(n[tile.z] // tile.zt), str(tile.zt), [(tile.names[tile.z], "zo")])
    return (aranges + _pid_lines(tile.dims, tile.names, blocks)
            + [f"xmask = tl.full({shape}, True, tl.int1)  # tiles divide their dims"])


def _pid_lines(dims, names: dict, blocks: dict) -> list:
    """Lines taking each dim's variable from ``pid``, innermost first: a dim in ``blocks``
    ({dim: (count, block, [(variable, offsets)])}) its block's start plus each offsets, any
    other dim one value a program."""
    lines = ["t = pid"]
    for k in reversed(range(len(dims))):
        s, n = dims[k]
        count, block, parts = blocks.get(s, (str(n), None, None))
        at = "t" if k == 0 else f"(t % {count})"
        if block is None:
            lines.append(f"{names[s].name} = {at}")
        else:
            start = "" if count == "1" else f"{at} * {block} + "
            lines += [f"{var.name} = {start}{offs}" for var, offs in parts]
        if k and count != "1":
            lines.append(f"t = t // {count}")
    return lines


# Row kernels. A persistent row kernel takes XBLOCK consecutive rows a program: an access whose
# stride-1 dim is its innermost row dim (X) reads runs of XBLOCK along the rows, one along the
# row (the columns) runs of the row; an access whose stride-1 dim is another row dim (Y) reads
# one element per sector. Mamba2's backward (transformers 5.17, 8 x 1024 at batch 4, H100):
# the segment-sum cumsum over [b, c, h, l, l] rows reads a [b, c, l, l, h] operand (h
# contiguous, 268 MB of its 806) and ran 740 us for 270 us of bytes; a SwiGLU-gradient row
# kernel over [b, c, l, h] rows stores three outputs with l contiguous, 525 us.
# A tiled row kernel takes ``XT`` values of X by ``XBLOCK // XT`` of Y a program. Accesses along
# Y are written in the other order (Y inner) and their values reordered through
# triton_lib.swap_rows, so each access walks its own stride-1 dim in runs of its tile side.
ROW_SECTOR = 32         # bytes: the run a tile side should give each access
ROW_MIN_YT = 4          # Y values a tile at least
ROW_MIN_XT = 8          # X values a tile at least, where accesses run along X
ROW_ELEMS_MAX = 8192    # elements a program at most (launch.STRIDED_ELEMS)
# A store along Y whose tile side is under a sector writes part sectors, each of which the L2
# completes from memory when it writes the sector back. Mamba2's segment-sum kernel writing
# G [b, c, l, s, h] (fp32, h contiguous) beside its product (row_outputs.read_beside), 403 MB,
# each kernel file alone (benchmarks/kernel_files.py, H100, session 68), us: 8 x 4 rows on 8
# warps 576, 8 x 8 on 4 / 8 / 16 warps 371 / 261 / 280, 8 x 16 397-1936; unfused (its clone
# kernel and the row kernel reading G) 94 + 225. Such a tile takes Y a sector where it holds
# at most ``ROW_SECTOR_ELEMS`` elements, on at least ``ROW_SECTOR_WARPS`` warps. Loads along Y
# keep ``ROW_MIN_YT``: the row kernel reading G along h ran 225 at 8 x 4, 204 at 8 x 8 (8 warps)
# and 298-309 at 8 x 16 (kernel_files.py), 199 / 215 / 182 in benchmarks/row_tiles.py: no
# rule in that. Session 72 (H100) tried a sector of Y for loads too (8 x 8 on 8 warps for fp32):
# the light 537-MB segment-sum cumsum (32 ops) went from 348 to 269 us (8 x 4 on 8 or 16 warps:
# 349, 351: the tile, not the warps), but the 806-MB one (66 ops, two cumsums, four stores) from
# 742 to 1615, and the training step from 33313 / 33338 to 33560 / 33599 us: not taken. ptxas
# (sm_90): the light one 168 -> 169 registers, no spills; the heavy one 255 registers without
# spills at 8 x 4 and 384 bytes of spills at 8 x 8 (shared memory 16 -> 64 KB).
ROW_SECTOR_ELEMS = 16384
ROW_SECTOR_WARPS = 8


def _row_x_side(xt: int, rblock: int):
    """The tile's X values from ``xt`` for rows of ``rblock``: halved to ``ROW_MIN_XT`` while
    ``ROW_MIN_YT`` rows of Y pass ``ROW_ELEMS_MAX`` elements (a long row: shorter runs along
    X, half a sector of bf16 at 8); None where even that does not fit (no tile)."""
    while xt > ROW_MIN_XT and xt * ROW_MIN_YT * rblock > ROW_ELEMS_MAX:
        xt //= 2
    return xt if xt * ROW_MIN_YT * rblock <= ROW_ELEMS_MAX else None


def _stored_y_side(xt: int, yt: int, itemsize: int, rblock: int) -> int:
    """Y values a program at least where a store of ``itemsize`` walks Y (of which ``yt``
    divide it): a sector of Y, halved while the tile passes ``ROW_SECTOR_ELEMS``."""
    least = max(ROW_MIN_YT, min(yt, ROW_SECTOR // itemsize))
    while least > ROW_MIN_YT and xt * least * rblock > ROW_SECTOR_ELEMS:
        least //= 2
    return least


def row_sector_reachable(y_size, itemsize: int, row_length, steps) -> bool:
    """Whether a tile of rows (``row_plan``) gives a store along a row dim of ``y_size``
    other than the innermost runs of a sector or more: the plan's own sides (X a sector of
    this itemsize), and Y's side either a sector or all of Y with X or the column stepping
    over it (``steps``: the store's strides along X and the column), the store then writing
    runs of Y by the tile's X or planes of Y by the row. Where X's accesses are narrower or X
    is shorter the plan's tile is smaller than assumed here, which only makes this answer
    cautious; the plan takes as Y the one dim most bytes walk."""
    if not all(sympy.sympify(v).is_Integer for v in (y_size, row_length)):
        return False
    y, need = int(y_size), max(1, ROW_SECTOR // itemsize)
    rblock = 1 << (int(row_length) - 1).bit_length()
    xt, yt = _row_x_side(need, rblock), _pow2_divisor(y)
    if xt is None or yt < ROW_MIN_YT:
        return False
    least = _stored_y_side(xt, yt, itemsize, rblock)
    return least >= need or (least == y and y in steps)


@dataclass(frozen=True)
class RowTile:
    """A tiled persistent row kernel over row ``dims`` ((sym, size), outermost first): ``x``
    (the innermost) walked ``xt`` a program, ``y`` walked ``XBLOCK // xt``, XBLOCK in
    [``lo``, ``cap``] on at least ``warps`` warps; ``names``: each dim's variable in the
    X-inner order, ``swapped`` in the Y-inner order (the other dims' the same)."""
    dims: tuple
    x: sympy.Symbol
    y: sympy.Symbol
    xt: int
    lo: int
    cap: int
    warps: int
    names: dict
    swapped: dict
    splits: Splits

    def apply(self, e):
        """The kernel's expression ``e`` in the tile's X-inner variables."""
        return self.splits.apply(e).xreplace(self.names)

    def turned(self, off):
        """The access at ``off`` (in ``names``) in the Y-inner order where it walks Y
        contiguously along the row and across X, else None."""
        if self.xt == 1:        # one X value a program: the X-inner order walks Y already
            return None
        nx, ny = self.names[self.x], self.names[self.y]
        co = affine_coeffs(off, {nx, ny, _COLS})
        if co is None or co.get(ny, 0) != 1 or co.get(nx, 0) == 0 or co.get(_COLS, 0) == 0:
            return None
        return off.xreplace({self.names[s]: v for s, v in self.swapped.items()})


def row_plan(lk, syms: list, sizes: list, subs: dict):
    """The tiling of the persistent row kernel ``lk`` over its coalesced row dims ``syms`` of
    ``sizes`` (``subs``: the dims coalescing dropped, as 0, and the column as ``cols``), or
    None: static sizes, accesses along a row dim Y other than the innermost one (X) at least
    1 / ``MIN_SHARE`` of the bytes, a power of two of at least ``ROW_MIN_YT`` dividing Y, and a
    tile of ``ROW_MIN_YT`` rows of Y that fits ``ROW_ELEMS_MAX`` elements."""
    n = lk.shape[-1]
    if not all(sympy.sympify(s).is_Integer for s in list(sizes) + [n]):
        return None
    splits, accesses = _accesses(lk, syms, sizes, subs, int(n))
    syms, size = splits.syms, {**splits.size, _COLS: int(n)}
    if len(syms) < 2:
        return None
    x = syms[-1]
    total, across, along_x, stored = 0, {}, [], {}
    for itemsize, co, guarded, nbytes, unit, store in accesses:
        total += nbytes
        if unit == x:
            along_x.append(itemsize)
        elif unit is not None and co.get(x, 0) != 0 and co.get(_COLS, 0) != 0 and not guarded:
            across[unit] = across.get(unit, 0) + nbytes
            if store:
                stored[unit] = min(stored.get(unit, itemsize), itemsize)
    if not across:
        return None
    y = max(across, key=across.get)
    if across[y] * MIN_SHARE < total:
        return None
    xt = min(_pow2_divisor(size[x]), ROW_SECTOR // min(along_x)) if along_x else 1
    yt = _pow2_divisor(size[y])
    rblock = 1 << (size[_COLS] - 1).bit_length()
    xt = _row_x_side(xt, rblock)
    if xt is None or yt < ROW_MIN_YT:
        return None
    # Y values a program at least: a sector for a store along Y
    least = _stored_y_side(xt, yt, stored[y], rblock) if y in stored else ROW_MIN_YT
    lo = xt * least
    cap = xt * min(yt, max(least, ROW_ELEMS_MAX // (rblock * xt)))
    names = {s: sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k, s in enumerate(syms)}
    swapped = dict(names)
    for s in (x, y):
        swapped[s] = sympy.Symbol(f"j{syms.index(s)}", integer=True, nonnegative=True)
    warps = ROW_SECTOR_WARPS if lo * rblock > ROW_ELEMS_MAX else 1
    return RowTile(tuple((s, size[s]) for s in syms), x, y, xt, lo, cap, warps, names, swapped,
                   splits)


def row_index_lines(tile: RowTile) -> list:
    """Lines giving each row dim's variable from ``pid``, in both orders (X inner: ``i``;
    Y inner: ``j``), the rows' mask (true: tiles divide their dims)."""
    yb = f"(XBLOCK // {tile.xt})"
    n = dict(tile.dims)
    x, y, i, j = tile.x, tile.y, tile.names, tile.swapped
    blocks = {x: (str(n[x] // tile.xt), str(tile.xt),
                  [(i[x], f"(r % {tile.xt})"), (j[x], f"(r // {yb})")]),
              y: (f"({n[y]} // {yb})", yb, [(i[y], f"(r // {tile.xt})"), (j[y], f"(r % {yb})")])}
    return (["r = tl.arange(0, XBLOCK)[:, None]"] + _pid_lines(tile.dims, i, blocks)
            + ["rmask = tl.full([XBLOCK, 1], True, tl.int1)  # tiles divide their dims"])
