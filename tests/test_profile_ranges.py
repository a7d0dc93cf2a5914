"""``profile_ranges`` (FUSION_COMPILER_PROFILE_RANGES=1, or torch.compile's options=): each
fused kernel's launch inside a profiler range named after its group, ``fc#<id> <label>``, the
ids and labels `dump` shows; off (the default), no such op on the call path. Same values, same
kernels and ATen ops either way."""
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fusion_compiler
from fusion_compiler.config import Config
from helpers import assert_close, kernel_count


def model(x, w):
    h = F.rms_norm(x + 1.0, (x.shape[-1],), w)
    return torch.softmax(h @ h.t(), -1) * 2.0


def _run(options, x, w):
    torch._dynamo.reset()
    f = torch.compile(model, backend="fusion", options=options)
    with fusion_compiler.capture_compiles() as reports:
        out = f(x, w)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        again = f(x, w)
    ranges = [e.name for e in prof.events() if e.name.startswith("fc#")]
    return out, again, reports, ranges


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_launch_in_a_range_named_after_its_group(dtype, device):
    torch.manual_seed(0)
    x = torch.randn(7, 33, device=device, dtype=dtype)
    w = torch.randn(33, device=device, dtype=dtype)
    out, again, reports, ranges = _run({"profile_ranges": True}, x, w)
    assert kernel_count(reports) == 2
    assert [op for r in reports for op in r.aten_ops] == ["aten.mm.default"]
    want = sorted(f"fc#{k['group']} {k['label']}" for r in reports for k in r.kernels)
    assert sorted(ranges) == want and len(want) == 2
    assert_close(out, model(x, w), dtype=dtype)
    assert torch.equal(out, again)
    plain, _, plain_reports, plain_ranges = _run({}, x, w)
    assert plain_ranges == [] and kernel_count(plain_reports) == 2
    assert torch.equal(plain, out)


def test_the_environment_turns_it_on():
    assert Config.from_env({}).profile_ranges is False
    assert Config.from_env({"FUSION_COMPILER_PROFILE_RANGES": "1"}).profile_ranges is True


def test_kernel_table_reads_each_groups_bytes(device):
    """benchmarks/kernel_table.py's bytes per group (``group_bytes``), keyed as the profiler's
    ranges are: each kernel's bytes read and written, from its source's header."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parent.parent / "benchmarks" / "kernel_table.py"
    spec = importlib.util.spec_from_file_location("kernel_table", path)
    kt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kt)
    x = torch.randn(7, 33, device=device)
    w = torch.randn(33, device=device)
    _, _, reports, ranges = _run({"profile_ranges": True}, x, w)
    moved = kt.group_bytes(reports)
    assert sorted(moved) == sorted(r.split(" ")[0] for r in ranges)
    # x + 1 and the RMSNorm: x and w read, h written; the softmax: its row of 7 read and written
    assert sorted(moved.values()) == sorted([(7 * 33 + 33 + 7 * 33) * 4, 2 * 7 * 7 * 4])
