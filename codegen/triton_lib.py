"""Small Triton helpers the generated kernels call as ``fl.NAME``.

On the GPU the transcendental helpers are libdevice's. Triton's interpreter (TRITON_INTERPRET=1,
used by the CPU tests) has no libdevice, so there they are written from the primitives it has.
"""
import contextlib
import logging
import os
import sys
import types

import triton
import triton.language as tl

log = logging.getLogger("fusion_compiler")


def _requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's own jit functions (tl.sum, tl.max, ...) were made for the interpreter: only when
# TRITON_INTERPRET was set before Triton was imported. Set later, the interpreter cannot call
# them ("Cannot call @triton.jit'd outside of the scope of a kernel").
LANGUAGE_INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"
_said_late = False


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: TRITON_INTERPRET, read now, where
    Triton's language was imported for it (else False, with a warning once: kernels run
    compiled, on the GPU, and CPU tensors on ATen)."""
    if not _requested():
        return False
    if LANGUAGE_INTERPRETED:
        return True
    global _said_late
    if not _said_late:
        _said_late = True
        log.warning("fusion-compiler: TRITON_INTERPRET=1 was set after Triton was imported, "
                    "so Triton's own functions (tl.sum, ...) were built for the GPU and its "
                    "interpreter cannot run them: kernels run compiled and CPU tensors on "
                    "ATen. Set TRITON_INTERPRET=1 before importing torch or triton to run "
                    "the kernels in the interpreter.")
    return False


INTERPRET = _requested()        # the mode this module's jit functions were made for

if INTERPRET:
    from .interpreter_patch import (bool_results, cache_dtype_lookup, live_asserts,
                                    skip_nested_patching)
    skip_nested_patching()      # every generated kernel calls these helpers: ~2 ms a call less
    cache_dtype_lookup()
    bool_results()              # masks typed int1 hold booleans (interpreter_patch.py)
    live_asserts()              # tl.device_assert tested, as on the GPU with debug


@triton.jit
def max_combine(a, b):
    """max that propagates NaN, as torch.amax does (one max.NaN instruction on the GPU; a
    compare-and-select combine cost softmax 7% of the bandwidth floor on the H200)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def lse_step(s, m, m_next, x):
    """A lane's sum of exp(x - its max) (the online softmax), its max going from ``m`` to
    ``m_next`` (``x`` included): the sum so far rescaled, plus this element's term. 0 while the
    lane has seen only -inf (masked columns); NaN from a NaN or a +inf, as eager's sum."""
    return tl.where(m_next == float("-inf"), 0.0, s * tl.exp(m - m_next) + tl.exp(x - m_next))


@triton.jit
def lse_terms(s, m, row_max):
    """Lanes' (or chunks') sums of exp(x - their max ``m``) brought to the row's max."""
    return tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max))


@triton.jit
def lse_guard(total, row_max):
    """A row of -inf only sums exp(-inf - -inf): NaN, as eager's."""
    return tl.where(row_max == float("-inf"), float("nan"), total)


@triton.jit
def welford_counts(span, RBLOCK: tl.constexpr, skip):
    """The elements each lane of a looped row's Welford update took, [1, RBLOCK]: lane j of a
    loop over ``span`` columns in steps of RBLOCK, one a step while inside, less its first
    step where ``j < skip`` (a shifted row's lanes before the row's start)."""
    lane = tl.arange(0, RBLOCK)[None, :]
    taken = tl.maximum(span - lane + RBLOCK - 1, 0) // RBLOCK - (lane < skip).to(tl.int32)
    return taken.to(tl.float32)


@triton.jit
def chan_mean(n, k, a, total, axis: tl.constexpr):
    """The mean of ``total`` elements held as lanes (or chunks) of ``n`` elements whose mean is
    ``k + a`` (a lane's first element and its mean less it), over ``axis`` (kept), as
    ``(kr, c)``: a reference near it, and the mean less it. Each lane's ``k - kr`` is exact
    where the row is offset (both close), so ``c`` keeps the digits an offset of 1e4 would
    take from a sum of the means. Empty lanes (n = 0) count for nothing, whatever their k."""
    live = n > 0
    k = tl.where(live, k, 0.0)
    kr = tl.sum(n * k, axis, keep_dims=True) / total
    c = tl.where(live, (k - kr) + a, 0.0)
    return kr, tl.sum(n * c, axis, keep_dims=True) / total


