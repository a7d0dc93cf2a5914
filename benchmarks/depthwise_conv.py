"""Depthwise 1-d convolutions as fused sums of shifted products (passes/depthwise_conv.py),
timed against eager and Inductor (both run the convolution on cuDNN or ATen's depthwise
kernel), and against fusion with the pass off (``fusion-cudnn``): do_bench medians over
interleaved rounds, fresh random inputs, max error against eager, % of the HBM floor (bytes
that must move over the copy bandwidth measured in the same run).

    python3 benchmarks/depthwise_conv.py [--rounds 5] [--cases mamba2 ...]

Cases (bf16):
  mamba2      transformers' Mamba2 mixer at 4 x 1024 tokens, 2304 channels, 4 taps:
              ``silu(conv1d(xBC.transpose(1, 2), padding=3)[..., :L]).transpose(1, 2)`` where
              xBC is the middle 2304 columns of the in-projection's [4, 1024, 4384] output
              (read 2 B and write 2 B an element)
  mamba2-rows the same, its output read as rows of L * C, as the model's next steps read it
              (eager copies the transposed output; the rewrite's is that view already)
  contiguous  the same conv + SiLU of a contiguous [4, 1024, 2304] input
  conv-only   ``conv1d(x, padding=3)`` of a contiguous [4, 2304, 1024], output [4, 2304, 1027]

``train_mamba2_rows`` is the ``mamba2-rows`` case as a ``fusion-compiler bench`` target for a
training step (``--mode training``).
"""
from __future__ import annotations

import argparse
import statistics
import types

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from patterns import copy_bandwidth

B, L, C, TAPS = 4, 1024, 2304, 4


def mixer(xbc, w, b):
    y = F.conv1d(xbc.transpose(1, 2), w, b, padding=TAPS - 1, groups=C)
    return F.silu(y[..., :L]).transpose(1, 2)


def mamba2(zxbcdt, w, b):
    return mixer(zxbcdt[..., 2048:2048 + C], w, b)


def mamba2_rows(zxbcdt, w, b):
    return mamba2(zxbcdt, w, b).reshape(B, -1)


def conv_only(x, w, b):
    return F.conv1d(x, w, b, padding=TAPS - 1, groups=C)


class Mamba2Conv(torch.nn.Module):
    """The ``mamba2-rows`` case with its weight and bias as parameters: a target for
    ``fusion-compiler bench``/``dump`` (``train_mamba2_rows``), whose training step sums the
    weight's and the bias's gradients over batch and time."""

    def __init__(self, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(C, 1, TAPS, device=device, dtype=dtype) / 2)
        self.bias = torch.nn.Parameter(torch.randn(C, device=device, dtype=dtype))

    def forward(self, zxbcdt):
        return mamba2_rows(zxbcdt, self.weight, self.bias)


def train_mamba2_rows(device="cpu", dtype=torch.bfloat16):
    """``bench benchmarks/depthwise_conv.py:train_mamba2_rows --mode training``: the mixer's
    convolution at Mamba2's size, its input a leaf that takes a gradient too."""
    x = torch.randn(B, L, 4384, device=device, dtype=dtype, requires_grad=True)
    return Mamba2Conv(device, dtype), (x,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", nargs="*", default=None, help="some cases only (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    bf = torch.bfloat16

    def weights():
        return (torch.randn(C, 1, TAPS, device="cuda", dtype=bf) * 0.5,
                torch.randn(C, device="cuda", dtype=bf))
    elements = B * L * C * 2
    cases = {
        "mamba2": (mamba2, lambda: (torch.randn(B, L, 4384, device="cuda", dtype=bf),
                                    *weights()), elements * 2),
        "mamba2-rows": (mamba2_rows, lambda: (torch.randn(B, L, 4384, device="cuda", dtype=bf),
                                              *weights()), elements * 2),
        "contiguous": (mixer, lambda: (torch.randn(B, L, C, device="cuda", dtype=bf),
                                       *weights()), elements * 2),
        "conv-only": (conv_only, lambda: (torch.randn(B, C, L, device="cuda", dtype=bf),
                                          *weights()), B * C * (L + L + TAPS - 1) * 2),
    }
    for name, (fn, make, floor_bytes) in cases.items():
        if args.cases and name not in args.cases:
            continue
        inputs = make()
        variants = {"eager": fn}
        for backend in ("inductor", "fusion"):
            torch._dynamo.reset()
            variants[backend] = torch.compile(fn, backend=backend)
        # a copy of the code object: Dynamo keeps compiled code on it
        variants["fusion-cudnn"] = torch.compile(
            types.FunctionType(fn.__code__.replace(), fn.__globals__), backend="fusion",
            options={"depthwise_conv": False})
        want = fn(*inputs)
        errors = {v: (f(*inputs).double() - want.double()).abs().max().item()
                  for v, f in variants.items()}
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, f in variants.items():
                ins = make()
                times[v].append(do_bench(lambda: f(*ins), warmup=25, rep=100) * 1e3)
        line = [f"{name:11s}"]
        for v in variants:
            us = statistics.median(times[v])
            line.append(f"{v} {us:7.1f} us ({100 * floor_bytes / bw / (us * 1e-6):.0f}%) "
                        f"err {errors[v]:.2g}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
