"""What the GPU compiler makes of the generated kernels, checked without a GPU: Triton compiles
a kernel for sm_90 (the H200) on the CPU, through LLVM to PTX."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import compile_and_run, kernel_count

pytest.importorskip("triton.backends.nvidia.compiler")

# Loads a generated kernel module and prints its pointwise kernel's PTX for sm_90. Run in its
# own process: this one's kernels are made for Triton's interpreter.
PTX = r'''
import importlib.util, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
path = sys.argv[1]
text = open(path).read()
spec = importlib.util.spec_from_file_location("kernel_module", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
types = {"torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32",
         "torch.int8": "*i8"}
sig = {name: types[t] for name, t in re.findall(r"^    (in\d+|out\d+),  # (torch\.\w+)", text, re.M)}
sig["numel"] = "i32"
const = {"BLOCK": 1024, "INDEX64": False, "EVEN": True}
sig.update({k: "constexpr" for k in const})
attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
src = ASTSource(module._pointwise_kernel, signature=sig, constexprs=const, attrs=attrs)
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
'''


def ptx_of(module_path, tmp_path, edit=None) -> str:
    path = module_path
    if edit:
        path = tmp_path / "edited.py"
        path.write_text(edit(module_path.read_text()))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    run = subprocess.run([sys.executable, "-c", PTX, str(path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def mul_add(a, b, c):
    return a * b + c


def dequant_add(q, s, r):
    return q.to(torch.bfloat16) * s + r


CASES = {
    "bf16 a * b + c": (mul_add, lambda d: [torch.randn(5, 300, dtype=torch.bfloat16, device=d)
                                           for _ in range(3)]),
    "fp16 a * b + c": (mul_add, lambda d: [torch.randn(5, 300, dtype=torch.float16, device=d)
                                           for _ in range(3)]),
    "dequant+add": (dequant_add, lambda d: [
        torch.randint(-127, 127, (5, 300), dtype=torch.int8, device=d),
        torch.randn(300, dtype=torch.bfloat16, device=d),
        torch.randn(5, 300, dtype=torch.bfloat16, device=d)]),
}


def kernel_module(cache_dir, fn, args):
    """The one kernel module compiling ``fn`` writes (on the GPU or in the interpreter)."""
    out, reports = compile_and_run(fn, args)
    assert kernel_count(reports) == 1
    (path,) = cache_dir.rglob("*.py")
    return path


@pytest.mark.parametrize("case", CASES)
def test_a_product_eager_rounds_is_not_fused_into_the_add_that_reads_it(cache_dir, tmp_path,
                                                                          device, case):
    """Eager rounds a * b to bf16 / fp16 before adding c. Left alone, LLVM narrows the rounded
    product to a half-precision multiply and contracts it with the add into one fma.rn.bf16x2
    (fma.rn.f16x2), one rounding fewer than eager: a quarter of dequant+add's elements were a
    bf16 step off on the H200. The product must stay fp32 and be converted before the add."""
    fn, make = CASES[case]
    ptx = ptx_of(kernel_module(cache_dir, fn, make(device)), tmp_path)
    assert "mul.f32" in ptx or "mul.rn.f32" in ptx
    assert "fma.rn.bf16" not in ptx and "fma.rn.f16" not in ptx
    assert "cvt.rn.bf16" in ptx or "cvt.rn.f16" in ptx


def test_without_the_guard_the_compiler_would_fuse_the_rounding_away(cache_dir, tmp_path,
                                                                      device):
    """Why the guard exists: the same kernel with the product rounded by a plain conversion
    compiles to packed fmas, which the test above would catch."""
    path = kernel_module(cache_dir, mul_add, CASES["bf16 a * b + c"][1](device))
    text = path.read_text()
    assert "fl.round_bf16(" in text
    ptx = ptx_of(path, tmp_path, edit=lambda t: t.replace("fl.round_bf16(", "fl.convert_bf16("))
    if "fma.rn.bf16" not in ptx:
        pytest.skip("this Triton does not contract the unguarded rounding either")


@pytest.mark.parametrize("name", ["rmsnorm_fp8", "rmsnorm_dynamic_fp8", "swiglu"])
def test_products_only_scaled_further_take_no_guard(cache_dir, device, name):
    """The guard costs packed bf16 arithmetic (the FP8 norm kernels fell from 90% to 80-87% of
    the bandwidth floor with every product guarded), so a rounded product that is only
    multiplied, divided, clamped, compared or max-reduced afterwards, or stored, goes without."""
    from patterns import PATTERNS, make_args
    path = kernel_module(cache_dir, PATTERNS[name], make_args(name, 5, 300, torch.bfloat16,
                                                              device))
    text = path.read_text()
    assert "fl.convert_bf16(" in text and "fl.round_bf16(" not in text
