"""Where a row kernel may store an output that is not per element or per row of its
reduction (codegen/lower.py asks, for ``iteration_space`` and for each store):

- ``layout_chain``: a per-element value laid out again by views, permutes, a clone, a zero
  padding or a roll (Swin's cyclic shift and window partition after its LayerNorm), stored at
  the index ``push_index`` maps each element to;
- ``pulled``: a value the rows are a view of, each element once (a column sum's input, summed
  as rows of its permuted view: passes/column_sums.py), stored at the index the views read
  each element of the iteration from, where the reduction computed it;
- ``reshaped``: a value of as many elements in another shape, computed by pointwise ops from
  the rows reshaped (GroupNorm's [N, C, H, W] output of its [N, groups, C/groups * HxW] rows),
  computed and stored at the index the reshape gives each element of the iteration;
- ``alongside``: a value of the shape of one that is ``pulled``, computed and stored at the
  index that one's chain gives each element of the iteration (a channels-first LayerNorm's
  output beside the input whose permuted view the rows are);
- ``traced``: a value computed element for element, by views and elementwise ops, from a value
  of the iteration's shape (Mamba2's segment sums decayed in another layout than the
  cumsum's rows), computed and stored at the index the chain's views move each element to;
- ``read_beside``: a value that, laid out by views, is an operand of an elementwise op on such
  a chain, of the op's own shape (the bmm's result that those decays multiply, in the layout
  the backward reads): stored where that op reads it.

A pointwise kernel with outputs of several shapes iterates over one of them where the others
are views of it (``pointwise_shape``), and stores those by the same chains (``moved``:
``layout_chain``, ``pulled``, ``alongside``, ``traced``).
"""
from __future__ import annotations

import sympy

from .indexing import INDEX_OPS, flip_index, roll_index, view_index
from .kernel_ir import KernelIR, ref_id
from .lowered import GATHERS, REDUCTIONS, SCANS, VIEWS, flat_args
from .ops import CASTS, ELEMENTWISE


# ops that only lay out their one input again: an output reached from a per-element value of
# a row kernel through them is that value stored at another address (Swin's window partition,
# and its cyclic shift before it: a roll)
ROLL = "aten.roll.default"
FLIP = "aten.flip.default"
_LAYOUT = VIEWS | {"aten.permute.default", "aten.transpose.int", "aten.t.default",
                   "aten.clone.default", "aten.alias.default", "aten.detach.default",
                   "aten.unsqueeze.default", "aten.squeeze.dim", "aten.constant_pad_nd.default",
                   ROLL, FLIP}


# views that read each element of their input once: an output that reaches the rows through them
# is stored where the rows read it
_PULL = VIEWS | {"aten.permute.default", "aten.transpose.int", "aten.t.default",
                 "aten.alias.default", "aten.detach.default", "aten.unsqueeze.default",
                 "aten.squeeze.dim"}


_MOVES = {"aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.as_strided.default",
          "aten.cat.default", "aten.constant_pad_nd.default", ROLL, FLIP} | set(GATHERS)


def reshaped(ir: KernelIR, vid: int, shape: tuple) -> bool:
    """Whether value ``vid`` may be an output of a row kernel over ``shape`` in another shape:
    as many elements, in the same order, computed by pointwise ops from the rows' values
    reshaped (a GroupNorm's [N, C, H, W] output of its [N, groups, C/groups * H * W] rows, and
    the SiLU after it). Stored where the reshape puts each element of the iteration, by the
    output's strides. Nothing on the way may move elements (a permute, a cat, a gather...):
    each element is computed where its row is."""
    def numel(s):
        return sympy.Mul(*s) if s else sympy.Integer(1)
    out = ir.values[vid].shape
    if not out or tuple(out) == tuple(shape) or sympy.simplify(numel(out) - numel(shape)) != 0:
        return False
    n_in, stack, seen = len(ir.inputs), [vid], set()
    while stack:                # the ops computing vid in its own shape, back to the rows
        v = stack.pop()
        if v in seen or v < n_in or ir.values[v].shape != out:
            continue
        seen.add(v)
        op = ir.ops[v - n_in]
        if op.target in _MOVES or op.target in REDUCTIONS or op.target in SCANS:
            return False
        stack.extend(r for r in map(ref_id, flat_args(op.args)) if r is not None)
    return True


