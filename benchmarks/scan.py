"""Cumulative sums as scans in row kernels (codegen/lower.py ``_scan``), timed against eager and
Inductor: do_bench medians over interleaved rounds, fresh random inputs, max error against
eager, and for the memory-bound float scans the HBM floor (bytes that must move over the copy
bandwidth measured in the same run).

    python3 benchmarks/scan.py [--rounds 5]

Cases:
  positions   BLOOM's alibi positions, ``(mask.cumsum(-1) - 1) * mask`` of an int64 [8, 512]
              padding mask (launch-bound; ATen's scan is several kernels)
  positions-4k   the same on [64, 4096]
  scan-bf16   ``cumsum(x * 0.5, -1).to(bf16)`` of a bf16 [4096, 4096] (read 2 B, write 2 B)
  scan-grad   forward and backward of ``cumsum(x, -1).sin()``, bf16 [1024, 2048]
  scan-dim1   ``cumsum(x * 0.5, 1).to(bf16)`` of a bf16 [16, 2048, 512]: a scan over a middle
              dim (passes/scan_dims.py: rows of 2048 lying 512 apart); also timed with ATen's
              cumsum (``fusion-aten-scan``: the pass off)
  segsum      Mamba2's ``segment_sum`` then exp (transformers' PyTorch path) of fp32 decays
              [4, 32, 4, 256]: [l, l] blocks of 256, ``cumsum(dim=-2)``; writes 134 MB; also
              with its two ``tril`` masks folded into constants the kernel loads
              (``fusion-folded-masks``, as before kernels computed them from their index)
"""
from __future__ import annotations

import argparse
import statistics
import types

import torch
from triton.testing import do_bench

from patterns import copy_bandwidth


def positions(m):
    return (m.cumsum(-1) - 1) * m


def scan(x):
    return torch.cumsum(x * 0.5, -1).to(torch.bfloat16)


def scan_grad(x):
    return torch.cumsum(x, -1).sin()


def scan_dim1(x):
    return torch.cumsum(x * 0.5, 1).to(torch.bfloat16)


def segsum(a):
    n = a.size(-1)
    t = a[..., None].expand(*a.size(), n)
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    s = torch.cumsum(t.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=0)
    return torch.exp(s.masked_fill(~keep, -torch.inf))


def _without_scan_dims(f):
    """``f`` run with passes/scan_dims.py off (its first call compiles)."""
    from fusion_compiler.passes import scan_dims

    def call(*args):
        run, scan_dims.run = scan_dims.run, lambda gm, ctx: 0
        try:
            return f(*args)
        finally:
            scan_dims.run = run
    return call


def _with_folded_masks(f):
    """``f`` run with its aranges' masks folded into constants that the kernel loads (as before
    kernels computed them from their index; its first call compiles)."""
    from fusion_compiler.passes import constant_fold

    def call(*args):
        made, constant_fold._from_index = constant_fold._from_index, lambda values: set()
        try:
            return f(*args)
        finally:
            constant_fold._from_index = made
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", nargs="*", default=None, help="some cases only (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    cases = {
        "positions": (positions, lambda: ((torch.rand(8, 512, device="cuda") > 0.2).long(),),
                      None, False),
        "positions-4k": (positions, lambda: ((torch.rand(64, 4096, device="cuda") > 0.2).long(),),
                         None, False),
        "scan-bf16": (scan, lambda: (torch.randn(4096, 4096, device="cuda",
                                                 dtype=torch.bfloat16),), 4096 * 4096 * 4, False),
        "scan-grad": (scan_grad, lambda: (torch.randn(1024, 2048, device="cuda",
                                                      dtype=torch.bfloat16).requires_grad_(),),
                      None, True),
        "scan-dim1": (scan_dim1, lambda: (torch.randn(16, 2048, 512, device="cuda",
                                                      dtype=torch.bfloat16),),
                      16 * 2048 * 512 * 4, False),
        "segsum": (segsum, lambda: (-torch.rand(4, 32, 4, 256, device="cuda"),),
                   4 * 32 * 4 * 256 * 256 * 4, False),
    }
    for name, (fn, make, floor_bytes, grad) in cases.items():
        if args.cases and name not in args.cases:
            continue
        inputs = make()
        variants = {"eager": fn}
        for backend in ("inductor", "fusion"):
            torch._dynamo.reset()
            variants[backend] = torch.compile(fn, backend=backend)
        if name in ("scan-dim1", "segsum"):
            # the same, with ATen's cumsum (scan_dims off): as before it. A copy of the code
            # object: Dynamo keeps compiled code on it, and both variants are fusion's
            variants["fusion-aten-scan"] = _without_scan_dims(torch.compile(
                types.FunctionType(fn.__code__.replace(), fn.__globals__), backend="fusion"))
        if name == "segsum":
            variants["fusion-folded-masks"] = _with_folded_masks(torch.compile(
                types.FunctionType(fn.__code__.replace(), fn.__globals__), backend="fusion"))

        def run(f, ins):
            out = f(*ins)
            if grad:
                ins[0].grad = None          # a fresh gradient, no accumulating add
                out.backward(torch.ones_like(out))
            return out
        want = run(fn, inputs)
        want_grad = inputs[0].grad.clone() if grad else None
        errors = {}
        for v, f in variants.items():
            ins = tuple(t.detach().clone().requires_grad_(grad) if grad else t for t in inputs)
            got = run(f, ins)
            err = (got.double() - want.double()).abs().max().item()
            if grad:
                err = max(err, (ins[0].grad.double() - want_grad.double()).abs().max().item())
            errors[v] = err
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, f in variants.items():
                ins = tuple(t.detach().clone().requires_grad_(grad) if grad else t
                            for t in make())
                times[v].append(do_bench(lambda: run(f, ins), warmup=25, rep=100) * 1e3)
        line = [f"{name:13s}"]
        for v in variants:
            us = statistics.median(times[v])
            extra = f" ({100 * floor_bytes / bw / (us * 1e-6):.0f}% of floor)" if floor_bytes else ""
            line.append(f"{v} {us:8.1f} us{extra} err {errors[v]:.2g}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