@triton.jit
def welford_mean(kr, c, s, total):
    """A row's mean: Welford's (``kr + c``, chan_mean's) where finite, else its plain sum ``s``
    over ``total``: a row holding an infinity has a Welford mean of NaN (inf - inf in the
    update) where its sum is the infinity, as eager's mean is."""
    m = kr + c
    return tl.where(tl.abs(m) < float("inf"), m, s / total)


@triton.jit
def chan_m2(n, k, a, m2, mu, axis: tl.constexpr):
    """Chan's combination: the sum of squared deviations from ``mu`` (their combined mean) of
    lanes (or chunks) of ``n`` elements with mean ``k + a`` (as chan_mean's) and sum of squared
    deviations ``m2``, over ``axis`` (kept). A rounding of ``mu`` moves it to second order only:
    the lanes' deviations from the exact mean sum to 0."""
    d = tl.where(n > 0, (k - mu) + a, 0.0)
    return tl.sum(m2 + n * d * d, axis, keep_dims=True)


@triton.jit
def min_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


if INTERPRET:
    # The interpreter runs a reduction's combine function in Python, pair by pair: the masked
    # softmax fuzz test spent 16.8 of its 20 s there. tl.max and tl.min are numpy reductions;
    # a NaN anywhere in the row makes the result NaN, as max_combine's does.
    @triton.jit
    def _nan_where_held(x, r, axis: tl.constexpr):
        """``r``, a reduction of ``x`` over ``axis``, NaN where that row of ``x`` holds one."""
        if x.dtype.is_floating():
            return tl.where(tl.max((x != x).to(tl.int32), axis) > 0, float("nan"), r)
        return r

    @triton.jit
    def row_max(x, axis: tl.constexpr):
        return _nan_where_held(x, tl.max(x, axis), axis)

    @triton.jit
    def row_min(x, axis: tl.constexpr):
        return _nan_where_held(x, tl.min(x, axis), axis)
else:
    @triton.jit
    def row_max(x, axis: tl.constexpr):
        return tl.reduce(x, axis, max_combine)

    @triton.jit
    def row_min(x, axis: tl.constexpr):
        return tl.reduce(x, axis, min_combine)


