"""Nearest upsampling by powers of two as index arithmetic (Dynamo graph, pre-ATen).

``F.interpolate(x, mode="nearest")`` reaches aot_autograd as PyTorch's decomposition: an index
of x by two index vectors computed from aranges. Its backward is an ``index_put`` with
accumulation into zeros: on ATen, zeros of the input's size and an index_put kernel (the
CUDA one sorts the indices); and a training forward computes the index vectors (two small
kernels) to keep them for the backward. Where each spatial size is the input's times a power
of two s, ATen's nearest index ``floor(i * (1 / s))`` is exactly ``i // s`` (1 / s is exact in
floating point), and the call becomes, along each spatial dim d in turn,

    cat([x.unsqueeze(d + 1)] * s, d + 1), reshaped [..., n * s, ...]

so that the forward reads x by index arithmetic in the kernel that reads the output (once: a
cat of copies of one value of size 1 along its dim, ``Lowering._cat``), bits copied as they are
(-0.0 and NaN too; session 48's form, pads of -0.0 summed, lost -0.0's sign on the GPU), and the
backward, a cat's gradient being slices, is the sum of the s slices of the output gradient
(``s_h * s_w`` strided reads an element in 2-d), pointwise in one kernel with what computes
the gradient. bf16 and fp16 inputs go through fp32 (exact conversions forward), so that the
backward sums in fp32 and rounds once, as ATen's upsample backward does. fp32, fp64, bf16 and
fp16 inputs with static sizes, mode "nearest" (not "nearest-exact"), no antialias; a
``scale_factor`` that is not exactly the power of two keeps ATen's form, whose index it would
not equal.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .sdpa_mask import add_call, example_value

_SIGNATURE = inspect.signature(F.interpolate)


def _factors(node):
    """The power-of-two factor of each spatial dim where ``node`` is such an interpolate, else
    None."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    args = bound.arguments
    if args.get("mode", "nearest") != "nearest" or args.get("antialias") \
            or args.get("align_corners") is not None:
        return None
    x, out = example_value(args.get("input")), example_value(node)
    if x is None or out is None or x.dim() not in (3, 4, 5) \
            or x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16) \
            or x.dim() != out.dim() or not all(type(s) is int for s in (*x.shape, *out.shape)) \
            or tuple(x.shape[:2]) != tuple(out.shape[:2]) or 0 in x.shape:
        return None
    factors = []
    for n, m in zip(x.shape[2:], out.shape[2:]):
        s = m // n
        if m % n or s < 1 or s & (s - 1):
            return None
        factors.append(s)
    scale = args.get("scale_factor")
    if scale is not None and not args.get("recompute_scale_factor"):
        given = list(scale) if isinstance(scale, (list, tuple)) else [scale] * len(factors)
        if [float(g) for g in given] != [float(s) for s in factors]:
            return None
    return factors


def run(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm``'s nearest upsamplings by powers of two as above; how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.interpolate:
            continue
        factors = _factors(node)
        if factors is None or all(s == 1 for s in factors):
            continue
        x = _SIGNATURE.bind(*node.args, **node.kwargs).arguments["input"]
        dtype = example_value(x).dtype
        out, last = x, node.prev
        low = dtype in (torch.float16, torch.bfloat16)
        if low:                         # the backward sums s_h * s_w gradients in fp32, as ATen
            last = out = add_call(gm, last, "float", (out,))
        for d, s in enumerate(factors, start=2):
            if s == 1:
                continue
            value = example_value(out)
            last = out = add_call(gm, last, torch.unsqueeze, (out, d + 1))
            last = total = add_call(gm, last, torch.cat, ([out] * s, d + 1))
            shape = list(value.shape)
            shape[d] *= s
            last = out = add_call(gm, last, torch.reshape, (total, shape))
        if low:
            out = add_call(gm, last, "to", (out, dtype))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
    return done
