"""Constant folding: tensors computed from constants alone are computed once, at compile time.

Hugging Face's GPT-2 builds its attention mask from the positions, and the positions from
``arange(seq)``: with no ``attention_mask`` given, ``arange -> cat/sub/ne -> cumsum -> index ->
le/eq/and -> where`` depends on no input at all, yet runs on every call (on the H200's host,
``index`` 46 us and ``cumsum`` 34 us each, beside the kernels the rest becomes). Here every value
whose inputs are all constants is computed once, when the graph is compiled, and the graph reads
the kept tensor (a non-persistent buffer of the graph module).

A value is folded when
- it is a call of an ATen op that is pure: no mutable argument, not random
  (``nondeterministic_seeded``), not an ``empty`` (uninitialized memory);
- every tensor it reads is folded too (so the roots are factories with constant arguments:
  ``arange(512)``, ``full([], True)``); a size read from an input (``sym_size``) is not constant;
- the tensor it produces spans at most ``MAX_BYTES`` of memory (a constant is kept for the
  graph's lifetime), and the op, run now, gives exactly the traced size, strides and dtype.
Only the values the rest of the graph reads are kept; the other folded nodes disappear. A
node whose op and arguments equal an earlier folded node's is replaced by it before it is
evaluated (dedupe.py's rule: the model built the same constant twice; Hugging Face's GPT-2,
compiled, builds its mask in each of its twelve layers). A kept
value may not be a graph output, or a view of one: the caller could write to it, and eager
PyTorch returns a new tensor on each call. Those are computed at run time, from kept inputs.
Nor is a lone factory call kept here (``full([], -inf)``, ``arange(n)``): a kernel that reads it
makes it for free, as a literal or from its index, where a kept tensor would be one more load.
Those a kernel did not take in are kept after partition (``factories``, run by fast_calls).

Values are computed on the CPU where that gives the device's bits: integers and booleans, and
ops that compute nothing (views, ``where``, ``cat``, ``index``, a ``full``) whatever their dtype.
A float op with arithmetic runs on the graph's device, its inputs moved there. Only the kept
values are moved (their storage whole, so an expanded view keeps its strides). On the GPU each
ATen op's first use in a process loads its CUDA kernels; the CPU's ops are loaded already. (A
sampled profile of a warm GPT-2 compile on the H200 put this pass at 0.55 s: an over-count, as
the sampling thread runs when CUDA calls release the GIL; the change made no difference to the
warm compile that session 35's runs could see.)

Two rewrites use the folded values. ``embedding(weight, idx)`` with a constant ``idx`` of
consecutive indices ``[start, start + n)`` (GPT-2's positions) is a slice of the weight's rows,
a view that fuses into its reader, instead of a gather. And ``x[i0, i1, ...]`` with constant
index tensors on adjacent dims (Hugging Face's masks pick ``padding_mask[batch_idx, kv_idx]``
with aranges) is one gather, ``index_select`` of those dims merged by the linear index
``i0 * n1 * ... + i1 * ... + ...``, which joins the kernel that reads it: on ATen an index
kernel, and a kernel of its own for what computes ``x`` (the mask's conversion to bool).
The indices are checked against their dims' sizes now: an index out of range keeps ATen's op
and its error.
"""
from __future__ import annotations

import logging
import math

import torch
from torch.fx.node import map_arg

from .index_rows import wrap_negative
from .pad_gemm import emit
from .shapes import mergeable

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")