@triton.jit
def swap_rows(x, A: tl.constexpr, B: tl.constexpr, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """``x`` as a [XBLOCK, RBLOCK] block whose rows are ordered ``a * B + b``, reordered to
    ``b * A + a`` (XBLOCK = A * B): a tiled row kernel's values between its two orders of the
    rows (codegen/tiles.py); a layout conversion through shared memory on the GPU."""
    x = tl.broadcast_to(x, [XBLOCK, RBLOCK])
    return tl.reshape(tl.permute(tl.reshape(x, [A, B, RBLOCK]), (1, 0, 2)), [XBLOCK, RBLOCK])


@triton.jit
def store_rows(ptr, value, mask, XBLOCK: tl.constexpr):
    """Store a row kernel's per-row ``value`` ([XBLOCK, 1], [1] or a scalar) at ``ptr`` under
    ``mask`` (both [XBLOCK, 1]) as a block of XBLOCK. Stored as a [XBLOCK, 1] block, two
    chains of per-row values that share an op (a = f(m), b = f(m - a), c = f(a); stores of b,
    a, c) fail Triton 3.6's TritonGPURemoveLayoutConversions ("operand #0 does not dominate
    this use", triton-lang/triton#8257): its coalescing gives the [XBLOCK, 1] stores a layout
    of their own, and rematerializing the chains in it misorders them. Fixed by Triton 3.9.
    Compiled for sm_90 with Triton 3.6 on the CPU, four exp values of a row's min in two
    dataflows, each order of their stores, at 5 block shapes and warp counts: 72 of 240
    kernels failed with [XBLOCK, 1] stores, none with 1-d ones (tests/test_row_outputs.py compiles such chains)."""
    ptr, value = tl.broadcast(ptr, value)      # a block of one ([1]) too: the rows' shape
    tl.store(tl.reshape(ptr, [XBLOCK]), tl.reshape(value, [XBLOCK]),
             mask=tl.reshape(mask, [XBLOCK]))


@triton.jit
def div_scale(b):
    """The power of two div.full.f32 scales a division's operands by: 1/4 for |b| > 2^126,
    2^24 for |b| < 2^-126, else 1 (NaN: 1)."""
    a = tl.abs(b)
    return tl.where(a > 8.507059173023462e37, 0.25, tl.where(a < 1.1754943508222875e-38,
                                                          16777216.0, 1.0))


if INTERPRET:
    @triton.jit
    def rsqrt(x):
        return tl.math.rsqrt(x)

    @triton.jit
    def div_recip(b, k):
        return b    # the GPU's reciprocal cannot be reproduced here: div_shared divides by b

    @triton.jit
    def div_shared(a, k, r):
        """a / b, with r = div_recip(b, k): exact here, as ``/`` is in the interpreter."""
        return a / r

    @triton.jit
    def round_fp16(x):
        return x.to(tl.float16).to(tl.float32)

    convert_fp16 = round_fp16   # on the GPU the two differ in what the compiler may fold

    # The interpreter truncates fp32 -> bf16; round to nearest even by hand, as the GPU does.
    @triton.jit
    def round_bf16(x):
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))

    convert_bf16 = round_bf16   # as convert_fp16

    # The interpreter's fp32 -> fp8 e4m3 conversion rounds ties away from even and gets carries
    # into the exponent wrong (124.5 -> 64). Round to nearest even by hand: scale |x| by the
    # quantum of its binade, round with the 1.5 * 2^23 trick, scale back, restore the sign.
    @triton.jit
    def round_fp8e4m3(x, SATURATE: tl.constexpr):
        a = tl.abs(x)
        bits = a.to(tl.uint32, bitcast=True)
        e = ((bits >> 23) & 0xFF).to(tl.int32) - 127
        e = tl.maximum(e, -6) - 3
        quantum = ((e + 127) << 23).to(tl.uint32).to(tl.float32, bitcast=True)
        r = ((a / quantum + 12582912.0) - 12582912.0) * quantum
        if SATURATE:
            r = tl.minimum(r, 448.0)
        else:
            r = tl.where(a > 464.0, float("nan"), r)
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)

    @triton.jit
    def store_bf16(x):
        return round_bf16(x).to(tl.bfloat16)

    @triton.jit
    def store_fp8e4m3(x, SATURATE: tl.constexpr):
        return _encode_fp8e4m3(round_fp8e4m3(x, SATURATE))

    @triton.jit
    def _encode_fp8e4m3(r):
        """Exactly representable fp32 -> e4m3fn, encoded by hand (the interpreter's conversion
        mangles NaN and signed zero)."""
        bits = r.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        a = tl.abs(r)
        e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        normal = (((e + 7) << 3) | ((a.to(tl.uint32, bitcast=True) >> 20) & 7).to(tl.int32)).to(tl.uint32)
        sub = (a * 512.0).to(tl.uint32)
        code = tl.where(a >= 0.015625, normal, sub)
        code = tl.where(r != r, 0x7F, code | sign)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def tanh(x):
        """libdevice's tanhf as the GPU's ``tanh`` below runs it, with an exact exp2 and
        division where the GPU approximates them: an odd polynomial below |x| = 0.6, else
        1 - 2 / (2^(2|x| log2 e) + 1) with x's sign (1 from |x| >= 9.01): 1.8 ulps at most.
        Near saturation the last subtraction is the only rounding that counts (0.53 ulps at
        most from 3 to 9); (1 - e) / (1 + e) was off by up to 1.5 there, which tanh's
        gradient, 1 - y^2, turned into 20% at |x| = 7 (a fuzzer's find), and by up to 61
        between 0.01 and 0.6. fp32 only: its coefficients are fp32's."""
        a = tl.abs(x)
        x2 = x * x
        p = 0.01573968306183815 * x2 - 0.05230396240949631
        p = p * x2 + 0.13315297663211823
        p = p * x2 - 0.33332768082618713
        p = p * x2 + 0.0            # as libdevice: + 0 makes the product's -0 a +0, so that
        small = p * x + x           # tanh(-0) is -0
        big = 1.0 - 2.0 / (tl.exp2(a * 2.885390043258667) + 1.0)
        big = tl.where(a >= 9.010913848876953, 1.0, big)
        big = tl.where(x < 0, -big, big)
        return tl.where(a < 0.6000000238418579, small, big)

    @triton.jit
    def tanh_libdevice(x):
        """For fp64 (``ops``: fp32 takes ``tanh``), where fp32's polynomial falls short: to
        about an fp64 ulp of 1 in absolute terms."""
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def log1p(x):
        return tl.log(1.0 + x)

    @triton.jit
    def expm1(x):
        return tl.exp(x) - 1.0

    @triton.jit
    def trunc(x):
        return tl.where(x < 0, tl.ceil(x), tl.floor(x))

    @triton.jit
    def pow(x, y):
        y = tl.zeros_like(x) + y     # a constant exponent as a tensor like x
        r = tl.exp2(y * tl.log2(tl.abs(x)))
        whole = y == tl.floor(y)
        odd = whole & ((y - 2.0 * tl.floor(y * 0.5)) == 1.0)
        r = tl.where((x < 0) & odd, -r, r)
        r = tl.where((x < 0) & (whole == 0), float("nan"), r)
        return tl.where(y == 0, 1.0, r)
