"""What the GPU compiler makes of the generated kernels, checked without a GPU: Triton compiles
a kernel for sm_90 (the H200) on the CPU, through LLVM to PTX."""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fusion_compiler.codegen import precompile
from helpers import compile_and_run, instead_of_compiles, kernel_count

pytest.importorskip("triton.backends.nvidia.compiler")

# Compiles recorded launches for sm_90 and prints their PTX, in a process of its own: Triton's
# interpreter, loaded here, cannot share a process with its compiler (as in test_precompile.py).
# One process serves every test of this module (its imports take seconds): each request is a
# length line and pickled specs, each reply a line after the marker
_MARK = b"fusion-compiler-ptx "
_PTX = """
import json, pickle, sys, traceback
from triton.backends.compiler import GPUTarget
from fusion_compiler.codegen.precompile import compile_specs
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
while True:
    header = stdin.readline()
    if not header:
        break
    specs = pickle.loads(stdin.read(int(header)))
    try:
        reply = {"ptx": [r["ptx"] for r in compile_specs(specs, GPUTarget("cuda", 90, 32),
                                                          ("ptx",))]}
    except Exception:
        reply = {"error": traceback.format_exc()}
    stdout.write(%r + json.dumps(reply).encode() + b"\\n")
    stdout.flush()
""" % _MARK
_process = {}


@pytest.fixture(scope="module", autouse=True)
def _compiler_process(tmp_path_factory):
    """The compiler process ``ptx_of`` starts, ended with the module's tests."""
    _process["dir"] = tmp_path_factory.mktemp("ptx")
    yield
    proc = _process.pop("proc", None)
    if proc is not None:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()


def ptx_of(specs, tmp_path=None) -> str:
    """The PTX of the recorded launches ``specs``, compiled for sm_90 by the module's compiler
    process (started at the first call)."""
    proc = _process.get("proc")
    if proc is None or proc.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(_process["dir"] / "triton")
        with open(_process["dir"] / "stderr.txt", "wb") as errors:
            proc = _process["proc"] = subprocess.Popen(
                [sys.executable, "-c", _PTX], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=errors, env=env)
    data = pickle.dumps(specs)
    proc.stdin.write(b"%d\n" % len(data) + data)
    proc.stdin.flush()
    watchdog = threading.Timer(300, proc.kill)     # a hung compile fails, not the suite
    watchdog.start()
    try:
        line = proc.stdout.readline()
        while line and not line.startswith(_MARK):
            line = proc.stdout.readline()
    finally:
        watchdog.cancel()
    if not line:
        tail = (_process["dir"] / "stderr.txt").read_bytes()[-3000:].decode(errors="replace")
        raise AssertionError(f"the compiler process ended (or hung and was ended): {tail}")
    reply = json.loads(line[len(_MARK):])
    assert "error" not in reply, reply.get("error", "")[-3000:]
    return "\n".join(reply["ptx"])


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


def launches(fn, args, monkeypatch) -> list:
    """The launches of ``fn``'s one kernel as ``precompile.compile_specs`` takes them."""
    specs = []
    instead_of_compiles(monkeypatch,
                        at_finish=lambda ctx: specs.extend(precompile.launch_specs(ctx)))
    out, reports = compile_and_run(fn, args)
    assert kernel_count(reports) == 1 and specs
    return specs


@pytest.mark.parametrize("case", CASES)
def test_a_product_eager_rounds_is_not_fused_into_the_add_that_reads_it(cache_dir, tmp_path,
                                                                          device, monkeypatch,
                                                                          case):
    """Eager rounds a * b to bf16 / fp16 before adding c. Left alone, LLVM narrows the rounded
    product to a half-precision multiply and contracts it with the add into one fma.rn.bf16x2
    (fma.rn.f16x2), one rounding fewer than eager: a quarter of dequant+add's elements were a
    bf16 step off on the H200. The product must stay fp32 and be converted before the add."""
    fn, make = CASES[case]
    ptx = ptx_of(launches(fn, make(device), monkeypatch), tmp_path)
    assert "mul.f32" in ptx or "mul.rn.f32" in ptx
    assert "fma.rn.bf16" not in ptx and "fma.rn.f16" not in ptx
    assert "cvt.rn.bf16" in ptx or "cvt.rn.f16" in ptx