def alongside(ir: KernelIR, vid: int, shape: tuple):
    """A chain as ``pulled``'s from another value of ``vid``'s shape to the rows, or None:
    ``vid`` is then evaluated and stored at the index that chain pulls each element of the
    iteration back to, which walks its shape once (a channels-first LayerNorm's [N, C, H, W]
    output, computed from x and the means over ``permute(x)``'s rows: passes/middle_dims.py).
    Any op may compute it there; a reduction read at another row than its own is refused
    where it is read (``Lowering._reduction_value``)."""
    out = ir.values[vid].shape
    if not out or tuple(out) == tuple(shape):
        return None
    for v, value in enumerate(ir.values):
        if v != vid and tuple(value.shape) == tuple(out):
            chain = pulled(ir, v, shape)
            if chain is not None:
                return chain
    return None


def pulled(ir: KernelIR, vid: int, shape: tuple):
    """[(op, result id), ...] from value ``vid`` (not of ``shape``) to a value of the row kernel's
    ``shape`` through views that read each element once (``_PULL``), or None. The row kernel
    evaluates ``vid`` at the index those views pull each element of the iteration back to
    (``Lowering._source_index`` along the chain, last op first): there it is stored, each
    element once."""
    n_in = len(ir.inputs)
    readers: dict = {}
    for j, op in enumerate(ir.ops):
        if op.target in _PULL and op.args and ref_id(op.args[0]) is not None:
            readers.setdefault(ref_id(op.args[0]), []).append(n_in + j)
    stack = [(vid, [])]
    while stack:
        v, chain = stack.pop()
        if chain and ir.values[v].shape == shape:
            return chain
        stack.extend((r, chain + [(ir.ops[r - n_in], r)]) for r in readers.get(v, ()))
    return None


# ops an element keeps its place through (push_index maps it), besides elementwise ops
_TRACE = VIEWS | {"aten.permute.default", "aten.transpose.int", "aten.t.default",
                  "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims"}


def traced(ir: KernelIR, vid: int, shape: tuple):
    """(root, [(op, result id), ...]) where value ``vid`` is computed element for element from
    a value ``root`` of ``shape``: through views that keep each element (``_TRACE``) and
    elementwise ops, each from an operand of its own shape; else None. ``vid`` is evaluated and
    stored at the index the chain's views move each element of the iteration to
    (``push_index``), each element once: transformers 5.17's Mamba2 computes its decayed
    scores in the [c, l, s, h] layout of the cumsum's [h, c, l, s] rows, permuted back."""
    n_in = len(ir.inputs)
    stack, seen = [(vid, [])], set()
    while stack:
        v, chain = stack.pop()
        if chain and tuple(ir.values[v].shape) == tuple(shape):
            return v, chain[::-1]
        if v < n_in or v in seen:
            continue
        seen.add(v)
        op = ir.ops[v - n_in]
        if op.target in _TRACE:
            sources = [ref_id(op.args[0])]
        elif op.target in ELEMENTWISE:
            sources = [r for r in map(ref_id, flat_args(op.args)) if r is not None
                       and tuple(ir.values[r].shape) == tuple(ir.values[v].shape)]
        else:
            continue
        stack.extend((r, chain + [(op, v)]) for r in sources if r is not None)
    return None


def read_beside(ir: KernelIR, vid: int, shape: tuple):
    """(root, chain, views) where value ``vid``, laid out by views that keep each element
    (``_TRACE``, ``views``: [(op, result id), ...] from ``vid`` on), is an operand of an
    elementwise op of ``chain`` of its result's own shape, ``chain`` the first ops of one
    ``traced`` gives another output (``root`` of ``shape`` first); else None. The kernel
    evaluates that op at each element of its result once, so ``vid`` at each of its own once:
    it is stored there, at the index ``chain`` moves the iteration to, pulled back through
    ``views``. Mamba2's chunked scan multiplies the segment sums' decays by a bmm's result
    laid out by a clone that backward reads too (transformers 5.17): the clone is written by
    the row kernel that reads the bmm's result, where a kernel of its own wrote it and the
    row kernel read it back."""
    n_in = len(ir.inputs)
    for o in ir.outputs:
        if o == vid or tuple(ir.values[o].shape) == tuple(shape):
            continue
        found = traced(ir, o, shape)
        if found is None:
            continue
        root, chain = found
        for k, (op, rid) in enumerate(chain):
            if op.target not in ELEMENTWISE:
                continue
            for r in map(ref_id, flat_args(op.args)):
                if r is None or tuple(ir.values[r].shape) != tuple(ir.values[rid].shape):
                    continue
                views = []
                while r != vid and r >= n_in and ir.ops[r - n_in].target in _TRACE:
                    views.append((ir.ops[r - n_in], r))
                    r = ref_id(ir.ops[r - n_in].args[0])
                if r == vid:
                    return root, chain[:k + 1], views[::-1]
    return None


