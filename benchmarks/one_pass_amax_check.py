"""variants.one_pass_amax against the generated dynamic FP8 kernel, bit for bit, on ten input
kinds at odd shapes, with the share of rows that take its fallback (second reduction).

    python benchmarks/one_pass_amax_check.py

On the GPU (session 30): equal at 37x4096, 5x1000, 64x4096, 1x4096, 129x2048; not at 16384x4096
or 300x8192, where the tuple reduction adds the sum of squares in another order than tl.sum.
Under TRITON_INTERPRET=1 the interpreter's tuple reduction also sums in another order.
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import variants as V  # noqa: E402
from fusion_compiler import patterns as P  # noqa: E402
from fusion_compiler.measure import recording  # noqa: E402

def build(m, n, dev):
    x = torch.randn(m, n, device=dev).bfloat16(); w = torch.randn(n, device=dev).bfloat16()
    torch._dynamo.reset()
    with recording() as rec, torch.no_grad():
        f = torch.compile(P.rmsnorm_dynamic_fp8, backend="fusion"); f(x, w)
    (t,) = rec.targets
    (k,) = t.report.kernels
    return Path(k["path"]).read_text()

def load(text, name):
    d = Path(tempfile.mkdtemp()) / f"{name}.py"; d.write_text(text)
    spec = importlib.util.spec_from_file_location(name, d); mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod); return mod

def share(x, w):
    p = x.float().abs() * w.float().abs()
    t = p.topk(2, dim=1).values
    return (t[:, 1] >= 0.984 * t[:, 0]).float().mean().item()

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
bad = 0
shapes = [(37, 4096), (5, 1000), (64, 4096), (1, 4096), (129, 2048)]
if dev.type == "cuda":   # too slow for the interpreter
    shapes += [(16384, 4096), (300, 8192)]
for m, n in shapes:
    src = build(m, n, dev)
    gen = load(src, f"g{m}_{n}")
    var = load(V.one_pass_amax()(src), f"v{m}_{n}")
    g = torch.Generator(device=dev).manual_seed(m + n)
    rn = lambda *s: torch.randn(*s, device=dev, generator=g)
    cases = {
        "randn": (rn(m, n).bfloat16(), rn(n).bfloat16()),
        "ties": (torch.randint(-3, 4, (m, n), device=dev, generator=g).bfloat16(), torch.randint(-2, 3, (n,), device=dev, generator=g).bfloat16()),
        "near": ((rn(m, n) * 0.01 + 1).bfloat16(), torch.ones(n, device=dev).bfloat16()),
        "tiny": ((rn(m, n) * 1e-30).bfloat16(), (rn(n).abs() * 1e-10).bfloat16()),
        "huge_w": (rn(m, n).bfloat16(), (rn(n) * 1e30).bfloat16()),
        "wide": ((rn(m, n) * torch.exp(rn(m, n) * 20)).bfloat16(), rn(n).bfloat16()),
        "zeros": (torch.zeros(m, n, device=dev).bfloat16(), rn(n).bfloat16()),
        "sub": ((rn(m, n) * 1e-39).bfloat16(), rn(n).bfloat16()),
        "heavy": ((rn(m, n) ** 3).bfloat16(), rn(n).bfloat16()),
    }
    x = cases["randn"][0].clone(); x[0, 3] = float("nan")
    if m > 2:
        x[1, 5] = float("inf"); x[2, :] = 0
    cases["special"] = (x, cases["randn"][1])
    for name, (x, w) in cases.items():
        s0, q0 = gen.launch(dev, x, w); s1, q1 = var.launch(dev, x, w)
        eq, es = P.rmsnorm_dynamic_fp8(x, w)
        se = torch.equal(s0.view(torch.int32), s1.view(torch.int32))
        qe = torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
        ge = torch.equal(s0.view(torch.int32), es.view(torch.int32)) and torch.equal(q0.view(torch.uint8), eq.view(torch.uint8))
        bad += not (se and qe)
        print(f"{m}x{n} {name:8s} var==gen scale {se} q {qe}  gen==eager {ge}  fallback share {share(x, w):.3f}", flush=True)
print("MISMATCHES", bad)