def test_without_the_guard_the_compiler_would_fuse_the_rounding_away(cache_dir, tmp_path,
                                                                      device, monkeypatch):
    """Why the guard exists: the same kernel with the product rounded by a plain conversion
    compiles to packed fmas, which the test above would catch."""
    specs = launches(mul_add, CASES["bf16 a * b + c"][1](device), monkeypatch)
    text = Path(specs[0]["path"]).read_text()
    assert "fl.round_bf16(" in text
    edited = tmp_path / "unguarded.py"
    edited.write_text(text.replace("fl.round_bf16(", "fl.convert_bf16("))
    ptx = ptx_of([dict(spec, path=str(edited)) for spec in specs], tmp_path)
    if "fma.rn.bf16" not in ptx:
        pytest.skip("this Triton does not contract the unguarded rounding either")


@pytest.mark.parametrize("name", ["rmsnorm_fp8", "rmsnorm_dynamic_fp8", "swiglu"])
def test_products_only_scaled_further_take_no_guard(cache_dir, device, name):
    """The guard costs packed bf16 arithmetic (the FP8 norm kernels fell from 90% to 80-87% of
    the bandwidth floor with every product guarded), so a rounded product that is only
    multiplied, divided, clamped, compared or max-reduced afterwards, or stored, goes without."""
    from patterns import PATTERNS, make_args
    compile_and_run(PATTERNS[name], make_args(name, 5, 300, torch.bfloat16, device))
    (path,) = cache_dir.rglob("*.py")
    text = path.read_text()
    assert "fl.convert_bf16(" in text and "fl.round_bf16(" not in text


def test_split_stages_stream_in_vectors_without_barriers(cache_dir, tmp_path, device,
                                                         monkeypatch):
    """A softmax over one row of 32768 splits into 4 chunks, two stages (the max with the sum
    of exps, online; the outputs). Each stage loads
    the row in 16-byte vectors (the chunk's start and the prefetch masks keep Triton's
    alignment proof), and the last stores in them too, with no barrier: its per-row values are
    scalars (a [1, 1] block reduced from the partials went through shared memory, 32 barriers
    before the loop; 19.8 against 2.2 us on the H200)."""
    x = torch.randn(1, 32768, dtype=torch.bfloat16, device=device)
    specs = launches(lambda x: torch.softmax(x, -1), (x,), monkeypatch)
    stages = {}
    for spec in specs:
        ptx = ptx_of([spec], tmp_path)
        stages[re.search(r"\.entry (\w+)", ptx).group(1)] = ptx
    assert sorted(stages) == ["_split0_kernel", "_split1_kernel"]
    for name, ptx in stages.items():
        assert "ld.global.v4.b32" in ptx, name
    assert "st.global.v4.b32" in stages["_split1_kernel"]
    assert "bar.sync" not in stages["_split1_kernel"]


@pytest.mark.parametrize("fn", [lambda x: torch.softmax(x, -1),
                                lambda x: torch.log_softmax(x.float(), -1)],
                         ids=["softmax", "log_softmax fp32 out"])
def test_unaligned_rows_stream_in_vectors(cache_dir, tmp_path, device, monkeypatch, fn):
    """Rows of an odd number of bf16 elements (GPT-2's vocabulary: 50257) start on 2 bytes:
    the looped kernel steps from each row's 16 bytes, so the steps inside the row load and
    store 16 bytes at a time (without the shift every load and store took 2 bytes: softmax
    over 4096 such rows ran at 38% of the HBM floor on the H200). Here three rows of 4097
    loop (steps of 2048 columns), one program a row (never split, never held: the resident
    kernel's test follows)."""
    from fusion_compiler.codegen import launch
    monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "2048")
    monkeypatch.setenv("FUSION_COMPILER_MAX_RESIDENT_ROW", "0")
    monkeypatch.setattr(launch, "SPLIT_MIN_CHUNK", 1 << 30)
    launch.split_settings.cache_clear()
    x = torch.randn(3, 4097, dtype=torch.bfloat16, device=device)
    try:
        specs = launches(fn, (x,), monkeypatch)
    finally:
        launch.split_settings.cache_clear()     # no entry of the patched rule left behind
    ptx = "\n".join(ptx_of([spec], tmp_path) for spec in specs)
    assert re.findall(r"\.entry (\w+)", ptx) == ["_looped_kernel"]
    assert "ld.global.v4.b32" in ptx
    assert "st.global.v4.b32" in ptx


