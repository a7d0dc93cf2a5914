"""The max pool's backward in its two forms (fusion_compiler/max_pool.py), timed at ResNet-50's
stem: BatchNorm with batch statistics, ReLU and the 3 x 3 stride-2 pool, forward and backward
of [N, 64, 112, 112] in bf16, one do_bench median of a forward + backward per round,
interleaved rounds.

    python3 benchmarks/pool_backward.py [--batch 128] [--rounds 5]

Variants: eager; Inductor; fusion (each input element reads the 4 windows that may hold it);
fusion-spread (session 47's form, for each of the 9 window positions a masked read of index
and gradient; here forced on dilation 1 by replacing ``max_pool._gather_windows``); fusion with
ATen's pool (``FUSION_COMPILER_MAX_POOL=0``). The AOT cache is off, so that each variant traces
its own graphs. Gradients are compared with eager's (max abs difference of the input's).
"""
from __future__ import annotations

import argparse
import os
import statistics
import types

os.environ["FUSION_COMPILER_AOT_CACHE"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fusion_compiler import max_pool  # noqa: E402


def stem(x, w, b):
    return F.max_pool2d(F.relu(F.batch_norm(x, None, None, w, b, training=True)), 3, 2, 1)


def _spread_form(acc, x, k, s, p, out, indices):
    return max_pool._spread_windows(acc, x, k, s, p, (1, 1), out, indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(args.batch, 64, 112, 112, device="cuda", dtype=dt).requires_grad_()
    w = (torch.rand(64, device="cuda", dtype=dt) + 0.5).requires_grad_()
    b = torch.randn(64, device="cuda", dtype=dt).requires_grad_()
    grad = torch.randn(args.batch, 64, 56, 56, device="cuda", dtype=dt)

    def compiled(backend, setup=None, undo=None):
        if setup:
            setup()
        # a code object of its own: Dynamo keeps compiled code on the function's code object,
        # so variants compiled from ``stem`` itself would share one entry (sessions 48-49 timed
        # the last variant compiled, ATen's pool, under all three fusion names)
        own = types.FunctionType(stem.__code__.replace(co_name=f"stem_{len(compiled.made)}"),
                                 stem.__globals__)
        compiled.made.append(own)
        fn = torch.compile(own, backend=backend)
        step(fn)            # compiled here, with the variant's setting in force
        if undo:
            undo()
        return fn

    def step(fn):
        x.grad = w.grad = b.grad = None
        fn(x, w, b).backward(grad)
        return x.grad

    compiled.made = []
    gather = max_pool._gather_windows

    def set_spread():
        max_pool._gather_windows = _spread_form

    def unset_spread():
        max_pool._gather_windows = gather

    def aten_pool():
        os.environ["FUSION_COMPILER_MAX_POOL"] = "0"

    def own_pool():
        os.environ.pop("FUSION_COMPILER_MAX_POOL", None)

    variants = {"eager": stem, "inductor": compiled("inductor"), "fusion": compiled("fusion"),
                "fusion-spread": compiled("fusion", set_spread, unset_spread),
                "fusion-atenpool": compiled("fusion", aten_pool, own_pool)}
    want = step(stem).double()
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(1000 * do_bench(lambda: step(fn), warmup=25, rep=200))
    print(f"stem forward + backward, batch {args.batch}, bf16, {torch.cuda.get_device_name()}: "
          f"median of {args.rounds} rounds of do_bench medians (us); x.grad's max abs "
          f"difference from eager's")
    for name, fn in variants.items():
        err = (step(fn).double() - want).abs().max().item()
        print(f"  {name:16s} {statistics.median(times[name]):9.1f}   {err:.3g}")


if __name__ == "__main__":
    main()
