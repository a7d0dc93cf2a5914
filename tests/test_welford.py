"""A norm's variance taken in its mean's pass by looped row kernels (lowered.partner_of's "m2",
row_loops' "wmean"): ``sum`` or ``mean`` of ``(x - mean(x))**2`` is Welford's update per lane
(a running mean and the sum of squared deviations from it, one reciprocal a step), the lanes
then a split row's chunks combined by Chan's formula. A LayerNorm over long rows reads them
twice, not three times; a split GroupNorm takes two stages, not three. Tests loop in steps of
16 columns, assert the passes and the kernel count, and compare with eager in each dtype, on
rows offset by 1e4, constant rows, rows with one outlier, NaN and +-inf, shifted rows, and
rows where the pattern must not be taken."""
import re

import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.codegen import launch
from helpers import assert_close, assert_outputs_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def up(x):
    """fp32 for bf16, fp16 and fp32 rows; fp64 stays fp64 (assert_true_values' reference)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def layer_norm(x):
    n = x.shape[-1]
    w = torch.linspace(0.5, 1.5, n, device=x.device, dtype=x.dtype)
    b = torch.linspace(-1, 1, n, device=x.device, dtype=x.dtype)
    return F.layer_norm(x, (n,), w, b, 1e-5)


def group_norm_silu(x):
    """Rows of 2 channels x the rest (2 groups), SiLU after."""
    y = x.view(x.shape[0], 4, -1)
    return F.silu(F.group_norm(y, 2, eps=1e-5))


def var_mean(x):
    """Per-row outputs alone: one pass."""
    v, m = torch.var_mean(up(x), dim=-1)
    return v, m


def centred_square(x):
    """The variance written with pow, beside the centred row: a mean of squares."""
    xf = up(x)
    d = xf - xf.mean(-1, keepdim=True)
    return d.pow(2).mean(-1), (d * 2).to(x.dtype)


# op -> (function, passes over the row: Welford's, then the per-element outputs if any)
OPS = {"layer_norm": (layer_norm, 2), "group_norm_silu": (group_norm_silu, 2),
       "var_mean": (var_mean, 1), "centred_square": (centred_square, 2)}


def assert_true_values(out, fn, x):
    """Against eager in fp64, each output cast to eager's dtype, with the dtype's tolerance.
    Not eager in the input's dtype: over the constant bf16 row of 9984, whose variance is 0,
    eager's rstd (316) turns its mean's rounding into 0.03 at each output; the kernel's Welford
    mean is exact there. The per-element outputs of an fp32 row offset by 1e4 take 2e-3: x -
    mean cannot be nearer than the mean's rounding at 1e4 (eager's is 1e-3 from fp64's too)."""
    expected = fn(x)
    truth = fn(x.double())
    expected, truth = (expected, truth) if isinstance(expected, tuple) else ((expected,), (truth,))
    out = out if isinstance(out, tuple) else (out,)
    for i, (a, e, t) in enumerate(zip(out, expected, truth)):
        t = t.to(e.dtype)
        if e.dtype == torch.float32 and a.dim() > 1:
            assert_close(a[1], t[1], atol=2e-3, rtol=1e-5, name=f"output {i}, the offset row")
            a, t = a[torch.arange(a.shape[0]) != 1], t[torch.arange(t.shape[0]) != 1]
        assert_close(a, t, name=f"output {i}")


def looped_source(reports) -> str:
    text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
    return text[text.index("def _looped_kernel"):text.index("def _split0_kernel")]


def hard_rows(n, dtype, device):
    """Random rows, and rows that test the update: offset by 1e4 (the variance a 1e-8 part of
    the squares; 100 in fp16), constant (variance 0), increasing, one outlier in the last
    column, and scaled by 1e-3."""
    x = randn((8, n), dtype, device)
    x[1] = (x[1].float() + (1e4 if dtype != torch.float16 else 100.0)).to(dtype)
    x[2] = 3.0
    x[3] = torch.linspace(-20, 20, n, device=device).to(dtype)
    x[4, -1] = 300.0
    x[5] = (x[5].float() * 1e-3).to(dtype)
    return x