def ptxas_report(ptx: str, tmp_path) -> str:
    """ptxas -v's report of ``ptx`` compiled for sm_90a (the target Triton writes for the
    H200): registers and spills per kernel. The ptxas Triton itself takes for sm_90, whose
    version sets the PTX's (Triton 3.9 writes PTX 9.4 for its CUDA 13 ptxas, which the other,
    CUDA 12.8, rejects)."""
    from triton.backends.nvidia.compiler import get_ptxas
    tool = get_ptxas(90)
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    run = subprocess.run([tool.path, "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


def test_rows_held_in_registers_load_in_vectors_without_spills(cache_dir, tmp_path, device,
                                                               monkeypatch):
    """Rows of GPT-2's vocabulary (50257 bf16 elements, on 2 bytes) held by the resident
    kernel: 13 chunks of 4096 on 32 warps, from each row's 16 bytes. The 11 chunks inside the
    row load and store 4 elements a thread (8-byte vectors), unpredicated; ptxas keeps the
    row in 64 registers a thread and spills 8 bytes: each access's address is the row's
    pointer plus the chunk's columns (written as one offset, the 13 chunks' per-element
    offsets were shared by the loads and the stores, and kept live between them: 65 spill
    instructions in the SASS, against 4)."""
    from fusion_compiler.codegen import launch
    monkeypatch.setattr(launch, "SPLIT_MIN_CHUNK", 1 << 30)     # two rows: never split
    launch.split_settings.cache_clear()
    x = torch.randn(2, 50257, dtype=torch.bfloat16, device=device)
    try:
        specs = launches(lambda x: torch.softmax(x, -1), (x,), monkeypatch)
    finally:
        launch.split_settings.cache_clear()
    ptx = "\n".join(ptx_of([spec], tmp_path) for spec in specs)
    assert re.findall(r"\.entry (\w+)", ptx) == ["_resident_kernel"]
    assert len(re.findall(r"ld\.global\.v2\.b32 ", ptx)) >= 11
    assert len(re.findall(r"st\.global\.v2\.b32 ", ptx)) >= 11
    report = ptxas_report(ptx, tmp_path)
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= 16, report


def test_a_column_sum_loads_in_vectors_across_its_rows(cache_dir, tmp_path, device,
                                                       monkeypatch):
    """A column sum's first kernel (passes/column_sums.py) reads strided rows: a program takes
    a run of columns, loaded in 16-byte vectors across its rows, and stores the producer's
    value the same way. Its row mask compares with the static row count: against the
    unspecialized R, Triton could not prove the mask constant over a vector and every access
    was a 2-byte load (4x slower than eager on the H200)."""
    g, x = (torch.randn(1024, 768, dtype=torch.bfloat16, device=device) for _ in range(2))

    def f(g, x):
        y = g * torch.sigmoid(x)
        return y, y.sum(0)
    specs = []
    instead_of_compiles(monkeypatch,
                        at_finish=lambda ctx: specs.extend(precompile.launch_specs(ctx)))
    out, reports = compile_and_run(f, (g, x))
    assert kernel_count(reports) == 2
    first = [s for s in specs if "sigmoid" in Path(s["path"]).read_text()]
    assert first
    ptx = ptx_of(first, tmp_path)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "ld.global.b16" not in ptx


def _gelu_of_gemm(x, w):
    return torch.nn.functional.gelu(x @ w)


def _rmsnorm_of_gemm_sum(x, a, b):
    """add+RMSNorm over two GEMM outputs: the sum is written over one, the norm over the other."""
    h = x @ a + x @ b
    hf = h.float()
    return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


IN_PLACE = {
    "gelu": (_gelu_of_gemm, lambda d: [torch.randn(64, 96, dtype=torch.bfloat16, device=d),
                                       torch.randn(96, 256, dtype=torch.bfloat16, device=d)],
             "INPLACE = {0: 0}"),
    # a row of 2048: several warps a row, whose reduction meets in shared memory
    "add+rmsnorm": (_rmsnorm_of_gemm_sum,
                    lambda d: [torch.randn(64, 96, dtype=torch.bfloat16, device=d)]
                    + [torch.randn(96, 2048, dtype=torch.bfloat16, device=d) / 9
                       for _ in range(2)],
                    "INPLACE = {0: 0, 1: 1}"),
}


@pytest.mark.parametrize("case", IN_PLACE)
def test_a_kernel_writing_over_its_input_loads_it_before_it_stores(cache_dir, tmp_path, device,
                                                                   monkeypatch, case):
    """passes/inplace.py hands a GELU the GEMM output it reads as the memory of its output, a
    persistent add+RMSNorm both GEMM outputs it adds: each thread must read its elements of
    them before it writes them. In the sm_90 code every load from global memory comes before
    the first store (straight-line code: a thread's accesses to one address stay in program
    order), and none is a non-coherent ``.nc`` load."""
    fn, make, inplace = IN_PLACE[case]
    specs = launches(fn, make(device), monkeypatch)
    assert inplace in Path(specs[0]["path"]).read_text()
    ptx = ptx_of(specs, tmp_path)
    body = [ln.strip() for ln in ptx.splitlines()]
    loads = [i for i, ln in enumerate(body) if ln.startswith(("ld.global", "@%p")) and "ld.global" in ln]
    stores = [i for i, ln in enumerate(body) if "st.global" in ln]
    assert loads and stores and max(loads) < min(stores), (loads, stores)
    assert not any(".nc" in body[i] for i in loads)
    if case == "add+rmsnorm":
        assert "bar.sync" in ptx        # the warps' partial sums meet, as the case intends


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "1-d"])
def test_a_transposed_store_is_written_in_vectors_from_tiles(cache_dir, tmp_path, device,
                                                             monkeypatch, tiled):
    """SiLU of [2, 128, 96] fp32 stored as computed and with its last two dims swapped
    (codegen/tiles.py): in tiles, both stores and the load are 16-byte vectors on sm_90 (the
    transposition goes through shared memory); the 1-d kernel (``FUSION_COMPILER_TILES=0``) stores the
    transposed output 4 bytes at a time, one element per sector of each warp's store."""
    if not tiled:
        monkeypatch.setenv("FUSION_COMPILER_TILES", "0")

    def fn(x):
        y = torch.nn.functional.silu(x)
        return y.transpose(1, 2).contiguous(), y
    specs = launches(fn, (torch.randn(2, 128, 96, device=device),), monkeypatch)
    ptx = ptx_of(specs, tmp_path)
    stores = re.findall(r"st\.global[.\w]*", ptx)
    if tiled:
        assert stores and all(".v4." in s for s in stores), stores
        assert "ld.global.v4" in ptx and "bar.sync" in ptx
    else:
        assert any(".v4." not in s for s in stores), stores


