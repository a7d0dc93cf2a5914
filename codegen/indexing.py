"""Index arithmetic: views as index maps, dimension coalescing, and printing to Triton.

An index is a tuple of sympy expressions in the kernel's iteration symbols, one per dimension of
the value it addresses. Views, broadcasts, permutes, slices and cat only rewrite indices; the data
moves once, in the loads and stores of the kernel.

Coalescing merges adjacent iteration dimensions (d, d+1) when every memory access is affine in
them with coef(d) == coef(d+1) * size(d+1), so a contiguous [B, S, H] access prints as one
linear offset instead of a chain of divisions.
"""
from __future__ import annotations

import sympy
from torch.utils._sympy.functions import (
    CleanDiv, FloorDiv, Max, Min, Mod, ModularIndexing, PowByNatural, PythonMod)

from .kernel_ir import NotFusable


def broadcast_index(index: tuple, out_shape: tuple, arg_shape: tuple) -> tuple:
    """Index into an operand broadcast (numpy rules) to ``out_shape``."""
    lead = len(out_shape) - len(arg_shape)
    if lead < 0:
        raise NotFusable(f"operand of rank {len(arg_shape)} wider than result {len(out_shape)}")
    return tuple(sympy.Integer(0) if s == 1 else index[lead + k] for k, s in enumerate(arg_shape))


def linearize(index, shape):
    """The row-major position of ``index`` in ``shape``, with the digits of one value put back
    together (``join_digits``: a reshape's index mapped back through the inverse reshape, a
    GroupNorm's [N, C, H, W] output read from its rows, gives the rows' own position)."""
    lin, mult = sympy.Integer(0), sympy.Integer(1)
    for i, s in zip(reversed(index), reversed(shape)):
        lin += i * mult
        mult *= s
    return join_digits(sympy.expand(lin))


def digits(atom):
    """(x, lo, hi) where ``atom`` is x's digits between lo and hi ((x // lo) % (hi // lo); hi
    None: no upper bound), else None."""
    if isinstance(atom, FloorDiv) and atom.args[1].is_Integer:
        return atom.args[0], int(atom.args[1]), None
    if isinstance(atom, ModularIndexing) and atom.args[1].is_Integer and atom.args[2].is_Integer:
        return atom.args[0], int(atom.args[1]), int(atom.args[1]) * int(atom.args[2])
    if isinstance(atom, (Mod, PythonMod, sympy.Mod)) and atom.args[1].is_Integer:
        return atom.args[0], 1, int(atom.args[1])
    return None


