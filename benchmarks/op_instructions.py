"""Instructions per element of each pointwise op as the code generator writes it, for sm_90:
the cost model's FLOP weights (passes/cost_model.py, OP_FLOPS) come from this. Needs no GPU.

    python benchmarks/op_instructions.py

Each op becomes a kernel ``y = op(x)`` over fp32 blocks of 1024 on 4 warps (8 elements a
thread), compiled by Triton for sm_90; the PTX instructions of its body, less those of a kernel
that copies ``x``, divided by the 8 elements, are the op's. PTX, not SASS: an instruction such as
``div.full.f32`` or ``sqrt.rn.f32`` is a few SASS instructions, and both sides of a branch are
counted (libdevice's erf, log). The figures are a rough measure, used as one.
"""
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# op -> the expression the code generator writes for it (codegen/ops.py), of x
OPS = {
    "copy": "x",
    "add": "x + 1.5",
    "mul": "x * 1.5",
    "div": "x / (x + 3.0)",
    "exp": "tl.exp(x)",
    "exp2": "tl.exp2(x)",
    "expm1": "fl.expm1(x)",
    "log": "tl.log(x)",
    "log2": "tl.log2(x)",
    "log1p": "fl.log1p(x)",
    "tanh": "fl.tanh(x)",
    "sigmoid": "1.0 / (1.0 + tl.exp(-x))",
    "erf": "tl.math.erf(x)",
    "rsqrt": "fl.rsqrt(x)",
    "sqrt": "tl.sqrt_rn(x)",
    "sin": "tl.sin(x)",
    "cos": "tl.cos(x)",
    "pow": "fl.pow(x, x)",
}
SOURCE = '''
import triton
import triton.language as tl
from fusion_compiler.codegen import triton_lib as fl


@triton.jit
def kernel(inp, out, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(inp + i)
    tl.store(out + i, {expr})
'''
ELEMENTS_PER_THREAD = 8     # 1024 elements on 4 warps


def instructions(expr: str, folder: Path) -> int:
    path = folder / f"k{abs(hash(expr))}.py"
    path.write_text(SOURCE.format(expr=expr))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = ASTSource(module.kernel, {"inp": "*fp32", "out": "*fp32", "BLOCK": "constexpr"},
                    {"BLOCK": 1024})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return sum(1 for line in ptx.split("\n")
               if re.match(r"\s+(@!?%p\d+ )?[a-z]", line) and not line.strip().startswith("."))


def main() -> int:
    folder = Path(tempfile.mkdtemp())
    counts = {op: instructions(expr, folder) for op, expr in OPS.items()}
    base = counts.pop("copy")
    print(f"{'op':8s} {'per element':>12s}   (PTX instructions beyond a copy, sm_90)")
    for op, n in counts.items():
        print(f"{op:8s} {(n - base) / ELEMENTS_PER_THREAD:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
