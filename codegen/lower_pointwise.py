"""Pointwise ops of the lowering: an ATen pointwise op at an index becomes a Triton expression
with ATen's dtype rules (0-dim operands promoted, compares in the operands' dtype, results
rounded to bf16/fp16/fp8 after each op as eager rounds them, a rounded product guarded where
something adds to it), and two rewrites: ``1 + tanh(u)`` as ``2 / (1 + exp(-2u))``, and a
division by one value per row as two multiplies by a reciprocal taken once per row.

``PointwiseLowering`` is a part of ``lower.Lowering``: its methods use the lowering's
``value``, ``_assign``, ``ir``, ``kind``, ``uses``, ``products`` and ``summed``.
"""
from __future__ import annotations

import sympy
import torch

from . import ops
from .indexing import broadcast_index, print_expr
from .kernel_ir import IROp, KernelIR, NotFusable, ref_id
from .lowered import VIEWS, Var, flat_args

# Ops that read a value without adding anything to it, so that the GPU compiler cannot contract
# a product rounded for them into an fma; casts and views pass the question on to their readers.
_NO_ADD = {
    "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.abs.default", "aten.amax.default", "aten.amin.default", "aten.clamp.default",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.minimum.default",
    "aten.maximum.default"} | {f"aten.{c}.{o}" for c in ops.COMPARE for o in ("Tensor", "Scalar")}
_PASS_ON = ops.CASTS | VIEWS


def summed_values(ir: KernelIR) -> set:
    """Ids of the values something may add to (an add, a sum, an op not known to scale):
    rounded there, a product needs ``fl.round_*``'s guard."""
    readers: dict = {}
    for i, op in enumerate(ir.ops):
        for a in flat_args(op.args):
            if ref_id(a) is not None:
                readers.setdefault(ref_id(a), []).append((op.target, len(ir.inputs) + i))
    memo: dict = {}

    def summed(v) -> bool:
        if v not in memo:
            memo[v] = any(summed(out) if t in _PASS_ON else t not in _NO_ADD
                          for t, out in readers.get(v, ()))
        return memo[v]
    return {v for v in range(len(ir.values)) if summed(v)}


def is_product(expr: str) -> bool:
    """Whether a register expression multiplies (ops.POINTWISE prints ``a * b``)."""
    return " * " in expr


def _category(dtype: torch.dtype) -> int:
    return 2 if dtype.is_floating_point else (0 if dtype == torch.bool else 1)


