"""Robustness: try hard to break the compiler, and check it falls back instead of breaking.

1. Fallback: fusible ops mixed with ops the compiler does not handle (sort, scatter, index_put,
   dropout, random ops, complex, in-place updates of inputs, data-dependent shapes, custom ops,
   graph breaks). Each must give eager's result; kernels still run around the fallback op.
2. Numerics: NaN/Inf through pointwise chains and row reductions (persistent and looped row
   kernels), a 1,048,576-element row, 50,000 rows, empty tensors, 0-dim tensors.
3. Recompilation: dynamic=True does not recompile for new sizes; a dtype change does.
4. Configuration and command line: bad values are errors that name the variable.

Every compiler bug found here keeps its minimal reproducer below as a regression test (a new
one is marked ``xfail(strict=True, reason="bug: ...")`` until it is fixed, with ``bug`` or, for
the interpreter-only code path, ``interpreter_bug``). docs/support.md summarises what is fused
and what falls back.
"""
from __future__ import annotations

import os
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.cli import main as cli_main
from fusion_compiler.config import Config, ConfigError
from helpers import TOL, as_tuple, assert_close, compile_and_run, kernel_count, leftover_aten

# NaN/Inf inputs make numpy (under the interpreter) and ATen warn; the values are checked.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NAN, INF = float("nan"), float("inf")


def interpreter_bug(reason):
    """A bug of the interpreter-only helpers: xfail (strict) where the interpreter runs."""
    return pytest.mark.xfail(INTERPRETED, strict=True,
                             reason=f"bug (Triton-interpreter code path): {reason}")


def bug(reason):
    return pytest.mark.xfail(strict=True, reason=f"bug: {reason}")


def check(fn, args, *, min_kernels=None, aten=(), atol=None, rtol=None, dynamic=False):
    """Compile ``fn`` (fullgraph), compare every output with eager, return the reports."""
    out, reports = compile_and_run(fn, args, dynamic=dynamic)
    expected = fn(*args)
    for k, (a, e) in enumerate(zip(as_tuple(out), as_tuple(expected))):
        assert_close(a, e, atol=atol, rtol=rtol, name=f"output {k}")
    assert not any(r.error for r in reports), [r.error for r in reports]
    if min_kernels is not None:
        assert kernel_count(reports) >= min_kernels, [r.groups_not_generated for r in reports]
    left = leftover_aten(reports)
    for op in aten:
        assert any(op in o for o in left), f"{op} not reported on ATen: {left}"
    return reports


def compile_loose(fn, *args):
    """torch.compile without fullgraph (graph breaks allowed); (output, reports)."""
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion")(*args)
    return out, reports


# =============================================================================== 1. fallback
def _idx(device):
    return torch.randint(0, 16, (8, 16), device=device)


