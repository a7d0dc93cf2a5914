"""The resident kernel's settings, measured on hand-written kernels before it was built: a
softmax whose row a program holds in registers as K static chunks of CH columns on W warps
(read once), against eager, Inductor and fusion's kernel of the day, over rows of an odd
vocabulary (4096 x 50257, 8192 x 30522) and 2048 x 32768. Chunks inside the row load without
a mask from the row's 16 bytes; ``rc``: the exps computed again for the output, not kept;
``bf``: the row kept as bf16 until used. The source of ``launch.RESIDENT_RBLOCK`` and
``RESIDENT_WARPS`` (BENCHMARKS.md, session 25).

    python benchmarks/resident_variants.py         (GPU: writes $OUT/reg_rows.json)
    python benchmarks/resident_variants.py --cpu   (registers and spills for sm_90 only)
"""
import importlib.util, os, sys, tempfile, re, subprocess
from pathlib import Path
import triton

TEMPLATE = '''
import triton
import triton.language as tl

@triton.jit
def softmax_k(x_ptr, y_ptr, N, CH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * N
    a0 = tl.multiple_of(base // 8 * 8, 8)
    sh = (base - a0).to(tl.int32)
    c = tl.arange(0, CH)
    xp = x_ptr + a0
    yp = y_ptr + a0
{loads}
    mx = {maxes}
    m = tl.max(mx, 0)
{exps}
    s = tl.sum({sums}, 0)
    r = 1.0 / s
{stores}
'''

def source(k, ch, recompute, bf=False):
    cast = '' if bf else '.to(tl.float32)'
    f32 = '.to(tl.float32)' if bf else ''
    def ld(j):
        if 0 < j < k - 1:   # inside every row (N >= (k-1)*ch): no mask, 16-byte vectors
            return f"    o{j} = c + {j * ch}\n    x{j} = tl.load(xp + o{j}){cast}\n"
        return (f"    o{j} = c + {j * ch}\n    k{j} = (o{j} >= sh) & (o{j} < sh + N)\n"
                f"    x{j} = tl.load(xp + o{j}, mask=k{j}, other=float('-inf')){cast}\n")
    loads = "".join(ld(j) for j in range(k))
    maxes = "x0"
    for j in range(1, k):
        maxes = f"tl.maximum({maxes}, x{j})"
    maxes = f"({maxes}){f32}"
    exps = "".join(f"    e{j} = tl.exp(x{j}{f32} - m)\n" for j in range(k))
    sums = " + ".join(f"e{j}" for j in range(k))
    ex = (lambda j: f"tl.exp(x{j}{f32} - m)") if recompute else (lambda j: f"e{j}")
    stores = "".join(f"    tl.store(yp + o{j}, ({ex(j)} * r).to(y_ptr.dtype.element_ty)"
                     + (")\n" if 0 < j < k - 1 else f", mask=k{j})\n") for j in range(k))
    return TEMPLATE.format(loads=loads, maxes=maxes, exps=exps, sums=sums, stores=stores)

def load(k, ch, recompute=False, bf=False):
    d = Path(tempfile.mkdtemp())
    p = d / f"reg_softmax_{k}_{ch}_{int(recompute)}{int(bf)}.py"
    p.write_text(source(k, ch, recompute, bf))
    spec = importlib.util.spec_from_file_location(p.stem, p)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    return m.softmax_k

VARIANTS = [  # (K, CH, warps, recompute, bf16 kept)
    (13, 4096, 32, False, False), (13, 4096, 32, True, False), (7, 8192, 32, False, False),
    (13, 4096, 16, False, False), (25, 2048, 32, False, False), (13, 4096, 32, True, True),
    (13, 4096, 16, True, True), (7, 8192, 32, True, True),
]

def cpu():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
    for k, ch, w, rc, bf in VARIANTS:
        fn = load(k, ch, rc, bf)
        src = ASTSource(fn, {"x_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "CH": "constexpr"},
                        {"CH": ch}, {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w})
        f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False); f.write(c.asm["cubin"]); f.close()
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        ld = (len(re.findall(r"ld.global.v4", c.asm["ptx"])), len(re.findall(r"st.global.v4", c.asm["ptx"])), len(re.findall(r"ld.global", c.asm["ptx"])))
        print(k, ch, w, rc, bf, re.search(r"REG:(\d+)", res).group(0), re.search(r"STACK:(\d+)", res).group(0),
              "ld.v4", ld, flush=True)

def gpu():
    import json, torch
    from triton.testing import do_bench
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from long_rows import profile_call
    out = Path(os.environ.get("OUT", "."))
    res = {}
    for R, N in [(4096, 50257), (8192, 30522), (2048, 32768)]:
        x = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.softmax(x, -1)
        fns = {"eager": lambda x: torch.softmax(x, -1), "inductor": torch.compile(lambda x: torch.softmax(x, -1))}
        import fusion_compiler  # the "fusion" backend
        assert fusion_compiler.__name__
        torch._dynamo.reset()
        fns["fusion"] = torch.compile(lambda x: torch.softmax(x, -1), backend="fusion")
        for k, ch, w, rc, bf in VARIANTS:
            k = -(-(N + 7) // ch)
            fn = load(k, ch, rc, bf)
            y = torch.empty_like(x)
            def call(x, fn=fn, ch=ch, w=w, y=y):
                fn[(x.shape[0],)](x, y, x.shape[1], CH=ch, num_warps=w)
                return y
            fns[f"reg k{k} ch{ch} w{w} rc{int(rc)} bf{int(bf)}"] = call
        row = {}
        for name, f in fns.items():
            try:
                err = (f(x).float() - ref.float()).abs().max().item()
                p = profile_call(f, (x,))
                ms = do_bench(lambda: f(x), warmup=25, rep=200, return_mode="median")
                row[name] = {"err": err, "kernel_us": p["kernel_us"], "do_bench_us": ms * 1e3}
                print(f"{R}x{N} {name:28s} kernel {p['kernel_us']:8.1f}us do_bench {ms*1e3:8.1f}us err {err:.3g} floor {4*R*N/4.22e6:.1f}", flush=True)
            except Exception as e:
                row[name] = {"error": repr(e)[:300]}
                print(name, "ERROR", repr(e)[:300], flush=True)
        res[f"{R}x{N}"] = row
    (out / "reg_rows.json").write_text(json.dumps(res, indent=1))

if __name__ == "__main__":
    cpu() if "--cpu" in sys.argv else gpu()