def join_digits(lin):
    """``lin`` with each set of terms ``c * b * ((x // b) % m)`` (and ``c * b * (x // b)``)
    that covers adjacent ranges of x's digits merged: ``35 * (x // 35) + 7 * ((x // 7) % 5) +
    x % 7`` is ``x``. Exact for nonnegative x: each term is c * (x mod hi - x mod lo)."""
    groups, rest = {}, []
    for term in sympy.Add.make_args(lin):
        coeff, atom = term.as_coeff_Mul()
        d = digits(atom) if isinstance(atom, (FloorDiv, ModularIndexing)) else None
        if d is None:
            rest.append(term)
            continue
        x, lo, hi = d
        if not coeff.is_Integer or int(coeff) % lo:
            rest.append(term)
            continue
        groups.setdefault((x, int(coeff) // lo), []).append((lo, hi, term))
    out = list(rest)
    for (x, c), spans in groups.items():
        spans.sort(key=lambda t: t[0])
        merged = [list(spans[0][:2]) + [[spans[0][2]]]]
        for lo, hi, term in spans[1:]:
            if merged[-1][1] == lo:
                merged[-1][1] = hi
                merged[-1][2].append(term)
            else:
                merged.append([lo, hi, [term]])
        for lo, hi, terms in merged:
            if len(terms) == 1:
                out.append(terms[0])
            elif hi is None:
                out.append(c * x if lo == 1 else c * lo * FloorDiv(x, lo))
            else:
                out.append(c * lo * ModularIndexing(x, lo, hi // lo))
    return sympy.Add(*out)


def delinearize(lin, shape, ranges=None):
    """The index in ``shape`` of row-major position ``lin``. With ``ranges`` ({symbol: its
    exclusive upper bound}, the iteration's own symbols), a position that is a sum of
    nonnegative integer multiples of bounded symbols is split exactly where it can be: the
    terms whose coefficients a dimension's stride divides go to the outer dims, the rest stays
    if it cannot reach that stride (r1 * K + col with col < K: (r1, col), not (r1 + col // K,
    col % K))."""
    if ranges:
        split = _split(lin, shape, ranges)
        if split is not None:
            return split
    out, mult = [], sympy.Integer(1)
    for k in reversed(range(len(shape))):
        if shape[k] == 1:
            out.append(sympy.Integer(0))
        elif k == 0:
            out.append(FloorDiv(lin, mult))
        else:
            out.append(ModularIndexing(lin, mult, shape[k]))
        mult *= shape[k]
    return tuple(reversed(out))


def _split(lin, shape, ranges):
    """``delinearize`` without floor divisions, or None where that is not exact."""
    if not all(sympy.sympify(s).is_Integer for s in shape):
        return None
    terms = []
    for term in sympy.Add.make_args(sympy.expand(lin)):
        coeff, rest = term.as_coeff_Mul()
        bounded = rest == 1 or (rest.is_Symbol and rest in ranges)
        if not coeff.is_Integer or coeff < 0 or not bounded:
            return None
        top = sympy.Integer(1) if rest == 1 else sympy.sympify(ranges[rest]) - 1   # largest
        if not top.is_Integer:
            return None
        if coeff:
            terms.append((int(coeff), rest, int(top)))
    out, stride = [], 1
    strides = []
    for s in reversed(shape):
        strides.append(stride)
        stride *= int(s)
    strides.reverse()
    for k, size in enumerate(shape):        # outer dims first: each takes the terms it divides
        st, nxt = strides[k], (strides[k - 1] if k else None)
        mine = [(c, r, m) for c, r, m in terms if c % st == 0 and (nxt is None or c < nxt)]
        if sum(c // st * m for c, _, m in mine) >= int(size) and k:
            return None                         # could carry into the dim outside
        out.append(sum((sympy.Integer(c // st) * r for c, r, _ in mine), sympy.Integer(0)))
        terms = [t for t in terms if t not in mine]
    return tuple(out) if not terms else None


def view_index(index: tuple, out_shape: tuple, in_shape: tuple, hints: dict,
               ranges: dict | None = None) -> tuple:
    """Index into the input of a view/reshape, given the index into its output.

    Dims are matched in groups of equal products (as torch's view does); a group of one dim on
    each side maps straight through, other groups are linearised and split again."""
    out_shape, in_shape = tuple(out_shape), tuple(in_shape)
    result = []
    i = j = 0
    while i < len(out_shape) or j < len(in_shape):
        i0, j0 = i, j
        po = pi = sympy.Integer(1)
        if i < len(out_shape):
            po, i = po * out_shape[i], i + 1
        if j < len(in_shape):
            pi, j = pi * in_shape[j], j + 1
        while sympy.simplify(po - pi) != 0:
            if _hint(po, hints) <= _hint(pi, hints) and i < len(out_shape):
                po, i = po * out_shape[i], i + 1
            elif j < len(in_shape):
                pi, j = pi * in_shape[j], j + 1
            else:
                raise NotFusable(f"view {out_shape} -> {in_shape}: dims do not group")
        # take trailing size-1 dims into the group on both sides
        while i < len(out_shape) and out_shape[i] == 1 and (j >= len(in_shape) or in_shape[j] != 1):
            i += 1
        while j < len(in_shape) and in_shape[j] == 1 and (i >= len(out_shape) or out_shape[i] != 1):
            j += 1
        o_dims, i_dims = out_shape[i0:i], in_shape[j0:j]
        o_idx = index[i0:i]
        if len(o_dims) == 1 and len(i_dims) == 1:
            result.append(o_idx[0])
        else:
            result.extend(delinearize(linearize(o_idx, o_dims), i_dims, ranges))
    return tuple(result)


def _hint(expr, hints):
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else int(expr.xreplace(hints))


def affine_coeffs(expr, syms):
    """{sym: coefficient} if ``expr`` is affine in ``syms``, else None."""
    coeffs = {}
    for term in sympy.Add.make_args(sympy.expand(expr)):
        present = term.free_symbols & syms
        if not present:
            continue
        if len(present) > 1:
            return None
        s = present.pop()
        c = sympy.simplify(term / s)
        if c.has(s):
            return None
        coeffs[s] = coeffs.get(s, 0) + c
    return coeffs


def coalesce(syms: list, sizes: list, exprs: list, protected: set = frozenset()):
    """Merge adjacent iteration dims wherever every access expression allows it.

    Returns (syms, sizes, exprs) with fewer dims; size-1 dims are dropped first."""
    subs = {s: sympy.Integer(0) for s, n in zip(syms, sizes) if n == 1}
    exprs = [sympy.sympify(e).xreplace(subs) for e in exprs]
    dims = [(s, n) for s, n in zip(syms, sizes) if n != 1]
    k = len(dims) - 2
    while k >= 0:
        (sa, na), (sb, nb) = dims[k], dims[k + 1]
        if sa in protected or sb in protected:
            k -= 1
            continue
        ok = True
        for e in exprs:
            if not (e.has(sa) or e.has(sb)):
                continue
            co = affine_coeffs(e, {sa, sb})
            if co is None or sympy.simplify(co.get(sa, 0) - co.get(sb, 0) * nb) != 0:
                ok = False
                break
        if ok:
            exprs = [e.xreplace({sa: sympy.Integer(0)}) for e in exprs]
            dims[k:k + 2] = [(sb, na * nb)]
        k -= 1
    return [s for s, _ in dims], [n for _, n in dims], exprs


def flatten_index(expr, syms: list, sizes: list, lin):
    """``expr``, written in the row-major iteration dims ``syms`` of ``sizes``, in terms of the
    linear index ``lin`` those dims are taken from.

    The innermost dims that ``expr`` walks contiguously (coefficients c, c*n_last, ...) become
    one ``c * (lin % span)`` (``c * lin`` when that is every dim) instead of a div and a mod per
    dim: exact, and it lets Triton see a contiguous access and vectorise it."""
    subs = dict(zip(syms, delinearize(lin, sizes)))
    expr = sympy.sympify(expr)
    if not isinstance(expr, sympy.Expr):    # a predicate: left as div/mod per dim
        return expr.xreplace(subs)
    co = affine_coeffs(expr, set(syms)) if syms else None
    c = co.get(syms[-1], 0) if co else 0
    if c == 0:
        return expr.xreplace(subs)
    k, span = len(syms) - 1, sizes[-1]
    while k > 0 and sympy.simplify(co.get(syms[k - 1], 0) - c * span) == 0:
        k -= 1
        span = span * sizes[k]
    rest = sympy.expand(expr) - sum(co.get(s, 0) * s for s in syms[k:])
    flat = lin if k == 0 else ModularIndexing(lin, sympy.Integer(1), span)
    return rest.xreplace(subs) + c * flat


def flat_index_subs(syms, sizes, linear):
    """{sym: expression in ``linear``} for dims iterated in row-major order by one linear index."""
    return dict(zip(syms, delinearize(linear, sizes)))


def print_expr(e) -> str:
    """A sympy index expression as Triton (or Python) integer code."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return e.name
    if e.is_Rational:
        raise NotFusable(f"non-integer index expression {e}")
    if e.is_Add:
        return "(" + " + ".join(print_expr(a) for a in e.args) + ")"
    if e.is_Mul:
        return "(" + " * ".join(print_expr(a) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
        return "(" + " * ".join([print_expr(e.base)] * int(e.exp)) + ")"
    if isinstance(e, PowByNatural):
        return print_expr(sympy.Pow(*e.args))
    if isinstance(e, (FloorDiv, CleanDiv)):
        num, den = e.args
        shift = _lifted(num, den)
        if shift:
            return f"({print_expr(num + shift * den)} // {print_expr(den)} - {shift})"
        if isinstance(e, FloorDiv) and _signed(num, den):
            return _floor_div(print_expr(num), print_expr(den))
        return f"({print_expr(num)} // {print_expr(den)})"
    if isinstance(e, ModularIndexing):
        base, div, mod = e.args
        base += _lifted(base, div * mod) * div * mod
        if _signed(base, div * mod):
            inner = print_expr(base) if div == 1 else _floor_div(print_expr(base), print_expr(div))
            return _floor_mod(inner, print_expr(mod))
        inner = print_expr(base) if div == 1 else f"({print_expr(base)} // {print_expr(div)})"
        return f"({inner} % {print_expr(mod)})"
    if isinstance(e, (Mod, PythonMod, sympy.Mod)):
        num, den = e.args
        num += _lifted(num, den) * den
        if _signed(num, den):
            return _floor_mod(print_expr(num), print_expr(den))
        return f"({print_expr(num)} % {print_expr(den)})"
    if isinstance(e, (Max, sympy.Max)):
        return _fold("max", e.args)
    if isinstance(e, (Min, sympy.Min)):
        return _fold("min", e.args)
    if isinstance(e, sympy.core.relational.Relational):
        return f"({print_expr(e.lhs)} {e.rel_op} {print_expr(e.rhs)})"
    if e is sympy.true or e is sympy.false:    # a predicate decided by the sizes alone
        return str(bool(e))
    raise NotFusable(f"cannot print index expression {e} ({type(e).__name__})")


def _lifted(num, den) -> int:
    """How many ``den`` to add to ``num`` (``a + c``, a sum of index terms that are never
    negative, and a negative constant ``c``) so that it is never negative: 0 where it cannot be
    (or need not be) done. Triton's ``//`` and ``%`` on integers truncate toward zero, as C's
    (on the GPU and in Triton 3.9's interpreter), where Python's floor; and Triton's axis
    analysis claims constancy for ``//`` that a negative numerator breaks
    (triton-lang/triton#7749, the reason Inductor prints such a division another way). Where
    this cannot lift a numerator that may be negative, ``_floor_div`` prints it. A numerator
    that is never negative takes both out: ``(a - 1) // 2`` is printed ``(a + 1) // 2 - 1``,
    the same number everywhere, a masked lane included."""
    if not (isinstance(den, sympy.Integer) and den > 0):
        return 0
    c, rest = sympy.sympify(num).as_coeff_Add()
    if not (c.is_Integer and c < 0 and rest != 0 and _never_negative(rest)):
        return 0
    return -(int(c) // int(den))        # ceil(-c / den)


def _signed(num, den) -> bool:
    """Whether ``num`` may be negative (after ``_lifted``) where ``den`` is positive: then C's
    truncating ``//`` and ``%`` (Triton's, on the GPU and in its interpreter) and the floor
    division sympy's index means differ, and the division is printed in a form exact under
    both (``_floor_div``). A flip's index ``9 - x`` divided by a slice's step 3 is ``3 +
    (-x) // 3`` after sympy; printed as it is, a flipped slice's gradient with a step read
    the wrong elements, and past the end (a fuzzer's find)."""
    den = sympy.sympify(den)
    return bool(den.is_positive) and not _never_negative(sympy.sympify(num))


def _floor_mod(n: str, d: str) -> str:
    """``n mod d`` rounded toward minus infinity, for d > 0, under floor or truncating ``%``:
    ``n % d`` lies in (-d, d) either way, ``+ d`` makes it positive."""
    return f"((({n} % {d}) + {d}) % {d})"


def _floor_div(n: str, d: str) -> str:
    """``floor(n / d)`` for d > 0 under floor or truncating ``//``: n less its floor remainder
    is a multiple of d, which both divide exactly."""
    return f"(({n} - {_floor_mod(n, d)}) // {d})"


def _never_negative(e) -> bool:
    """Whether index expression ``e`` is never negative: sums and products of non-negative
    integers and of symbols that are (the iteration indices and the sizes; a loaded index is
    not), their floor divisions by and remainders of positive integers."""
    if e.is_Integer:
        return e >= 0
    if e.is_Symbol:
        return bool(e.is_nonnegative)
    if e.is_Add or e.is_Mul:
        return all(_never_negative(a) for a in e.args)
    if isinstance(e, (FloorDiv, CleanDiv, Mod, PythonMod, sympy.Mod)):
        return _never_negative(e.args[0]) and e.args[1].is_Integer and e.args[1] > 0
    if isinstance(e, ModularIndexing):
        return _never_negative(e.args[0]) and all(a.is_Integer and a > 0 for a in e.args[1:])
    return False


def _fold(fn, args):
    out = print_expr(args[0])
    for a in args[1:]:
        out = f"{fn}({out}, {print_expr(a)})"
    return out


def _slice(index, args, shape):
    dim = args[1] % len(shape) if len(args) > 1 else 0
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    step = args[4] if len(args) > 4 else 1
    start = sympy.sympify(start)
    if start.is_Integer and start < 0:
        start = shape[dim] + start
    return index[:dim] + (start + index[dim] * step,) + index[dim + 1:]


def _select(index, args, shape):
    dim = args[1] % len(shape)
    i = sympy.sympify(args[2])
    if i.is_Integer and i < 0:
        i = shape[dim] + i
    return index[:dim] + (i,) + index[dim:]


def _unsqueeze(index, args, shape):
    dim = args[1] % (len(shape) + 1)
    return index[:dim] + index[dim + 1:]


def _squeeze(index, args, shape):
    if len(args) < 2:
        dims = {d for d, s in enumerate(shape) if s == 1}
    else:
        dims = args[1] if isinstance(args[1], tuple) else (args[1],)
        dims = {d % max(len(shape), 1) for d in dims if shape and shape[d % len(shape)] == 1}
    it = iter(index)
    return tuple(sympy.Integer(0) if d in dims else next(it) for d in range(len(shape)))


def _permute(index, args, shape):
    out = [None] * len(shape)
    for k, d in enumerate(args[1]):
        out[d % len(shape)] = index[k]
    return tuple(out)


def _transpose(index, args, shape):
    if len(shape) < 2:
        return index
    a, b = (args[1] % len(shape), args[2] % len(shape)) if len(args) > 2 else (0, 1)
    out = list(index)
    out[a], out[b] = index[b], index[a]
    return tuple(out)


def roll_index(index, args, shape, forward=False):
    """``roll(x, shifts, dims)``: the index of x read at output ``index`` (x at i - shift, modulo
    the dimension's size), or with ``forward`` the output index where x's element at ``index``
    lands. Not a view (the roll's output is a new tensor), so not in INDEX_OPS."""
    shifts, dims = args[1], args[2] if len(args) > 2 else ()
    if not dims or len(dims) != len(shifts):
        raise NotFusable("roll of the flattened tensor")
    out = list(index)
    for s, d in zip(shifts, dims):
        d %= len(shape)
        n = sympy.sympify(shape[d])
        if not n.is_Integer or not isinstance(s, int):
            raise NotFusable("roll by a symbolic size or shift")
        step = (s if forward else -s) % int(n)
        if step:
            out[d] = ModularIndexing(out[d] + step, sympy.Integer(1), n)
    return tuple(out)


def flip_index(index, args, shape):
    """``flip(x, dims)``: the index of x read at output ``index`` (x at n - 1 - i along each
    flipped dim), which is also where x's element at ``index`` lands (a flip is its own
    inverse). Not a view, so not in INDEX_OPS."""
    out = list(index)
    for d in set(x % len(shape) for x in args[1]):
        out[d] = sympy.sympify(shape[d]) - 1 - out[d]
    return tuple(out)


# Views that rewrite one index into another: op -> f(index, args, input shape) -> input index
INDEX_OPS = {
    "aten.slice.Tensor": _slice, "aten.select.int": _select,
    "aten.unsqueeze.default": _unsqueeze, "aten.squeeze.dim": _squeeze,
    "aten.squeeze.dims": _squeeze, "aten.squeeze.default": _squeeze,
    "aten.permute.default": _permute, "aten.t.default": _transpose,
    "aten.transpose.int": _transpose,
    "aten.alias.default": lambda index, args, shape: index,
    "aten.detach.default": lambda index, args, shape: index,
}


def step_divisors(e, cols):
    """The divisors K through which alone ``e`` reads ``cols`` (as ``cols // K`` or
    ``(cols // K) % M``, K an integer above 1), or None where it reads ``cols`` otherwise or
    not at all. A loop step of columns ``[c0, c0 + RBLOCK)``, ``c0`` a multiple of RBLOCK,
    gives ``e`` one value (its value at ``c0``) wherever every K is a multiple of RBLOCK: the
    channel ``cols // HxW`` of a GroupNorm row, whose weight the step then loads once."""
    e = sympy.sympify(e)
    if cols not in e.free_symbols:
        return None
    found = set()

    def only_divided(x):
        if x == cols:
            return False
        if isinstance(x, (FloorDiv, CleanDiv, ModularIndexing)) and x.args[0] == cols \
                and x.args[1].is_Integer and x.args[1] > 1:
            found.add(int(x.args[1]))
            return True
        return all(only_divided(a) for a in x.args)
    return found if only_divided(e) else None