@pytest.mark.parametrize("tiled", [True, False], ids=["tiles", "consecutive rows"])
def test_a_row_kernel_read_along_another_row_dim_loads_vectors_from_tiles(
        cache_dir, tmp_path, device, monkeypatch, tiled):
    """A cumsum over l2 of rows [b, h, l] of an fp32 [b, l2, l, h] tensor (h contiguous),
    stored along its rows and along l: with tiles of rows (codegen/tiles.py) the read walks h in
    16-byte vectors, its values reordered through shared memory; with consecutive rows
    (``FUSION_COMPILER_TILES=0``) each element of the read is a 4-byte load of its own."""
    if not tiled:
        monkeypatch.setenv("FUSION_COMPILER_TILES", "0")

    def fn(x):
        y = torch.cumsum(x.permute(0, 3, 2, 1), dim=-1)
        return y.contiguous(), torch.exp(y).transpose(-1, -2).contiguous()
    specs = launches(fn, (torch.randn(2, 32, 64, 16, device=device),), monkeypatch)
    text = Path(specs[0]["path"]).read_text()
    assert ("fl.swap_rows(tl.load(" in text) == tiled
    ptx = ptx_of(specs, tmp_path)
    loads = re.findall(r"ld\.global[.\w]*", ptx)
    stores = re.findall(r"st\.global[.\w]*", ptx)
    assert stores and all(".v4." in s for s in stores), stores
    if tiled:
        assert loads and all(".v4." in s for s in loads), loads
    else:
        assert any(".v4." not in s for s in loads), loads
