"""A convolution's bias added where the graph can fuse it (ATen graph, first passes).

ATen's cuDNN path does not give cuDNN the bias: it runs the convolution, then
``output.add_(bias.reshape(1, -1, 1, 1))``, a second kernel that reads and writes the whole
output (ConvNeXt-T at batch 32 on the H200: 22 such adds, 232 us of the call's 2436 us of GPU
time, BENCHMARKS.md). Where ATen's own backend selection (``torch._C._select_conv_backend``)
names that path, the graph says the same thing in two ops:

    convolution(x, w, b, ...)   ->   add(convolution(x, w, None, ...), view(b, [1, C, 1, ...]))

the very arithmetic ATen does (the convolution's output rounded to its dtype, the bias added to
it, rounded again: bit-equal results, checked on the GPU by tests/test_conv_bias.py), so the fusion pass can fuse the add into the convolution's consumer
(ConvNeXt's LayerNorm), as Inductor does. The add's output keeps the convolution's layout, as
``add_`` does. Other backends add the bias inside the convolution (the CUDA depthwise kernels,
MKLDNN on the CPU), with one rounding less: left alone.
"""
from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .pad_gemm import _val, emit

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")

DEVICES = ("cuda",)
BACKENDS = ("Cudnn", "CudnnTranspose")      # ATen adds the bias after these (Convolution.cpp)
MAX_PROBE_BYTES = 1 << 30                   # a larger input is not allocated to ask (left alone)


def _backend(node) -> str | None:
    """ATen's backend for a convolution node, None if unknown: asked with empty real tensors
    of the traced sizes, strides and dtypes, as the call will ask at run time. Fake tensors
    can get another answer: on the H200, an NCHW depthwise convolution's fake values gave
    cuDNN where the real tensors get ATen's depthwise kernel (tests/test_conv_bias.py, GPU)."""
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = node.args
    values = [_val(a) for a in (x, w, b)]
    if not all(isinstance(s, int) for v in values for s in (*v.shape, *v.stride())) \
            or values[0].numel() * values[0].element_size() > MAX_PROBE_BYTES:
        return None
    try:
        with unset_fake_temporarily():
            real = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                    for v in values]
            return torch._C._select_conv_backend(*real, stride, padding, dilation, transposed,
                                                 output_padding, groups).name
    except Exception:   # noqa: BLE001 - an unknown case stays one ATen op
        return None


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Split the bias off the convolutions on ``DEVICES`` whose ATen backend is in
    ``BACKENDS``; how many were split."""
    devices, backends = DEVICES, BACKENDS
    split = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution.default \
                or len(node.args) != 9 or node.kwargs or node.args[2] is None:
            continue
        out, bias = _val(node), _val(node.args[2])
        if out is None or bias is None or out.device.type not in devices \
                or any(_val(a) is None for a in node.args[:2]) or bias.dtype != out.dtype \
                or _backend(node) not in backends:
            continue
        mode = out.fake_mode
        shape = [1, -1] + [1] * (out.dim() - 2)
        with gm.graph.inserting_after(node):
            view = emit(gm, aten.view.default, (node.args[2], shape), mode)
        with gm.graph.inserting_after(view):
            add = gm.graph.call_function(aten.add.Tensor, (node, view))
        node.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        node.args = node.args[:2] + (None,) + node.args[3:]
        with mode:
            conv = aten.convolution.default(*[_val(a) if isinstance(a, torch.fx.Node) else a
                                              for a in node.args])
            add.meta["val"] = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype,
                                                  device=out.device)
        node.meta["val"] = conv
        split += 1
    if split:
        log.info("fusion-compiler: %d convolution biases added by the graph, not by ATen", split)
    return split
