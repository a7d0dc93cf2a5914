"""Give scaled_dot_product_attention a mask its fused CUDA kernels accept (Dynamo graph, pre-ATen).

SDPA picks its kernel when aot_autograd traces it: FlashAttention, memory-efficient, cuDNN or the
math form (bmm, a masked softmax over [batch, heads, q, k], bmm). Every fused CUDA kernel needs
the mask's last dimension at stride 1. Hugging Face's BERT, compiled, builds its mask as an
expand of a per-row vector ([b, 1, q, k] with strides (0, q, 1, 0)), so SDPA takes the math form
and the model runs attention as three kernels over [b, h, q, k] instead of one. A copy of such a
mask into contiguous memory (b * q * k bytes for a bool mask, once per distinct mask, shared by
every layer) holds the same values, and the fused kernels take it.

The two forms differ in one case: a query row whose keys are all masked. The math form gives it
zeros (a safe softmax); the fused kernels give something else (cuDNN: an average of the values).
What eager PyTorch ran, with the strided mask, was the math form, so the rewrite keeps its
answer: ``where(any key kept in the row, fused attention, 0)``, the test computed once per mask.

    out = sdpa(q, k, v, mask)          ->   m = mask.contiguous(); keep = m.any(-1, keepdim=True)
                                            out = where(keep, sdpa(q, k, v, m), 0)

(for a float mask, "kept" is "not -inf"). Runs on the Dynamo graph, before aot_autograd: only
there is SDPA still one call.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
MASK_POSITION = 3       # scaled_dot_product_attention(query, key, value, attn_mask, ...)


def _mask_arg(node):
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"], lambda new: node.update_kwarg("attn_mask", new)
    if len(node.args) > MASK_POSITION:
        return node.args[MASK_POSITION], lambda new: node.update_arg(MASK_POSITION, new)
    return None, None


def example_value(node):
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _needs_copy(mask, devices) -> bool:
    value = example_value(mask)
    if value is None or value.device.type not in devices or value.dim() == 0:
        return False
    return value.shape[-1] != 1 and value.stride(-1) != 1


def add_call(gm, after, target, args, kwargs=None):
    """A node after ``after`` calling ``target`` (a Tensor method's name, or a function), with
    its example value computed under the fake mode of its arguments."""
    kwargs = kwargs or {}
    method = isinstance(target, str)
    with gm.graph.inserting_after(after):
        node = (gm.graph.call_method(target, args, kwargs) if method
                else gm.graph.call_function(target, args, kwargs))
    values = torch.fx.node.map_arg(list(args), example_value)      # nodes in lists too
    fn = getattr(torch.Tensor, target) if method else target
    flat = [v for a in values for v in (a if isinstance(a, (list, tuple)) else [a])]
    mode = next((v.fake_mode for v in flat if getattr(v, "fake_mode", None) is not None), None)
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["example_value"] = fn(*values, **kwargs)
    return node


def run(gm: torch.fx.GraphModule, devices=("cuda",)) -> int:
    """Rewrite each SDPA whose mask is on ``devices`` (CPU attention takes any mask) with its last
    dimension not at stride 1, as above; how many distinct masks were copied."""
    masks: dict = {}            # mask node -> (contiguous copy, row-kept test)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA or example_value(node) is None:
            continue
        mask, replace = _mask_arg(node)
        if mask is None or not _needs_copy(mask, devices):
            continue
        if mask not in masks:
            copy = add_call(gm, mask, "contiguous", (mask,))
            kept = copy if example_value(mask).dtype == torch.bool else \
                add_call(gm, copy, "ne", (copy, float("-inf")))
            masks[mask] = copy, add_call(gm, kept, "any", (kept, -1), {"keepdim": True})
        copy, keep = masks[mask]
        replace(copy)
        guarded = add_call(gm, node, torch.where, (keep, node, 0.0))
        node.replace_all_uses_with(guarded, delete_user_cb=lambda user: user is not guarded)
    if masks:
        gm.recompile()
    return len(masks)
