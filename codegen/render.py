"""The Triton module of one fused group: which kernels it has (pointwise, persistent, looped or
resident, split stages, multi-part), their source (codegen/kernel_source.py), and the host
launcher around them (codegen/launcher.py).

The layout follows the Triton tutorials (02-fused-softmax, 05-layer-norm): one program per block
of rows (row kernels) or per block of elements (pointwise kernels), masks on every load and
store, fp32 math, a header comment naming the fused ops and the estimated bytes.
"""
from __future__ import annotations

import re

import sympy

from . import launch as rules
from .kernel_ir import KernelIR, NotFusable, ref_id
from .kernel_source import render_kernel
from .launcher import render_launcher, row_inplace_outputs
from .lower import Lowering, iteration_space
from .lowered import GATHERS, SCANS
from .multipart import split
from .resident import NotHeld
from .row_loops import partial_slots
from .statements import element_registers, late_loads, strided_kind


def generate(ir: KernelIR, hints: dict, title: str, max_persistent_block: int,
             max_resident_row: int = 0, tiles: bool = True) -> str:
    """Full source of the module for one fused group. A row longer than
    ``max_persistent_block`` (as a power of two) is held in registers by the resident kernel
    where it is static and at most ``max_resident_row`` long, else streamed by the looped
    kernel; few such rows are split across programs (the split stages). ``tiles``: pointwise
    kernels may take 2-d tiles (codegen/tiles.py)."""
    parts = multipart_parts(ir)
    if parts is not None:
        return _generate_multipart(ir, parts, hints, title, tiles)
    kind, shape = iteration_space(ir)
    kernels = []
    late = []               # a persistent kernel's loads after its reduction (HOIST)
    strided = 0             # its rows' elements lie apart, consecutive rows side by side (launcher)
    partials = 0            # a looped kernel's reductions: the split stages' partials a row
    reuse = None            # a persistent kernel's outputs over dead inputs (launcher.py)
    looped_block = rules.LOOPED_RBLOCK      # a looped kernel's step (launch.row_limits)
    tiling = {} if tiles else None      # a tiled pointwise kernel's cap on BLOCK (tiles.py)
    if kind == "pointwise":
        kernels.append(("pointwise", render_kernel(Lowering(ir, hints, True).run(),
                                                   "_pointwise_kernel", tiling=tiling)))
    else:
        n = shape[-1]
        held, looped, max_persistent_block, looped_block = lower_rows(
            ir, hints, n, max_persistent_block, tiles)
        if held is not None:
            late = late_loads(held)
            strided = strided_kind(held)
            # tiles of rows only where no looped kernel shares the launcher's settings
            kernels.append(("persistent", render_kernel(
                held, "_persistent_kernel", late=late, strided=strided,
                tiling=tiling if looped is None else None)))
            # each row read once, before it is written (the launcher hands over no input
            # where it picks the looped kernel beside it, for a long row)
            reuse = row_inplace_outputs(held)
        if looped is not None:
            resident = None
            if n.is_Integer and looped_block == rules.LOOPED_RBLOCK \
                    and rules.resident(int(n), max_persistent_block, max_resident_row):
                # the persistent lowering: the row's values live in registers, each computed once
                try:
                    resident = render_kernel(Lowering(ir, hints, True).run(), "_resident_kernel")
                except NotHeld:
                    pass
            if resident is not None:
                kernels.append(("resident", resident))
            else:
                kernels.append(("looped", render_kernel(looped, "_looped_kernel")))
            # the same rows split across programs, one kernel per phase (few long rows)
            kernels += [(f"split{s}", render_kernel(looped, f"_split{s}_kernel", stage=s))
                        for s in range(len(looped.phases))]
            partials = partial_slots(looped.phases)
    header = _header(ir, title, kind)
    body = "\n\n".join(src for _, (src, _) in kernels)
    launcher = render_launcher(ir, kind, shape, {name: args for name, (_, args) in kernels},
                                max_persistent_block, bool(late), strided,
                                partials, reuse, looped_block, tiling and tiling.get("cap"),
                                tiling and tiling.get("rows"))
    if strided:
        launcher = f"STRIDED = {strided}\n\n\n" + launcher
    return f"{header}\n{_IMPORTS}\n\n{body}\n\n{launcher}\n"


def lower_rows(ir: KernelIR, hints: dict, n, max_persistent_block: int, tiles: bool):
    """(held, looped, max_persistent_block, looped_block) of a row kernel over rows of ``n``:
    the persistent lowering where a program holds the row (else None), the looped one where
    the row is streamed (else None; symbolic rows get both, the launcher picks), the block
    past which rows loop and the looped kernel's step. Legality calls it too, so a group it
    passes is one the generator makes (NotFusable propagates)."""
    scans = any(op.target in SCANS for op in ir.ops)
    looped_block = rules.LOOPED_RBLOCK
    if n.is_Integer and scans:
        # a scan holds its row in one block (the lowering refused longer or symbolic rows)
        max_persistent_block = max(max_persistent_block, rules._next_pow2(int(n)))
    fits = n.is_Integer and rules._next_pow2(int(n)) <= max_persistent_block
    held = Lowering(ir, hints, True, tiles).run() if not n.is_Integer or fits else None
    looped = None if fits else Lowering(ir, hints, False).run()
    if not scans:
        # elements too heavy for a thread to hold a whole row of them: the looped kernel,
        # in steps that fit (launch.row_limits)
        max_persistent_block, looped_block = rules.row_limits(
            int(n) if n.is_Integer else None, element_registers(held or looped),
            max_persistent_block)
        if fits and rules._next_pow2(int(n)) > max_persistent_block:
            held, looped = None, Lowering(ir, hints, False).run()
    return held, looped, max_persistent_block, looped_block


