"""Depthwise 1-d convolutions with few taps as sums of shifted products, channels innermost
(Dynamo graph, pre-ATen).

The Mamba family's PyTorch path (Mamba, Mamba2, Bamba, Jamba, Falcon-H1, Zamba2: transformers
runs it where the ``causal_conv1d`` package is missing, and torch.compile always traces it)
mixes each channel over its last few time steps with a depthwise convolution of a transposed
input, then an activation, then transposes back:

    silu(conv1d(x.transpose(1, 2), weight [C, 1, 4], bias, padding=3, groups=C)[..., :L])
        .transpose(1, 2)                                    # x [N, L, C], channels innermost

On the GPU the convolution is one cuDNN call, about 100 us for Mamba2's [4, 2304, 1024] in
bf16 on an H100 (its floor: 13 us), and its output comes back time-innermost, so the
activation transposes it and whatever reads the result after the transpose back reads across
the grain. Written as what it is, a weighted sum of the padded input shifted by each tap,

    out[n, c, t] = bias[c] + sum_k weight[c, 0, k] * pad(x)[n, c, t * stride + k * dilation]

in the input's transposed view, [N, L, C] (the graph's own x above), the whole computation is
pointwise with channels innermost: each tap a read of the lines the previous tap brought on
chip, and the result, transposed back to [N, C, L_out], has channels innermost too
(strides ``(L_out * C, 1, C)``), so the activation keeps that layout and the transpose back
is a contiguous view. The sum runs in fp32 from fp32 copies of the operands, rounded to the
dtype once at the end: the accumulation of ATen's depthwise kernels and cuDNN (they may add
the taps in another order; cuDNN adds the bias after rounding, one rounding more). The taps'
weights come from a transposed copy, ``w[:, 0].t().contiguous()`` [K, C], each tap's C weights
in a row: where the mixer is large the fuse pass keeps that copy a kernel of its own and the
mixer reads the rows contiguously (``groups.read_across_the_grain``; Mamba2's mixer took 82 us
on the H100 reading ``w[:, 0, k]`` at a stride of 4, 26 us reading the rows). Written
before aot_autograd, the rewrite is differentiated as it stands: the input's gradient is a sum
of shifted products of the output's, the weight's a sum over batch and time of products.

An output of the graph whose layout this changes is copied into eager's (``_restore_outputs``). Only for ``conv1d`` of a [N, C, L] input with one filter
a channel (``groups`` = C = the output's channels), at most ``MAX_TAPS`` taps, static sizes,
integer stride, padding and dilation, floating dtypes alike; 2-d depthwise convolutions
(MobileNet, ConvNeXt: 9 to 49 taps over a 2-d window) stay on cuDNN.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.nn.functional as F

from .channels_last import _fake_mode, _propagate
from .sdpa_mask import example_value

MAX_TAPS = 8        # the kernel's loads an output element: one per tap
_SIGNATURE = inspect.signature(lambda input, weight, bias=None, stride=1, padding=0,
                               dilation=1, groups=1: None)


def _one(v):
    """An int from an int or a 1-tuple of one (conv1d's stride, padding, dilation); 'valid'
    padding is 0; None for anything else ('same' padding)."""
    if v == "valid":
        return 0
    if isinstance(v, (tuple, list)) and len(v) == 1:
        v = v[0]
    return v if type(v) is int else None


def _plan(node):
    """(x, weight, bias, taps, stride, padding, dilation) where ``node`` is a depthwise conv1d
    the rewrite applies to (module docstring); None for any other node."""
    if node.op != "call_function" or node.target is not torch.conv1d:
        return None
    try:
        args = _SIGNATURE.bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return None
    x, w, b = args["input"], args["weight"], args.get("bias")
    vx, vw, out = example_value(x), example_value(w), example_value(node)
    vb = example_value(b) if b is not None else None
    if vx is None or vw is None or out is None or (b is not None and vb is None):
        return None
    stride, padding, dilation = (_one(args.get(k, d)) for k, d in
                                 (("stride", 1), ("padding", 0), ("dilation", 1)))
    groups = args.get("groups", 1)
    if None in (stride, padding, dilation) or type(groups) is not int or stride < 1 \
            or dilation < 1 or padding < 0:
        return None
    if vx.dim() != 3 or vw.dim() != 3 or out.dim() != 3 or not all(
            type(s) is int for v in (vx, vw, out) for s in v.shape):
        return None
    channels, taps = vx.shape[1], vw.shape[2]
    if groups != channels or tuple(vw.shape[:2]) != (channels, 1) or out.shape[1] != channels \
            or not 1 <= taps <= MAX_TAPS or out.numel() == 0:
        return None
    dtypes = {vx.dtype, vw.dtype, out.dtype} | ({vb.dtype} if vb is not None else set())
    if len(dtypes) != 1 or out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if vb is not None and tuple(vb.shape) != (channels,):
        return None
    return x, w, b, taps, stride, padding, dilation


def _rewrite(gm, node, plan) -> tuple:
    """The shifted sum in place of conv1d ``node``'s uses: (the nodes added, in order, the
    one that replaces ``node``)."""
    x, w, b, taps, stride, padding, dilation = plan
    out = example_value(node)
    dtype, length = out.dtype, out.shape[2]
    added = []
    graph = gm.graph

    def call(target, *args):
        method = isinstance(target, str)
        made = (graph.call_method(target, args) if method
                else graph.call_function(target, args))
        added.append(made)
        return made

    def f32(v):
        return v if dtype == torch.float32 else call("float", v)

    with graph.inserting_before(node):
        xs = f32(call("transpose", x, 1, 2))                    # [N, L, C]
        if padding:
            xs = call(F.pad, xs, (0, 0, padding, padding))
        # the taps' weights as rows [K, C]: each tap reads its C weights contiguously
        ws = f32(call("contiguous", call("t", call(operator.getitem, w, (slice(None), 0)))))
        acc = None
        for k in range(taps):
            start = k * dilation
            tap = call(operator.getitem, xs,
                       (slice(None), slice(start, start + (length - 1) * stride + 1, stride)))
            term = call(operator.mul, tap, call(operator.getitem, ws, k))
            acc = term if acc is None else call(operator.add, acc, term)
        if b is not None:
            acc = call(operator.add, acc, f32(b))
        if dtype != torch.float32:
            acc = call("to", acc, dtype)
        result = call("transpose", acc, 1, 2)                   # [N, C, L_out]
    result.meta["example_value"] = out     # eager's strides, for _restore_outputs
    node.replace_all_uses_with(result)
    return added, result


def run(gm: torch.fx.GraphModule) -> list:
    """Rewrite ``gm``'s depthwise conv1d calls as above, in place; a (name, output shape, taps)
    for each. Where the rewritten graph does not trace on fake tensors, it is undone."""
    done, added, pairs = [], [], []
    for node in list(gm.graph.nodes):
        plan = _plan(node)
        if plan is None:
            continue
        nodes, result = _rewrite(gm, node, plan)
        added += nodes
        pairs.append((node, result))
        done.append((node.name, tuple(example_value(node).shape), plan[3]))
    if not done:
        return []
    try:
        values = _propagate(gm)
        _restore_outputs(gm, values, added)
    except Exception:               # noqa: BLE001 - the convolutions stay as they were
        _undo(gm, pairs, added)
        return []
    for node, _ in pairs:
        gm.graph.erase_node(node)
    for node, value in values.items():
        if node.graph is gm.graph:
            node.meta["example_value"] = value
    gm.recompile()
    return done


def _layout(t) -> tuple:
    """The strides of ``t``'s dims of more than one element (what views and readers see)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n != 1)


