"""The online softmax in looped row kernels (lowered.online_sums, fl.lse_step): the sum of
exp(x - max(x)) of a softmax, log_softmax or cross-entropy is taken in its max's pass, each
lane summing exp(x - its own running max) and rescaling as that max grows, then the lanes (and a
split row's chunks) brought to the row's max. One pass over the row fewer: softmax reads its
rows twice, not three times; cross-entropy once. Tests loop in steps of 16 columns, assert the
passes and the kernel count, and compare with eager in each dtype, with rows whose max grows at
every step, huge offsets, NaN, +-inf and all -inf rows."""
import re

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.codegen import launch
from helpers import assert_close, assert_outputs_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def softmax(x):
    return torch.softmax(x, dim=-1)


def log_softmax(x):
    return torch.log_softmax(x, dim=-1)


def logsumexp(x):
    """The normaliser itself as an output, beside the max."""
    xf = x.float()
    m = xf.amax(-1, keepdim=True)
    return m + torch.log(torch.exp(xf - m).sum(-1, keepdim=True)), torch.exp(xf - m).sum(-1)


OPS = {"softmax": softmax, "log_softmax": log_softmax, "logsumexp": logsumexp}


def looped_source(reports) -> str:
    text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
    return text[text.index("def _looped_kernel"):text.index("def _split0_kernel")]


def hard_rows(n, dtype, device):
    """Random rows, and rows that test the rescaling: increasing (a new max at every step),
    decreasing, offset by 1e4 (exp(x - m) of the first steps underflows to 0 later), and the
    max in the row's last column."""
    x = randn((8, n), dtype, device)
    x[1] = torch.linspace(-20, 20, n, device=device).to(dtype)
    x[2] = torch.linspace(20, -20, n, device=device).to(dtype)
    x[3] = (x[3].float() + 1e4).to(dtype) if dtype != torch.float16 else x[3] * 8
    x[4, -1] = 30.0
    return x


@pytest.mark.parametrize("n", [41, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_the_sum_of_exps_is_taken_in_the_max_pass(op, dtype, n, small_steps, device):
    fn = OPS[op]
    x = hard_rows(n, dtype, device)
    out, reports = compile_and_run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    src = looped_source(reports)
    assert "fl.lse_step(" in src
    # the max with the sum, then the outputs (logsumexp's are per row: no second pass)
    assert len(re.findall(r"for off in range\(", src)) == (1 if op == "logsumexp" else 2)
    expected = fn(x)
    assert_outputs_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_reads_its_logits_once(dtype, small_steps, device):
    """The loss needs the max, the sum of exps and the target's logit: one pass."""
    x = hard_rows(57, dtype, device)
    t = torch.randint(0, 57, (8,), device=device)
    t[2] = -100

    def f(x, t):
        return F.cross_entropy(x.float(), t)
    out, reports = compile_and_run(f, (x, t))
    assert len(re.findall(r"for off in range\(", looped_source(reports))) == 1
    assert_close(out, f(x, t), dtype=torch.float32)


def test_nan_and_infinite_rows(small_steps, device):
    """NaN and +inf rows are NaN, as eager's; a -inf lane is left out; a row of -inf alone is
    NaN (eager's max - max); rows around them are untouched."""
    x = randn((7, 41), torch.float32, device)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, :20] = float("-inf")
    x[4] = float("-inf")
    x[5, 0] = float("-inf")
    for fn in (softmax, log_softmax, logsumexp):
        out, reports = compile_and_run(fn, (x,))
        assert "fl.lse_step(" in looped_source(reports)
        expected = fn(x)
        assert_outputs_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_rows_combine_their_chunks_sums(dtype, small_chunks, device):
    """Split across programs (chunks of 32 columns), the max's stage also leaves each chunk's
    sum of exps, brought to the chunk's max; the output stage brings them to the row's: two
    stages, not three."""
    x = hard_rows(301, dtype, device)[:3].contiguous()
    x[1, 7] = float("-inf")
    x[2, 200:] = float("-inf")      # whole chunks of -inf: left out of the row's sum
    for fn in (softmax, logsumexp):
        torch._dynamo.reset()
        with fusion_compiler.capture_compiles() as reports:
            compiled = torch.compile(fn, backend="fusion", fullgraph=True)
            out = compiled(x)
        assert launch.split_settings(3, 301)[0] > 1
        text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
        assert "def _split1_kernel" in text and "def _split2_kernel" not in text
        expected = fn(x)
        assert_outputs_close(out, expected)


def test_persistent_kernels_keep_two_passes_in_registers(device):
    """A row that fits in registers is read once anyway: no online sum there."""
    x = randn((5, 300), torch.bfloat16, device)
    out, reports = compile_and_run(softmax, (x,))
    text = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
    assert "_persistent_kernel" in text and "lse_step" not in text
    assert_close(out, softmax(x), dtype=torch.bfloat16)