FALLBACK = {
    # name: (fn, inputs(device), ATen op expected to stay, min kernels around it)
    "sort": (lambda a: torch.sort(a.exp() * 2, -1).values.relu() + 1,
             lambda d: (torch.randn(8, 16, device=d),), "aten.sort", 2),
    "topk": (lambda a: torch.topk(a.sigmoid() * 3, 4, -1).values.exp(),
             lambda d: (torch.randn(8, 16, device=d),), "aten.topk", 2),
    "scatter": (lambda a, i: torch.scatter(a * 2, 1, i, a.sin()).exp(),
                lambda d: (torch.randn(8, 16, device=d), _idx(d)), "aten.scatter", 2),
    "scatter_add": (lambda a, i: torch.scatter_add(a * 2, 1, i, a.sin()).exp() - 1,
                    lambda d: (torch.randn(8, 16, device=d), _idx(d)), "aten.scatter_add", 2),
    "scatter_reduce": (lambda a, i: torch.scatter_reduce(a * 2, 1, i, a.cos(), "amax").tanh(),
                       lambda d: (torch.randn(8, 16, device=d), _idx(d)), "aten.scatter_reduce", 2),
    "index_put": (lambda a, i, v: torch.index_put(a * 2, (i,), v.exp()).sigmoid() + 1,
                  lambda d: (torch.randn(8, 16, device=d), torch.tensor([0, 3, 5], device=d),
                             torch.randn(16, device=d)), "aten.index_put", 2),
    "cumprod": (lambda a: torch.cumprod(a * 0.5, -1).softmax(-1),
                lambda d: (torch.randn(8, 16, device=d),), "aten.cumprod", 2),
    # rows of 16 lying 8 apart, side by side in runs of 8: ATen's (passes/scan_dims.py)
    "cumsum-dim0": (lambda a: torch.cumsum(a * 2, 0).softmax(-1),
                    lambda d: (torch.randn(16, 8, device=d),), "aten.cumsum", 2),
    "complex64": (lambda a: ((a * 3).to(torch.complex64) * 2).real + 1,
                  lambda d: (torch.randn(8, 16, device=d),), "aten.mul", 1),
    "complex-abs": (lambda a, b: torch.complex(a.exp(), b * 2).abs().softmax(-1),
                    lambda d: (torch.randn(8, 16, device=d), torch.randn(8, 16, device=d)),
                    "aten.complex", 1),
    "fp64-softmax-then-fp32": (lambda a: torch.softmax(a.double() * 2, -1).float() + 1,
                               lambda d: (torch.randn(8, 16, device=d),), "aten.amax", 1),
    "fp8-e5m2-output": (lambda a: (a * 4).to(torch.float8_e5m2),
                        lambda d: (torch.randn(8, 16, device=d),), "aten._to_copy", 1),
    "reduction-over-dim0": (lambda a: torch.softmax(a * 2, 0) + a.sum(0),
                            lambda d: (torch.randn(8, 16, device=d),), "aten.amax", 1),
    "int-sum": (lambda a: (a * 3).sum(-1) + 1,
                lambda d: (torch.randint(-9, 9, (8, 16), device=d),), "aten.sum", 1),
    "matmul": (lambda a, w: (a.relu() @ w).sigmoid() * 2,
               lambda d: (torch.randn(8, 16, device=d), torch.randn(16, 4, device=d)),
               "aten.mm", 2),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_fallback_ops_between_fused_ops_match_eager(name, device):
    fn, make, op, kernels = FALLBACK[name]
    args = make(device)
    if name == "fp8-e5m2-output":     # compare the fp8 codes: assert_close has no e5m2 tolerance
        out, reports = compile_and_run(fn, args)
        assert torch.equal(out.view(torch.uint8), fn(*args).view(torch.uint8))
        assert kernel_count(reports) >= kernels and any(op in o for o in leftover_aten(reports))
        return
    check(fn, args, min_kernels=kernels, aten=[op])


def test_index_put_in_place_on_an_input_mutates_it_like_eager(device):
    def fn(a, i):
        a.index_put_((i,), torch.ones(16, device=a.device))
        return a * 2 + 1

    base, i = torch.randn(8, 16, device=device), torch.tensor([0, 3, 5], device=device)
    ours, ref = base.clone(), base.clone()
    out, reports = compile_and_run(fn, (ours, i))
    assert_close(out, fn(ref, i))
    assert_close(ours, ref, name="mutated input")
    assert kernel_count(reports) >= 1 and any("index_put" in o for o in leftover_aten(reports))


def _add_(a):
    a.add_(1)
    return a * 2


def _two_inputs_(a, b):
    a.mul_(b.sigmoid())
    b.add_(a)
    return (a + b).sum(-1)


def _broadcast_(a, b):
    a.add_(b.exp())
    a.relu_()
    return a.sum(-1)


def _view_of_input_(a):
    a[:, :4].mul_(3)
    return a.exp()


def _through_transpose_(a):
    a.t()[2:5].mul_(10)
    return a.softmax(-1)


def _copy_(a, b):
    a.copy_(b * 2)
    return a + 1


def _int_(a):
    a.mul_(3).add_(-7)
    return a


def _masked_fill_nan_(a, m):
    a.masked_fill_(m, NAN)
    return a.nan_to_num(0.0) + a.isnan()


INPLACE = {
    # name: (fn, inputs(device) - every input is cloned for each run)
    "add_": (_add_, lambda d: (torch.randn(8, 16, device=d),)),
    "two-inputs": (_two_inputs_, lambda d: (torch.randn(8, 16, device=d),
                                            torch.randn(8, 16, device=d))),
    "broadcast-operand": (_broadcast_, lambda d: (torch.randn(8, 16, device=d),
                                                  torch.randn(16, device=d))),
    "slice-of-input": (_view_of_input_, lambda d: (torch.randn(8, 16, device=d),)),
    "transposed-slice": (_through_transpose_, lambda d: (torch.randn(8, 16, device=d),)),
    "non-contiguous-input": (_add_, lambda d: (torch.randn(16, 8, device=d).t(),)),
    "copy_-bf16-into-fp32": (_copy_, lambda d: (torch.randn(8, 16, device=d),
                                                torch.randn(8, 16, device=d).bfloat16())),
    "int32": (_int_, lambda d: (torch.randint(-9, 9, (8, 16), dtype=torch.int32, device=d),)),
    "masked_fill_-nan": (_masked_fill_nan_, lambda d: (lambda x: (x, x > 0.5))(
        torch.randn(8, 16, device=d))),
    "same-tensor-twice": (_two_inputs_, lambda d: (lambda x: (x, x))(torch.randn(8, 16, device=d))),
}


@pytest.mark.parametrize("name", list(INPLACE))
def test_in_place_updates_of_inputs_match_eager(name, device):
    fn, make = INPLACE[name]
    inputs = make(device)

    def fresh():    # clones that keep aliasing between inputs (same tensor twice stays so)
        clones = {}
        return tuple(clones.setdefault(id(t), t.clone(memory_format=torch.preserve_format))
                     for t in inputs)
    ours, ref = fresh(), fresh()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion")(*ours)
    expected = fn(*ref)
    assert_close(out, expected)
    for k, (a, e) in enumerate(zip(ours, ref)):
        assert_close(a, e, name=f"input {k} after the call")
    assert kernel_count(reports) >= 1 and not any(r.error for r in reports)


def test_dropout_in_training_matches_eager_with_the_same_seed(device):
    """Dropout stays one ATen op (native_dropout), so it draws the same random numbers as eager
    after torch.manual_seed: the outputs and the gradients are equal."""
    def fn(a, w):
        return F.dropout(F.gelu(a * w), p=0.25, training=True).softmax(-1)

    a, w = torch.randn(8, 32, device=device), torch.randn(32, device=device)
    ours = [t.clone().requires_grad_() for t in (a, w)]
    ref = [t.clone().requires_grad_() for t in (a, w)]
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        compiled = torch.compile(fn, backend="fusion", fullgraph=True)
        torch.manual_seed(123)
        out = compiled(*ours)
        torch.manual_seed(123)
        again = compiled(*[t.detach() for t in ours])
        grad = torch.randn_like(out)
        out.backward(grad)            # the backward graph compiles here
    torch.manual_seed(123)
    expected = fn(*ref)
    assert_close(out, expected)
    assert_close(again, expected.detach(), name="second call, same seed")
    expected.backward(grad)
    for name, x, y in zip("aw", ours, ref):
        assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-4, name=f"grad {name}")
    assert kernel_count(reports, "forward") >= 1 and kernel_count(reports, "backward") >= 1
    assert "aten.native_dropout.default" in leftover_aten(reports, "forward")
    (forward,) = [r for r in reports if r.kind == "forward"]
    reasons = {a["op"]: a["reason"] for a in forward.summary["aten_ops"]}
    assert reasons["native_dropout"].startswith("dropout: ATen's own kernel"), reasons
    dropped = (out.detach() == 0).float().mean().item()
    assert 0.0 <= dropped < 1.0


