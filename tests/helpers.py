"""Shared test helpers: compile and count kernels, compare with eager verbosely."""
from __future__ import annotations

import torch

import fusion_compiler

# Per-dtype tolerances (atol, rtol) against eager. bf16/fp16 kernels round after every op as
# eager does, so differences come from reduction order and transcendental approximations.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}


def compile_and_run(fn, args, dynamic=False):
    """Run ``fn`` compiled with the fusion backend; return (outputs, graph reports)."""
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(fn, backend="fusion", dynamic=dynamic, fullgraph=True)(*args)
    return out, reports


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_close(actual, expected, dtype=None, atol=None, rtol=None, name="output"):
    """allclose that says where and by how much, and never passes on NaN mismatches."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    d_atol, d_rtol = TOL.get(dtype or expected.dtype, (0, 0))
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    # compared where the tensors live: a 4-GiB GPU tensor copied to the host takes minutes
    a, e = actual.detach().double(), expected.detach().to(actual.device).double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN at different places ({int((nan_a ^ nan_e).sum())} elements)"
    a, e = a.masked_fill(nan_a, 0), e.masked_fill(nan_e, 0)
    bad = (a - e).abs() > atol + rtol * e.abs()
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        diff = (a - e).abs()
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements differ beyond atol={atol} rtol={rtol}; "
            f"max abs diff {diff.max().item():.3g}; first at {idx}: got {a[tuple(idx)].item():.6g}, "
            f"expected {e[tuple(idx)].item():.6g}")


def fp8_steps_apart(actual, expected):
    """Distance in fp8 codes between two e4m3fn tensors (sign-magnitude order)."""
    def ordinal(t):
        b = t.view(torch.uint8).to(torch.int32)
        mag = b & 0x7F
        return torch.where(b & 0x80 != 0, -mag, mag)
    return (ordinal(actual) - ordinal(expected)).abs()


def assert_fp8_matches(actual, expected, min_equal=0.999):
    """FP8 outputs: bit-equal on at least ``min_equal`` of elements, never more than one step off."""
    assert actual.dtype == expected.dtype == torch.float8_e4m3fn
    equal = (actual.view(torch.uint8) == expected.view(torch.uint8)).float().mean().item()
    steps = fp8_steps_apart(actual.cpu(), expected.cpu()).max().item()
    assert equal >= min_equal, f"only {equal:.5f} of fp8 elements bit-equal (need {min_equal})"
    assert steps <= 1, f"fp8 outputs {steps} steps apart"


def assert_outputs_close(out, expected):
    """``assert_close`` on each output of a function returning a tensor or a tuple of them,
    each in its own dtype's tolerance."""
    outs = out if isinstance(out, tuple) else (out,)
    wants = expected if isinstance(expected, tuple) else (expected,)
    assert len(outs) == len(wants), f"{len(outs)} outputs, eager has {len(wants)}"
    for k, (got, want) in enumerate(zip(outs, wants)):
        assert_close(got, want, dtype=want.dtype, name=f"output {k}")


def segment_sum(a):
    """transformers' Mamba2 ``segment_sum`` (its PyTorch path): the chunk's decays expanded to
    [l, l], masked below the diagonal, summed down the columns (``cumsum(dim=-2)``), masked
    with -inf above it."""
    n = a.size(-1)
    t = a[..., None].expand(*a.size(), n)
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    s = torch.cumsum(t.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=0)
    return s.masked_fill(~keep, -torch.inf)


def scan_device(*args) -> torch.device:
    """Where eager's reference for a function with scans runs: the CPU where ``args`` hold
    fp16/bf16 CUDA tensors. CUDA's low-precision cumsum accumulates in its own dtype
    (pytorch/pytorch#180150, "expected behavior"); the CPU's in fp32, as the fused kernels do.
    A bf16 cumsum of 32 values on CUDA drifts by several units in the last place."""
    low = any(a.is_cuda and a.dtype in (torch.float16, torch.bfloat16) for a in args)
    return torch.device("cpu") if low else args[0].device


def scan_reference(fn, *args):
    """Eager's outputs of ``fn`` (a tuple), computed on ``scan_device(*args)``."""
    where = scan_device(*args)
    out = as_tuple(fn(*(a.detach().to(where) for a in args)))
    return tuple(o.to(args[0].device) for o in out)


def kernel_count(reports, kind=None):
    return sum(r.num_kernels for r in reports if kind is None or r.kind == kind)


def aten_reasons(fn, *args) -> list:
    """The dump's reasons, sorted, for the ops ``fn`` leaves on ATen (``explain``)."""
    torch._dynamo.reset()
    return sorted({a["reason"] for s in fusion_compiler.explain(fn, *args) for a in s["aten_ops"]})


def leftover_aten(reports, kind=None):
    return [op for r in reports if kind is None or r.kind == kind for op in r.aten_ops]


def current_cache():
    """The KernelCache the backend uses for the current environment."""
    from fusion_compiler import backend
    from fusion_compiler.config import Config
    return backend.kernel_cache(Config.from_env())


class _NoCompiles:
    """In place of generate.KernelCompiles: nothing is compiled at compile time (the first
    launch compiles, as in Triton's interpreter); the tests' hooks run instead."""

    def __init__(self, ctx, at_add, at_finish):
        self.ctx, self.at_add, self.at_finish = ctx, at_add, at_finish

    def add(self, group, launch):
        if self.at_add is not None:
            self.at_add(self.ctx, group, launch)

    def finish(self):
        if self.at_finish is not None:
            self.at_finish(self.ctx)
        return 0


def instead_of_compiles(monkeypatch, at_finish=None, at_add=None):
    """Generated kernels are not compiled at compile time; ``at_add(ctx, group, launch)`` runs
    as the generate pass makes each group's launcher (before partition), ``at_finish(ctx)``
    where the pipeline waits for the compiles (after it). Lean launchers, as on a GPU."""
    from fusion_compiler.passes import generate

    monkeypatch.setattr(generate, "LEAN", True)
    monkeypatch.setattr(generate, "KernelCompiles",
                        lambda ctx: _NoCompiles(ctx, at_add, at_finish))
