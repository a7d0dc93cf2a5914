"""Looped row kernels over rows that do not start on 16 bytes (kernel_source._row_shift,
row_loops.column_loop's ``shifted_row``): rows of an odd length (GPT-2's vocabulary of 50257)
start on 2 or 4 bytes, and each step's loads took one element at a time. The loop steps from
the row's first element rounded down to 16 bytes instead; the steps inside the row load and
store without masks, the first and the last mask by element. Tests shrink the loop's step to
16 columns so that rows of a few dozen elements take a masked first step, unmasked steps and
a masked last step, at every shift (rows of 41 start at 41 * r elements: shifts 0 to 7), and
assert the kernel count, that the shift was taken, and the values against eager in each
dtype."""
import re

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler import backend
from helpers import assert_close, assert_outputs_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def softmax(x):
    return torch.softmax(x * 0.5, dim=-1)


def log_softmax_fp32(x):
    """bf16 rows in, fp32 rows out: one shift serves both (16 bytes hold 8 and 4 of them)."""
    return torch.log_softmax(x.float(), dim=-1)


def row_stats(x):
    """Per-row outputs beside a row output."""
    v, m = torch.var_mean(x.float(), dim=-1)
    return x.amax(-1), v, m, torch.exp(x - x.amax(-1, keepdim=True))


OPS = {"softmax": softmax, "log_softmax_fp32": log_softmax_fp32, "row_stats": row_stats}


def source(reports):
    return "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)


@pytest.mark.parametrize("n", [41, 102, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_unaligned_rows_step_from_their_16_bytes(op, dtype, n, small_steps, device):
    x = randn((9, n), dtype, device)
    fn = OPS[op]
    out, reports = compile_and_run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert "rowa = (rstart // " in source(reports)
    expected = fn(x)
    assert_outputs_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_over_unaligned_rows(dtype, small_steps, device):
    """The per-row loss reads the target's logit by a gather and stores one value a row: a
    block of one (it meets the ignored target's constant) at the row's scalar address."""
    x = randn((7, 57), dtype, device)
    t = torch.randint(0, 57, (7,), device=device)
    t[3] = -100

    def f(x, t):
        return F.cross_entropy(x.float(), t)
    out, reports = compile_and_run(f, (x, t))
    assert "rowa = (rstart // " in source(reports)
    # the mean over the rows that count: the losses' sum in a kernel, the count of the rows
    # (a sum of integers) left to ATen
    assert leftover_aten(reports) == ["aten.sum.dim_IntList"]
    assert_close(out, f(x, t), dtype=torch.float32)


def test_nan_and_inf_in_unaligned_rows(small_steps, device):
    """A NaN in the masked first step, an Inf in an unmasked step: each row's softmax as
    eager's (NaN rows, an Inf's row NaN where eager's is)."""
    x = randn((5, 41), torch.bfloat16, device)
    x[1, 0] = float("nan")
    x[2, 20] = float("inf")
    x[3, 40] = float("-inf")
    out, reports = compile_and_run(softmax, (x,))
    assert kernel_count(reports) == 1
    assert_close(out, softmax(x), dtype=torch.bfloat16)


@pytest.mark.parametrize("case", ["aligned rows", "a weight by column", "dynamic sizes"])
def test_no_shift_where_it_cannot_serve(case, small_steps, device):
    """Rows of 48 bf16 elements start on 16 bytes; a LayerNorm's weight is read by column
    alone (another shift than the row's); under dynamic sizes the row's start is not known.
    The loop steps from column 0, and the values are eager's."""
    n = 48 if case == "aligned rows" else 41
    x = randn((6, n), torch.bfloat16, device)
    w = randn((n,), torch.bfloat16, device)
    fn = softmax if case != "a weight by column" else (
        lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, 1e-5))
    args = (x,) if case != "a weight by column" else (x, w)
    out, reports = compile_and_run(fn, args, dynamic=case == "dynamic sizes")
    assert kernel_count(reports) == 1
    assert "_looped_kernel" in source(reports) and "rowa" not in source(reports)
    assert_close(out, fn(*args), dtype=torch.bfloat16)


def test_unaligned_rows_in_training(small_steps, device):
    """log_softmax forward and backward over rows of 41: both directions' looped kernels
    step from the rows' 16 bytes."""
    x = randn((6, 41), torch.bfloat16, device).requires_grad_()
    g = randn((6, 41), torch.bfloat16, device)

    def f(x):
        return torch.log_softmax(x, dim=-1)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion")(x)
        out.backward(g)
    got = x.grad.clone()
    x.grad = None
    expected = f(x)
    expected.backward(g)
    assert [r.kind for r in reports] == ["forward", "backward"]
    assert all("rowa = (rstart // " in source([r]) for r in reports)
    assert_close(out, expected, dtype=torch.bfloat16)
    assert_close(got, x.grad, dtype=torch.bfloat16, name="grad")


@pytest.mark.parametrize("n", [41, 48])
def test_passes_over_rows_larger_than_l2_carry_eviction_hints(n, small_steps, cache_dir, device,
                                                              monkeypatch):
    """Where a looped kernel's rows hold more than L2 (here: at least one element), its passes
    before the last load with evict_last, the last pass loads and stores with evict_first
    (row_loops.evicting); the values do not change. At the default threshold these rows have
    none."""
    from fusion_compiler.codegen import row_loops
    x = randn((9, n), torch.bfloat16, device)
    out, reports = compile_and_run(softmax, (x,))
    assert "eviction_policy" not in source(reports)
    assert_close(out, softmax(x), dtype=torch.bfloat16)
    monkeypatch.setattr(row_loops, "EVICT_MIN_ELEMENTS", 1)
    monkeypatch.setattr(backend, "_caches", {})
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(cache_dir) + "-hints")
    out, reports = compile_and_run(softmax, (x,))
    assert kernel_count(reports) == 1
    text = source(reports)
    looped = text[text.index("def _looped_kernel"):text.index("def _split0_kernel")]
    # each pass from its first step's loads (`off = 0`; unshifted, `col0 = 0`): the max's
    # (with the sum of exps, online), the output's
    passes = re.split(r"\n\s*(?:off|col0) = 0\n", looped)[1:]
    assert len(passes) == 2 and row_loops.EVICT == 2
    for i, p in enumerate(passes):
        loads = [ln for ln in p.splitlines() if "tl.load(in0" in ln]
        stores = [ln for ln in p.splitlines() if "tl.store(out0" in ln]
        hint = 'eviction_policy="evict_first"' if i == 1 else 'eviction_policy="evict_last"'
        assert loads and all(hint in ln for ln in loads), (i, loads)
        assert bool(stores) == (i == 1)
        assert all('eviction_policy="evict_first"' in ln for ln in stores), stores
    assert_close(out, softmax(x), dtype=torch.bfloat16)