@pytest.mark.parametrize("n", [48, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_the_variance_is_taken_in_the_mean_pass(op, dtype, n, small_steps, device):
    fn, passes = OPS[op]
    x = hard_rows(n, dtype, device)
    out, reports = compile_and_run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    src = looped_source(reports)
    assert "fl.chan_m2(" in src and "wr = " in src
    assert len(re.findall(r"for off in range\(", src)) == passes
    assert_true_values(out, fn, x)


def test_offset_rows_in_fp32_keep_their_variance(small_steps, device):
    """fp32 rows of mean 1e4 and variance 1: the variance within fp32's tolerance of eager's in
    fp64. Each lane's running mean is kept less its first element, and the lanes are combined
    about a reference: a running mean of 1e4 itself rounds to 5e-4 at every step, which made
    the variance 1e-4 off (as eager's fp32 var_mean on the H200 is: 3e-5)."""
    x = randn((4, 203), torch.float32, device) + 1e4
    out, reports = compile_and_run(var_mean, (x,))
    assert "fl.chan_m2(" in looped_source(reports)
    v, m = var_mean(x.double())
    assert_close(out[0], v.float(), name="variance")
    assert_close(out[1], m.float(), atol=5e-4, name="mean")     # half an fp32 step at 1e4


def test_nan_and_infinite_rows(small_steps, device):
    """A NaN or an inf makes its row's variance NaN, as eager's; rows around them are
    untouched. The mean of a row holding an infinity is the infinity, as ``x.mean`` gives (a
    plain sum's: fl.welford_mean), also where the infinity is a lane's first element; eager's
    var_mean gives NaN there on the CPU (its Welford update), the infinity on CUDA."""
    x = randn((6, 41), torch.float32, device)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, 0] = float("-inf")
    x[4, 20] = float("inf")
    x[4, 21] = float("-inf")
    for fn in (layer_norm, var_mean):
        out, reports = compile_and_run(fn, (x,))
        assert "fl.chan_m2(" in looped_source(reports)
        expected = fn(x) if fn is layer_norm else (var_mean(x)[0], x.mean(-1))
        assert_outputs_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_rows_combine_their_chunks_moments(dtype, small_chunks, device):
    """Split across programs (chunks of 32 columns, the last one short), the first stage
    leaves each chunk's mean and sum of squared deviations; the second combines them: two
    stages, not three."""
    x = hard_rows(301, dtype, device)[:4].contiguous()
    x[3, 7] = float("nan")
    for fn in (layer_norm, var_mean):
        out, reports = compile_and_run(fn, (x,))
        assert launch.split_settings(4, 301)[0] > 1
        text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
        assert "def _split1_kernel" in text and "def _split2_kernel" not in text
        assert "fl.chan_m2(scount, " in text
        assert_true_values(out, fn, x)


@pytest.mark.parametrize("n", [41, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_shifted_rows(dtype, n, small_steps, device):
    """Rows of 41 start at every shift: the lanes before a row's start take their first
    element a step later (the second step, peeled too: their own reciprocal count and one
    element fewer); rows of 20 end in that second step (no loop left). A norm without a
    weight (a weight read by column would need its own shift)."""
    def standardize(x):
        v, m = torch.var_mean(up(x), -1, keepdim=True, correction=0)
        return ((up(x) - m) * torch.rsqrt(v + 1e-5)).to(x.dtype)
    x = hard_rows(n, dtype, device)
    out, reports = compile_and_run(standardize, (x,))
    src = looped_source(reports)
    assert "rowa = (rstart // " in src and "fl.welford_counts(N + sh, RBLOCK, sh)" in src
    assert_true_values(out, standardize, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_training(dtype, small_steps, device):
    """Forward and backward over looped rows: the saved mean and rstd are Welford's."""
    x = randn((5, 70), dtype, device).requires_grad_()
    w = randn((70,), dtype, device).requires_grad_()
    b = randn((70,), dtype, device).requires_grad_()

    def f(x, w, b):
        return F.layer_norm(x, (70,), w, b, 1e-5)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fusion", fullgraph=True)
    g = randn((5, 70), dtype, device)
    out = compiled(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b), g)
    ref = f(x, w, b)
    ref_grads = torch.autograd.grad(ref, (x, w, b), g)
    assert_close(out, ref, dtype=dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for name, a, e in zip("xwb", grads, ref_grads):
        assert_close(a, e, atol=tol, rtol=tol, name=f"grad {name}")


def not_the_row_mean(x):
    """``(x - mean(y))**2`` with y another tensor's rows: no partner, three passes."""
    y = x.float() * 2
    d = x.float() - y.mean(-1, keepdim=True)
    return (d * d).sum(-1)


def column_broadcast(x):
    """A square matrix's row means broadcast along the rows (``x - mean`` without keepdim):
    each column takes a row's mean; no partner."""
    xf = x.float()
    d = xf - xf.mean(-1)
    return (d * d).sum(-1)


@pytest.mark.parametrize("fn", [not_the_row_mean, column_broadcast], ids=lambda f: f.__name__)
def test_look_alikes_keep_their_passes(fn, small_steps, device):
    x = randn((40, 40), torch.float32, device)
    out, reports = compile_and_run(fn, (x,))
    text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
    assert "fl.chan_m2(" not in text
    assert_close(out, fn(x), atol=1e-4, rtol=1e-4)


def test_persistent_rows_keep_two_levels(device):
    """A row in registers reads memory once: no Welford update there."""
    x = randn((8, 256), torch.bfloat16, device)
    out, reports = compile_and_run(layer_norm, (x,))
    text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
    assert "fl.chan_m2(" not in text and "def _looped_kernel" not in text
    assert_outputs_close(out, layer_norm(x))


def guarded_norm(x):
    """A norm whose rstd hides the variance's NaN (nan_to_num): a row holding an infinity
    shows its mean, x - (-inf) = inf, where Welford's NaN mean would make every element NaN."""
    xf = up(x)
    m = xf.mean(-1, keepdim=True)
    v = ((xf - m) * (xf - m)).mean(-1, keepdim=True)
    return (xf - m) * torch.nan_to_num(torch.rsqrt(v + 1e-5), nan=1.0)


@pytest.mark.parametrize("fn, kept", [(layer_norm, False), (var_mean, True),
                                      (guarded_norm, True)], ids=["layer_norm", "var_mean",
                                                                  "guarded_norm"])
def test_the_plain_sum_only_where_the_mean_is_seen(fn, kept, small_steps, device):
    """Beside Welford's mean the lanes keep a plain sum (the mean of a row holding an
    infinity) only where the mean is seen other than through a norm (lowered.mean_hidden): not
    a LayerNorm's, whose rstd is NaN on such a row anyway."""
    x = randn((4, 41), torch.float32, device)
    x[1, 0] = float("-inf")
    x[2, 30] = float("inf")
    out, reports = compile_and_run(fn, (x,))
    src = looped_source(reports)
    assert "fl.chan_m2(" in src
    assert ("fl.welford_mean(" in src) == kept
    expected = fn(x) if fn is not var_mean else (var_mean(x)[0], x.mean(-1))
    assert_outputs_close(out, expected)