def _restore_outputs(gm, values, added) -> None:
    """Copy each tensor output whose layout the rewrite changed into eager's: its dims
    permuted into eager's stride order, made contiguous, permuted back."""
    output = next(iter(gm.graph.find_nodes(op="output")))

    def restore(node):
        before, after = example_value(node), values.get(node)
        if before is None or not isinstance(after, torch.Tensor) or \
                _layout(before) == _layout(after):
            return node
        order = sorted(range(before.dim()), key=lambda d: -before.stride(d))
        back = sorted(range(before.dim()), key=order.__getitem__)
        with _fake_mode(gm):
            copy_value = after.permute(order).contiguous().permute(back)
        if _layout(copy_value) != _layout(before):
            raise ValueError(f"output {node.name}: eager's strides {tuple(before.stride())} "
                             "are not a permutation of contiguous ones")
        with gm.graph.inserting_before(output):
            turned = gm.graph.call_method("permute", (node, order))
            copy = gm.graph.call_method("contiguous", (turned,))
            result = gm.graph.call_method("permute", (copy, back))
        added.extend([turned, copy, result])
        return result

    output.args = torch.fx.node.map_arg(output.args, restore)


def _undo(gm, pairs, added) -> None:
    """Each convolution's uses back on it, the added nodes erased."""
    for conv, result in pairs:
        result.replace_all_uses_with(conv)
    for node in reversed(added):
        gm.graph.erase_node(node)
