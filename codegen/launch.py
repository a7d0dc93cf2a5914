"""Launch settings shared by every generated launcher: block sizes, warps, looped or not.

One place decides them (Liger-Kernel's ``calculate_settings`` idea), so tuning them tunes every
kernel. They depend on sizes known only at run time, and are cheap: a few integer operations.
"""
from __future__ import annotations

import functools
import types

import torch
from triton import knobs

from .triton_lib import INTERPRET

LOOPED_RBLOCK = 2048        # columns per loop step of a looped row kernel
ROW_ELEMS = 2048            # elements a persistent row program aims to hold (rows x RBLOCK);
                            # softmax rows of 1024 on the H200: 2 rows, 4 warps 101% of the
                            # floor, 4 rows, 8 warps 98%
STRIDED_ELEMS = 8192        # elements a program may hold where a row's elements lie apart and
STRIDED_PROGRAMS_PER_SM = 4  # consecutive rows side by side (a norm over NCHW channels), while
                            # the grid keeps this many programs an SM (row_settings)
POINTWISE_BLOCK = 2048      # bias+GELU 16384 x 11008 on the H200: 91% of the floor at 1024, 97%
PROGRAM_BYTES = 4096        # bytes of full-size inputs a pointwise program aims to load (below)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _warps(elems: int) -> int:
    """Warps of a row program holding ``elems`` (a power of two) elements. 4096 on 4 warps, not
    8: rows of 4096 on the H200 (16384 rows, do_bench, same run) ran add+RMSNorm at 96.0% of
    the floor against 94.2%, RMSNorm+FP8 89.4 / 88.1, dynamic FP8 84.2 / 81.5
    (benchmarks/variants.py)."""
    if elems >= 32768:
        return 32
    if elems >= 8192:
        return 16
    if elems >= 512:
        return 4
    return 2


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    """Streaming multiprocessors of the current GPU (the H200's 132 in the interpreter)."""
    if LEAN:
        return torch.cuda.get_device_properties(current_device()).multi_processor_count
    return 132


FEW_PROGRAMS_PER_SM = 4     # at most this many programs per SM: a grid bound by latency


@functools.lru_cache(maxsize=1024)
def few_programs(grid: int) -> bool:
    """Whether a grid of ``grid`` programs has at most ``FEW_PROGRAMS_PER_SM`` per SM (528 on
    the H200): its programs wait on memory latency more than they share the bandwidth, so each
    should have its loads in flight early (row kernels: HOIST, codegen/kernel_source.py)."""
    return grid <= FEW_PROGRAMS_PER_SM * _sm_count()


