"""Sums over the tokens (bias and norm-weight gradients) on the GPU: eager, Inductor, fusion.

    python benchmarks/column_sums.py [--chunks 64 128 256 512] [--out FILE]

passes/column_sums.py sums a [R, C] gradient over its R rows as a split row sum of its permuted
view: S partial sums of chunks of ``CHUNK`` rows (fp32), then their total. Each case is timed
with every chunk length of ``--chunks`` (the pass's ``CHUNK``, set before compiling), beside
eager and Inductor: do_bench medians, L2 flushed, fresh random inputs (bf16), and the kernels'
own device time per call after the same flush (``timing.kernel_times``, profiler; taken after
every do_bench: a profiler session slows the host's later calls), each with its % of the HBM
floor (the bytes that must move over the copy bandwidth measured here). These calls are small:
do_bench's figures hold the host's call path, the kernel times what a GPU-bound training step
pays. The cases are the
training graphs' own: a Linear's bias gradient alone (GPT-2 and BERT: C = 768, 2304, 3072;
Llama's norm width 2048), after an activation's backward whose result is also needed
(``y = g * sigmoid(x)``: y and its column sum), and a LayerNorm's weight and bias gradients.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patterns import busy, copy_bandwidth  # noqa: E402
from timing import kernel_times  # noqa: E402

from fusion_compiler.passes import column_sums  # noqa: E402

bf = torch.bfloat16


def bias_grad(g):
    return g.sum(0)


def act_bias_grad(g, x):
    y = g * torch.sigmoid(x)
    return y, y.sum(0)


def norm_grads(g, h):
    return (g * h).sum([0, 1]), g.sum([0, 1])


def cases():
    """(name, fn, input shapes, bytes that must move)"""
    out = []
    for c in (768, 2048, 2304, 3072):
        out.append((f"bias grad 4096x{c}", bias_grad, [(4096, c)], 4096 * c * 2 + c * 2))
    out.append(("act + bias grad 4096x3072", act_bias_grad, [(4096, 3072)] * 2,
                3 * 4096 * 3072 * 2 + 3072 * 2))
    out.append(("norm weight + bias grads 8x512x768", norm_grads, [(8, 512, 768)] * 2,
                2 * 4096 * 768 * 2 + 2 * 768 * 2))
    return out


def median_us(f):
    return statistics.median(do_bench(f, warmup=25, rep=100, return_mode="all")) * 1e3


def fresh(shapes):
    return [torch.randn(s, device="cuda", dtype=bf) for s in shapes]


def compiled(fn, backend, chunk):
    torch._dynamo.reset()
    column_sums.CHUNK = chunk
    return torch.compile(fn) if backend == "inductor" else torch.compile(fn, backend=backend)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[column_sums.CHUNK])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    busy(2)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = {"copy_TBps": bw / 1e12, "cases": {}}
    default = column_sums.CHUNK
    variants = [("eager", None, default), ("inductor", "inductor", default)] + [
        (f"chunk {c}", "fusion", c) for c in a.chunks]
    for timer in ("do_bench", "kernel"):
        for name, fn, shapes, nbytes in cases():
            floor = nbytes / bw * 1e6
            args = fresh(shapes)
            expected = fn(*args)
            entry = results["cases"].setdefault(name, {"floor_us": floor, "max_err": {}})
            times = entry.setdefault(timer, {})
            for label, backend, chunk in variants:
                f = fn if backend is None else compiled(fn, backend, chunk)
                got = f(*args)
                if backend == "fusion":
                    got, want = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
                    entry["max_err"][label] = max((x.float() - y.float()).abs().max().item()
                                                  for x, y in zip(got, want))
                times[label] = (median_us(lambda: f(*args)) if timer == "do_bench"
                                else kernel_times(f, args)["kernel_us"])
            column_sums.CHUNK = default
            line = "  ".join(f"{k} {v:6.1f} ({100 * floor / v:3.0f}%)" for k, v in times.items())
            print(f"{timer:8s} {name:36s} floor {floor:5.1f} us  {line}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