else:
    from triton.language.extra import libdevice

    # A value eager rounds between two ops goes through an identity the compiler cannot see
    # through before it is rounded. Otherwise LLVM narrows a product rounded to bf16 into a
    # bf16 multiply (exact) and contracts it with the add that reads it into one fma.rn.bf16x2,
    # which skips the rounding eager does in between: dequant+add (q * s + r) then differed
    # from eager by one bf16 step in a quarter of its elements on the H200.
    @triton.jit
    def _opaque(x):
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    # the plain rounding, for a value that is not a product (a sum, a converted integer): the
    # compiler may keep it in packed bf16 arithmetic (bias+GELU's add, int8 -> bf16)
    @triton.jit
    def convert_bf16(x):
        return x.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def convert_fp16(x):
        return x.to(tl.float16).to(tl.float32)

    @triton.jit
    def round_bf16(x):
        return convert_bf16(_opaque(x))

    @triton.jit
    def round_fp16(x):
        return convert_fp16(_opaque(x))

    # stores convert once from the unrounded value: round-to-nearest-even, as round_* do
    @triton.jit
    def store_bf16(x):
        return x.to(tl.bfloat16)

    @triton.jit
    def store_fp8e4m3(x, SATURATE: tl.constexpr):
        if not SATURATE:
            x = tl.where(tl.abs(x) > 464.0, float("nan"), x)
        return x.to(tl.float8e4nv)

    @triton.jit
    def round_fp8e4m3(x, SATURATE: tl.constexpr):
        # the GPU conversion saturates (satfinite); where torch makes |x| > 464 NaN, do so too
        if not SATURATE:
            x = tl.where(tl.abs(x) > 464.0, float("nan"), x)
        return x.to(tl.float8e4nv).to(tl.float32)

    @triton.jit
    def rsqrt(x):
        # what tl.math.rsqrt becomes for fp32: libdevice's __nv_rsqrtf, under Triton's
        # nvvm-reflect FTZ flag this one instruction; written here so that a kernel needs no
        # libdevice (linking it in costs ~30 ms of compile time per kernel: GPT-2 has six)
        return tl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=f,f",
                                         [x.to(tl.float32)], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def div_recip(b, k):
        # MUFU.RCP, as in div.full.f32 (b * k is a normal number or zero, inf, NaN)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [b * k],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def div_shared(a, k, r):
        """a / b as div.full.f32 computes it, with k = div_scale(b), r = div_recip(b, k)."""
        return (a * k) * r

    # wrapped in jit functions: Triton maps the generic libdevice module to the target's only
    # where a kernel names it
    @triton.jit
    def tanh_libdevice(x):
        return libdevice.tanh(x)

    @triton.jit
    def tanh(x):
        """libdevice's tanhf, instruction for instruction, without its per-element branch.

        libdevice (as Triton 3.6 inlines it) computes an odd polynomial below |x| = 0.6 and
        1 - 2 / (2^(2|x| log2 e) + 1) with x's sign above, 1 from |x| >= 9.01, choosing by a
        branch that diverges within a warp where inputs straddle 0.6. Both sides computed and
        one selected: the same bits (the same PTX operations in the same order), 609 -> 522
        SASS instructions for GPT-2's bf16 GELU kernel and 23.0 -> 20.4 us at [4096, 3072] on
        the H200 (benchmarks/variants.py, newgelu). For fp32; fp64 takes ``tanh_libdevice``."""
        return tl.inline_asm_elementwise(
            """{
            .reg .f32 a, x2, p, c, e, d, q, s, r1;
            .reg .b32 sb, xb;
            .reg .pred small, big;
            abs.ftz.f32 a, $1;
            setp.ltu.f32 small, a, 0f3F19999A;
            mul.f32 x2, $1, $1;
            mov.b32 p, 0f3C80F082;
            mov.b32 c, 0fBD563CAE;
            fma.rn.ftz.f32 p, p, x2, c;
            mov.b32 c, 0f3E085941;
            fma.rn.ftz.f32 p, p, x2, c;
            mov.b32 c, 0fBEAAA9ED;
            fma.rn.ftz.f32 p, p, x2, c;
            mov.b32 c, 0f00000000;
            fma.rn.ftz.f32 p, p, x2, c;
            fma.rn.ftz.f32 r1, p, $1, $1;
            mul.f32 e, a, 0f4038AA3B;
            ex2.approx.ftz.f32 e, e;
            add.f32 d, e, 0f3F800000;
            rcp.approx.ftz.f32 q, d;
            mov.b32 c, 0fC0000000;
            mov.b32 s, 0f3F800000;
            fma.rn.ftz.f32 s, q, c, s;
            setp.ge.f32 big, a, 0f41102CB4;
            selp.f32 s, 0f3F800000, s, big;
            mov.b32 sb, s;
            mov.b32 xb, $1;
            and.b32 xb, xb, -2147483648;
            or.b32 sb, sb, xb;
            mov.b32 s, sb;
            selp.f32 $0, r1, s, small;
            }""", "=f,f", [x.to(tl.float32)], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def log1p(x):
        return libdevice.log1p(x)

    @triton.jit
    def expm1(x):
        return libdevice.expm1(x)

    @triton.jit
    def trunc(x):
        return libdevice.trunc(x)

    @triton.jit
    def pow(x, y):
        return libdevice.pow(x, y)


_TWINS: dict = {}


def for_mode(interpret: bool):
    """These helpers built for the interpreter or for the GPU. ``triton.jit`` picks one or the
    other when a function is decorated, so a process that switches TRITON_INTERPRET (a test
    that analyzes a CPU model without running it, then one that runs it) needs both: this
    module as imported, and a twin built from the same file under the other setting."""
    if interpret == INTERPRET:
        return sys.modules[__name__]
    twin = _TWINS.get(interpret)
    if twin is None:
        name = f"{__name__}_{'interpreted' if interpret else 'compiled'}"
        twin = types.ModuleType(name)
        twin.__file__ = __file__
        sys.modules[name] = twin
        with triton_mode(interpret):
            with open(__file__) as f:
                exec(compile(f.read(), __file__, "exec"), twin.__dict__)
        _TWINS[interpret] = twin
    return twin


@contextlib.contextmanager
def triton_mode(interpret: bool):
    """TRITON_INTERPRET set to ``interpret`` inside the block: the mode ``triton.jit`` makes
    the functions decorated there for."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
