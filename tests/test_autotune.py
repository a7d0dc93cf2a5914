"""Autotuning of launch settings (codegen/autotune.py). On the CPU the kernels run in Triton's
interpreter, where settings do not change the time, so a stand-in timer decides which setting
is fastest (on a GPU host too: these tests run there on the GPU); what is checked is the mechanism: the candidates, the bound, the choice applied to
the launcher at the tuned sizes only, the numbers still eager's, and the choice read back from
disk on a warm compile with nothing timed. The GPU test times for real."""
import json

import pytest
import torch

from fusion_compiler.codegen import autotune
from fusion_compiler.codegen import launch as L
from helpers import assert_close, compile_and_run, instead_of_compiles, kernel_count


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def bias_gelu(x, b):
    return torch.nn.functional.gelu(x + b, approximate="tanh")


def test_candidates_include_the_rule_first_and_stay_bounded():
    assert autotune.candidates("row", (1, 4096, False, 4)) == [
        (1, 4096, False, 4), (1, 4096, False, 2), (1, 4096, False, 8)]
    assert autotune.candidates("row", (4, 512, False, 16)) == [
        (4, 512, False, 16), (4, 512, False, 8)]
    assert autotune.candidates("pointwise", (2048, 4)) == [(2048, 4), (1024, 2), (4096, 8)]
    assert autotune.candidates("pointwise", (256, 2)) == [(256, 2), (512, 4)]
    for kind, rule in [("row", (2, 1024, False, 4)), ("pointwise", (1024, 4))]:
        assert len(autotune.candidates(kind, rule)) <= autotune.MAX_SETTINGS


