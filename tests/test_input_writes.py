"""Buffers updated in the graph are written by the kernel that computes their new value
(aot_autograd's ``keep_inference_input_mutations``; passes/input_writes.py): no copy after
the graph. Where the kernel cannot (the value computed from something else, the old value
read after that kernel), ATen's ``copy_`` stays, with its reason in the dump. The updated
buffers and the outputs as eager's."""
import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _writes(reports):
    return [w for r in reports for w in r.summary.get("input_writes", [])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_norm_running_statistics_are_written_by_their_kernel(dtype, device):
    """A training BN's running mean, running variance and batch count: each written by the
    kernel computing it (the statistics' combination, the count's add), no copy left."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(6).to(device, dtype)
    ref = torch.nn.BatchNorm2d(6).to(device, dtype)
    ref.load_state_dict(bn.state_dict())
    x = randn((4, 6, 5, 7), dtype, device)
    with torch.no_grad():
        out, reports = compile_and_run(lambda x: F.relu(bn(x)), (x,))
        expected = F.relu(ref(x))
    assert leftover_aten(reports) == []
    assert len(_writes(reports)) == 3
    assert kernel_count(reports) == 4
    assert_close(out, expected, dtype=dtype)
    for name in ("running_mean", "running_var"):
        assert_close(getattr(bn, name), getattr(ref, name), dtype=dtype, name=name)
    assert torch.equal(bn.num_batches_tracked, ref.num_batches_tracked)


def test_an_exponential_moving_average_buffer(device):
    """avg <- 0.9 avg + 0.1 mean(x, 0), twice: the column sum's kernel writes avg."""
    class EMA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("avg", torch.zeros(37, device=device))

        def forward(self, x):
            self.avg.mul_(0.9).add_(x.mean(0) * 0.1)
            return x - self.avg
    ours, theirs = EMA(), EMA()
    x = randn((50, 37), torch.float32, device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        f = torch.compile(ours, backend="fusion", fullgraph=True)
        for _ in range(2):
            out = f(x)
    for _ in range(2):
        expected = theirs(x)
    assert len(_writes(reports)) == 1 and leftover_aten(reports) == []
    assert_close(out, expected, dtype=torch.float32)
    assert_close(ours.avg, theirs.avg, dtype=torch.float32, name="avg")


def test_a_value_computed_from_something_else_is_copied(device):
    """buf <- x * 2: the kernel computing x * 2 does not read buf, so it may not take its
    place (nothing says buf's layout is its output's): the copy stays, and says why."""
    x, buf = randn((8, 5), torch.float32, device), randn((8, 5), torch.float32, device)
    ours = buf.clone()

    def f(x, buf):
        buf.copy_(x * 2)
        return x + 1
    out, reports = compile_and_run(f, (x, ours))
    assert _writes(reports) == [] and leftover_aten(reports) == ["aten.copy_.default"]
    reasons = [a["reason"] for r in reports for a in r.summary["aten_ops"]]
    assert any("graph input's update" in why for why in reasons), reasons
    assert_close(ours, x * 2, dtype=torch.float32, name="buf")
    assert_close(out, x + 1, dtype=torch.float32)


def _beside(x, buf):
    """out = x * 3 + buf over [6, 9], new = buf * 0.5 + 1 over [9]: one pointwise kernel over
    out's elements, each of buf's read six times."""
    new = buf * 0.5 + 1
    out = x * 3 + buf
    buf.copy_(new)
    return out


def _per_row(x, buf):
    """new = buf * 0.5 and out = x.sum(-1) + buf: per-row values of one row kernel."""
    new = buf * 0.5
    out = x.sum(-1) + buf
    buf.copy_(new)
    return out


@pytest.mark.parametrize("f, n", [(_beside, 9), (_per_row, 6)], ids=["beside", "per-row"])
def test_the_old_value_read_for_another_output_keeps_the_copy(f, n, device):
    """The kernel computing buf's new value also reads its old one for another output: the
    launcher offers no output over buf there, so the copy stays; out reads the old value and
    buf ends as eager's."""
    x, buf = randn((6, 9), torch.float32, device), randn((n,), torch.float32, device)
    ours, theirs = buf.clone(), buf.clone()
    out, reports = compile_and_run(f, (x, ours))
    expected = f(x, theirs)
    assert_close(out, expected, dtype=torch.float32)
    assert_close(ours, theirs, dtype=torch.float32, name="buf")
    assert _writes(reports) == [] and leftover_aten(reports) == ["aten.copy_.default"]
    assert kernel_count(reports) == 1
