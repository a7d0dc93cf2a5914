"""Shapes pass: sizes and strides of every tensor as sympy expressions.

Reads the fake tensors dynamo and aot_autograd attach (``node.meta["val"]``). A static size is a
sympy Integer, a dynamic one an expression in the graph's size symbols (s0, s1, ...). Decisions
evaluate the expressions at the size hints: the sizes of the example inputs.

Writes ``node.meta["fc_tensor"]`` (``TensorInfo``) on every node that yields one tensor, and
``node.meta["fc_symint"]`` (a sympy expression) on every node that yields a symbolic int.
``ctx.size_hints`` maps each free symbol to its hint.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily


def static_layout(value) -> tuple | None:
    """(sizes, strides, storage offset, dtype, device) of a tensor whose sizes, strides and
    offset are all ints (``fake_of_layout`` makes it again); None otherwise."""
    if not isinstance(value, torch.Tensor):
        return None
    sizes, strides, offset = tuple(value.shape), tuple(value.stride()), value.storage_offset()
    if not all(type(n) is int for n in (*sizes, *strides, offset)):
        return None
    return sizes, strides, offset, value.dtype, value.device


def mergeable(x: torch.Tensor, first: int, last: int) -> bool:
    """Whether dimensions ``first`` .. ``last - 1`` of ``x`` (static strides) are a view of one
    dimension: each one's stride is the next one's times its size, where dims of size 1 (any
    stride) are left out and the dims around them compared. A fuzzer's find: [2500, 1, 3] of
    strides (6, 3, 1) passed as one dim when each pair was compared with its neighbour; the view
    a pass then emitted got wrong strides from torch's Python view (aot_autograd's cold
    compile) and raised in a process that loaded the graph from the AOT cache."""
    dims = [d for d in range(first, last) if x.shape[d] != 1]
    return all(x.stride(a) == x.stride(b) * x.shape[b] for a, b in zip(dims, dims[1:]))


def fake_of_layout(mode, sizes, strides, offset, dtype, device):
    """A fake tensor of ``mode`` with this layout (int sizes, strides and storage offset): a meta
    tensor over a storage just long enough, wrapped as ``FakeTensor`` does (12 us on the CPU;
    through the mode's dispatch of ``empty`` and ``as_strided``, 280)."""
    with unset_fake_temporarily():
        return FakeTensor(mode, meta_of_layout(sizes, strides, offset, dtype), device)


def meta_of_layout(sizes, strides, offset, dtype) -> torch.Tensor:
    """A meta tensor of this layout; called with no fake mode active (aot_autograd compiles
    a graph inside its own: ``unset_fake_temporarily``), or the mode would make it a fake."""
    if offset:
        span = 1 + sum((n - 1) * st for n, st in zip(sizes, strides)) if all(sizes) else 0
        return torch.empty(offset + span, dtype=dtype, device="meta").as_strided(
            sizes, strides, offset)
    return torch.empty_strided(sizes, strides, dtype=dtype, device="meta")


@dataclass(frozen=True)
class TensorInfo:
    """What the passes know of one tensor value."""
    shape: tuple      # sympy expressions
    stride: tuple     # sympy expressions
    dtype: torch.dtype
    device: torch.device
    storage_offset: sympy.Expr

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property           # sympy builds a Mul on each product: cost-model hot
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property
    def free_symbols(self) -> frozenset:
        """The size symbols of the shape, strides and offset (empty for static shapes)."""
        return frozenset().union(*(e.free_symbols for e in (*self.shape, *self.stride,
                                                            self.storage_offset)
                                   if not e.is_Integer))

    @functools.cached_property
    def key(self) -> str:
        """A short, exact text of this info, for cache keys (sympy's printer is slow: static
        sizes are written as ints)."""
        def text(e):
            return str(int(e)) if e.is_Integer else f"({e})"
        return (",".join(map(text, self.shape)) + "|" + ",".join(map(text, self.stride))
                + f"|{text(self.storage_offset)}|{self.dtype}|{self.device}")


def to_sympy(value) -> sympy.Expr:
    """An int or SymInt as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    if type(value) is int:
        return sympy.Integer(value)
    if isinstance(value, (int, sympy.Expr)):
        return sympy.sympify(value)
    raise TypeError(f"expected an int or SymInt, got {type(value).__name__}: {value!r}")


def tensor_info(val: torch.Tensor) -> TensorInfo:
    return TensorInfo(
        shape=tuple(to_sympy(s) for s in val.shape),
        stride=tuple(to_sympy(s) for s in val.stride()),
        dtype=val.dtype,
        device=val.device,
        storage_offset=to_sympy(val.storage_offset()),
    )


def _collect_hints(val, hints: dict) -> None:
    values = []
    if isinstance(val, torch.SymInt):
        values.append(val)
    elif isinstance(val, torch.Tensor):
        values.extend(v for v in (*val.shape, *val.stride(), val.storage_offset())
                      if isinstance(v, torch.SymInt))
    for v in values:
        shape_env = v.node.shape_env
        known = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
        for sym in v.node.expr.free_symbols:
            if sym not in hints and sym in known:
                hints[sym] = int(known[sym])


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Write ``fc_tensor`` / ``fc_symint`` on every node and collect the size hints."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["fc_tensor"] = tensor_info(val)
        elif isinstance(val, torch.SymInt):
            node.meta["fc_symint"] = to_sympy(val)
        _collect_hints(val, ctx.size_hints)
    return gm


def hint(expr, size_hints: dict) -> int:
    """Value of a size expression at the example inputs' sizes."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    return int(expr.xreplace(size_hints))
