"""Pointwise kernels over 2-d tiles, where some of their memory is walked along another dim.

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
the 1-d kernel, as a part of a multi-part kernel too.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .indexing import affine_coeffs
from .statements import all_stores

XT_MAX = 64         # X values a tile: 256 bytes of fp32, 128 of bf16 contiguous a row
MIN_RUN = 16        # contiguous elements a tile must give each access along X and along Y
MIN_SHARE = 8       # the transposed accesses' share of the kernel's bytes, at least 1 / this


@dataclass(frozen=True)
class Tile:
    """A tiled pointwise kernel over ``dims`` ((sym, size), outermost first): ``x`` (the
    innermost) walked ``xt`` a tile, ``y`` walked ``BLOCK // xt`` (at most ``cap // xt``);
    ``names``: each dim's variable."""
    dims: tuple
    x: sympy.Symbol
    y: sympy.Symbol
    xt: int
    cap: int
    names: dict


def _pow2_divisor(n: int) -> int:
    return n & -n


def plan(lk, syms: list, sizes: list, subs: dict):
    """The tiling of the pointwise kernel ``lk`` over its coalesced dims ``syms`` of
    ``sizes`` (``subs``: the dims coalescing dropped, as 0), or None: static sizes, an
    innermost dim and a transposed one each at least ``MIN_RUN`` in powers of two, and
    accesses along the transposed dim at least 1 / ``MIN_SHARE`` of the bytes."""
    if len(syms) < 2 or not all(sympy.sympify(n).is_Integer for n in sizes):
        return None
    size = {s: int(n) for s, n in zip(syms, sizes)}
    x = syms[-1]
    xt = min(XT_MAX, _pow2_divisor(size[x]))
    if xt < MIN_RUN:
        return None
    accesses = [(lk.ir.inputs[in_id].dtype.itemsize, off) for _, in_id, off, _ in lk.loads]
    accesses += [(lk.ir.values[lk.ir.outputs[st[1]]].dtype.itemsize, st[3])
                 for st in all_stores(lk)]
    total, across = 0, {}
    for itemsize, off in accesses:
        co = affine_coeffs(sympy.sympify(off).xreplace(subs), set(syms))
        if co is None:
            continue
        nbytes = itemsize
        for s in syms:
            if co.get(s, 0) != 0:
                nbytes *= size[s]
        total += nbytes
        unit = [s for s in syms if co.get(s, 0) == 1]
        if unit and unit[0] != x and co.get(x, 0) != 0:
            across[unit[0]] = across.get(unit[0], 0) + nbytes
    if not across:
        return None
    y = max(across, key=across.get)
    yt = _pow2_divisor(size[y])
    if yt < MIN_RUN or across[y] * MIN_SHARE < total:
        return None
    names = {s: sympy.Symbol(f"i{k}", integer=True, nonnegative=True) for k, s in enumerate(syms)}
    return Tile(tuple(size.items()), x, y, xt, yt * xt, names)


def index_lines(tile: Tile) -> list:
    """Lines giving each dim's variable from ``pid``: X's and Y's blocks of the tile, the other
    dims' scalars, taken innermost first."""
    yb = f"(BLOCK // {tile.xt})"
    lines = [f"xo = tl.arange(0, {tile.xt})[None, :]",
             f"yo = tl.arange(0, {yb})[:, None]",
             "t = pid"]
    for k in reversed(range(len(tile.dims))):
        s, n = tile.dims[k]
        name = tile.names[s].name
        if s == tile.x:
            count, block, offs = str(n // tile.xt), str(tile.xt), "xo"
        elif s == tile.y:
            count, block, offs = f"({n} // {yb})", yb, "yo"
        else:
            count, block, offs = str(n), None, None
        at = "t" if k == 0 else f"(t % {count})"
        if block is None:
            lines.append(f"{name} = {at}")
        elif count == "1":
            lines.append(f"{name} = {offs}")
        else:
            lines.append(f"{name} = {at} * {block} + {offs}")
        if k and count != "1":
            lines.append(f"t = t // {count}")
    lines.append(f"xmask = tl.full([{yb}, {tile.xt}], True, tl.int1)  # tiles divide their dims")
    return lines
