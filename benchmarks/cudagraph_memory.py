"""Where a CUDA-graph backend's GPU memory goes, segment by segment.

    python benchmarks/cudagraph_memory.py fusion examples/gpt2.py:bench_8x512
    python benchmarks/cudagraph_memory.py inductor examples/gpt2.py:bench_8x512

The model's eager output is kept (as ``fusion-compiler bench`` keeps it for the error column),
then the backend with ``mode="reduce-overhead"`` is called five times on fresh inputs. Printed:
allocated and reserved memory after each call; the peak of reserved memory during one more
call over what the process held before compiling (``bench``'s peak column); the largest error
against eager; and the allocator's segments grouped by memory pool and stream, with the
allocated blocks of 8 MiB or more (a cuBLAS workspace is one block of 32 MiB on the H200).
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import collections

import torch

MB = 2 ** 20


def fresh(args):
    return [torch.randint_like(a, 0, 100) if not a.is_floating_point() else torch.randn_like(a)
            for a in args]


def segments() -> None:
    groups = collections.defaultdict(lambda: [0, 0, 0, collections.Counter()])
    for seg in torch.cuda.memory_snapshot():
        g = groups[(tuple(seg.get("segment_pool_id", (0, 0))), seg["stream"])]
        g[0] += seg["total_size"]
        g[1] += seg["allocated_size"]
        g[2] += 1
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and block["size"] >= 8 * MB:
                g[3][block["size"] // MB] += 1
    print("segments by (pool, stream):")
    for (pool, stream), (total, allocated, n, big) in sorted(groups.items(),
                                                             key=lambda kv: -kv[1][0]):
        print(f"  pool={pool} stream={stream:#x}: {n} segments, {total / MB:.0f} MB, "
              f"{allocated / MB:.0f} MB allocated; blocks >= 8 MiB (MiB: count): "
              f"{sorted(big.items(), reverse=True)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", help="fusion or inductor")
    parser.add_argument("target", help="a model factory, as in `fusion-compiler bench`")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        print("cudagraph_memory.py needs a CUDA GPU")
        return 2
    from fusion_compiler.targets import load_factory

    model, args = load_factory(a.target)[0](device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(*args)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved()
        fn = torch.compile(model, backend=a.backend, mode="reduce-overhead")
        for i in range(5):
            fn(*fresh(args))
            torch.cuda.synchronize()
            print(f"call {i}: allocated {torch.cuda.memory_allocated() / MB:.0f} MB, reserved "
                  f"{torch.cuda.memory_reserved() / MB:.0f} MB")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_reserved() - held
        err = (out.float() - expected.float()).abs().max().item()
    print(f"peak reserved over what was held before compiling: {peak / MB:.0f} MB; "
          f"max error against eager {err:.4f}")
    segments()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