def multipart_parts(ir: KernelIR):
    """The parts of ``ir`` if it is several independent pointwise computations of different
    shapes (see codegen/multipart.py), else None (``ir`` is one kernel, or not fusable)."""
    try:
        iteration_space(ir)
        return None
    except NotFusable:
        pass
    parts = split(ir)
    if len(parts) < 2:
        return None
    for sub, _, _ in parts:
        if iteration_space(sub)[0] != "pointwise":       # NotFusable propagates
            raise NotFusable("parts of a multi-part kernel must be pointwise")
    return parts


def _generate_multipart(ir: KernelIR, parts, hints: dict, title: str, tiles: bool) -> str:
    sources, calls, runtime = [], [], set()
    shapes, caps = [], []
    for i, (sub, inputs, positions) in enumerate(parts):
        tiling = {} if tiles else None
        src, size_args = render_kernel(Lowering(sub, hints, True).run(), f"_part{i}", part=True,
                                       tiling=tiling)
        caps += [tiling["cap"]] if tiling else []
        sources.append(src)
        runtime |= set(size_args)
        args = ([f"in{j}" for j in inputs] + [f"out{p}" for p in positions] + size_args)
        calls.append(args)
        shapes.append(iteration_space(sub)[1])
    runtime = sorted(runtime, key=lambda k: int(k[1:]))
    params = [f"in{i},  # {v.dtype} {list(v.shape)}" for i, v in enumerate(ir.inputs)]
    params += [f"out{p},  # {ir.values[o].dtype} {list(ir.values[o].shape)}"
               for p, o in enumerate(ir.outputs)]
    params += [f"{k}," for k in runtime]
    params += [f"numel{i}," for i in range(len(parts))]
    params += ["BLOCK: tl.constexpr, INDEX64: tl.constexpr,"]
    lines = ["pid = tl.program_id(0)"]
    starts = []
    for i in range(1, len(parts)):
        prev = f"start{i - 1} + " if i > 1 else ""
        lines.append(f"start{i} = {prev}tl.cdiv(numel{i - 1}, BLOCK)")
        starts.append(f"start{i}")
    for i, args in enumerate(calls):
        offset = f"pid - start{i}" if i else "pid"
        call = f"_part{i}({', '.join(args + [offset, f'numel{i}', 'BLOCK', 'INDEX64'])})"
        if i == len(parts) - 1:
            lines += (["else:"] if i else []) + [("    " if i else "") + call]
        else:
            lines += [f"{'if' if i == 0 else 'elif'} pid < start{i + 1}:", "    " + call]
    sig = "\n".join("    " + p for p in params)
    code = "\n".join("    " + ln for ln in lines)
    wrapper = f"@triton.jit\ndef _multipart_kernel(\n{sig}\n):\n{code}"
    header = _header(ir, title, f"multi-part: {len(parts)} parts")
    launcher = render_launcher(ir, "multipart", shapes, {"multipart": runtime}, 0,
                               block_cap=min(caps) if caps else None)
    body = "\n\n".join(sources + [wrapper])
    return f"{header}\n{_IMPORTS}\n\n{body}\n\n{launcher}\n"


_IMPORTS = """import torch
import triton
import triton.language as tl

from fusion_compiler.codegen import triton_lib as fl
from fusion_compiler.codegen.launch import (FAST_ALLOC, current_device, empty_cuda, first_launch,
                                            few_programs, launch_static, pointwise_settings,
                                            raw_stream, reinterpret, row_settings,
                                            split_settings)
"""


_MOVED = re.compile(r"^# bytes moved: (\d+) read \+ (\d+) written$", re.M)


def bytes_moved(source: str):
    """The bytes a generated module's kernel reads and writes, summed, from its header
    (``_header``); None where they are symbolic."""
    m = _MOVED.search(source)
    return None if m is None else int(m.group(1)) + int(m.group(2))


def _header(ir, title, kind):
    """Header comment; a function of the IR alone, so one cache key has one source."""
    def nbytes(values):
        return sympy.simplify(sum((sympy.Mul(*v.shape) * v.dtype.itemsize for v in values),
                                  sympy.Integer(0)))
    tables = {ref_id(op.args[0]): ir.values[len(ir.inputs) + j]
              for j, op in enumerate(ir.ops) if op.target in GATHERS}
    # a table is read by rows: at most what the gather produces
    read = nbytes(tables.get(i, v) for i, v in enumerate(ir.inputs))
    written = nbytes(ir.values[o] for o in ir.outputs)
    names = [op.target.replace("aten.", "").replace("prims.", "") for op in ir.ops]
    lines = [f"# fusion-compiler: {title} ({kind} kernel)",
             f"# fused ops ({len(names)}): " + ", ".join(names),
             f"# bytes moved: {read} read + {written} written"]
    return "\n".join(lines)
