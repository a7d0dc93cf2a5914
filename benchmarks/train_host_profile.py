"""Where a training step's host time goes (GPU): time a step back to back without
synchronization, then cProfile five steps, for each backend.

    python benchmarks/train_host_profile.py benchmarks/hf_zoo.py:resnet50_32_train fusion eager

The step is `bench --mode training`'s (forward, backward of a mean-square loss, SGD step). A
step whose host time equals its wall time is bound by the host: the GPU waits for it.
"""
import cProfile
import io
import pstats
import sys
import time

import torch

from fusion_compiler.bench import _training_step
from fusion_compiler.targets import load_factory


def main(target: str, backends: list) -> None:
    for backend in backends:
        torch._dynamo.reset()
        model, args = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
        f = model if backend == "eager" else torch.compile(model, backend=backend)
        step = _training_step(f, model)
        for _ in range(4):
            step(*args)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            step(*args)
        host = (time.perf_counter() - t) / 10 * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 10 * 1e3
        print(f"{backend}: host {host:.2f} ms a step (no sync), wall {wall:.2f} ms", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            step(*args)
        torch.cuda.synchronize()
        profiler.disable()
        for order in ("tottime", "cumtime"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(30)
            print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["fusion", "eager"])