def _tuning(monkeypatch, time_fn, count=1):
    """Compile with LEAN set (so the generate pass goes on to compile and tune), the compile
    step replaced by tuning with ``time_fn``; returns the contexts seen."""
    monkeypatch.setattr(autotune, "MIN_BYTES", 0)     # the CPU shapes are small
    seen = []

    def spy(ctx):
        seen.append(ctx)
        autotune.tune(ctx, time_fn=time_fn, count=count)
    instead_of_compiles(monkeypatch, at_finish=spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_kernel_takes_the_fastest_warps_and_caches_them(dtype, monkeypatch, cache_dir, device):
    timed = []

    def four_warps_fastest(call, settings):
        call()                  # the launcher runs with this setting (in the interpreter)
        timed.append(settings)
        return 0.5e-3 if settings[-1] == 4 else 1e-3
    seen = _tuning(monkeypatch, four_warps_fastest)
    x = torch.randn(37, 300, dtype=dtype, device=device)
    w = torch.randn(300, dtype=dtype, device=device)
    out, reports = compile_and_run(rmsnorm, (x, w))
    assert kernel_count(reports) == 1
    assert_close(out, rmsnorm(x, w), dtype)
    rule = L.row_settings(37, 300, 16384)
    assert rule == (4, 512, False, 8) and set(timed) == set(autotune.candidates("row", rule))
    (ctx,) = seen
    (launch,) = ctx.launchers.values()
    settings = launch.func.__globals__["row_settings"]
    assert settings(37, 300, 16384) == (4, 512, False, 4)       # tuned at the tuned sizes
    assert settings(5, 300, 16384) == L.row_settings(5, 300, 16384)     # the rule elsewhere
    (kernel,) = [k for k in ctx.kernels if "tuned" in k]
    assert kernel["tuned"]["settings"] == [4, 512, False, 4]
    (stored,) = (ctx.config.cache_dir / "autotune").glob("*.json")
    assert json.loads(stored.read_text())["settings"] == [4, 512, False, 4]
    # the tuned settings compute the same numbers on other inputs
    x2 = torch.randn(37, 300, dtype=dtype, device=device)
    assert_close(torch.compile(rmsnorm, backend="fusion")(x2, w), rmsnorm(x2, w), dtype)

    # warm: read from disk, nothing timed
    def never(call, settings):
        raise AssertionError("timed on a warm compile")
    torch._dynamo.reset()
    _tuning(monkeypatch, never)
    out, reports = compile_and_run(rmsnorm, (x, w))
    assert_close(out, rmsnorm(x, w), dtype)


def test_no_change_unless_clearly_faster(monkeypatch, cache_dir, device):
    """A setting within MARGIN of the rule's is noise: the rule stays, and the module keeps
    calling the rule itself."""
    seen = _tuning(monkeypatch, lambda call, s: 1e-3 * (0.99 if s[-1] == 8 else 1.0))
    x = torch.randn(6, 1000, device=device)
    compile_and_run(bias_gelu, (x, torch.randn(1000, device=device)))
    (ctx,) = seen
    (launch,) = ctx.launchers.values()
    assert launch.func.__globals__["pointwise_settings"] is L.pointwise_settings
    (kernel,) = [k for k in ctx.kernels if "tuned" in k]
    assert kernel["tuned"]["settings"] == kernel["tuned"]["rule"]


def test_pointwise_kernel_tuned_and_bounded(monkeypatch, cache_dir, device):
    """Two graphs' worth of kernels, count=1: only the one moving the most bytes is timed; a
    kernel below MIN_BYTES or with integer inputs is never timed."""
    timed = []

    def bigger_blocks_fastest(call, settings):
        call()
        timed.append(settings)
        return 1e-3 / settings[0]
    seen = _tuning(monkeypatch, bigger_blocks_fastest)

    def two_kernels(x, b, y):
        return bias_gelu(x, b), y.softmax(-1)
    x, b, y = (torch.randn(s, device=device) for s in [(64, 1000), (1000,), (3, 50)])
    out, reports = compile_and_run(two_kernels, (x, b, y))
    assert kernel_count(reports) == 2
    assert_close(out[0], bias_gelu(x, b))
    assert_close(out[1], y.softmax(-1))
    assert {len(s) for s in timed} == {2}          # only the pointwise (bias+GELU) kernel
    (ctx,) = seen
    tuned = [k for k in ctx.kernels if "tuned" in k]
    assert len(tuned) == 1 and tuned[0]["tuned"]["settings"][0] > tuned[0]["tuned"]["rule"][0]

    timed.clear()
    monkeypatch.setattr(autotune, "MIN_BYTES", 1 << 40)
    torch._dynamo.reset()
    compile_and_run(lambda a: a * 2 + 1, (torch.randn(33, 17, device=device),))
    assert not timed
    monkeypatch.setattr(autotune, "MIN_BYTES", 0)
    torch._dynamo.reset()
    compile_and_run(lambda a: (a * 3 + 1) % 7, (torch.randint(0, 100, (33, 17), device=device),))
    assert not timed


def test_a_failed_tuning_keeps_the_rule(monkeypatch, cache_dir, caplog, device):
    """A setting that cannot be timed (here: the timer fails) leaves the kernel on the rule's
    settings with a warning; the model still runs, with eager's numbers."""
    monkeypatch.setenv("FUSION_COMPILER_STRICT", "0")

    def broken(call, settings):
        raise RuntimeError("no timer")
    seen = _tuning(monkeypatch, broken)
    x, w = torch.randn(9, 70, device=device), torch.randn(70, device=device)
    with caplog.at_level("WARNING", logger="fusion_compiler"):
        out, reports = compile_and_run(rmsnorm, (x, w))
    assert kernel_count(reports) == 1
    assert_close(out, rmsnorm(x, w))
    (ctx,) = seen
    (launch,) = ctx.launchers.values()
    assert launch.func.__globals__["row_settings"] is L.row_settings
    assert "keeps the default launch settings" in caplog.text


@pytest.mark.gpu
def test_autotune_on_the_gpu(monkeypatch, tmp_path):
    """Real timing: the tuned graph computes eager's numbers, the choice is stored, and a warm
    compile reads it back without timing."""
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUSION_COMPILER_AUTOTUNE", "2")
    from fusion_compiler import backend
    monkeypatch.setattr(backend, "_caches", {})
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out, reports = compile_and_run(rmsnorm, (x, w))
    assert kernel_count(reports) == 1
    assert_close(out, rmsnorm(x, w), torch.bfloat16)
    (stored,) = (tmp_path / "autotune").glob("*.json")
    record = json.loads(stored.read_text())
    assert len(record["us"]) >= 2 and record["settings"] in [list(s) for s in
                                                               autotune.candidates("row", tuple(record["rule"]))]
    monkeypatch.setattr(autotune, "_time", lambda call: (_ for _ in ()).throw(AssertionError))
    torch._dynamo.reset()
    out, _ = compile_and_run(rmsnorm, (x, w))
    assert_close(out, rmsnorm(x, w), torch.bfloat16)
