"""Where the host time of a compiled call goes (GPU): the launch-bound Llama case, profiled.

    python benchmarks/profile_overhead.py [--out DIR]

Prints, for examples/llama.py:bench_1x128 under the fusion backend: host microseconds per call
(plain and with CUDA graphs, beside Inductor's), the functions that take the host time (cProfile,
by own time), one launcher's cost against one eager op, and where the cold compile goes.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import bench_1x128  # noqa: E402
from timing import call_us  # noqa: E402


def per_call_us(fn, args, n=50):
    return call_us(fn, args, calls=n)


def top(profile, n, pattern=None, key="tottime"):
    s = io.StringIO()
    st = pstats.Stats(profile, stream=s).sort_stats(key)
    st.print_stats(*([pattern] if pattern else []), n)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    report = []
    model, (ids,) = bench_1x128(device="cuda")
    model.eval()
    with torch.no_grad():
        report.append(f"eager: {per_call_us(model, (ids,)):.0f} us/call")
        for name, kw in [("fusion", dict(backend="fusion")),
                         ("fusion-cg", dict(backend="fusion", mode="reduce-overhead")),
                         ("inductor", dict(backend="inductor")),
                         ("inductor-cg", dict(backend="inductor", mode="reduce-overhead"))]:
            torch._dynamo.reset()
            fn = torch.compile(model, **kw)
            pr = cProfile.Profile()
            t0 = time.perf_counter()
            if name == "fusion":
                pr.enable()
            fn(ids)
            torch.cuda.synchronize()
            pr.disable()
            cold = time.perf_counter() - t0
            report.append(f"{name}: {per_call_us(fn, (ids,)):.0f} us/call (first call {cold:.2f} s)")
            if name == "fusion":
                report.append("cold compile, fusion's own functions (cumulative):\n"
                              + top(pr, 30, "fusion_compiler|passes|codegen", "cumulative"))
                report.append("cold compile, all (own time):\n" + top(pr, 25))
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(20):
                    fn(ids)
                torch.cuda.synchronize()
                pr.disable()
                report.append("20 calls, own time:\n" + top(pr, 35))
        # one launcher against one eager op
        x = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
        y = torch.randn_like(x)
        torch._dynamo.reset()
        f = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b, backend="fusion")
        report.append(f"one fused swiglu call: {per_call_us(f, (x, y), 500):.1f} us; eager silu*mul "
                      f"(2 ops): {per_call_us(lambda a, b: torch.nn.functional.silu(a) * b, (x, y), 500):.1f} us; "
                      f"eager add (1 op): {per_call_us(torch.add, (x, y), 500):.1f} us")
        from fusion_compiler.report import capture_compiles
        torch._dynamo.reset()
        with capture_compiles() as reports:
            f = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b, backend="fusion")
            f(x, y)
        from fusion_compiler import backend
        key = reports[0].kernels[0]["key"]
        module = next(c.modules[key] for c in backend._caches.values() if key in c.modules)
        report.append(f"launcher alone: {per_call_us(module.launch, (x.device, x, y), 500):.1f} us")
    text = "\n".join(report)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
