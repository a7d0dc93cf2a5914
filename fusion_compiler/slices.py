"""A slice's gradient, a slice written into a tensor, a scatter of one element per line and a
crop, as ops the code generator fuses: decompositions of ``slice_backward``, ``slice_scatter``,
``scatter`` and ``constant_pad_nd`` (the decomposition table, decompositions.py).

PyTorch's core table makes a slice's gradient a tensor of zeros (``full``) and a
``slice_scatter`` of the gradient into it: two ATen kernels, a write of the whole input's
size and a copy. Hugging Face's rotary embeddings slice each head in halves (``rotate_half``),
so the backward of every attention layer of a Llama, Mistral, Qwen or Gemma has four of each,
on the query's and key's gradients: the largest memory-bound ops of those models' backward
left on ATen (a CPU `dump` of benchmarks/hf_zoo.py's models, session 48). Swin's patch merging
takes every other row and column (``x[:, 0::2, 1::2]``), the same with a step.

Here the gradient of a slice is the gradient padded with zeros along the sliced dimension: a
``constant_pad_nd`` (a step of 1), or each element spread ``step`` apart by ``spread``'s
unsqueeze, pad and reshape (index arithmetic, no scatter). Its reader (the sum of RoPE's two
halves, the rest of the backward) computes it at each load: no zeros are written.
``slice_scatter(base, src)`` with a step of 1 is ``cat`` of base's part before the slice,
``src`` and base's part after it, each element loaded from one of them; with a step, a
``where`` between the spread ``src`` and ``base``.

Left to ATen (NotImplemented: the core table's, or the op as traced): symbolic sizes or
bounds, base and source of different dtypes, and a base that is not contiguous (a cat's
output is; ATen's keeps base's strides).

Two more writes of the same kind, found by the same survey: ``scatter`` of one element per
line (cross entropy's one-hot of its targets, a max's gradient) is a ``where`` against an
arange (``scatter_value``, ``scatter_src``), and a pad by negative amounts (a crop: the
backward of every pad) a slice, then the pad that is left (``constant_pad_nd``).

A scatter into a base whose elements share memory (an expanded tensor) writes into a copy:
ATen's ``clone_preserve_strides`` cannot keep such strides and clones to a dense layout. torch
2.11's fake ``slice_scatter``, ``select_scatter`` and ``diagonal_scatter`` kept them (fixed by
2.13): the graph said stride 0 where the tensor was dense, and a kernel reading it read one
element for all (the fuzzer, on an H100: ``neg(slice_scatter(x.expand(3), ...))`` gave
``[-2a, -2a, -2a]`` for ``[-2a, -a, -a]``). ``into_a_copy`` makes that copy a contiguous
``clone`` in the graph, where fake and real layouts agree, and scatters into it.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def pad_dim(t, dim: int, before: int, after: int, value=0):
    """``constant_pad_nd`` of ``t`` by ``before`` and ``after`` along ``dim`` alone."""
    pads = [0] * (2 * t.dim())          # constant_pad_nd pads from the last dim back
    at = 2 * (t.dim() - 1 - dim % t.dim())
    pads[at], pads[at + 1] = before, after
    return aten.constant_pad_nd(t, pads, value)


def spread(t, dim: int, step: int, shift: int, length: int):
    """``t`` along ``dim`` with its element m at ``m * step + shift`` of a dimension of
    ``length``, zeros elsewhere: index arithmetic (unsqueeze, constant pad, reshape, pad,
    slice), no scatter."""
    dim %= t.dim()
    n = t.shape[dim]
    if step == 1 and n + shift <= length:
        return pad_dim(t, dim, shift, length - n - shift)
    q, r = divmod(shift, step)
    u = pad_dim(t.unsqueeze(dim + 1), dim + 1, r, step - 1 - r)
    u = u.reshape(t.shape[:dim] + (n * step,) + t.shape[dim + 1:])
    u = pad_dim(u, dim, q * step, max(0, length - (n + q) * step))
    return aten.slice(u, dim, 0, length)


def _bounds(length, start, end, step):
    """ATen's slice bounds ``(start, end)`` of a dimension of ``length`` (None: its ends,
    negative: from the end, clamped to it), or None where a size or bound is symbolic."""
    start = 0 if start is None else start
    end = length if end is None else end
    if not all(type(v) is int for v in (length, start, end, step)) or step < 1:
        return None
    start = start + length if start < 0 else start
    end = end + length if end < 0 else end
    start = min(max(start, 0), length)
    end = min(max(end, start), length)
    return start, end


def slice_backward(grad, input_sizes, dim, start, end, step):
    """The gradient of ``x[start:end:step]`` along ``dim`` (x's sizes ``input_sizes``): the
    gradient spread into zeros (module docstring)."""
    dim %= len(input_sizes)
    bounds = _bounds(input_sizes[dim], start, end, step)
    if bounds is None or grad.dim() != len(input_sizes):
        return NotImplemented
    start, end = bounds
    if grad.shape[dim] != -(-(end - start) // step):
        return NotImplemented
    return spread(grad, dim, step, start, input_sizes[dim])


def dense_order(t) -> list | None:
    """The permutation of ``t``'s dims, outermost first in memory, that makes it contiguous,
    or None where none does (gaps, overlaps, symbolic strides)."""
    if not all(type(v) is int for v in (*t.shape, *t.stride())):
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))     # stable: ties keep order
    return order if t.permute(order).is_contiguous() else None


def slice_scatter(base, src, dim=0, start=None, end=None, step=1):
    """``base`` with ``src`` in its ``[start:end:step]`` along ``dim``, a new tensor (module
    docstring). A base whose dims are permuted in memory (Funnel's relative shift writes into
    one with its batch and head dims swapped) is scattered in the order that makes it
    contiguous, and the result permuted back: base's strides, as ATen's result has."""
    if base.dim() == 0 or src.dtype != base.dtype:
        return NotImplemented
    if not base.is_contiguous():
        order = dense_order(base)
        if order is None or src.dim() != base.dim():
            return NotImplemented
        out = slice_scatter(base.permute(order), src.permute(order), order.index(dim % base.dim()),
                            start, end, step)
        if out is NotImplemented:
            return out
        return out.permute(sorted(range(base.dim()), key=order.__getitem__))
    dim %= base.dim()
    bounds = _bounds(base.shape[dim], start, end, step)
    if bounds is None or not all(type(s) is int for s in base.shape):
        return NotImplemented
    start, end = bounds
    if src.dim() != base.dim() or src.shape[dim] != -(-(end - start) // step):
        return NotImplemented
    if step == 1:
        parts = [aten.slice(base, dim, 0, start), src, aten.slice(base, dim, end, base.shape[dim])]
        parts = [p for p in parts if p.shape[dim] > 0]
        return aten.cat(parts, dim) if len(parts) > 1 else parts[0].clone()
    where = spread(torch.ones_like(src, dtype=torch.bool), dim, step, start, base.shape[dim])
    return torch.where(where, spread(src, dim, step, start, base.shape[dim]), base)


def _one_per_line(base, dim, index):
    """Whether ``scatter(base, dim, index, ...)`` writes one element of each line along
    ``dim``: the index of size 1 there, of base's size in every other dim, static sizes."""
    if base.dim() == 0 or index.dim() != base.dim() or index.dtype != torch.int64:
        return False
    dim %= base.dim()
    return all(type(s) is int for s in (*base.shape, *index.shape)) and index.shape[dim] == 1 \
        and all(i == b for d, (i, b) in enumerate(zip(index.shape, base.shape)) if d != dim)


def _chosen(base, dim, index):
    """``arange(n) == index`` along ``dim`` (n: base's size there), broadcast to base's shape.
    The index is read through ``index_select`` of an arange, which is the index itself where it
    is in range and, as ATen's scatter does, an error where it is not (the kernel's gather
    asserts its index)."""
    dim %= base.dim()
    n = base.shape[dim]
    positions = torch.arange(n, device=base.device)
    checked = aten.index_select(positions, 0, index.reshape(-1)).view(index.shape)
    return positions.view([n if d == dim else 1 for d in range(base.dim())]) == checked


def _shares_memory(base) -> bool:
    """Whether elements of ``base`` overlap in memory (ATen's MemOverlap::Yes): a stride of 0
    where the size is more than 1 (a symbolic size is: 0 and 1 are specialized), or, with
    static sizes and strides, strides that meet."""
    if any(type(st) is int and st == 0 and (type(n) is not int or n > 1)
           for n, st in zip(base.shape, base.stride())):
        return True
    return all(type(s) is int for s in (*base.shape, *base.stride())) \
        and torch._debug_has_internal_overlap(base) == 1


def into_a_copy(op, decomposition=None):
    """A decomposition of the scatter ``op`` (slice, select, diagonal or as_strided scatter):
    where the base's elements share memory, ``op`` into a contiguous ``clone`` of it (module
    docstring), else ``decomposition`` or ATen's op (NotImplemented)."""
    def decompose(base, *args, **kwargs):
        if _shares_memory(base):
            return op(aten.clone(base, memory_format=torch.contiguous_format), *args, **kwargs)
        return NotImplemented if decomposition is None else decomposition(base, *args, **kwargs)
    decompose.__name__ = f"into_a_copy({op})"
    return decompose


def scatter_value(base, dim, index, value):
    """``base.scatter(dim, index, value)`` writing one element of each line along ``dim``
    (cross entropy's backward: the target's one-hot, times the gradient; a max's backward):
    ``where(arange(n) == index, value, base)``, pointwise, so the row kernel reading it
    computes it, instead of ATen's copy of base and scatter kernel. Other forms keep ATen's."""
    if not _one_per_line(base, dim, index):
        return NotImplemented
    return torch.where(_chosen(base, dim, index), torch.scalar_tensor(value, dtype=base.dtype,
                                                                      device=base.device), base)


def scatter_src(base, dim, index, src):
    """``base.scatter(dim, index, src)`` writing one element of each line along ``dim``: as
    ``scatter_value``, with ``src``'s values at index's positions."""
    if not _one_per_line(base, dim, index) or src.dtype != base.dtype or src.dim() != base.dim() \
            or any(s < i for s, i in zip(src.shape, index.shape)):
        return NotImplemented
    for d, i in enumerate(index.shape):
        if src.shape[d] != i:
            src = aten.slice(src, d, 0, i)
    return torch.where(_chosen(base, dim, index), src, base)


def constant_pad_nd(x, pad, value=0):
    """A pad with negative amounts (a crop: the backward of a pad is one, as in Swin's
    windows or ``spread``'s gradient) as a slice of what is cropped, then the pad of what is
    left, both index arithmetic; ATen's op otherwise (NotImplemented), or where a pad or size
    is symbolic."""
    pad = list(pad)
    if not pad or len(pad) % 2 or len(pad) // 2 > x.dim() \
            or not all(type(p) is int for p in pad) or min(pad) >= 0:
        return NotImplemented
    out = x
    for k in range(len(pad) // 2):
        dim = x.dim() - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        n = out.shape[dim]
        if type(n) is not int or n + min(before, 0) + min(after, 0) < 0:
            return NotImplemented
        if before < 0 or after < 0:
            out = aten.slice(out, dim, max(0, -before), n - max(0, -after))
    rest = [max(0, p) for p in pad]
    return aten.constant_pad_nd(out, rest, value) if any(rest) else out.clone()
