"""codegen/interpreter_patch.py: Triton's interpreter skips re-patching triton.language in
nested @triton.jit calls, and a kernel computes what it did with the re-patching."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="Triton's interpreter only")

import triton                                       # noqa: E402
import triton.language as tl                        # noqa: E402

from fusion_compiler.codegen import triton_lib as fl          # noqa: E402,F401 (installs it)
from fusion_compiler.codegen import interpreter_patch          # noqa: E402
from fusion_compiler.codegen.interpreter_patch import skip_nested_patching   # noqa: E402


@triton.jit
def _scale(x, k):
    return x * k


@triton.jit
def _kernel(x_ptr, out_ptr, sums_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)
    y = fl.round_bf16(_scale(x, 3.0))               # nested calls: a helper module's, this one's
    tl.store(out_ptr + row * N + cols, y, mask=cols < N)
    tl.store(sums_ptr + row, tl.sum(y, 0))         # tl.sum: a jit function of tl.core's module


def _run(x):
    out = torch.empty_like(x)
    sums = torch.empty(x.shape[0])
    _kernel[(x.shape[0],)](x, out, sums, N=x.shape[1], BLOCK=64)
    return out, sums


def test_nested_calls_skip_the_patching_and_compute_the_same(monkeypatch):
    assert skip_nested_patching()
    x = torch.randn(5, 37)
    out, sums = _run(x)
    expected = (x * 3.0).bfloat16().float()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(sums, expected.sum(1), atol=1e-5, rtol=1e-5)
    # the launch restored the language: its builtins are Triton's own again
    assert tl.core.is_builtin(tl.where) and tl.core.is_builtin(tl.tensor.__add__)

    # Triton's own patching runs once a launch, and once more for tl.sum's module (tl.core,
    # which the kernel's globals lack); without the skip, once for each of the 3 nested calls
    # of each of the 5 programs as well
    calls = []
    original = interpreter_patch._original
    monkeypatch.setattr(interpreter_patch, "_original", lambda fn: calls.append(fn) or original(fn))
    again, _ = _run(x)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    assert [fn.__name__ for fn in calls] == ["_kernel", "sum"]


def test_dtype_lookups_are_cached_and_the_same():
    """The cached ``_get_np_dtype`` gives the interpreter's own answer for scalars, blocks
    and pointers."""
    from triton.runtime import interpreter
    assert interpreter_patch.cache_dtype_lookup()
    lookup = interpreter._get_np_dtype
    assert getattr(lookup, "fc_cached", False)
    original = lookup.fc_original
    for t in (tl.float32, tl.bfloat16, tl.int1, tl.int64, tl.float8e4nv, tl.pointer_type(tl.float16),
              tl.block_type(tl.bfloat16, [4, 8]), tl.block_type(tl.pointer_type(tl.int8), [16])):
        assert lookup(t) == original(t) == lookup(t), t
    out, _ = _run(torch.randn(3, 20))            # a kernel still runs through it
    assert out.shape == (3, 20)


@triton.jit
def _pick(src_ptr, idx_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    keep = offs < numel
    i = tl.load(idx_ptr + 0)                        # a loaded scalar
    x = tl.load(src_ptr + i + 0 * offs, mask=keep & (offs < 1) & (i < 3) & (i >= 0), other=0.0)
    tl.store(out_ptr + offs, x, mask=keep)


def test_a_mask_anded_with_a_scalar_comparison_loads():
    """``mask & (i < 3)``, ``i`` a loaded scalar: Triton 3.9's interpreter typed the comparison
    as ``i``'s int64 and broadcast it to int64 data, and the load refused the int32 mask ("mask
    has unsupported dtype"); with ``bool_results`` it loads what the GPU would."""
    assert interpreter_patch.bool_results()
    src = torch.tensor([4.0, 5.0, 6.0])
    out = torch.full((2,), -1.0)
    _pick[(1,)](src, torch.tensor([2]), out, 2, BLOCK=4)
    assert out.tolist() == [6.0, 0.0]
