"""Pointwise ATen ops as Triton expressions, and dtype handling.

Values live in registers as fp32 for every float type of 32 bits or less (fp64 stays fp64,
integers and bool keep their type). After an op whose ATen result is bf16/fp16/fp8 the value is
rounded to that type and back, so the kernel computes what eager computes op by op.
"""
from __future__ import annotations

import math

import torch

from .kernel_ir import NotFusable, ref_id

TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.float8_e4m3fn: "tl.float8e4nv",
    torch.float8_e5m2: "tl.float8e5", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64",
    torch.bool: "tl.int1",
}
ROUNDED = {torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
# Whether this torch saturates out-of-range fp32 -> e4m3fn conversions to +-448 (else NaN).
FP8_SATURATES = torch.tensor([1000.0]).to(torch.float8_e4m3fn).float().item() == 448.0


def reg_dtype(dtype: torch.dtype) -> str:
    """Triton type a value of this torch dtype has in registers."""
    if dtype.is_floating_point:
        return "tl.float64" if dtype == torch.float64 else "tl.float32"
    return TL_DTYPE[dtype]


def compute_dtype(dtypes) -> torch.dtype:
    """Dtype an op computes in, from its tensor operands' dtypes (ATen's type promotion)."""
    floats = [d for d in dtypes if d.is_floating_point]
    if floats:
        return torch.float64 if torch.float64 in floats else torch.float32
    ints = [d for d in dtypes if d != torch.bool]
    if ints:
        return max(ints, key=lambda d: (d.itemsize, d.is_signed))
    return torch.bool


def literal(value, dtype: torch.dtype) -> str:
    """A Python scalar as a Triton literal of the compute dtype. A value of a rounded dtype
    (bf16, fp16, fp8: a ``full``, a ``where``'s or ``masked_fill``'s scalar, a pad's value; the
    arithmetic ops compute in fp32 and pass fp32 here) is that dtype's value, rounded as ATen's
    cast rounds it (through fp32): ``where(c, x_bf16, 0.1).float()`` is 0.10009765625, as
    eager's, not the register's 0.1 (the GPU fuzzer's find)."""
    if isinstance(value, bool) or dtype == torch.bool:
        return "1" if value else "0"
    if dtype.is_floating_point:
        value = float(value)
        if dtype in ROUNDED and math.isfinite(value):
            value = torch.tensor(value, dtype=torch.float32).to(dtype).item()
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    if isinstance(value, float):
        raise NotFusable(f"float scalar {value} in an integer op")
    # ATen casts the scalar to the tensor's integer type, wrapping around (uint8: -1 -> 255)
    bits = dtype.itemsize * 8
    value = int(value) & ((1 << bits) - 1)
    if dtype.is_signed and value >= 1 << (bits - 1):
        value -= 1 << bits
    return str(value)


def _div(a, b, ct):
    # Triton's fp32 `/` is div.full.f32 (within 2 ulp), not IEEE div.rn: a bf16 pointwise kernel
    # has ~50 fp32 instructions per element before it stops being memory-bound, and div.rn costs
    # a good share of them. After rounding to bf16/fp8 the results equal eager's but for the rare
    # element that sits on a rounding boundary.
    return f"({a} / {b})"


def _int_div(a, b, ct, mode, remainder=False):
    """Integer ``div(a, b, rounding_mode=mode)`` or ``remainder(a, b)`` (the remainder of the
    floor division, with the divisor's sign). Triton's ``//`` and ``%`` on integers are C's
    (truncation, the dividend's sign), on the GPU and in the interpreter alike; floor division
    is one less where the remainder is nonzero and its sign differs from the divisor's. Floats
    stay on ATen: a rounded quotient of ``/`` (div.full.f32, 2 ulp) could land on the wrong
    side of an integer. A literal zero divisor too: ATen's error, not a kernel's garbage."""
    if ct.is_floating_point or ct == torch.bool:
        raise NotFusable(f"{'remainder' if remainder else f'{mode} division'} of {ct} values "
                         "stays on ATen")
    if mode not in ("trunc", "floor"):
        raise NotFusable(f"division with rounding mode {mode!r} of integers")
    literal_b = b.lstrip("-").isdigit()
    if literal_b and int(b) == 0:
        raise NotFusable("integer division by a literal zero stays on ATen (its error)")
    quotient, rem = f"({a} // {b})", f"({a} % {b})"
    if mode == "trunc" and not remainder:
        return quotient
    if literal_b:
        wrong = f"({rem} < 0)" if int(b) > 0 else f"({rem} > 0)"
    else:
        wrong = f"(({rem} != 0) & (({rem} < 0) != ({b} < 0)))"
    if remainder:
        return f"tl.where({wrong}, {rem} + {b}, {rem})"
    return f"tl.where({wrong}, {quotient} - 1, {quotient})"


# scalar exponents _pow writes as a product, a square root, a division or a reciprocal square
# root (an instruction or two an element); any other exponent is libdevice's powf
CHEAP_EXPONENTS = (1, 2, 3, 0.5, -1, -0.5)


def _pow(a, b, ct):
    """pow with a scalar exponent: exact products for small integers, as ATen does."""
    try:
        e = float(b)
    except ValueError:     # a tensor exponent
        return _float_only(ct, f"fl.pow({a}, {b})")
    if e == 2:
        return f"({a} * {a})"
    if e == 3:
        return f"({a} * {a} * {a})"
    if e == 1:
        return a
    if not ct.is_floating_point:
        raise NotFusable(f"integer pow with exponent {b} stays on ATen")
    if e == 0.5:
        return f"tl.sqrt_rn({a})" if ct == torch.float32 else f"tl.sqrt({a})"
    if e == -1:
        return _div("1.0", a, ct)
    if e == -0.5:
        return _rsqrt(a, ct)
    return f"fl.pow({a}, {literal(e, ct)})"


def _rsqrt(a, ct):
    """fp32: ``fl.rsqrt``, the instruction libdevice's ``__nv_rsqrtf`` is (without linking
    libdevice into the kernel: ~30 ms of compile time per kernel); other types: libdevice's."""
    return f"fl.rsqrt({a})" if ct == torch.float32 else f"tl.math.rsqrt({a})"


def _float_only(ct, expr):
    if not ct.is_floating_point:
        raise NotFusable(f"integer pow stays on ATen ({ct})")
    return expr


def _clamp(x, lo, hi):
    if lo is not None:
        x = f"tl.maximum({x}, {lo}, propagate_nan=tl.PropagateNan.ALL)"
    if hi is not None:
        x = f"tl.minimum({x}, {hi}, propagate_nan=tl.PropagateNan.ALL)"
    return x


def _alpha(b, alpha):
    return b if alpha in (None, 1) else f"({b} * {alpha})"


# name -> f(args, kwargs, compute_dtype) -> expression; args are operand strings or scalars
# already printed as literals of the compute dtype (None stays None).
POINTWISE = {
    "aten.add.Tensor": lambda a, k, ct: f"({a[0]} + {_alpha(a[1], k.get('alpha'))})",
    "aten.add.Scalar": lambda a, k, ct: f"({a[0]} + {_alpha(a[1], k.get('alpha'))})",
    "aten.sub.Tensor": lambda a, k, ct: f"({a[0]} - {_alpha(a[1], k.get('alpha'))})",
    "aten.sub.Scalar": lambda a, k, ct: f"({a[0]} - {_alpha(a[1], k.get('alpha'))})",
    "aten.rsub.Scalar": lambda a, k, ct: f"({_alpha(a[1], k.get('alpha'))} - {a[0]})",
    "aten.mul.Tensor": lambda a, k, ct: f"({a[0]} * {a[1]})",
    "aten.mul.Scalar": lambda a, k, ct: f"({a[0]} * {a[1]})",
    "aten.div.Tensor": lambda a, k, ct: _div(a[0], a[1], ct),
    "aten.div.Scalar": lambda a, k, ct: _div(a[0], a[1], ct),
    "aten.div.Tensor_mode": lambda a, k, ct: _int_div(a[0], a[1], ct, k.get("rounding_mode")),
    "aten.div.Scalar_mode": lambda a, k, ct: _int_div(a[0], a[1], ct, k.get("rounding_mode")),
    "aten.remainder.Tensor": lambda a, k, ct: _int_div(a[0], a[1], ct, "floor", True),
    "aten.remainder.Scalar": lambda a, k, ct: _int_div(a[0], a[1], ct, "floor", True),
    "aten.neg.default": lambda a, k, ct: f"(-{a[0]})",
    "aten.abs.default": lambda a, k, ct: f"tl.abs({a[0]})",
    "aten.exp.default": lambda a, k, ct: f"tl.exp({a[0]})",
    "aten.exp2.default": lambda a, k, ct: f"tl.exp2({a[0]})",
    "aten.expm1.default": lambda a, k, ct: f"fl.expm1({a[0]})",
    "aten.log.default": lambda a, k, ct: f"tl.log({a[0]})",
    "aten.log2.default": lambda a, k, ct: f"tl.log2({a[0]})",
    "aten.log1p.default": lambda a, k, ct: f"fl.log1p({a[0]})",
    "aten.sqrt.default": lambda a, k, ct: _pow(a[0], 0.5, ct),
    "aten.rsqrt.default": lambda a, k, ct: _rsqrt(a[0], ct),
    "aten.reciprocal.default": lambda a, k, ct: _div("1.0", a[0], ct),
    "aten.sin.default": lambda a, k, ct: f"tl.sin({a[0]})",
    "aten.cos.default": lambda a, k, ct: f"tl.cos({a[0]})",
    "aten.tanh.default": lambda a, k, ct: (f"fl.tanh_libdevice({a[0]})" if ct == torch.float64
                                           else f"fl.tanh({a[0]})"),
    "aten.sigmoid.default": lambda a, k, ct: _div("1.0", f"(1.0 + tl.exp(-{a[0]}))", ct),
    "aten.erf.default": lambda a, k, ct: f"tl.math.erf({a[0]})",
    "aten.relu.default": lambda a, k, ct: _clamp(a[0], literal(0, ct), None),   # NaN stays NaN
    "aten.pow.Tensor_Scalar": lambda a, k, ct: _pow(a[0], a[1], ct),
    "aten.pow.Tensor_Tensor": lambda a, k, ct: _float_only(ct, f"fl.pow({a[0]}, {a[1]})"),
    "aten.clamp.default": lambda a, k, ct: _clamp(a[0], *(list(a[1:]) + [None, None])[:2]),
    "aten.clamp.Tensor": lambda a, k, ct: _clamp(a[0], *(list(a[1:]) + [None, None])[:2]),
    "aten.clamp_min.default": lambda a, k, ct: _clamp(a[0], a[1], None),
    "aten.clamp_max.default": lambda a, k, ct: _clamp(a[0], None, a[1]),
    "aten.maximum.default": lambda a, k, ct: _clamp(a[0], a[1], None),
    "aten.minimum.default": lambda a, k, ct: _clamp(a[0], None, a[1]),
    "aten.sign.default": lambda a, k, ct: (f"tl.where({a[0]} > 0, {literal(1, ct)}, "
                                           f"tl.where({a[0]} < 0, {literal(-1, ct)}, {literal(0, ct)}))"),
    "aten.floor.default": lambda a, k, ct: f"tl.floor({a[0]})",
    "aten.ceil.default": lambda a, k, ct: f"tl.ceil({a[0]})",
    "aten.trunc.default": lambda a, k, ct: f"fl.trunc({a[0]})",
    "aten.bitwise_not.default": lambda a, k, ct: f"({a[0]} ^ 255)" if ct == torch.uint8 else f"(~{a[0]})",
    "aten.bitwise_and.Tensor": lambda a, k, ct: f"({a[0]} & {a[1]})",
    "aten.bitwise_or.Tensor": lambda a, k, ct: f"({a[0]} | {a[1]})",
}
COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
for _name, _sym in COMPARE.items():
    for _overload in ("Tensor", "Scalar"):
        POINTWISE[f"aten.{_name}.{_overload}"] = (
            lambda a, k, ct, s=_sym: f"({a[0]} {s} {a[1]})")
# Ops whose operands are bool, whatever the tensors' dtypes.
LOGICAL = {
    "aten.logical_not.default": lambda a: f"({a[0]} == 0)",
    "aten.logical_and.default": lambda a: f"(({a[0]} != 0) & ({a[1]} != 0))",
    "aten.logical_or.default": lambda a: f"(({a[0]} != 0) | ({a[1]} != 0))",
    "aten.isnan.default": lambda a: f"({a[0]} != {a[0]})",
    "aten.isinf.default": lambda a: f"(tl.abs({a[0]}) == float(\"inf\"))",
}
# bitwise ops on bool tensors are the logical ones
BOOL_BITWISE = {"aten.bitwise_and.Tensor": "aten.logical_and.default",
                "aten.bitwise_or.Tensor": "aten.logical_or.default",
                "aten.bitwise_not.default": "aten.logical_not.default"}
# Ops that only change the dtype (or nothing): the value is the operand's, cast.
CASTS = {"aten.clone.default", "aten._to_copy.default", "prims.convert_element_type.default",
         "aten.alias.default", "aten.detach.default"}
# Ops that compute each element of their result from the operands' elements at its index.
ELEMENTWISE = set(POINTWISE) | set(LOGICAL) | CASTS | {"aten.where.self"}


_CLAMPS = {"aten.clamp.default": (1, 2), "aten.clamp_min.default": (1, None),
           "aten.clamp_max.default": (None, 1)}
FP8_E4M3_MAX = 448.0
FP8_E4M3_ROUNDS_TO_MAX = 464.0      # |x| <= 464 rounds to 448 (464 is a tie, to even)


def past_saturating_clamps(ir, vid: int) -> int:
    """The value to convert to float8_e4m3fn with a saturating conversion in place of converting
    ``vid`` the way this torch does; ``vid`` itself where that would change a result. A clamp
    whose bounds take in [-448, 448] changes nothing a saturating conversion (|x| > 448 and
    +-inf to +-448, NaN kept) would not do; where torch's conversion does not saturate (values
    past 464 become NaN), the clamps must also bound both sides by 464. Two to four instructions
    per element less (the clamp, and the NaN select of a non-saturating conversion): the FP8
    quant kernels, compute-heavy at one byte written per element, ran 5% of the HBM floor
    faster on the H200 without the clamp."""
    n_in = len(ir.inputs)
    dtype = ir.values[vid].dtype
    lo_all, hi_all, first = -math.inf, math.inf, vid
    while vid >= n_in:
        op = ir.ops[vid - n_in]
        where = _CLAMPS.get(op.target)
        if where is None:
            break
        kw = dict(op.kwargs)
        lo, hi = ((op.args[i] if i is not None and i < len(op.args) else kw.get(name))
                  for i, name in zip(where, ("min", "max")))
        src = ref_id(op.args[0])
        if (src is None or not _bound(lo, below=True) or not _bound(hi, below=False)
                or ir.values[src].dtype != dtype or not dtype.is_floating_point):
            break
        lo_all = max(lo_all, -math.inf if lo is None else lo)
        hi_all = min(hi_all, math.inf if hi is None else hi)
        vid = src
    if vid == first:
        return first
    if not FP8_SATURATES and (lo_all < -FP8_E4M3_ROUNDS_TO_MAX or hi_all > FP8_E4M3_ROUNDS_TO_MAX):
        return first
    return vid


def _bound(b, below: bool) -> bool:
    """Whether clamp bound ``b`` lets all of [-448, 448] through (None: no bound on that side)."""
    if b is None:
        return True
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        return False        # a tensor bound, a symbolic one: not known here
    return b <= -FP8_E4M3_MAX if below else b >= FP8_E4M3_MAX


def cast(expr: str, src: torch.dtype, dst: torch.dtype, saturate: bool | None = None,
         guard: bool = True) -> str:
    """Register value of dtype ``src`` as a register value of dtype ``dst``, rounding as eager
    (``saturate``: an e4m3 conversion that saturates, whatever this torch's does).

    ``guard``: the value may be a product (the lowering knows which are not). Rounded to bf16 or
    fp16, a product goes through ``fl.round_*``, which keeps the GPU compiler from contracting
    it with an add that reads it (one fma, without eager's rounding in between)."""
    src_reg, dst_reg = reg_dtype(src), reg_dtype(dst)
    if dst == torch.bool and src != torch.bool:
        return f"({expr} != 0)"
    if dst in ROUNDED:
        if src == dst:
            return expr
        if src_reg != "tl.float32":
            expr = f"{expr}.to(tl.float32)"
        how = "round" if guard and src.is_floating_point else "convert"
        if dst == torch.bfloat16:
            return f"fl.{how}_bf16({expr})"
        if dst == torch.float16:
            return f"fl.{how}_fp16({expr})"
        if dst == torch.float8_e4m3fn:
            sat = FP8_SATURATES if saturate is None else saturate
            return f"fl.round_fp8e4m3({expr}, {sat})"
        if dst == torch.float8_e5m2:
            raise NotFusable("float8_e5m2 results stay on ATen (overflow rules differ)")
        return f"{expr}.to({TL_DTYPE[dst]}).to(tl.float32)"
    if src_reg == dst_reg:
        return expr
    return f"{expr}.to({dst_reg})"
