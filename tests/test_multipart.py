"""Multi-part kernels (codegen/multipart.py): sibling pointwise computations of different shapes
that share an input run as one launch, each part over its own range of program ids."""
import pytest
import torch

from fusion_compiler.codegen.multipart import split
from helpers import assert_close, as_tuple, compile_and_run, kernel_count, leftover_aten


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_q_k(q, k, cos, sin):
    return rope(q, cos, sin), rope(k, cos, sin)


def three_scales(a, b, c, s):
    # three independent pointwise parts of three shapes, all reading s
    return (a * s).relu(), torch.sigmoid(b + s), (c - s) * 2.0


def _check(fn, args, dtype, parts):
    out, reports = compile_and_run(fn, args)
    assert kernel_count(reports) == 1, [r.groups_not_generated for r in reports]
    assert not [op for op in leftover_aten(reports) if "mul" in op or "add" in op]
    (kernel,) = [k for r in reports for k in r.kernels]
    source = open(kernel["path"]).read()
    assert source.count("def _part") == parts and "_multipart_kernel" in source
    for i, (a, e) in enumerate(zip(as_tuple(out), as_tuple(fn(*args)))):
        assert_close(a, e, dtype=dtype, name=f"output {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seq,heads_q,heads_k,d", [(7, 4, 2, 16), (1, 3, 1, 8), (33, 8, 2, 64)])
def test_rope_of_q_and_k_is_one_launch(dtype, seq, heads_q, heads_k, d, device):
    q = torch.randn(2, heads_q, seq, d, dtype=dtype, device=device)
    k = torch.randn(2, heads_k, seq, d, dtype=dtype, device=device)
    cos, sin = (torch.randn(seq, d, dtype=dtype, device=device) for _ in range(2))
    _check(rope_q_k, (q, k, cos, sin), dtype, parts=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_parts_of_odd_sizes_and_a_strided_input(dtype, device):
    s = torch.randn(41, dtype=dtype, device=device)
    a = torch.randn(41, 9, dtype=dtype, device=device).t()        # transposed: strided loads
    b = torch.randn(333, 41, dtype=dtype, device=device)
    c = torch.randn(1, 41, dtype=dtype, device=device)
    _check(three_scales, (a, b, c, s), dtype, parts=3)


def test_dynamic_sizes_reuse_the_kernel(device):
    from fusion_compiler import backend
    import fusion_compiler

    cos, sin = torch.randn(5, 16, device=device), torch.randn(5, 16, device=device)
    compiled = torch.compile(rope_q_k, backend="fusion", dynamic=True, fullgraph=True)
    with fusion_compiler.capture_compiles() as reports:
        for seq in (5, 11):
            cos, sin = torch.randn(seq, 16, device=device), torch.randn(seq, 16, device=device)
            q, k = torch.randn(2, 4, seq, 16, device=device), torch.randn(2, 2, seq, 16, device=device)
            generated = sum(c.generated for c in backend._caches.values())
            out = compiled(q, k, cos, sin)
            for a, e in zip(out, rope_q_k(q, k, cos, sin)):
                assert_close(a, e)
    assert len(reports) == 1 and kernel_count(reports) == 1
    assert sum(c.generated for c in backend._caches.values()) == generated


def test_split_copies_a_shared_view_into_each_part():
    # cos.unsqueeze(0) is read by both parts: a view, so each part gets its own copy of it
    def fn(q, k, cos):
        c = cos.unsqueeze(0)
        return q * c, k + c
    from test_cost_model import analyze
    ctx = analyze(fn, torch.randn(4, 3, 8), torch.randn(2, 3, 8), torch.randn(3, 8))
    (g,) = ctx.groups
    parts = split(g.ir)
    assert len(parts) == 2
    for sub, inputs, positions in parts:
        targets = [op.target for op in sub.ops]
        assert "aten.unsqueeze.default" in targets and len(positions) == 1


def test_range_predicates_are_decided_by_numbers_only():
    """cat, pad and gather guard their reads with range predicates (codegen/lower.py's _ge and
    _lt): decided when the bound and the index differ by a number, left as an inequality
    otherwise (not evaluated by sympy's assumption system, which cannot decide them from the
    index symbols' signs)."""
    import sympy

    from fusion_compiler.codegen.indexing import print_expr
    from fusion_compiler.codegen.lower import _ge, _lt

    x = sympy.Symbol("x0", integer=True, nonnegative=True)
    assert _ge(sympy.Integer(5), 3) is sympy.true and _lt(sympy.Integer(5), 3) is sympy.false
    assert _ge(x + 4, x + 4) is sympy.true and _lt(x + 4, x + 4) is sympy.false
    ge, lt = _ge(x, 64), _lt(x - 64, 128)
    assert isinstance(ge, sympy.GreaterThan) and isinstance(lt, sympy.StrictLessThan)
    assert print_expr(ge) == "(x0 >= 64)" and print_expr(lt) == "((-64 + x0) < 128)"
    assert ge.subs(x, 70) is sympy.true and lt.subs(x, 200) is sympy.false
