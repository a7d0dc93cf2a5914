"""Convolution outputs checked against the layout of the trace, where they run.

A generated kernel addresses its inputs with the strides the trace gave them, and so do the
saved activations a backward graph reads. For the ATen ops left in a graph those strides are
the fake implementation's answer, which for most ops is the real layout. A convolution's is
not always: cuDNN picks its output's memory format from those of its input and weight, and
torch's fake convolution can answer otherwise. On an H100 (torch 2.11, session 52), the
channels-last rewrite of ``Conv2d(3, 6, 3) -> ReLU -> Conv2d(6, 5, 1)`` on a 2 x 3 x 7 x 6
image gave gradients off by up to 8: a kernel read a gradient cuDNN had written channels-last
as if it were contiguous. A fake convolution of that channels-last image answered contiguous
where cuDNN's was channels-last. Nothing failed; the numbers were wrong.

So each output of a convolution, forward or backward, passes through ``as_traced`` before
anything reads it: the tensor itself where its strides are the traced ones (one tuple compare a
call), else a copy in the traced layout, with a warning the first time for each op and pair of
layouts. A copy costs a read and a write of the tensor: a correct result, slower, and the
warning says so. Strides of size-1 dimensions address nothing and are not compared. Outputs
with symbolic sizes or strides are not checked: the channels-last rewrite, where the mismatch
was seen, does not run on dynamic shapes.
"""
from __future__ import annotations

import logging
import operator

import torch

log = logging.getLogger("fusion_compiler")
aten = torch.ops.aten

CHECKED = {aten.convolution.default: "aten.convolution",
           aten.convolution_backward.default: "aten.convolution_backward"}
_warned: set = set()


def run(gm: torch.fx.GraphModule) -> int:
    """Insert ``as_traced`` after each convolution output that something reads; how many. The
    caller compiles the graph's code."""
    graph = gm.graph
    added = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in CHECKED:
            continue
        if node.target is aten.convolution.default:
            outs = [node]
        else:
            outs = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
        for out in outs:
            stride = _traced_stride(out)
            if stride is None or not out.users:
                continue
            with graph.inserting_after(out):
                checked = graph.call_function(as_traced, (out, stride, CHECKED[node.target]))
            checked.meta = dict(out.meta)
            out.replace_all_uses_with(checked, delete_user_cb=lambda user: user is not checked)
            added += 1
    return added


def _traced_stride(node) -> tuple | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    stride = tuple(value.stride())
    if not all(type(s) is int for s in (*stride, *value.shape)):
        return None
    return stride


def as_traced(t: torch.Tensor, stride: tuple, op: str) -> torch.Tensor:
    """``t`` where its strides are ``stride``, else a copy of it that has them."""
    if t.stride() == stride:
        return t
    return _restride(t, stride, op)


def _restride(t: torch.Tensor, stride: tuple, op: str) -> torch.Tensor:
    if all(a == b for a, b, n in zip(t.stride(), stride, t.shape) if n > 1):
        return t        # only size-1 dimensions differ: the same addresses
    key = (op, tuple(t.shape), tuple(t.stride()), stride)
    if key not in _warned:
        _warned.add(key)
        log.warning("fusion-compiler: %s returned a %s tensor with strides %s where the trace "
                    "gave %s; it is copied into the traced layout on each call (correct, one "
                    "extra copy). torch's fake tensor disagrees with the convolution backend "
                    "here; where the channels-last rewrite causes it, "
                    "FUSION_COMPILER_CHANNELS_LAST=0 avoids the copies.", op, list(t.shape), tuple(t.stride()), stride)
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out
