"""Depthwise 1-d convolutions with few taps as sums of shifted products (ATen graph, first
passes).

The Mamba family's PyTorch path (Mamba, Mamba2, Bamba, Jamba, Falcon-H1, Zamba2: transformers
runs it where the ``causal_conv1d`` package is missing, and torch.compile always traces it)
mixes each channel over its last few time steps with a depthwise convolution:

    conv1d(x.transpose(1, 2), weight [C, 1, 4], bias, padding=3, groups=C)[..., :L]

On the GPU that is one cuDNN (or ATen depthwise) call on a transposed input, a memory-bound
operation its kernels run well short of the bandwidth limit, with a copy of the input before it
and an activation after it. Written as what it is, a weighted sum of the padded input shifted by
each tap,

    out[n, c, t] = bias[c] + sum_k weight[c, 0, k] * pad(x)[n, c, t * stride + k * dilation]

it is pointwise: one kernel with the input's transpose before it and the activation after it,
each shifted read a masked load of lines the previous tap brought on chip. The sum runs in fp32
from fp32 copies of the operands, rounded to the dtype once at the end: the accumulation of
ATen's depthwise kernels and cuDNN (they may add the taps in another order; cuDNN adds the bias
after rounding, one rounding more).

Only for 1-d convolutions (a [N, C, L] input) with one filter a channel (``groups`` = C = the
output's channels), ``MAX_TAPS`` taps or fewer, not transposed, floating dtypes alike, static
sizes and a contiguous output (ATen's for these). 2-d depthwise convolutions (MobileNet,
ConvNeXt: 9 to 49 taps over a 2-d window) stay on cuDNN, as do the convolution's gradients.
"""
from __future__ import annotations

import torch

from .pad_gemm import _val, contiguous, emit

aten = torch.ops.aten

MAX_TAPS = 8        # a kernel's loads a output element: one per tap


def _plan(node):
    """(x, weight, bias, taps, stride, padding, dilation) for a depthwise 1-d convolution the
    rewrite applies to (module docstring); None for any other node."""
    if node.op != "call_function" or node.target is not aten.convolution.default \
            or len(node.args) != 9 or node.kwargs:
        return None
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = node.args
    vx, vw, out = _val(x), _val(w), node.meta.get("val")
    vb = _val(b) if b is not None else None
    if not all(isinstance(v, torch.Tensor) for v in (vx, vw, out)) \
            or (b is not None and not isinstance(vb, torch.Tensor)):
        return None
    if transposed or vx.dim() != 3 or vw.dim() != 3 or any(output_padding) \
            or not all(type(s) is int for v in (vx, vw, out) for s in (*v.shape, *v.stride())):
        return None
    channels, taps = vx.shape[1], vw.shape[2]
    if groups != channels or tuple(vw.shape[:2]) != (channels, 1) or out.shape[1] != channels \
            or not 1 <= taps <= MAX_TAPS:
        return None
    dtypes = {vx.dtype, vw.dtype, out.dtype} | ({vb.dtype} if vb is not None else set())
    if len(dtypes) != 1 or out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if out.numel() == 0 or not out.is_contiguous():
        return None
    if vb is not None and tuple(vb.shape) != (channels,):
        return None
    return x, w, b, taps, stride[0], padding[0], dilation[0]


def _cast(gm, x, dtype, mode):
    """``x`` as ``dtype`` (``_to_copy``), or ``x`` where it is that already."""
    if _val(x).dtype == dtype:
        return x
    node = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})
    with mode:
        node.meta["val"] = aten._to_copy.default(_val(x), dtype=dtype)
    return node


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s depthwise 1-d convolutions with few taps as sums of shifted products,
    in place; each named in ``ctx.depthwise_convs``. How many."""
    done = 0
    for node in list(gm.graph.nodes):
        found = _plan(node)
        if found is None:
            continue
        x, w, b, taps, stride, padding, dilation = found
        want = node.meta["val"]
        length = want.shape[2]
        mode = want.fake_mode
        f32 = torch.float32
        with gm.graph.inserting_before(node):
            xs = _cast(gm, x, f32, mode)
            if padding:
                xs = emit(gm, aten.constant_pad_nd.default, (xs, [padding, padding], 0.0), mode)
            ws = _cast(gm, w, f32, mode)
            acc = None
            for k in range(taps):
                start = k * dilation
                tap = emit(gm, aten.slice.Tensor,
                           (xs, 2, start, start + (length - 1) * stride + 1, stride), mode)
                wk = emit(gm, aten.select.int, (ws, 2, k), mode)      # [C, 1]
                term = emit(gm, aten.mul.Tensor, (tap, wk), mode)
                acc = term if acc is None else emit(gm, aten.add.Tensor, (acc, term), mode)
            if b is not None:
                bias = emit(gm, aten.unsqueeze.default, (_cast(gm, b, f32, mode), 1), mode)
                acc = emit(gm, aten.add.Tensor, (acc, bias), mode)
            out = _cast(gm, acc, want.dtype, mode)
            if not _val(out).is_contiguous():
                out = contiguous(gm, out)
        out.meta.update({key: v for key, v in node.meta.items() if key != "val"})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        ctx.depthwise_convs.append((node.name, tuple(want.shape), taps))
        done += 1
    return done