MAX_BYTES = 16 << 20
PREFIX = "_fc_constant"
UNINITIALIZED = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")
# factories: results made from their (constant) arguments alone
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
FACTORIES = {*ARANGES, aten.full.default, aten.zeros.default, aten.ones.default,
             aten.scalar_tensor.default}


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Fold ``gm``'s constant values in place; ``ctx.constants`` names each one kept."""
    from .dedupe import duplicate_of

    values, first = {}, {}
    outputs = graph_outputs(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and is_pure(node.target) \
                and all(a in values for a in node.all_input_nodes):
            # the same op of the same folded values (GPT-2's mask, built again in each of its
            # twelve layers: 4 MB a copy in bf16 at 8 x 512) is computed and kept once, by
            # dedupe.py's rule
            same, key = duplicate_of(node, first, outputs)
            if same is not None:
                node.replace_all_uses_with(same)
                gm.graph.erase_node(node)
                continue
            value = _evaluate(node, values)
            if value is not None:
                values[node] = value
                if key is not None:
                    first.setdefault(key, node)
    if not values:
        return gm
    _consecutive_embeddings(gm, values)
    _constant_picks(gm, values)
    made, unfolded = _from_index(values), set()
    while True:
        kept = [n for n in values if any(u not in values for u in n.users)]
        # a value that is, or is aliased by, an output is computed at run time; so is a lone
        # factory call, which a kernel reading it computes for free (a literal, an index), and
        # a mask made of aranges that only kernels read (they compute it from their index),
        # with what it is made of
        left = [n for n in kept if reaches_output(n, outputs) or n.target in FACTORIES
                or (n in made and _computed_by_kernels(n, values, unfolded))]
        if not left:
            break
        for n in left:
            del values[n]
        unfolded.update(n for n in left if n in made)
    for node in kept:
        _keep(gm, node, placed(values[node], node))
        ctx.constants.append((node.name, _span_bytes(values[node])))
    for node in reversed(list(gm.graph.nodes)):
        if node in values and not node.users:
            gm.graph.erase_node(node)
    if kept:
        log.info("fusion-compiler: %d constant tensors computed at compile time (%d nodes)",
                 len(kept), len(values))
    return gm


# views and integer/bool arithmetic a kernel computes from its index: a mask made of aranges
# (``tril(ones(n, n))`` is traced as ``arange(n)[None, :] - arange(n)[:, None] <= k``)
INDEX_OPS = {
    aten.unsqueeze.default, aten.expand.default, aten.view.default, aten.permute.default,
    aten.slice.Tensor, aten.select.int, aten.squeeze.dim, aten.alias.default,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.neg.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor,
    aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
    aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.bitwise_not.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.minimum.default,
    aten.maximum.default}
# and what selects or casts exact values into a float mask (``where(causal, 0, -inf)``)
SELECTING = {aten.where.self, aten.masked_fill.Scalar, aten._to_copy.default}


def _from_index(values: dict) -> set:
    """The folded values a kernel computes from its index alone: integer aranges, constants,
    and integer/bool arithmetic and views of them, selections and casts of those."""
    made = set()
    for node in values:             # in graph order: inputs first
        dtype = values[node].dtype
        if node.target in FACTORIES:
            ok = not (node.target in ARANGES and dtype.is_floating_point)
        elif node.target in INDEX_OPS:
            ok = not dtype.is_floating_point and not dtype.is_complex
        else:
            ok = node.target in SELECTING
        if ok and all(a in made for a in node.all_input_nodes):
            made.add(node)
    return made


def _computed_by_kernels(node, values: dict, unfolded: set) -> bool:
    """Whether kernels compute ``node`` (made of aranges, ``_from_index``) from their index:
    it is part of a mask they compute already (all its readers left in the graph are such
    parts), or it is a mask (bool, or a float selection of one) whose every reader left in
    the graph is an op a kernel computes (a pointwise op, a reduction, a scan;
    classify.OP_KINDS) on its device. Integer values read by the graph stay folded: a max
    pool's window positions computed so gave wrong gradients on an H100 in bf16/fp16 (not on
    the CPU, not in fp32; session 58, not understood), loaded they are right."""
    from .classify import OP_KINDS, OpKind

    readers = [u for u in node.users if u not in values]
    if all(u in unfolded for u in readers):
        return True
    if not _mask(node):
        return False
    device = node.meta["val"].device
    return all(OP_KINDS.get(u.target, OpKind.OPAQUE) is not OpKind.OPAQUE
               and isinstance(u.meta.get("val"), torch.Tensor)
               and u.meta["val"].device == device for u in readers)


def _mask(node) -> bool:
    """Whether ``node``'s value is a boolean mask, or a float selection or cast of one (not
    a number computed from aranges: ``_computed_by_kernels``)."""
    dtype = node.meta["val"].dtype
    if dtype == torch.bool:
        return True
    if not dtype.is_floating_point or node.target not in SELECTING:
        return False
    return node.target is not aten._to_copy.default or _mask(node.args[0])


def factories(gm: torch.fx.GraphModule) -> int:
    """The factory calls with constant arguments still in ``gm`` after partition (no kernel
    took them in: ``arange`` for an ATen op, ``full`` for SDPA's mask) made once, now, and
    kept; not where the tensor, or a view of it, is returned. How many were kept."""
    outputs = graph_outputs(gm)
    kept = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in FACTORIES \
                or node.all_input_nodes or reaches_output(node, outputs):
            continue
        value = _evaluate(node, {})
        if value is not None:
            _keep(gm, node, placed(value, node))
            gm.graph.erase_node(node)
            kept += 1
    return kept


def graph_outputs(gm: torch.fx.GraphModule) -> set:
    """The nodes the graph returns."""
    return set(next(n for n in reversed(gm.graph.nodes) if n.op == "output").all_input_nodes)


def is_pure(target) -> bool:
    """A call of an ATen op that is not mutable, not random and not an uninitialized allocation."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags \
        and schema.name.split("::")[-1] not in UNINITIALIZED


def _span_bytes(t: torch.Tensor):
    """Bytes of memory ``t`` spans (an expanded view: its storage's), or None if symbolic."""
    sizes, strides = tuple(t.shape), t.stride()
    if not all(type(v) is int for v in (*sizes, *strides)):
        return None
    if 0 in sizes:
        return 0
    return (1 + sum((s - 1) * abs(st) for s, st in zip(sizes, strides))) * t.element_size()


# ops that compute no new number from their inputs' (views aside): their results are the same
# bits on every device, whatever the dtype
SELECTIONS = {aten.where.self, aten.cat.default, aten.index.Tensor, aten.clone.default,
              aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.full.default,
              aten.zeros.default, aten.ones.default, aten.scalar_tensor.default}


def _exact_anywhere(node, values) -> bool:
    """Whether ``node`` computes the same bits on the CPU as on its device."""
    if node.target in SELECTIONS or _aliases(node):     # a view computes nothing
        return True
    dtypes = [node.meta["val"].dtype] + [values[a].dtype for a in node.all_input_nodes]
    return not any(d.is_floating_point or d.is_complex for d in dtypes)


def _evaluate(node, values):
    """The node's real value, or None where it cannot be trusted to equal the traced one. It is
    computed on the CPU where that gives the same bits (``_exact_anywhere``): ``placed`` moves
    it to its device."""
    traced = node.meta.get("val")
    if not isinstance(traced, torch.Tensor) or traced.layout != torch.strided:
        return None
    span = _span_bytes(traced)
    if span is None or span > MAX_BYTES or not isinstance(traced.storage_offset(), int):
        return None
    host = traced.device.type != "cpu" and _exact_anywhere(node, values)
    where = torch.device("cpu") if host else traced.device

    def arg(a):
        # on the CPU, every input too: a ``where`` of float values computed on the device
        # (``linspace``'s two halves) raised there, mixing devices, and stayed unfolded: 30
        # tests whose functions make a linspace counted 2 kernels for 1 on the H100 (session
        # 67; all passed with this, session 68)
        return _moved(values[a], where) if host else placed(values[a], a)
    args, kwargs = map_arg(node.args, arg), map_arg(node.kwargs, arg)
    if host and "device" in kwargs:                     # a factory
        kwargs = {**kwargs, "device": where, "pin_memory": False}
    try:
        with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
            value = node.target(*args, **kwargs)
    except Exception:           # a device this machine lacks, an op that needs its inputs' data
        return None
    if not isinstance(value, torch.Tensor) or value.dtype != traced.dtype \
            or value.device != where or value.shape != traced.shape \
            or value.stride() != traced.stride() \
            or value.storage_offset() != traced.storage_offset():
        return None
    return value


def placed(value: torch.Tensor, node) -> torch.Tensor:
    """``value`` (computed for ``node``) on ``node``'s device."""
    return _moved(value, node.meta["val"].device)


def _moved(value: torch.Tensor, device) -> torch.Tensor:
    """``value`` on ``device``: its whole storage copied there, the same view of it (sizes,
    strides, offset) taken."""
    if value.device == device:
        return value
    with torch.utils._python_dispatch._disable_current_modes():
        storage = value.new_empty(0).set_(value.untyped_storage())    # the storage, 1-D
        return storage.to(device).as_strided(value.shape, value.stride(),
                                             value.storage_offset())


def reaches_output(node, outputs) -> bool:
    """Whether ``node``'s tensor, or a view of it, is a graph output."""
    return node in outputs or any(_aliases(u) and reaches_output(u, outputs) for u in node.users)


def _aliases(node) -> bool:
    """Whether ``node``'s result may share memory with an input (a view), or is unknown."""
    if node.op != "call_function" or node.meta.get("fc_launcher") is not None:
        return False                # a generated kernel's outputs are its own allocations
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _keep(gm, node, value) -> torch.fx.Node:
    """Replace ``node`` by a get_attr of ``value``, registered on ``gm``."""
    name = f"{PREFIX}_{node.name}"
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, value, persistent=False)
    with gm.graph.inserting_before(node):
        const = gm.graph.get_attr(name)
    const.meta = dict(node.meta)
    node.replace_all_uses_with(const)
    return const


def _consecutive_embeddings(gm, values: dict) -> None:
    """``embedding(w, idx)`` with a folded ``idx`` holding ``start, start + 1, ...`` in order:
    ``w[start:start + n].view(*idx.shape, dim)``, the same values without a gather."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding.default \
                or node.args[1] not in values:
            continue
        weight, index = node.args[0], values[node.args[1]]
        w = weight.meta.get("val")
        if index.dtype not in (torch.int64, torch.int32) or index.numel() == 0 \
                or not isinstance(w, torch.Tensor) or w.dim() != 2 \
                or not all(type(s) is int for s in w.shape):
            continue
        start = _consecutive_from(index)
        if start is None or start < 0 or start + index.numel() > w.shape[0]:
            continue
        mode = w.fake_mode
        with gm.graph.inserting_before(node):
            rows = emit(gm, aten.slice.Tensor, (weight, 0, start, start + index.numel()), mode)
            view = emit(gm, aten.view.default, (rows, [*index.shape, w.shape[1]]), mode)
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)


def _constant_picks(gm, values: dict) -> None:
    """``index.Tensor(x, [..., i0, i1, ...])`` with two or more folded integer index tensors on
    adjacent dims d, d + 1, ... of ``x``, in range, those dims mergeable in a view: an
    ``index_select`` along the merged dim by the linear index (module docstring)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index.Tensor \
                or len(node.args) != 2 or node.kwargs or node in values:
            continue
        x, indices = node.args
        at = [k for k, i in enumerate(indices) if i is not None]
        if len(at) < 2 or at != list(range(at[0], at[0] + len(at))) \
                or not all(indices[k] in values for k in at):
            continue
        picks = [values[indices[k]] for k in at]
        xv, out = x.meta.get("val"), node.meta.get("val")
        if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) \
                or not all(type(s) is int for s in xv.shape) \
                or any(p.dtype not in (torch.int32, torch.int64) for p in picks):
            continue
        d, m = at[0], len(at)
        sizes = xv.shape[d:d + m]
        if not mergeable(xv, d, d + m):
            continue                        # the dims do not merge in a view
        with torch.utils._python_dispatch._disable_current_modes():
            try:
                shape = torch.broadcast_shapes(*(p.shape for p in picks))
            except RuntimeError:
                continue                    # ATen's error
            if not all(bool(((p >= -n) & (p < n)).all()) for p, n in zip(picks, sizes)):
                continue                    # ATen's error for an index out of range
            negative = [bool((p < 0).any()) for p in picks]
        mode = xv.fake_mode
        made = []
        with gm.graph.inserting_before(node):
            linear = None
            for k, (n, neg) in enumerate(zip(sizes, negative)):
                idx = indices[d + k]
                if neg:
                    made += wrap_negative(gm, idx, n, mode)
                    idx = made[-1]
                step = math.prod(sizes[k + 1:])
                if step != 1:
                    idx = emit(gm, aten.mul.Tensor, (idx, step), mode)
                    made.append(idx)
                if linear is not None:
                    idx = emit(gm, aten.add.Tensor, (linear, idx), mode)
                    made.append(idx)
                linear = idx
            merged = [*xv.shape[:d], math.prod(sizes), *xv.shape[d + m:]]
            made.append(emit(gm, aten.reshape.default, (linear, [-1]), mode))
            made.append(emit(gm, aten.view.default, (x, merged), mode))
            made.append(emit(gm, aten.index_select.default, (made[-1], d, made[-2]), mode))
            made.append(emit(gm, aten.view.default,
                             (made[-1], [*xv.shape[:d], *shape, *xv.shape[d + m:]]), mode))
        got = made[-1].meta["val"]
        if (got.shape, got.stride(), got.dtype) != (out.shape, out.stride(), out.dtype):
            for n in reversed(made):
                gm.graph.erase_node(n)
            continue
        node.replace_all_uses_with(made[-1])
        gm.graph.erase_node(node)


def _consecutive_from(index: torch.Tensor):
    """``i`` if ``index`` holds ``i, i + 1, ...`` in row-major order, else None."""
    with torch.utils._python_dispatch._disable_current_modes():     # a real tensor
        flat = index.reshape(-1)
        start = int(flat[0])
        expected = torch.arange(start, start + flat.numel(), device=flat.device, dtype=flat.dtype)
        return start if torch.equal(flat, expected) else None