def moved(ir: KernelIR, vid: int, shape: tuple):
    """How a pointwise kernel over ``shape`` stores value ``vid`` of another shape, or None:
    ("push", (root, ops)), a value of ``shape`` laid out again (``layout_chain``, padding none:
    a launcher zeroes a pad's margins for row kernels alone), or ("pull", ops), ``vid`` read
    by views to ``shape`` (``pulled``), or of the shape of a value that is (``alongside``), or
    ("trace", (root, ops)), computed element for element from a value of ``shape``
    (``traced``). Each way each element once, at the index the views give it."""
    chain = layout_chain(ir, vid, shape)
    if chain is not None and all(op.target != "aten.constant_pad_nd.default"
                                 or not any(op.args[1]) for op, _ in chain[1]):
        return "push", chain
    chain = pulled(ir, vid, shape)
    if chain is None:
        chain = alongside(ir, vid, shape)
    if chain is not None:
        return "pull", chain
    chain = traced(ir, vid, shape)
    return None if chain is None else ("trace", chain)


def pointwise_shape(ir: KernelIR):
    """The shape a pointwise kernel with outputs of several shapes iterates over: the first
    shape, of the outputs' by how many have it and then of the values the kernel computes, where
    each output of another shape is a view of a value of it, each element once
    (``moved``: a bmm's output in the layout a later op reads, written beside that
    op's result). None where there is none."""
    shapes = [ir.values[o].shape for o in ir.outputs]
    numels = {sympy.expand(sympy.Mul(*s)) for s in shapes}
    if len(numels) != 1:
        return None             # no view holds each element of another size once
    n = numels.pop()
    computed = [s for s in dict.fromkeys(v.shape for v in ir.values[len(ir.inputs):])
                if sympy.expand(sympy.Mul(*s) - n) == 0]
    for shape in dict.fromkeys(sorted(shapes, key=lambda s: -shapes.count(s)) + computed):
        if all(s == shape or moved(ir, o, shape) is not None
               for o, s in zip(ir.outputs, shapes)):
            return shape
    return None


def layout_chain(ir: KernelIR, vid: int, shape: tuple):
    """(root, [(op, result id), ...]) if value ``vid`` of a row kernel over ``shape`` is a
    per-element value ``root`` laid out again by those ops (root first: views, permutes, a
    clone, a roll, a flip, and last a padding with zeros), each element once; else None. A
    padding is the last op only: the kernel stores the values inside it, the launcher zeroes
    the slabs around (``pad_slabs``): a slice's gradient that a GEMM reads (the logits'
    gradient of a causal LM's loss over ``logits[:, :-1]``, padded back by one position) is
    written once, where a pad kernel of its own copied all of it. A roll or a flip
    keeps the shape, so the walk goes on through those of the reduction's shape too, but for a
    flip of the row itself, which is read backwards where it is stored (a cumsum's gradient,
    the flipped cumsum of the flipped gradient, is then a reverse scan: ``Lowering._scan``)."""
    ops, n_in = [], len(ir.inputs)

    def moves_within(v):
        op = ir.ops[v - n_in]
        return op.target == ROLL or op.target == FLIP and all(
            d % len(shape) != len(shape) - 1 for d in op.args[1])
    while ir.values[vid].shape != shape or (vid >= n_in and moves_within(vid)):
        if vid < n_in:
            return None
        op = ir.ops[vid - n_in]
        src = ref_id(op.args[0]) if op.args else None
        if src is None or op.target not in _LAYOUT and not _float_cast(ir, op, vid, src):
            return None
        if op.target == "aten.constant_pad_nd.default" and any(p != 0 for p in op.args[1]) \
                and (ops or not _zero_pad(op)):
            return None
        if op.target == "aten.clone.default" and str(dict(op.kwargs).get("memory_format")) not in (
                "None", "torch.contiguous_format", "torch.preserve_format",
                "torch.channels_last", "torch.channels_last_3d"):
            return None         # the IR spells a memory format as its str; the store uses
                                # the output's strides, whichever format made them
        ops.append((op, vid))
        vid = src
    return (vid, ops[::-1]) if ops else None


