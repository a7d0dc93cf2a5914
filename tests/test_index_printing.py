"""Index expressions as printed into kernels: the same numbers under Python's floor division
(Triton's interpreter) and C's truncating one (Triton on the GPU), in every lane."""
import ast
import random

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from fusion_compiler.codegen.indexing import print_expr


class _Truncating(ast.NodeTransformer):
    """``a // b`` and ``a % b`` as C computes them on integers (toward zero)."""

    def visit_BinOp(self, node):
        self.generic_visit(node)
        name = {ast.FloorDiv: "tdiv", ast.Mod: "tmod"}.get(type(node.op))
        if name is None:
            return node
        return ast.Call(ast.Name(name, ast.Load()), [node.left, node.right], [])


def _tdiv(a, b):
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _tmod(a, b):
    return a - b * _tdiv(a, b)


def _evaluate(text: str, point: dict, truncating: bool) -> int:
    tree = ast.parse(text, mode="eval")
    if truncating:
        tree = ast.fix_missing_locations(_Truncating().visit(tree))
    return eval(compile(tree, "<index>", "eval"), {"tdiv": _tdiv, "tmod": _tmod}, dict(point))


def test_negative_numerators_are_lifted():
    """A max pool's window ``(w - 1) // 2`` is -1 at w = 0 by Python's rule and 0 by C's: the
    printed numerator is made never negative (``(w + 1) // 2 - 1``), so the two agree, masked
    lanes included (triton-lang/triton#7749: Triton's axis analysis also goes wrong there)."""
    cols = sympy.Symbol("cols", integer=True, nonnegative=True)
    loaded = sympy.Symbol("x7", integer=True)           # a loaded index: may be negative
    w, h = ModularIndexing(cols, 1, 11), FloorDiv(cols, 11)
    assert print_expr(FloorDiv(w - 1, 2)) == "((1 + (cols % 11)) // 2 - 1)"
    rng = random.Random(0)
    cases = [FloorDiv(w - 1, 2), FloorDiv(h - 1, 2), 2 * FloorDiv(w - 1, 2) + 22 * FloorDiv(h - 1, 2),
             ModularIndexing(cols - 3, 2, 5), ModularIndexing(cols - 30, 1, 7),
             sympy.Mod(cols - 5, 4), FloorDiv(cols - 7, 3)]
    for _ in range(40):
        c, k, d = rng.randint(-40, -1), rng.randint(1, 5), rng.randint(1, 9)
        cases.append(FloorDiv(k * cols + c, d))
        cases.append(ModularIndexing(k * w + c, d, rng.randint(2, 6)))
    for e in cases:
        text = print_expr(e)
        for v in range(0, 150):
            want = int(e.subs(cols, v))
            assert _evaluate(text, {"cols": v}, False) == want, (e, text, v)
            assert _evaluate(text, {"cols": v}, True) == want, (e, text, v)
    # a numerator never negative is printed as it is
    assert print_expr(FloorDiv(cols + 3, 2)) == "((3 + cols) // 2)"


def test_numerators_that_may_be_negative_divide_the_same_either_way():
    """A numerator that may be negative and cannot be lifted (a loaded index; a flip's
    ``9 - x``, which sympy makes ``3 + (-x) // 3``) is divided in a form exact under floor and
    truncating division alike. Printed as it was, a flipped slice's gradient with a step read
    the wrong elements, and past the end (a fuzzer's find, test_slices)."""
    cols = sympy.Symbol("cols", integer=True, nonnegative=True)
    loaded = sympy.Symbol("x7", integer=True)
    cases = [FloorDiv(loaded - 1, 2), FloorDiv(9 - cols, 3), FloorDiv(-cols, 3),
             sympy.Mod(9 - cols, 3), ModularIndexing(40 - 3 * cols, 2, 5),
             FloorDiv(loaded, 7) + sympy.Mod(loaded, 7)]
    assert print_expr(FloorDiv(-cols, 3)) != "((-1 * cols) // 3)"
    for e in cases:
        text = print_expr(e)
        for v in range(-60, 60):
            point = {"cols": abs(v), "x7": v}
            want = int(e.subs({cols: abs(v), loaded: v}))
            assert _evaluate(text, point, False) == want, (e, text, v)
            assert _evaluate(text, point, True) == want, (e, text, v)
