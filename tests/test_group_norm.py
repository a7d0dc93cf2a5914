"""GroupNorm (decompositions.native_group_norm): one row kernel over [N, groups, C/groups * HxW]
that stores its elements in the input's shape and memory format, with what reads them (a
UNet's GroupNorm + SiLU: one kernel). Kernel counts and values against eager, odd sizes,
each dtype with its tolerance."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler import decompositions
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gn_silu(x, w, b, groups):
    return F.silu(F.group_norm(x, groups, w, b, eps=1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("groups", [1, 4, 12])
def test_group_norm_and_silu_are_one_kernel(dtype, channels_last, groups, device):
    x = randn((3, 12, 5, 7), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = randn((12,), dtype, device), randn((12,), dtype, device)
    out, reports = compile_and_run(lambda x, w, b: gn_silu(x, w, b, groups), (x, w, b))
    expected = gn_silu(x, w, b, groups)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert out.stride() == expected.stride()            # ATen's memory format
    assert_close(out, expected, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 6, 11), (4, 10), (2, 6, 3, 4, 5), "3d"])
def test_group_norm_of_other_ranks_and_without_affine(dtype, shape, device):
    """[N, C, L] (audio), [N, C] (HxW of 1) and 5-d inputs, channels-last too; no weight, no
    bias."""
    if shape == "3d":
        x = randn((2, 6, 3, 4, 5), dtype, device).to(memory_format=torch.channels_last_3d)
    else:
        x = randn(shape, dtype, device)
    f = lambda x: F.group_norm(x, 2) * 3         # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert out.stride() == f(x).stride()
    assert_close(out, f(x), dtype=dtype)


def test_group_norm_with_a_residual_in_a_unet_block(device):
    """ResNet block of a UNet: GroupNorm, SiLU, and the residual added after: one kernel, and
    the rows' statistics read once."""
    x, r = randn((2, 8, 9, 9), torch.bfloat16, device), randn((2, 8, 9, 9), torch.bfloat16, device)
    w, b = randn((8,), torch.bfloat16, device), randn((8,), torch.bfloat16, device)
    f = lambda x, r, w, b: gn_silu(x, w, b, 4) + r        # noqa: E731
    out, reports = compile_and_run(f, (x, r, w, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x, r, w, b), dtype=torch.bfloat16)


def test_group_norm_trains(device):
    x = randn((2, 6, 4, 5), torch.float32, device).requires_grad_()
    w = randn((6,), torch.float32, device).requires_grad_()
    b = randn((6,), torch.float32, device).requires_grad_()

    def f(x, w, b):
        return (gn_silu(x, w, b, 3) ** 2).sum()
    torch._dynamo.reset()
    out = torch.compile(f, backend="fusion")(x, w, b)
    out.backward()
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    expected = f(x, w, b)
    expected.backward()
    assert_close(out, expected, dtype=torch.float32)
    for g, t, name in zip(got, (x, w, b), "xwb"):
        assert_close(g, t.grad, dtype=torch.float32, atol=1e-4, rtol=1e-4, name=f"{name} grad")


def test_dynamic_shapes(device):
    for shape in ((2, 6, 4, 5), (3, 6, 7, 2)):
        x = randn(shape, torch.float32, device)
        w, b = randn((6,), torch.float32, device), randn((6,), torch.float32, device)
        out, _ = compile_and_run(lambda x, w, b: gn_silu(x, w, b, 3), (x, w, b), dynamic=True)
        assert_close(out, gn_silu(x, w, b, 3), dtype=torch.float32)


def test_cpu_without_the_interpreter_keeps_atens_group_norm(monkeypatch):
    """No kernel runs on the CPU without Triton's interpreter: ATen's own GroupNorm stays,
    rather than its decomposition run op by op."""
    monkeypatch.setattr(decompositions, "interpreting", lambda: False)
    x, w, b = torch.randn(2, 6, 4, 5), torch.randn(6), torch.randn(6)
    out, reports = compile_and_run(lambda x, w, b: gn_silu(x, w, b, 3), (x, w, b))
    assert "aten.native_group_norm.default" in leftover_aten(reports)
    assert_close(out, gn_silu(x, w, b, 3), dtype=torch.float32)


def _digits(lin_value, shape):
    out, mult = [], 1
    for d in reversed(range(len(shape))):
        out.append((lin_value // mult) % shape[d] if d else lin_value // mult)
        mult *= shape[d]
    return tuple(reversed(out))


def test_reshape_index_arithmetic_is_exact():
    """The index arithmetic that lets a row kernel store in another shape: a position split
    by its symbols' bounds (``delinearize`` with ranges), and digits joined back
    (``join_digits``), checked against integer arithmetic at every point of random cases."""
    import random
    import sympy
    from fusion_compiler.codegen.indexing import delinearize, linearize, view_index
    rng = random.Random(0)
    a, b, x = sympy.symbols("a b x", integer=True, nonnegative=True)
    split = 0
    for _ in range(400):
        shape = tuple(rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4)))
        bounds = {a: rng.randint(1, 5), b: rng.randint(1, 5)}
        ca, cb, k = rng.randint(0, 12), rng.randint(0, 12), rng.randint(0, 3)
        got = delinearize(ca * a + cb * b + k, shape, bounds)
        split += not any(e.has(sympy.Mod) or "//" in str(e) or "Modular" in str(e) for e in got)
        total = 1
        for s in shape:
            total *= s
        for va in range(bounds[a]):
            for vb in range(bounds[b]):
                point = {a: va, b: vb}
                if ca * va + cb * vb + k >= total:
                    continue                    # not a position in the shape
                assert tuple(int(sympy.sympify(e).subs(point)) for e in got) == \
                    _digits(ca * va + cb * vb + k, shape)
        joined = linearize(delinearize(x, shape), shape)
        assert all(int(sympy.sympify(joined).subs({x: v})) == v for v in range(total))
    assert split > 100                          # the exact split is taken where it holds
    # GroupNorm's rows [3, 4, 105] to its output [3, 12, 5, 7] and back: the rows' own index
    r0, r1, col = sympy.symbols("r0 r1 col", integer=True, nonnegative=True)
    bounds = {r0: 3, r1: 4, col: 105}
    out = view_index((r0, r1, col), (3, 4, 105), (3, 12, 5, 7), {}, bounds)
    assert view_index(out, (3, 12, 5, 7), (3, 4, 105), {}, bounds) == (r0, r1, col)