def _float_cast(ir: KernelIR, op, vid: int, src: int) -> bool:
    """Whether ``op`` (computing ``vid`` from ``src``) converts one float dtype to another,
    element for element, in the same shape: the chain's store rounds the value there
    (``Lowering``: ``ops.cast`` on the register)."""
    a, b = ir.values[src], ir.values[vid]
    return (op.target in CASTS and a.shape == b.shape and a.dtype.is_floating_point
            and b.dtype.is_floating_point
            and set(dict(op.kwargs)) <= {"dtype", "layout", "device", "memory_format"}
            and str(dict(op.kwargs).get("memory_format")) in ("None", "torch.preserve_format"))


def _zero_pad(op) -> bool:
    """Whether a constant_pad_nd op pads with zeros on one side of one dim (one slab for the
    launcher to zero: one small fill launch; a pad kernel of its own is one launch too, so a
    pad of several margins is left to it) and crops nothing."""
    value = op.args[2] if len(op.args) > 2 else dict(op.kwargs).get("value", 0)
    pads = op.args[1]
    return value == 0 and all(isinstance(p, int) and p >= 0 for p in pads) \
        and sum(1 for p in pads if p) == 1


def pad_slabs(ir: KernelIR, vid: int, shape: tuple) -> list:
    """(dim, start, length) of each slab a row kernel over ``shape`` leaves for its launcher to
    zero in output ``vid``: the pad's own margins, where ``layout_chain`` ends in a padding."""
    chain = layout_chain(ir, vid, shape)
    if chain is None or chain[1][-1][0].target != "aten.constant_pad_nd.default":
        return []
    op, out = chain[1][-1]
    dims, pads = ir.values[out].shape, list(op.args[1])
    slabs = []
    for k in range(len(pads) // 2):
        d = len(dims) - 1 - k
        lo, hi = pads[2 * k], pads[2 * k + 1]
        if lo:
            slabs.append((d, sympy.Integer(0), sympy.Integer(lo)))
        if hi:
            slabs.append((d, dims[d] - hi, sympy.Integer(hi)))
    return slabs


def push_index(index: tuple, ir: KernelIR, root: int, ops: list, hints: dict) -> tuple:
    """The index into the last of ``ops``' results of the element at ``index`` of ``root``."""
    shape = ir.values[root].shape
    for op, vid in ops:
        t, out = op.target, ir.values[vid].shape
        if t in VIEWS:
            index = view_index(index, shape, out, hints)     # a reshape maps both ways alike
        elif t == "aten.permute.default":
            index = tuple(index[d % len(shape)] for d in op.args[1])
        elif t in ("aten.transpose.int", "aten.t.default"):
            index = INDEX_OPS[t](index, op.args, shape)      # its own inverse
        elif t == "aten.unsqueeze.default":
            d = op.args[1] % len(out)
            index = index[:d] + (sympy.Integer(0),) + index[d:]
        elif t == "aten.squeeze.dim":
            d = op.args[1] % len(shape)
            index = index[:d] + index[d + 1:] if shape[d] == 1 else index
        elif t == "aten.squeeze.dims":
            gone = {d % len(shape) for d in op.args[1] if shape[d % len(shape)] == 1}
            index = tuple(i for d, i in enumerate(index) if d not in gone)
        elif t == ROLL:
            index = roll_index(index, op.args, shape, forward=True)
        elif t == FLIP:
            index = flip_index(index, op.args, shape)
        elif t == "aten.constant_pad_nd.default":      # inside the margins: shifted by the first
            pads = list(op.args[1])
            index = tuple(i + (pads[2 * (len(out) - 1 - d)] if 2 * (len(out) - 1 - d) < len(pads)
                               else 0) for d, i in enumerate(index))
        shape = out
    return index
