"""variants.one_pass_amax against the generated dynamic FP8 kernel, bit for bit, on ten input
kinds at odd shapes, with the share of rows that take its fallback (second reduction).

    python benchmarks/one_pass_amax_check.py

On the GPU (session 30): equal at 37x4096, 5x1000, 64x4096, 1x4096, 129x2048; not at 16384x4096
or 300x8192, where the tuple reduction adds the sum of squares in another order than tl.sum.
Under TRITON_INTERPRET=1 the interpreter's tuple reduction also sums in another order.
"""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import variants as V  # noqa: E402
from fusion_compiler import patterns as P  # noqa: E402
from fusion_compiler.measure import recording  # noqa: E402


def generated_source(m: int, n: int, dev) -> str:
    """The source the fusion backend generates for the pattern at [m, n]."""
    x, w = torch.randn(m, n, device=dev).bfloat16(), torch.randn(n, device=dev).bfloat16()
    torch._dynamo.reset()
    with recording() as rec, torch.no_grad():
        torch.compile(P.rmsnorm_dynamic_fp8, backend="fusion")(x, w)
    (target,) = rec.targets
    (kernel,) = target.report.kernels
    return Path(kernel["path"]).read_text()


def fallback_share(x, w) -> float:
    """Rows whose two largest |x w| are within the bound: they take the second reduction."""
    top = (x.float().abs() * w.float().abs()).topk(2, dim=1).values
    return (top[:, 1] >= 0.984 * top[:, 0]).float().mean().item()


def inputs(m: int, n: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(m + n)

    def rn(*shape):
        return torch.randn(*shape, device=dev, generator=g)

    def ints(lo, hi, shape):
        return torch.randint(lo, hi, shape, device=dev, generator=g).bfloat16()

    cases = {
        "randn": (rn(m, n), rn(n)),
        "ties": (ints(-3, 4, (m, n)), ints(-2, 3, (n,))),
        "near": (rn(m, n) * 0.01 + 1, torch.ones(n, device=dev)),
        "tiny": (rn(m, n) * 1e-30, rn(n).abs() * 1e-10),
        "huge_w": (rn(m, n), rn(n) * 1e30),
        "wide": (rn(m, n) * torch.exp(rn(m, n) * 20), rn(n)),
        "zeros": (torch.zeros(m, n, device=dev), rn(n)),
        "sub": (rn(m, n) * 1e-39, rn(n)),
        "heavy": (rn(m, n) ** 3, rn(n)),
    }
    cases = {k: (x.bfloat16(), w.bfloat16()) for k, (x, w) in cases.items()}
    x = cases["randn"][0].clone()
    x[0, 3] = float("nan")
    if m > 2:
        x[1, 5] = float("inf")
        x[2, :] = 0
    cases["special"] = (x, cases["randn"][1])
    return cases


def main() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [(37, 4096), (5, 1000), (64, 4096), (1, 4096), (129, 2048)]
    if dev.type == "cuda":   # too slow for the interpreter
        shapes += [(16384, 4096), (300, 8192)]
    folder = Path(tempfile.mkdtemp())
    bad = 0
    for m, n in shapes:
        src = generated_source(m, n, dev)
        gen = V.load_module(src, f"g{m}_{n}", folder)
        var = V.load_module(V.one_pass_amax()(src), f"v{m}_{n}", folder)
        for name, (x, w) in inputs(m, n, dev).items():
            s0, q0 = gen.launch(dev, x, w)
            s1, q1 = var.launch(dev, x, w)
            eq, es = P.rmsnorm_dynamic_fp8(x, w)
            same_scale = torch.equal(s0.view(torch.int32), s1.view(torch.int32))
            same_q = torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
            gen_eager = (torch.equal(s0.view(torch.int32), es.view(torch.int32))
                         and torch.equal(q0.view(torch.uint8), eq.view(torch.uint8)))
            bad += not (same_scale and same_q)
            print(f"{m}x{n} {name:8s} var==gen scale {same_scale} q {same_q}  "
                  f"gen==eager {gen_eager}  fallback share {fallback_share(x, w):.3f}", flush=True)
    print("mismatches", bad)
    return 0


if __name__ == "__main__":
    sys.exit(main())