@functools.lru_cache(maxsize=1024)
def row_settings(rows: int, n: int, max_persistent_block: int, strided: int = 0,
                 looped_block: int | None = None):
    """(XBLOCK, RBLOCK, looped, num_warps) for a row kernel over ``rows`` rows of ``n``. A
    row longer than ``max_persistent_block`` loops in steps of ``looped_block`` (default
    ``LOOPED_RBLOCK``; less for heavy elements, ``row_limits``).
    ``strided``: the row's elements lie apart in memory and consecutive rows side by side
    (statements.strided_rows), so a program's load of a column reads a contiguous run of XBLOCK
    elements: the rows a program takes are doubled while it holds at most ``STRIDED_ELEMS``
    elements and the grid keeps ``STRIDED_PROGRAMS_PER_SM`` programs an SM; 8 warps at 8192
    elements, 4 for ``strided`` 1 (statements.strided_kind: a kernel that only reduces one
    such load, or a norm, whose per-element outputs follow the row's reductions), 8 for 2
    (column sums of several loads, per-element outputs beside a column sum).
    ConvNeXt-T's LayerNorms at batch 32 on the H200 (benchmarks/strided_rows.py,
    do_bench, us; the rule without ``strided`` / this rule / the sweep's best): channels of 96
    46.0 / 29.2 / 28.3, 192 21.8 / 15.9 / 14.0, 384 29.5 / 11.2 / 9.0, 768 9.0 / 9.0 / 9.0.
    Since the rows load in 16-byte vectors (a literal row count in the mask, session 27): this
    rule 24.2 / 13.1 / 9.0 / 8.3, the sweep's best 22.1 / 10.8 / 7.4 / 6.9 (4 warps, more rows
    a program). A channels-last BatchNorm's statistics (one such load: a chunk's mean and
    squared deviations, ``decompositions.var_mean_correction``) at 8192 elements a program, bf16
    [128, 256, 56, 56] on the H100 (scratch/bns/bnstats.py, profiler, session 53): 8 warps
    131.6 us, 4 warps 85.9 (Inductor's 86.5; a hand-written kernel 87.3 at 4 and 128.7 at 8);
    16384 elements on 8 warps 107.0, on 16 199.2. The other kernels (session 54, H100,
    scratch/bns/bnbwd.py, profiler, 8 / 4 warps, us): ConvNeXt-T's LayerNorms over NCHW
    channels, batch 32, forward: channels of 96 22.0 / 18.8, 192 10.5 / 8.3, 384 6.1 / 6.1;
    their input's gradient 34.7 / 25.8 and 12.9 / 10.9 (norms: 1). BatchNorm's backward column
    sums (two and three such loads) at [128, 64, 112, 112] 130.8 / 131.3 and 160.5 / 157.2, at
    [128, 256, 56, 56] 131.5 / 132.9 and 160.9 / 161.1: the same. GPT-2's and BERT's training
    steps with every kind on 4 (benchmarks/strided_rules.py --step, two rounds, fused kernels'
    time): 1872 / 1875 against 1786 / 1803 us, and 1782 / 1777 against 1748 / 1743: their
    column sums of several loads and their GELU gradients beside a column sum keep 8 (2).
    Kept on whole training steps (benchmarks/strided_rules.py --step, fused
    kernels per step, us; this rule / 8192 at 1.5 programs an SM on 4 warps / 16384 at 1.5 on
    4 / 16384 at 4 on 4): GPT-2 8 x 512 1680 / 1758 / 2331 / 2319, BERT 16 x 256 1642 / 1847 /
    2186 / 2019, though 8192 at 1.5 was as fast or faster on ConvNeXt and the column sums alone.

    A grid of at most 4 programs per SM gets twice the warps (4 -> 8 for rows of 4096): with
    few rows in flight, more warps per row keep more loads in flight. add+RMSNorm over rows of
    4096 on the H200, kernel time after an L2 flush (benchmarks/sweep_settings.py
    --kernel-time), 4 / 8 warps: 64 rows 3.0 / 2.5 us, 256 rows 4.4 / 4.2 us, 512 rows
    6.0 / 5.7 us; 1024 rows (7.8 programs per SM) 9.7 / 10.5 us."""
    rblock = _next_pow2(max(n, 1))
    if rblock > max_persistent_block:
        return 1, looped_block or LOOPED_RBLOCK, True, 8
    xblock = min(_next_pow2(rows), max(1, ROW_ELEMS // rblock))
    if strided:
        least = STRIDED_PROGRAMS_PER_SM * _sm_count()
        while 2 * xblock * rblock <= STRIDED_ELEMS and -(-rows // (2 * xblock)) >= least:
            xblock *= 2
        return xblock, rblock, False, 8 if xblock * rblock >= 8192 and strided != 1 else 4
    warps = _warps(xblock * rblock)
    if xblock * rblock >= 2048 and few_programs(-(-rows // xblock)):
        warps = min(2 * warps, 32)
    return xblock, rblock, False, warps


# a row longer than a persistent program's block, short enough to stay in registers, is held
# by one program as static chunks of RESIDENT_RBLOCK columns on RESIDENT_WARPS warps (the
# resident kernel, codegen/kernel_source.py): read once, where a looped kernel reads it once a pass.
# H200, one program a row, kernel time after an L2 flush (benchmarks/resident_variants.py),
# us: softmax 4096 x 50257 273 (13 chunks of 4096 on 32 warps; eager 361, the looped kernel
# 410, Inductor 561), 8192 x 30522 383 (looped 463), 2048 x 32768 93 (looped 98); chunks of
# 8192 spilled (372 us at 50257), chunks of 2048 or 16 warps were slower (292, 302)
RESIDENT_RBLOCK = 4096
RESIDENT_WARPS = 32
# most chunks x fp32 values an element keeps (resident._held_values). 64 registers a thread on
# 32 warps, spill instructions in the SASS (sm_90, CPU, benchmarks/resident_registers.py):
# bf16 rows of about 50000, 13 chunks: softmax (x 1) 4, RMSNorm and add+RMSNorm (x 1) 0,
# add+LayerNorm (x 1) 17, x + r + s then RMSNorm (x 1.5) 1; fp32 add+LayerNorm over 40000
# (10 x 2) 2. On the H200 the add+LayerNorm's 17 cost nothing visible: 123 us held against
# 165 looped (Inductor 153); written before the later phases took a chunk at a time, its
# weight and bias held for every chunk, it spilled 184 and took 221 us
RESIDENT_VALUES = 20


# registers an element of a row kernel's block takes for its loads (statements.element_registers),
# times the elements a thread holds, most: a persistent program's whole row, a looped program's
# step. ResNet-50's stem backward at batch 128 (BatchNorm's backward, ReLU's and the max pool's,
# 19 registers an element with int64 indexes: the pool's four windows' index, code and
# gradient) spilled 764 registers held whole (rows of 12544 on 16 warps: 32 elements a thread)
# and took 12.9 ms on the H200, 134 looped in steps of 2048 on 8 warps (3.7 ms, two passes);
# ATen's pool and the row kernel without it 1.1 ms + 0.27 ms; in steps of 1024, one pass,
# 1.3 ms. Compared in int32 (16 an element), compiled for sm_90 on the CPU (scratch/regs.py):
# held whole 337 spill instructions; steps of 2048 234 registers, 1024 128 (two 8-warp
# programs an SM), 512 75. Other kernels of the zoo take at most 15 an element.
PERSISTENT_ELEMENT_REGISTERS = 384
LOOPED_ELEMENT_REGISTERS = 96


def row_limits(n, registers: int, max_persistent_block: int):
    """(max_persistent_block, looped_block) for a row kernel over rows of ``n`` (static:
    an int) whose elements' loads take ``registers`` registers each: a row whose persistent
    program would hold more than ``PERSISTENT_ELEMENT_REGISTERS`` a thread loops instead, in
    steps of at most ``LOOPED_ELEMENT_REGISTERS`` a thread (at least 256 columns)."""
    step = LOOPED_RBLOCK
    while step > 256 and step // (32 * 8) * registers > LOOPED_ELEMENT_REGISTERS:
        step //= 2
    if isinstance(n, int):
        block = _next_pow2(n)
        if block <= max_persistent_block \
                and max(1, block // (32 * _warps(block))) * registers > PERSISTENT_ELEMENT_REGISTERS:
            max_persistent_block = block // 2
    return max_persistent_block, step


def resident(n: int, max_persistent_block: int, max_resident_row: int) -> bool:
    """Whether a static row of ``n`` elements is held by the resident kernel: longer than a
    persistent program's block, at most ``max_resident_row`` with the up to 7 columns read
    before it (a row read from its 16 bytes)."""
    return _next_pow2(n) > max_persistent_block and n + 7 <= max_resident_row


def resident_fits(chunks: int, values: float) -> bool:
    """Whether ``chunks`` chunks of ``values`` fp32 values an element fit the registers."""
    return chunks * values <= RESIDENT_VALUES


def resident_chunks(n: int, pad: int = 0) -> int:
    """Chunks of ``RESIDENT_RBLOCK`` columns holding a row of ``n`` elements read from ``pad``
    columns before its first (a row read from its first element rounded down to 16 bytes)."""
    return -(-(n + pad) // RESIDENT_RBLOCK)


# a looped kernel's rows are split until the grid has this many programs an SM: the stages
# stream from HBM, and more programs keep more bytes in flight (the VAE's GroupNorm + SiLU,
# 32 rows of 1048576, H200, kernel time: 4 an SM 82.0 us, 8 69.1, 16 on 4 warps 68.0,
# Inductor 73.2; 32 rows of 524288: 39.6, 38.8, 39.9, Inductor 40.7; long_rows.py --variants)
SPLIT_PROGRAMS_PER_SM = 8
SPLIT_MIN_CHUNK = 4 * LOOPED_RBLOCK     # columns a chunk takes at least
SPLIT_RBLOCK = LOOPED_RBLOCK            # columns a split program's loop step takes
SPLIT_WARPS = 8


@functools.lru_cache(maxsize=1024)
def split_settings(rows: int, n: int, step: int | None = None):
    """(S, CHUNK, SBLOCK, RBLOCK, num_warps) for a looped row kernel over ``rows`` rows of
    ``n``, or None: each row is split into S chunks of CHUNK columns (a multiple of the loop's
    step RBLOCK: ``step``, default ``SPLIT_RBLOCK``), one program each, where one program a row
    leaves SMs idle (a VAE's GroupNorm: 32 rows of 262144 elements on 132 SMs); SBLOCK is S as a power of two. None where a row
    makes fewer than two chunks, or there are as many rows as SMs: one program a row (the
    looped kernel). The stages cost a launch each: a UNet's GroupNorm at batch 8 (256 rows of
    20480) ran its kernels in 19.5 us split in two against 14.7 us looped (H200, profiler,
    benchmarks/long_rows.py); 32 rows of 262144, 23.3 against 115.1."""
    if rows >= _sm_count():
        return None
    want = -(-SPLIT_PROGRAMS_PER_SM * _sm_count() // rows)
    s = min(want, n // SPLIT_MIN_CHUNK)
    if s < 2:
        return None
    chunk = -(-n // s)
    step = step or SPLIT_RBLOCK
    chunk = -(-chunk // step) * step
    s = -(-n // chunk)
    return s, chunk, _next_pow2(s), step, SPLIT_WARPS


@functools.lru_cache(maxsize=1024)
def pointwise_settings(numel: int, stream_bytes: int = 2):
    """(BLOCK, num_warps) for a pointwise kernel over ``numel`` elements that loads
    ``stream_bytes`` bytes per element from inputs as large as its output (broadcast operands
    such as a bias not counted). A program loads about ``PROGRAM_BYTES`` of them: 2048
    elements of one bf16 stream, 1024 of two. 16384 x 11008 on the H200 (benchmarks/variants.py,
    same run, us): bias+GELU (one stream) 173.3 at 2048 against 184.4 at 1024; SwiGLU (two
    bf16 streams) 252.7 at 2048 against 252.0 at 1024 (Inductor's block, and its 251.7);
    dequant+add (int8 + bf16) level, 83.1-83.4. Small grids were tried and left: dequant+add
    over 64 x 4096 (128 programs of 2048 on 132 SMs) ran 1.9 us in blocks of 2048 and of 512
    alike (kernel time after an L2 flush, H200)."""
    block = POINTWISE_BLOCK
    if stream_bytes * block > PROGRAM_BYTES:
        block //= 2
    block = min(block, _next_pow2(numel))
    return block, max(1, min(4, block // 128))


# ---------------------------------------------------------------------------------- lean launches
# Triton's `kernel[grid](...)` binds and specializes every argument on each call (microseconds
# each, the whole cost of a small kernel). A generated launcher goes through it once per
# specialization and then calls the compiled kernel directly; its key refines Triton's own:
# 16-byte alignment of each input pointer, % 16 and == 1 of each specialized integer, the
# constexprs, the warps, 64-bit indexing, the device. Not in the interpreter, and not while
# Triton launch hooks are set (a profiler such as proton must see every launch).
LEAN = not INTERPRET and torch.cuda.is_available()
current_device = torch._C._cuda_getDevice if LEAN else (lambda: 0)
raw_stream = torch._C._cuda_getCurrentRawStream if LEAN else None
# Outputs on the current GPU are allocated by the C++ fast path Inductor's wrappers use too
# (torch.empty_strided parses its arguments and the device on every call: microseconds a launch)
empty_cuda = getattr(torch._C._dynamo.guards, "_empty_strided_cuda", None) if LEAN else None
FAST_ALLOC = empty_cuda is not None
# An output written over a dead input (launcher.inplace_outputs) is that input's memory at the
# output's size and strides, made as Inductor's code makes its reused buffers: a tensor of its
# own over the same storage, which autograd does not track as a view (0.6 us against 1.4 for
# ``view`` on the development CPU). A view would do the same work, but a graph output that is
# a view of a tensor made inside the graph is marked, once aot_autograd's function returns it,
# the view of a function with several outputs, and an in-place write into it then fails
# (wav2vec2's masked time steps, written into the projection's output after a graph break).
reinterpret = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", None) or (
    lambda t, size, stride, offset: t.as_strided(size, stride, t.storage_offset() + offset))


def remember(table: dict, key: tuple, kernel) -> None:
    """Keep ``kernel`` (what ``kernel[grid](...)`` returned) for direct relaunches under ``key``,
    as ``direct_entry`` makes it."""
    rt = knobs.runtime
    if (LEAN and kernel is not None and getattr(kernel, "function", None) is not None
            and not _hooked(rt.launch_enter_hook) and not _hooked(rt.launch_exit_hook)):
        table[key] = direct_entry(kernel)


def direct_entry(kernel) -> tuple:
    """``(launch, function, cooperative, pdl, metadata, kernel)``; a launcher relaunches with
    ``e[0](grid, 1, 1, stream, e[1], e[2], e[3], None, None, e[4], None, None, None, *args)``,
    Triton's C launch function's own arguments. Where the kernel needs no scratch memory and
    its launcher is that C function, ``e[0]`` is it: the Python of ``CompiledKernel.run`` and
    ``CudaLauncher.__call__`` (two frames and two scratch checks on every launch) is skipped.
    Otherwise ``e[0]`` goes through them, as Triton's own launches do."""
    launcher = kernel.run                       # a property: loads the kernel if need be
    c_launch = getattr(launcher, "launch", None)
    if (isinstance(c_launch, types.BuiltinFunctionType)
            and getattr(launcher, "global_scratch_size", 1) == 0
            and getattr(launcher, "profile_scratch_size", 1) == 0):
        return (c_launch, kernel.function, bool(launcher.launch_cooperative_grid),
                bool(launcher.launch_pdl), kernel.packed_metadata, kernel)

    def through_triton(gx, gy, gz, stream, function, _cooperative, _pdl, _gscratch, _pscratch,
                       *rest):
        kernel.run(gx, gy, gz, stream, function, *rest)
    return (through_triton, kernel.function, False, False, kernel.packed_metadata, kernel)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None, or (Triton 3.5+) an empty HookChain, is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


# ------------------------------------------------------------------------------- static launches
# Triton launches a kernel through a C module made for its argument signature, built by a C
# compiler on a cold cache (about 0.3 s each; GPT-2's first call built 15). torch ships one
# launcher for every signature (the one Inductor uses): it takes the argument types as a string.
# A kernel that fits it (no scratch memory, one CTA, no cooperative or PDL launch) is compiled
# with ``warmup``, never loaded by Triton, and launched by torch's: no C compiler runs for it.
_STATIC = getattr(torch._C, "_StaticCudaLauncher", None) if LEAN else None
launch_static = _STATIC._launch_kernel if _STATIC is not None else None
_ARG_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B",
              "u16": "H", "u32": "I", "u64": "K", "fp32": "f", "f32": "f", "fp64": "d"}


def first_launch(table: dict, key: tuple, kernel, grid: int, *args, **kwargs) -> None:
    """The first launch of ``kernel`` (a JITFunction) under ``key``: ``args`` are its
    non-constexpr arguments (tensors for pointers), ``kwargs`` its constexprs and options.
    Keeps, under ``key``, what relaunches it: ``static_entry``'s, or ``direct_entry``'s."""
    rt = knobs.runtime
    if (_STATIC is not None and not _hooked(rt.launch_enter_hook)
            and not _hooked(rt.launch_exit_hook)):
        # None where Triton's interpreter was turned on after this module loaded (warmup
        # compiles nothing there): Triton launches it, on the CPU
        compiled = kernel.warmup(*args, grid=(grid,), **kwargs)
        entry = static_entry(compiled, len(args)) if compiled is not None else None
        if entry is not None:
            table[key] = entry
            values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
            launch_static(entry[1], grid, 1, 1, entry[2], entry[3], entry[4],
                          values + entry[5], raw_stream(current_device()))
            return
    remember(table, key, kernel[(grid,)](*args, **kwargs))


def static_entry(compiled, nargs: int):
    """``(None, function, num_warps, shared, arg_types, extra, compiled)`` for torch's
    launcher, which a generated launcher calls as ``launch_static(e[1], grid, 1, 1, e[2],
    e[3], e[4], (*args, *e[5]), stream)``; or None where the kernel does not fit it (then
    Triton launches it). ``None`` first tells it from ``direct_entry``'s."""
    types_ = fits_static(compiled, nargs)
    if types_ is None:
        return None
    md = compiled.metadata
    cubin = next(p for name, p in compiled.metadata_group.items() if name.endswith(".cubin"))
    loaded = _STATIC._load_kernel(cubin, md.name, md.shared, current_device())
    function, registers = loaded[-3], loaded[-2]     # torch 2.12+ puts the module first
    if registers * md.num_warps * 32 > 65536:
        return None             # more registers than a block has: Triton says so, and why
    # Triton 3.3+ kernels take a pointer per kind of scratch memory, here null
    extra = tuple(None for name in ("global_scratch_size", "profile_scratch_size")
                  if hasattr(md, name))
    arg_types = "".join("O" if t[0] == "*" else _ARG_TYPES[t] for t in types_) + "O" * len(extra)
    return (None, function, md.num_warps, md.shared, arg_types, extra, compiled)


def fits_static(compiled, nargs: int):
    """The types of the ``nargs`` arguments of Triton's ``compiled`` kernel if torch's launcher
    can launch it, else None."""
    md = compiled.metadata
    if (_STATIC is None or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "num_ctas", 1) != 1
            or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False)
            or md.shared > _max_shared(current_device())
            or not any(name.endswith(".cubin") for name in compiled.metadata_group)):
        return None
    types_ = [t for t in compiled.src.signature.values() if t != "constexpr"]
    if len(types_) != nargs or not all(t[0] == "*" or t in _ARG_TYPES for t in types_):
        return None          # an integer argument specialized away (== 1), or an odd type
    return types_


@functools.lru_cache(maxsize=None)
def _max_shared(device: int) -> int:
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device)["max_shared_mem"]
