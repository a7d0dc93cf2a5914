"""Where one training step's GPU time goes, kernel by kernel: fusion (the backward recomputing
cheap forward values, and saving them instead: ``backward_recompute`` on and off) and Inductor.

    python benchmarks/training_kernels.py TARGET [--out results.json] [--backends ...]

TARGET as `fusion-compiler dump` takes it (``examples/gpt2.py:bench_8x512``), built on the GPU
in bf16, as `fusion-compiler bench` builds it. A step is ``fusion_compiler.bench``'s: forward, backward of a mean-square
loss, an SGD step. After three warm steps, one step runs under torch.profiler (its warm-up
step first). Printed per backend: the kernels, the span from the first start to the last end,
GPU time per category (``fusion_compiler.breakdown``: gemm, attention, fused, aten) and the 15
kernel names with the most time. With both fusion variants, their kernels are compared position
by position when their counts agree. The host's speed swings between runs on the H200 machine
(eager's GPT-2 step: 24.6 to 30.3 ms), which moves `bench`'s medians of host-bound steps; the
kernels' own times do not move with it.
"""
import argparse
import collections
import json
import sys

import torch

from fusion_compiler import bench
from fusion_compiler import breakdown as BD
from fusion_compiler.targets import call_factory, load_factory, target_imports

BACKENDS = {"fusion": ("fusion", {"backward_recompute": True}),
            "fusion-save": ("fusion", {"backward_recompute": False}),
            "fusion-aten-sums": ("fusion", {"column_sums": False}),
            "inductor": ("inductor", None)}


def profile_step(target: str, backend: str, options, train_mode: bool = False) -> list:
    """(name, start us from the step's first kernel, duration us) of every GPU activity."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with target_imports():          # as `fusion-compiler bench` builds it
        factory, where = load_factory(target)
        model, args, _ = call_factory(factory, where, "cuda", "bfloat16")
    model.train(train_mode)         # the factories build models in eval(): dropout off
    kwargs = {} if options is None else {"options": options}
    step = bench._training_step(torch.compile(model, backend=backend, **kwargs), model)
    for _ in range(3):
        step(*args)
    torch.cuda.synchronize()
    kernels = sorted(BD.profile_call(step, args), key=lambda k: k.start_us)
    t0 = kernels[0].start_us
    return [(k.name, k.start_us - t0, k.duration_us) for k in kernels]


def report(label: str, kernels: list) -> None:
    cats, by_name = collections.defaultdict(float), collections.defaultdict(lambda: [0, 0.0])
    for name, _, us in kernels:
        cats[BD.category(name)] += us
        by_name[name[:90]][0] += 1
        by_name[name[:90]][1] += us
    span = kernels[-1][1] + kernels[-1][2]
    print(f"{label}: {len(kernels)} kernels, span {span:.0f} us, "
          + ", ".join(f"{c} {t:.0f} us" for c, t in sorted(cats.items())))
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {us:9.1f} us {count:4d}x {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--out")
    ap.add_argument("--train-mode", action="store_true",
                    help="model.train(): dropout on (Hugging Face's default p=0.1), as a real "
                         "training run; the factories' models are in eval mode otherwise")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("training_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    found = {}
    for label in a.backends:
        found[label] = profile_step(a.target, *BACKENDS[label], a.train_mode)
        report(label, found[label])
    ours, saved = found.get("fusion"), found.get("fusion-save")
    if ours and saved and len(ours) == len(saved):
        print("largest differences by position, fusion - fusion-save (us):")
        order = sorted(range(len(ours)), key=lambda i: -abs(ours[i][2] - saved[i][2]))
        for i in order[:15]:
            print(f"  #{i:4d} {ours[i][2]:8.1f} {saved[i][2]:8.1f}  {ours[i][0][:70]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(found, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