class PointwiseLowering:
    """The pointwise half of ``lower.Lowering`` (see the module docstring)."""

    def _one_plus_tanh(self, vid, op: IROp, index, preds):
        """``1 + tanh(u)`` (GELU's tanh form) as ``2 / (1 + exp(-2u))``: the same value in
        fp32, without libdevice's tanh (which made bias+GELU compute-bound: 73% of the HBM
        floor on the H200, 90% with this form) and without the cancellation of 1 + tanh(u)
        near u = -inf. Only for fp32 values whose tanh nothing else reads; None otherwise."""
        if (op.target not in ("aten.add.Tensor", "aten.add.Scalar")
                or dict(op.kwargs).get("alpha", 1) != 1 or len(op.args) != 2):
            return None
        a, b = op.args
        tanh_ref, one = (a, b) if ref_id(a) is not None else (b, a)
        r = ref_id(tanh_ref)
        if r is None or r < len(self.ir.inputs) or isinstance(one, tuple) or one != 1:
            return None
        tanh = self.ir.ops[r - len(self.ir.inputs)]
        out, t_val = self.ir.values[vid], self.ir.values[r]
        if (tanh.target != "aten.tanh.default" or self.uses[r] != 1
                or out.dtype != torch.float32 or t_val.dtype != torch.float32):
            return None
        u_ref = ref_id(tanh.args[0])
        t_index = broadcast_index(index, out.shape, t_val.shape)
        u = self.value(u_ref, broadcast_index(t_index, t_val.shape, self.ir.values[u_ref].shape),
                       preds)
        if u.dtype != torch.float32:
            return None
        row_level = self.kind != "row" or u.row_level
        return self._assign(f"(2.0 / (1.0 + tl.exp(-2.0 * {u.name})))", torch.float32,
                            row_level, "aten.tanh.default")

    def _pointwise(self, vid, op: IROp, index, preds) -> Var:
        out = self.ir.values[vid]
        t = op.target
        fused = self._one_plus_tanh(vid, op, index, preds)
        if fused is not None:
            return fused
        args, saturate = op.args, None
        if out.dtype == torch.float8_e4m3fn and t in ops.CASTS and ref_id(args[0]) is not None:
            past = ops.past_saturating_clamps(self.ir, ref_id(args[0]))
            if past != ref_id(args[0]):
                args, saturate = (("ref", past),) + args[1:], True
        tensors, printed = [], []
        for a in args:
            r = ref_id(a)
            if r is not None:
                v = self.value(r, broadcast_index(index, out.shape, self.ir.values[r].shape), preds)
                tensors.append(v)
                printed.append(v)
            else:
                printed.append(a)
        row_level = self.kind != "row" or any(v.row_level for v in tensors)
        if t not in ops.CASTS and t != "aten.copy.default":
            printed = self._promote_zero_dim(op, printed)
            tensors = [p for p in printed if isinstance(p, Var)]
        if t in ops.CASTS or t == "aten.copy.default":
            src = tensors[-1]
            return self._assign(ops.cast(src.name, src.dtype, out.dtype, saturate,
                                         guard=src.name in self.products
                                         and vid in self.summed), out.dtype,
                                row_level, t)
        if t in ops.LOGICAL or (out.dtype == torch.bool and t in ops.BOOL_BITWISE):
            fn = ops.LOGICAL.get(t) or ops.LOGICAL[ops.BOOL_BITWISE[t]]
            names = [p.name if isinstance(p, Var) else ops.literal(p, torch.float32) for p in printed]
            return self._assign(fn(names), torch.bool, row_level, t)
        if t == "aten.where.self":
            c, a, b = printed
            ct = out.dtype
            expr = f"tl.where({self._as(c, torch.bool)}, {self._as(a, ct)}, {self._as(b, ct)})"
            return self._assign(expr, ct, row_level, t)
        if t == "aten.masked_fill.Scalar":
            x, m, fill = printed
            expr = f"tl.where({self._as(m, torch.bool)}, {self._as(fill, out.dtype)}, {self._as(x, out.dtype)})"
            return self._assign(expr, out.dtype, row_level, t)
        if t == "aten.fill.Scalar":
            return self._assign(f"tl.full([1], {self._as(printed[1], out.dtype)}, {ops.reg_dtype(out.dtype)})",
                                out.dtype, row_level)
        if t not in ops.POINTWISE:
            raise NotFusable(f"no Triton lowering for {t}")
        is_compare = t.split(".")[1] in ops.COMPARE
        ct = ops.compute_dtype([v.dtype for v in tensors]) if is_compare else out.dtype
        if ct in ops.ROUNDED:
            ct = torch.float32
        if ct == torch.bool and not is_compare:
            raise NotFusable(f"{t} on bool tensors")
        if is_compare and tensors and tensors[0].dtype in ops.ROUNDED:
            # ATen compares a bf16/fp16 tensor with a scalar in the tensor's dtype
            printed = [p if isinstance(p, Var) or not isinstance(p, float)
                       else torch.tensor(p, dtype=tensors[0].dtype).item() for p in printed]
        names = [self._as(p, ct) if p is not None else None for p in printed]
        kwargs = {k: ops.literal(v, ct) if isinstance(v, (int, float)) else v
                  for k, v in op.kwargs if isinstance(v, (int, float, str))}
        expr = self._by_shared_divisor(op, printed, names, ct) or ops.POINTWISE[t](names, kwargs, ct)
        dtype = torch.bool if is_compare else out.dtype
        guard = is_product(expr) and vid in self.summed
        return self._assign(ops.cast(expr, ct, dtype, guard=guard) if not is_compare
                            else expr, dtype, row_level, t)

    def _by_shared_divisor(self, op, printed, names, ct):
        """``a / b`` where ``b`` is one value per row (or per kernel): div.full.f32, which
        Triton emits for ``/``, is (a * k) * rcp(b * k) with k a power of two that keeps b in
        range; k and the reciprocal once per row, then two multiplies per element instead of
        the division's three instructions. The same bits as ``/`` on the GPU; in the
        interpreter, as ``/`` there, an exact division."""
        if op.target != "aten.div.Tensor" or op.kwargs or ct != torch.float32:
            return None
        b = printed[1]
        if not isinstance(b, Var):
            return None
        ref = ref_id(op.args[1])
        scalar = ref is not None and all(d == 1 for d in self.ir.values[ref].shape)
        if not scalar and (self.kind != "row" or b.row_level):
            return None
        k = self._assign(f"fl.div_scale({names[1]})", torch.float32, b.row_level)
        r = self._assign(f"fl.div_recip({names[1]}, {k.name})", torch.float32, b.row_level)
        return f"fl.div_shared({names[0]}, {k.name}, {r.name})"

    def _promote_zero_dim(self, op, printed):
        """ATen's type promotion: a 0-dim tensor next to dimensioned ones of the same kind
        (float, int, bool) takes their dtype first (bf16 x > fp32 0-dim 0.1 compares with
        bf16(0.1)), as a Python scalar would."""
        refs = [ref_id(a) for a in op.args]
        dims = [p.dtype for p, r in zip(printed, refs) if r is not None and self.ir.values[r].shape != ()]
        if not dims or len(dims) == sum(r is not None for r in refs):
            return printed
        common = dims[0]
        for d in dims[1:]:
            common = torch.promote_types(common, d)
        out = []
        for i, (p, r) in enumerate(zip(printed, refs)):
            if (r is not None and self.ir.values[r].shape == () and p.dtype != common
                    and 1 <= _category(p.dtype) <= _category(common)   # masks stay bool
                    and not self._keeps_scalar_precision(op, i, r, common)):
                guard = p.name in self.products and op.target not in _NO_ADD
                p = self._assign(ops.cast(p.name, p.dtype, common, guard=guard), common,
                                 p.row_level)
            out.append(p)
        return out

    def _keeps_scalar_precision(self, op, position, ref, common) -> bool:
        """ATen's CPU mul and div read a 0-dim second operand at its own precision (fp32 next
        to a bf16/fp16 tensor: ``original_scalar_value``), not rounded to the tensor's dtype;
        add, sub, and a 0-dim first operand are rounded. CPU kernels (the interpreter) follow
        that; CUDA kernels round, as for a 0-dim CUDA tensor."""
        return (self.ir.device_type == "cpu" and position == 1 and common in ops.ROUNDED
                and op.target in ("aten.mul.Tensor", "aten.div.Tensor")
                and self.ir.values[ref].dtype.is_floating_point)

    def _as(self, p, ct: torch.dtype) -> str:
        """An operand (register or scalar) in compute dtype ``ct``."""
        if isinstance(p, Var):
            return ops.cast(p.name, p.dtype, ct if ct not in ops.ROUNDED else torch.float32)
        if isinstance(p, sympy.Expr):
            return f"({print_expr(p)} * {'1.0' if ct.is_floating_point else '1'})"
        return ops.literal(p, ct)