def test_randn_like_matches_eager_with_the_same_seed(device):
    def fn(a):
        return (torch.randn_like(a) * a + 1).relu()

    a = torch.randn(8, 16, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusion", fullgraph=True)
    with fusion_compiler.capture_compiles() as reports:
        torch.manual_seed(5)
        out = compiled(a)
    torch.manual_seed(5)
    assert_close(out, fn(a))
    assert kernel_count(reports) >= 1 and "aten.randn_like.default" in leftover_aten(reports)


# custom ops registered with torch.library, in the middle of pointwise chains
@torch.library.custom_op("fc_robustness::twice_plus", mutates_args=())
def twice_plus(a: torch.Tensor) -> torch.Tensor:
    return a * 2 + 0.5


@twice_plus.register_fake
def _(a):
    return torch.empty_like(a)


@torch.library.custom_op("fc_robustness::scale_", mutates_args=("a",))
def scale_(a: torch.Tensor, s: float) -> None:
    a.mul_(s)


def test_custom_op_between_pointwise_chains(device):
    def fn(a):
        return torch.softmax(twice_plus((a * 3).sigmoid()).exp(), -1) + 1

    reports = check(fn, (torch.randn(8, 16, device=device),), min_kernels=2,
                    aten=["fc_robustness.twice_plus"])
    assert all(r.ran_kernels for r in reports)


def test_mutating_custom_op_on_an_intermediate_and_on_an_input(device):
    def on_intermediate(a):
        b = a.relu() + 1
        scale_(b, 3.0)
        return b.exp()

    def on_input(a):
        scale_(a, 3.0)
        return a.exp() * 2

    x = torch.randn(8, 16, device=device)
    check(on_intermediate, (x,), min_kernels=2)
    ours, ref = x.clone(), x.clone()
    out, reports = compile_and_run(on_input, (ours,))
    assert_close(out, on_input(ref))
    assert_close(ours, ref, name="input mutated by the custom op")
    assert kernel_count(reports) >= 1


def test_report_lists_a_mutating_custom_op_as_aten(device):
    def fn(a):
        b = a.relu() + 1
        scale_(b, 3.0)
        return b.exp()

    _, reports = compile_and_run(fn, (torch.randn(8, 16, device=device),))
    in_summary = [o["op"] for o in reports[0].summary["aten_ops"]]
    assert any("auto_functionalized" in o for o in in_summary)
    assert any("auto_functionalized" in o for o in reports[0].aten_ops), reports[0].aten_ops


def _print_break(a):
    b = a.sin() * 2
    print("fc robustness: a graph break")
    return (b + 1).exp().softmax(-1)


def _item_break(a):
    b = a.sin() * 2
    s = b.sum().item()
    return (b + s).exp()


def _branch_break(a):
    b = a.sin() * 2
    if b.sum() > 0:
        return b.cos() + 1
    return b.tanh() - 1


def _mask_break(a):
    return (a * 2)[a > 0].exp() + 1


def _nonzero_break(a):
    i = torch.nonzero(a > 0.5)
    return i * 2 + 1, (a[a > 0.5] * 3).sum()


@pytest.mark.parametrize("fn", [_print_break, _item_break, _branch_break, _mask_break,
                                _nonzero_break], ids=lambda f: f.__name__.strip("_"))
def test_graph_breaks_and_data_dependent_shapes_without_fullgraph(fn, device, capsys):
    x = torch.randn(8, 16, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, reports = compile_loose(fn, x)
    for a, e in zip(as_tuple(out), as_tuple(fn(x))):
        assert_close(a, e)
    assert len(reports) >= 2, "expected a graph break (two graphs or more)"
    assert kernel_count(reports) >= 1 and not any(r.error for r in reports)


def test_item_captured_in_the_graph(device):
    x = torch.randn(8, 16, device=device)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        check(lambda a: (a.sin() * 2 + a.sum().item()).exp(), (x,), min_kernels=1)
        check(lambda a: torch.softmax(a * a.amax().item(), -1), (x,), min_kernels=1)
        check(lambda a, n: (a * n.item()).relu() + 1, (x, torch.tensor(3, device=device)))


def test_data_dependent_shape_not_read_by_a_kernel(device):
    """nonzero / masked_select stay on ATen; fine while no kernel iterates over their sizes."""
    x = torch.randn(8, 16, device=device)
    check(lambda a: torch.nonzero(a.exp() > 1.5), (x,), min_kernels=1, aten=["nonzero"])
    check(lambda a: torch.masked_select(a * 2, a > 0).sum(), (x,), min_kernels=1)


@pytest.mark.parametrize("fn", [lambda a: a[a > 0] * 2, lambda a: torch.nonzero(a > 0) * 2],
                         ids=["mask-index", "nonzero"])
def test_kernel_over_a_data_dependent_shape(fn, device):
    check(fn, (torch.randn(8, device=device),))


@pytest.mark.gpu
def test_cpu_and_gpu_tensors_mixed(device):
    """GPU only: a 0-dim CPU tensor joins GPU kernels by value; a CPU tensor of more dims and
    the ops on it stay on ATen (other device: opaque)."""
    x = torch.randn(8, 16, device=device)
    check(lambda a, s: (a * s + s).exp(), (x, torch.tensor(1.5)), min_kernels=1)
    check(lambda a, c: (a.sigmoid() + c.to(a.device)).softmax(-1) * 2,
          (x, torch.randn(8, 16)), min_kernels=1)
    check(lambda a, c: ((a * 2).cpu() + c.exp(), a.relu()), (x, torch.randn(8, 16)),
          min_kernels=1)


# ========================================================================== 2. numerics
def special_rows(rows, n, dtype, device):
    """Random rows, then NaN/Inf in some: single NaN, +Inf, -Inf, both Infs, all -Inf, all +Inf,
    all NaN; the remaining rows stay finite."""
    x = torch.randn(rows, n, device=device).to(dtype)
    x[1, 3] = NAN
    x[2, 0] = INF
    x[3, n - 1] = -INF
    x[4, 1], x[4, n - 2] = INF, -INF
    x[5] = -INF
    x[6] = INF
    x[7] = NAN
    return x


def _pointwise_chain(a):
    y = (a * 2).exp().tanh() + a.sigmoid() - a.abs().sqrt()
    y = torch.maximum(y, a * 0.5) + torch.minimum(a, torch.zeros_like(a)).clamp(-1, 1)
    # gelu away from +-inf: eager's CPU gelu(inf) is NaN (its vectorized erf), ours is inf
    return torch.where(a.isnan(), a, y) + a.isinf().to(a.dtype) + F.silu(a) * F.gelu(
        a.clamp(-10, 10) / 4)


def _rmsnorm(a, w):
    return a * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(a.dtype) * w


ROW_OPS = {
    "softmax": lambda a, w: torch.softmax(a, -1),
    "log_softmax": lambda a, w: torch.log_softmax(a * 0.5, -1),
    "layernorm": lambda a, w: F.layer_norm(a, a.shape[-1:], w, w * 0.5),
    "rmsnorm": _rmsnorm,
    "amax": lambda a, w: a.amax(-1),
    "amin": lambda a, w: (a * 2).amin(-1),
    "sum": lambda a, w: a.sum(-1),
    "mean": lambda a, w: (a * w).mean(-1),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_through_pointwise_chains(dtype, device):
    x = special_rows(8, 33, dtype, device)
    check(_pointwise_chain, (x,), min_kernels=1)


@pytest.mark.parametrize("looped", [False, True], ids=["persistent", "looped"])
@pytest.mark.parametrize("op", list(ROW_OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_rows_through_row_reductions(op, dtype, looped, device, monkeypatch):
    if looped:
        if dtype == torch.float16 and op in ("amax", "amin", "softmax", "log_softmax"):
            pytest.skip("interpreter time: the fp32/bf16 cases cover the looped max")
        # rows of 2500 > max block 16: the looped kernel, two column steps of 2048 (one partial)
        monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "16")
    n = 2500 if looped else 33
    x = special_rows(8, n, dtype, device)
    w = torch.randn(n, device=device).to(dtype)
    reports = check(ROW_OPS[op], (x, w), min_kernels=1)
    assert not leftover_aten(reports), leftover_aten(reports)


def test_very_long_rows(device):
    """Rows of N = 1,048,576 on the GPU, 262,144 in the interpreter (4x less of its time): the
    looped row kernel (block 2048), its two rows split across programs (into 128 and 32
    chunks). Two rows, one with a NaN and an Inf (softmax row all NaN, as eager); rmsnorm on
    the same rows. About 12 s in the interpreter."""
    n = 1 << (20 if device == "cuda" else 18)
    x = torch.randn(2, n, device=device)
    x[1, 77], x[1, n - 5] = NAN, INF
    w = torch.randn(n, device=device)
    for fn, args in ((lambda a: torch.softmax(a, -1), (x,)), (_rmsnorm, (x, w))):
        out, reports = compile_and_run(fn, args)
        # fp32 sums over 2^18-2^20 terms in another order than ATen's: 10x the relative tolerance
        atol, rtol = TOL[torch.float32]
        assert_close(out, fn(*args), atol=atol, rtol=10 * rtol)
        assert kernel_count(reports) == 1
        source = Path(reports[0].kernels[0]["path"]).read_text()
        assert "_looped_kernel" in source


def test_fifty_thousand_short_rows(device):
    x = torch.randn(50_000, 7, device=device)
    x[123, 3] = NAN
    w = torch.randn(7, device=device)
    check(lambda a, w: F.layer_norm(a, (7,), w, w), (x, w), min_kernels=1)
    check(_rmsnorm, (x, w), min_kernels=1)
    # amax's NaN-propagating combine is slow in the interpreter (~25 s for 50,000 rows)
    rows = 50_000 if not INTERPRETED else 4_096
    check(lambda a: torch.softmax(a * 2, -1), (x[:rows],), min_kernels=1)


EMPTY = [(0, 16), (0,)]


@pytest.mark.parametrize("shape", EMPTY + [(4, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "sum-keepdim", "layernorm"])
def test_empty_tensors_reductions(shape, op, device):
    fn = {"sum": lambda a: (a * 2).sum(-1),
          "mean": lambda a: (a + 1).mean(-1),
          "sum-keepdim": lambda a: (a.exp().sum(-1, keepdim=True) + a).sum(-1),
          "layernorm": lambda a: F.layer_norm(a, a.shape[-1:])}[op]
    check(fn, (torch.randn(*shape, device=device),))


@pytest.mark.parametrize("shape", EMPTY, ids=str)
@pytest.mark.parametrize("op", ["pointwise", "softmax", "amax"])
def test_empty_rows(shape, op, device):
    fn = {"pointwise": lambda a: (a * 2).exp() + 1,
          "softmax": lambda a: torch.softmax(a * 2, -1),
          "amax": lambda a: a.amax(-1) if a.ndim > 1 else a * 2}[op]
    check(fn, (torch.randn(*shape, device=device),))


@pytest.mark.parametrize("shape", [(0, 7, 5), (0, 0), (3, 0)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_with_no_elements_are_allocated_not_computed(shape, dtype, device):
    """The decomposed softmax of an empty tensor runs no kernel and no ATen op but one
    allocation (passes/empty_values.py), with eager's size, strides and dtype; the report
    names what was allocated. A row sum over an empty dim (zeros, where there are rows) is
    still right."""
    from fusion_compiler.dump_format import render_table

    def fn(a):
        return torch.softmax(a.float() * 0.125, dim=-1).to(a.dtype), (a * 2).sum(-1)
    x = torch.randn(*shape, device=device, dtype=dtype)
    (soft, total), reports = compile_and_run(fn, (x,))
    want_soft, want_total = fn(x)
    assert (soft.shape, soft.stride(), soft.dtype) == (want_soft.shape, want_soft.stride(),
                                                        want_soft.dtype)
    assert_close(total, want_total, dtype)
    (report,) = reports
    assert kernel_count(reports) == 0
    # a sum over an extent of 0 stays (zeros where rows exist; a reduction over nothing is
    # left to ATen, which says where it is an error)
    left = [op for op in report.aten_ops if op != "aten.empty_strided.default"]
    assert left == ([] if shape[-1] else ["aten.sum.dim_IntList"])
    assert "exp" in report.summary["empty"] and "div" in report.summary["empty"]
    doc = {"target": "t", "graphs": [dict(report.summary, kernels=report.kernels,
                                          ran_kernels=report.ran_kernels)],
           "options": {"device": "-", "dtype": None, "training": False, "dynamic": False,
                       "profile": "p", "code": False}}
    assert "no elements, allocated instead of computed" in render_table(doc)


@pytest.mark.parametrize("shape", [(4, 0), (0, 0), (0,)], ids=str)
@pytest.mark.parametrize("op", ["amax", "amin", "softmax-amax"])
def test_reduction_without_identity_over_an_empty_dim_raises_like_eager(shape, op, device):
    fn = {"amax": lambda a: (a * 2).amax(-1),
          "amin": lambda a: a.amin(-1) + 1,
          "softmax-amax": lambda a: (a * 2).amax(-1) + a.sum(-1)}[op]
    x = torch.randn(*shape, device=device)
    with pytest.raises((IndexError, RuntimeError)):
        fn(x)
    with pytest.raises(Exception, match="zero-size|non-zero size|identity"):
        compile_and_run(fn, (x,))


@pytest.mark.parametrize("fn,shape", [
    (lambda a: a * 2, (4, 0)),
    (lambda a: a * 2, (0, 0)),
    (lambda a: a.sum(-1), (2, 0, 5)),
], ids=["pointwise-4x0", "pointwise-0x0", "sum-2x0x5"])
def test_zero_size_inner_dimension(fn, shape, device):
    check(fn, (torch.randn(*shape, device=device),))


def test_compiler_error_falls_back_to_aten_without_strict(device, monkeypatch):
    """Without FUSION_COMPILER_STRICT an internal compiler error (here the zero-size bug above)
    runs the graph on ATen with a warning and says so in the report."""
    monkeypatch.setenv("FUSION_COMPILER_STRICT", "0")
    x = torch.randn(4, 0, device=device)
    out, reports = compile_and_run(lambda a: a * 2 + 1, (x,))
    assert_close(out, x * 2 + 1)
    if reports[0].error:
        assert not reports[0].ran_kernels and reports[0].aten_ops


def _mean_saved(x, w):
    """A mean over a small middle dim (passes/middle_dims.py's elementwise slices), returned and
    saved for the product's gradient."""
    y = x.mean(1, keepdim=True)
    return (y * w).tanh(), y


@pytest.mark.parametrize("strict", [False, True], ids=["warned", "strict"])
def test_an_output_a_pass_left_in_other_strides_is_put_back(strict, device, monkeypatch,
                                                            caplog):
    """A rewrite that leaves an output in other strides than the trace's (middle_dims' old bug,
    put back here: its result in the slices' layout) is a pass's bug. Under
    FUSION_COMPILER_STRICT the compile raises, naming the output and both strides; else a
    warning, and the output is copied into the traced layout in the kernel that makes it:
    eager's strides and gradients, where the backward read the saved value wrong before."""
    from fusion_compiler.passes import middle_dims
    monkeypatch.setenv("FUSION_COMPILER_STRICT", "1" if strict else "0")
    monkeypatch.setattr(middle_dims, "contiguous", lambda gm, x: x)
    x = torch.randn(5, 3, 4, device=device).permute(2, 1, 0)
    w = torch.randn(4, 1, 5, device=device)

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in (x, w)]
        outs = fn(*leaves)
        sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        return outs, [t.grad for t in leaves]
    torch._dynamo.reset()
    if strict:
        with pytest.raises(Exception, match=r"output 1 \(view_default\) left the ATen passes in "
                                            r"strides \(1, 20, 4\), the trace's \(5, 5, 1\)"):
            step(torch.compile(_mean_saved, backend="fusion"))
        return
    with fusion_compiler.capture_compiles() as reports:
        outs, grads = step(torch.compile(_mean_saved, backend="fusion"))
    assert "copied into them (a bug: please report it)" in caplog.text
    assert [(r.kind, r.error, kernel_count([r])) for r in reports] == [
        ("forward", "", 1), ("backward", "", 2)] and leftover_aten(reports) == []
    want, want_grads = step(_mean_saved)
    for out, ref in zip(outs, want):
        assert out.stride() == ref.stride() == (5, 5, 1)
        assert_close(out.detach(), ref.detach())
    for got, ref in zip(grads, want_grads):
        assert_close(got, ref)


def test_a_pass_failing_after_rewrites_runs_the_rewritten_graph(device, monkeypatch):
    """The passes rewrite the graph and leave its code to the backend: when one fails after
    others have rewritten the graph (a constant folded, a duplicate removed), the ATen graph
    that runs is compiled from the graph as it is then, and gives eager's numbers."""
    from fusion_compiler.passes import constant_fold, dedupe, fuse

    monkeypatch.setenv("FUSION_COMPILER_STRICT", "0")
    rewrote = []
    for module in (constant_fold, dedupe):
        def spy(gm, ctx, _run=module.run, _name=module.__name__):
            before = len(gm.graph.nodes)
            out = _run(gm, ctx)
            rewrote.append((_name, before - len(gm.graph.nodes)))
            return out
        monkeypatch.setattr(module, "run", spy)

    def broken(gm, ctx):
        raise RuntimeError("injected after the rewrites")
    monkeypatch.setattr(fuse, "run", broken)

    def fn(x):
        ramp = torch.arange(37, device=x.device, dtype=x.dtype) * 0.5 + 1.0   # folded
        return (x * ramp).exp() + (x * ramp).exp() * 3.0                       # one exp kept

    x = torch.randn(5, 37, device=device)
    out, reports = compile_and_run(fn, (x,))
    assert_close(out, fn(x))
    assert reports[0].error and "injected" in reports[0].error
    assert not reports[0].ran_kernels
    assert all(removed > 0 for _, removed in rewrote), rewrote      # both passes changed it


ZERO_DIM = {
    "pointwise": lambda s: (s * 2).exp() + s.sin(),
    "nan": lambda s: (s * 0 + NAN).exp() + s,
    "sum": lambda s: (s * 2).sum(),
    "sum-dim": lambda s: (s * 2).sum(-1),
    "amax-dim": lambda s: (s + 1).amax(-1),
    "mean-dim": lambda s: (s * 2).mean(-1),
    "softmax": lambda s: torch.softmax(s * 3, -1),
    "layernorm-of-broadcast": lambda s: F.layer_norm(s.expand(5) * torch.arange(5.0, device=s.device), (5,)),
}


@pytest.mark.parametrize("name", list(ZERO_DIM))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_dim_tensors(name, dtype, device):
    check(ZERO_DIM[name], (torch.tensor(0.7, device=device, dtype=dtype),))


# ------------------------------------------------------- bugs found with special values
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_relu_propagates_nan(dtype, device):
    check(torch.relu, (torch.tensor([NAN, -1.0, 2.0], device=device, dtype=dtype),))


def test_sign_bf16(device):
    check(torch.sign, (torch.tensor([1.0, -2.0, 0.0, 3.0], device=device, dtype=torch.bfloat16),))


@pytest.mark.parametrize("fn", [lambda a, b: a ** 4, lambda a, b: a ** -2,
                                lambda a, b: torch.pow(a, b)], ids=["x**4", "x**-2", "x**y"])
def test_pow_with_a_negative_base(fn, device):
    a = torch.tensor([-2.0, -0.5, 0.0, 3.0], device=device)
    b = torch.tensor([3.0, 2.0, 0.0, 0.5], device=device)
    check(fn, (a, b))


def test_pow_of_integer_tensors(device):
    a = torch.randint(-5, 5, (4, 6), device=device)
    check(lambda x, y: x ** y, (a, torch.randint(0, 4, (4, 6), device=device)))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_input_dequant(dtype, device):
    q = (torch.randn(4, 8, device=device) * 8).to(dtype)
    check(lambda a: a.float() * 2 + 1, (q,))


def test_bitwise_not_uint8(device):
    check(lambda a: ~a, (torch.randint(0, 255, (4, 8), dtype=torch.uint8, device=device),))


@pytest.mark.parametrize("fn,dtype", [(lambda a: a + 300, torch.uint8),
                                      (lambda a: a + 300, torch.int8),
                                      (lambda a: a + 2 ** 40, torch.int32)],
                         ids=["uint8+300", "int8+300", "int32+2**40"])
def test_integer_scalar_out_of_the_tensors_range(fn, dtype, device):
    check(fn, (torch.tensor([0, 1, 100, 127], dtype=dtype, device=device),))


def test_uint8_compared_with_a_negative_scalar(device):
    check(lambda a: a > -1, (torch.tensor([0, 1, 200, 255], dtype=torch.uint8, device=device),))


# ------------------------------------------------------- bugs found with odd fusion shapes
@pytest.mark.parametrize("fn,shape", [
    (lambda a: torch.softmax(a, -1)[1] * 2, (4, 6)),
    (lambda a: torch.softmax(a, -1)[:, 1:3] * 2, (4, 6)),
    (lambda a: torch.softmax(torch.softmax(a, -1).t(), -1), (6, 6)),
], ids=["select-row", "slice-cols", "softmax-of-transposed-softmax"])
def test_view_of_softmax_then_pointwise(fn, shape, device):
    check(fn, (torch.randn(*shape, device=device),))


ODD_FUSIONS = {
    # reductions whose results are read along another dimension than their own rows
    "row-sum-read-as-column": (lambda a: a * a.sum(-1), (16, 16)),
    "row-amax-transposed": (lambda a: a - a.amax(-1, keepdim=True).t(), (16, 16)),
    "row-mean-as-row-and-column": (lambda a: a - a.mean(-1, keepdim=True) + a.mean(-1), (16, 16)),
    "reduce-of-reduce-3d": (lambda a: a.sum(-1).sum(-1), (4, 5, 6)),
    "reduce-expand-reduce": (lambda a: (a.sum(-1, keepdim=True).expand(4, 6) * a).amax(-1), (4, 6)),
    "sum-over-view": (lambda a: (a * 2).view(4, 3, 2).sum(-1), (4, 6)),
    "sum-over-permute": (lambda a: (a * 2).permute(0, 2, 1).sum(-1), (3, 4, 5)),
    "cat-with-itself": (lambda a: torch.cat([a, a * 2, a], -1).softmax(-1), (4, 6)),
    "cat-of-reductions": (lambda a: torch.cat([a.sum(-1, keepdim=True),
                                               a.amax(-1, keepdim=True)], -1) * 2, (4, 6)),
    "softmax-slice-no-pointwise": (lambda a: a.softmax(-1)[:, 1:3], (4, 6)),
    "normalized-slice": (lambda a: (a - a.sum(-1, keepdim=True))[1:3].exp(), (4, 6)),
    "normalized-viewed-3d": (lambda a: (a - a.sum(-1, keepdim=True)).view(4, 2, 3).sum(-1), (4, 6)),
    "outputs-that-alias": (lambda a: (a * 2, (a * 2).t(), (a * 2)[1:]), (4, 6)),
    "broadcast-both-sides": (lambda a: (a[:, :1] + a[:1, :]).softmax(-1), (4, 6)),
    "where-on-row-statistics": (lambda a: torch.where(a > a.mean(-1, keepdim=True), a,
                                                      a.amax(-1, keepdim=True)), (4, 6)),
}


@pytest.mark.parametrize("name", list(ODD_FUSIONS))
def test_odd_fusions_match_eager(name, device):
    fn, shape = ODD_FUSIONS[name]
    check(fn, (torch.randn(*shape, device=device),), min_kernels=1)


# ====================================================================== 3. recompilation
def _rowwise(a, w):
    return torch.softmax(a * w, -1).sum(-1) + F.layer_norm(a, a.shape[-1:]).amax(-1)


def test_dynamic_shapes_do_not_recompile(device, monkeypatch):
    """Rows and row length change, persistent -> looped included (max block 64): one graph."""
    monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "64")
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(_rowwise, backend="fusion", dynamic=True)
    with fusion_compiler.capture_compiles() as reports:
        for shape in [(3, 16), (5, 64), (4, 65), (2, 3000), (9, 33), (7, 17)]:
            x = torch.randn(*shape, device=device)
            x[0, 2] = NAN
            w = torch.randn(shape[-1], device=device)
            assert_close(fn(x, w), _rowwise(x, w), name=f"shape {shape}")
    assert len(reports) == 1 and kernel_count(reports) >= 1, [r.kind for r in reports]
    assert counters["stats"]["unique_graphs"] == 1


def test_dtype_change_recompiles_and_is_right(device):
    torch._dynamo.reset()
    fn = torch.compile(_rowwise, backend="fusion", dynamic=True)
    seen = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.bfloat16):
        x = torch.randn(5, 16, device=device, dtype=dtype)
        w = torch.randn(16, device=device, dtype=dtype)
        with fusion_compiler.capture_compiles() as reports:
            out = fn(x, w)
        assert_close(out, _rowwise(x, w), name=str(dtype))
        seen.append(len(reports))
    assert seen == [1, 1, 1, 0], "each new dtype compiles once; bf16 again reuses its graph"


# =============================================================== 4. configuration, CLI
@pytest.mark.parametrize("name,value", [
    ("FUSION_COMPILER_STRICT", "2"),
    ("FUSION_COMPILER_STRICT", "maybe"),
    ("FUSION_COMPILER_EMIT_SOURCES", "yes please"),
    ("FUSION_COMPILER_MAX_GROUP_OPS", "0"),
    ("FUSION_COMPILER_MAX_GROUP_OPS", "-3"),
    ("FUSION_COMPILER_MAX_GROUP_OPS", "many"),
    ("FUSION_COMPILER_MAX_GROUP_OPS", "2.0"),
    ("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "1e3"),
    ("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "0x400"),
])
def test_bad_config_values_name_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        Config.from_env({name: value})


def test_bad_config_value_through_torch_compile(monkeypatch, device):
    monkeypatch.setenv("FUSION_COMPILER_MAX_GROUP_OPS", "-3")
    with pytest.raises(Exception, match="FUSION_COMPILER_MAX_GROUP_OPS") as info:
        compile_and_run(lambda a: a.relu() + 1, (torch.randn(4, 8, device=device),))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(c, ConfigError) for c in chain)


@pytest.mark.parametrize("value", ["b200", ""])
def test_unknown_profile_is_a_config_error(value, monkeypatch, device):
    monkeypatch.setenv("FUSION_COMPILER_PROFILE", value)
    with pytest.raises(Exception) as info:
        compile_and_run(lambda a: a.relu() + 1, (torch.randn(4, 8, device=device),))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(c, ConfigError) and "FUSION_COMPILER_PROFILE" in str(c) for c in chain)


@pytest.mark.parametrize("env", [{"FUSION_COMPILER_MAX_PERSISTENT_BLOCK": "1"},
                                 {"FUSION_COMPILER_MAX_GROUP_OPS": "1"},
                                 {"FUSION_COMPILER_PROFILE": "L4"}], ids=lambda e: str(e))
def test_extreme_but_valid_settings_stay_correct(env, monkeypatch, device):
    """Every row looped, every op its own kernel, a profile named in upper case."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    x, w = special_rows(8, 40, torch.float32, device), torch.randn(40, device=device)
    reports = check(lambda a, w: F.layer_norm(a * w, (40,)) + torch.softmax(a, -1), (x, w),
                    min_kernels=1)
    if "FUSION_COMPILER_MAX_GROUP_OPS" in env:
        assert all(len(k["ops"]) <= 1 for r in reports for k in r.kernels), reports[0].kernels


TINY = textwrap.dedent('''
    import torch

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x * 2 + 1).sum(-1)

    def make_model_and_inputs(device="cpu", dtype=torch.float32):
        return Tiny(), (torch.randn(4, 8, device=device, dtype=dtype),)
''')


@pytest.mark.parametrize("argv,expected", [
    (["dump", "{tiny}", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["dump", "{tiny}", "--format=json", "--no-such=3"], "unrecognized arguments: --no-such=3"),
    (["dump", "{tiny}", "extra"], "unrecognized arguments: extra"),
    (["dump", "{tiny}", "--profile"], "expected one argument"),
    (["dump", "{tiny}", "--dynamic=yes"], "ignored explicit argument"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
], ids=["unknown-option", "unknown-option-value", "extra-positional", "missing-value",
        "flag-with-value", "unknown-command"])
def test_cli_usage_errors_are_one_line_with_status_2(argv, expected, tmp_path, capsys):
    tiny = tmp_path / "tiny.py"
    tiny.write_text(TINY)
    rc = cli_main([a.format(tiny=tiny) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("fusion-compiler: error: "), err
    assert expected in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("name,value", [("FUSION_COMPILER_PROFILE", "b200"),
                                        ("FUSION_COMPILER_MAX_GROUP_OPS", "0"),
                                        ("FUSION_COMPILER_STRICT", "maybe")])
def test_cli_bad_environment_is_one_line_with_status_2(name, value, tmp_path, capsys,
                                                       monkeypatch):
    tiny = tmp_path / "tiny.py"
    tiny.write_text(TINY)
    monkeypatch.setenv(name, value)
    rc = cli_main(["dump", str(tiny)])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("fusion-compiler: error: ") and name in lines[0]


# ------------------------------------------------- a slice of a cat inside one of its operands
@pytest.mark.parametrize("where", ["[1:]", "[:1]", "[:-1]", "[1:-1]"])
def test_slice_of_cat_decided_by_sizes(where, device):
    """A slice that falls inside one operand makes the cat's select predicate a constant
    (True/False from the sizes alone); GPT-2's mask code does this (torch.diff with prepend).
    Found by examples/gpt2.py: code generation raised on the constant."""
    sl = {"[1:]": slice(1, None), "[:1]": slice(None, 1), "[:-1]": slice(None, -1),
          "[1:-1]": slice(1, -1)}[where]

    def f(a, b):
        return torch.cat([a, b])[sl] * 2 + 1

    a, b = torch.randn(1, device=device), torch.randn(16, device=device)
    out, reports = compile_and_run(f, (a, b))
    assert kernel_count(reports) == 1 and not leftover_aten(reports)
    assert_close(out, f(a, b))


def test_diff_with_prepend_fuses(device):
    x = torch.randint(0, 100, (3, 17), device=device)
    f = lambda x: torch.diff(x, prepend=x[:, :1] - 1) != 1  # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) >= 1
    assert torch.equal(out, f(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_first_update_passes_the_keys_to_attention_uncopied(dtype, device):
    """transformers' BART layers update an empty cache even with use_cache=False:
    cat([tensor([]), k], -2) copies k for attention to read once. Attention reads k itself
    (a transposed view), the cat is gone from the graph and named in the report, and the
    result is eager's. Where something else reads the cat, it stays."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 16, generator=g).to(device=device, dtype=dtype)
    kv = torch.randn(2, 7, 64, generator=g).to(device=device, dtype=dtype)

    def attend(q, kv, also_returned=False):
        empty = torch.tensor([], dtype=kv.dtype, device=kv.device)
        k = torch.cat([empty, kv.view(2, 7, 4, 16).transpose(1, 2)], dim=-2)
        v = torch.cat([empty, (kv * 2).view(2, 7, 4, 16).transpose(1, 2)], dim=-2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return (out, k) if also_returned else out

    out, reports = compile_and_run(attend, (q, kv))
    (report,) = reports
    assert len(report.summary["passed_through"]) == 2
    assert not [op for op in report.aten_ops if ".cat." in op]
    assert_close(out, attend(q, kv), dtype=dtype)

    def attend_and_return_k(q, kv):
        return attend(q, kv, also_returned=True)

    out, reports = compile_and_run(attend_and_return_k, (q, kv))
    assert len(reports[0].summary["passed_through"]) == 1        # v only: k is returned
    for a, e in zip(out, attend_and_return_k(q, kv)):
        assert_close(a, e, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_update_that_is_returned_joins_the_kernel_of_its_keys(dtype, device):
    """A KV cache whose update is a graph output (a graph break in transformers' cache
    constructor leaves the cache alive past the graph): cat([tensor([]), k], -2) must be
    written, but without its empty input it is a copy that the kernel computing k (RoPE
    here) writes directly, and the value's copy is one kernel, not an ATen cat. Odd sizes, but
    a head size of 16: the GPU's attention kernels need a multiple of 8, and below that SDPA
    decomposes into ATen ops the fusion takes (other kernels than the ones counted here)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 7, 16, generator=g).to(device=device, dtype=dtype)
    kv = torch.randn(2, 7, 48, generator=g).to(device=device, dtype=dtype)
    cos = torch.randn(7, 16, generator=g).to(device=device, dtype=dtype)
    sin = torch.randn(7, 16, generator=g).to(device=device, dtype=dtype)

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def layer(q, kv):
        empty = torch.tensor([], dtype=kv.dtype, device=kv.device)
        k = rope(kv.view(2, 7, 3, 16).transpose(1, 2))
        k = torch.cat([empty, k], dim=-2)
        v = torch.cat([empty, (kv + 1).view(2, 7, 3, 16).transpose(1, 2)], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v), k, v

    out, reports = compile_and_run(layer, (q, kv))
    (report,) = reports
    assert len(report.summary["trimmed_cats"]) == 2
    assert not report.summary["passed_through"]
    assert not [op for op in report.aten_ops if ".cat." in op]
    assert kernel_count(reports) == 1      # RoPE writing the cached keys, and the values (both read kv)
    for a, e in zip(out, layer(q, kv)):
        assert a.stride() == e.stride()
        assert_close(a, e, dtype=dtype)


def test_cat_keeps_a_dtype_its_empty_inputs_promote_to(device):
    """torch.cat promotes over empty inputs too: a float32 empty tensor makes the bf16 keys'
    copy float32, so the empty input is kept (and the cat stays on ATen), never dropped."""
    kv = torch.randn(2, 5, 6, device=device).to(torch.bfloat16)

    def f(kv):
        empty = torch.tensor([], dtype=torch.float32, device=kv.device)
        return torch.cat([empty, kv * 2], dim=-2)

    out, reports = compile_and_run(f, (kv,))
    assert not reports[0].summary["trimmed_cats"]
    assert out.dtype == torch.float32
    assert_close(out, f(kv), dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_computations_are_computed_once(dtype, device):
    """T5's layers each mask the shared position bias the same way and copy it for their
    attention: one masked copy is computed and written, not one per layer (they were written
    by one kernel and alive at once)."""
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(2, 3, 5, 5, generator=g).to(device=device, dtype=dtype)
    keep = torch.rand(2, 1, 1, 5, generator=g).to(device) > 0.3
    xs = [torch.randn(2, 3, 5, 5, generator=g).to(device=device, dtype=dtype) for _ in range(3)]

    def layers(bias, keep, a, b, c):
        out = []
        for x in (a, b, c):
            masked = torch.where(keep, bias, torch.finfo(bias.dtype).min).clone()
            out.append(torch.softmax(x + masked, -1))
        return out

    out, reports = compile_and_run(layers, (bias, keep, *xs))
    (report,) = reports
    ops = [op for k in report.kernels for op in k["ops"]]
    assert sum(op == "aten.where.self" for op in ops) == 1, ops
    assert kernel_count(reports) == 1                   # the three softmaxes, the mask once
    for a, e in zip(out, layers(bias, keep, *xs)):
        assert_close(a, e, dtype=dtype)


def test_identical_outputs_stay_distinct_tensors(device):
    """Two equal results the caller gets are two tensors: writing to one leaves the other."""
    x = torch.randn(4, 7, device=device)

    def twice(x):
        return x.exp() + 1, x.exp() + 1

    (a, b), _ = compile_and_run(twice, (x,))
    assert a.data_ptr() != b.data_ptr()
    b.zero_()
    assert_close(a, x.exp() + 1)
