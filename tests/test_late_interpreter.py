"""TRITON_INTERPRET=1 set after Triton was imported (codegen/triton_lib.interpreting).

Triton's own jit functions (``tl.sum``) are then built for the GPU and its interpreter cannot
call them: a reduction kernel would fail inside Triton. The backend says so once and treats the
interpreter as off: a CPU model runs on ATen, as eager.
"""
import logging

import torch

import fusion_compiler
from fusion_compiler.codegen import triton_lib
from helpers import assert_close, kernel_count


def test_an_interpreter_asked_for_too_late_is_off_with_one_warning(monkeypatch, caplog, cache_dir):
    monkeypatch.setattr(triton_lib, "LANGUAGE_INTERPRETED", False)
    monkeypatch.setattr(triton_lib, "_said_late", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = torch.nn.Sequential(torch.nn.Linear(24, 37), torch.nn.LayerNorm(37), torch.nn.GELU())
    x = torch.randn(5, 24)
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        assert not triton_lib.interpreting()
        with fusion_compiler.capture_compiles() as reports, torch.no_grad():
            out = torch.compile(model, backend="fusion")(x)
    warned = [r for r in caplog.records if "before importing torch or triton" in r.getMessage()]
    assert len(warned) == 1
    assert reports and not any(r.ran_kernels for r in reports)
    assert kernel_count(reports) == 0
    with torch.no_grad():
        assert_close(out, model(x))


def test_an_interpreter_asked_for_in_time_is_on(monkeypatch):
    monkeypatch.setattr(triton_lib, "LANGUAGE_INTERPRETED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_lib.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_lib.interpreting()
