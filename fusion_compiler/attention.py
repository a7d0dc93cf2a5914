"""Attention stays one op: ``F.scaled_dot_product_attention`` picks its kernel when it runs.

aot_autograd decomposes ``scaled_dot_product_attention`` while it traces, choosing a kernel from
the fake tensors it traces with. Where that choice falls on the math form (torch 2.11 on CUDA,
with the boolean mask Hugging Face's BERT and GPT-2 build under torch.compile), the graph gets
bmm, a masked softmax and bmm in place of one flash/memory-efficient kernel, and the [b, h, s, s]
scores go through HBM: BERT-base 16 x 256 ran slower than eager that way on the H200.

So in inference graphs (grad mode off while compiling, which Dynamo guards on), 4-D CUDA calls
are replaced by the opaque op ``fusion_compiler::sdpa`` before aot_autograd: at run time it
calls ``F.scaled_dot_product_attention`` on the real tensors, which chooses the kernel exactly as
eager PyTorch would for the same inputs. Its output always has the [b, s, h, d] memory layout
the fused kernels return (viewed as [b, h, s, d]); the fake implementation states that layout,
so the strides the code generator compiles against are the strides the op produces. Training
graphs keep the decomposition (the op has no autograd formula).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SDPA = torch._C._nn.scaled_dot_product_attention      # what F.scaled_dot_product_attention is


@torch.library.custom_op("fusion_compiler::sdpa", mutates_args=())
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
         is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    # [b, s, h, d] in memory: a no-op for the fused kernels' output, one copy for the math one
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@sdpa.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    b, h, s, _ = q.shape
    d = v.shape[-1]
    return q.new_empty_strided((b, h, s, d), (s * h * d, d, h * d, 1))


_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
             "enable_gqa": False}
_ORDER = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]


def _bound(node) -> dict | None:
    """The call's arguments by name, or None if they cannot be read."""
    if len(node.args) > len(_ORDER):
        return None
    bound = dict(_DEFAULTS)
    bound.update(zip(_ORDER, node.args))
    for name, value in node.kwargs.items():
        if name not in _ORDER:
            return None
        bound[name] = value
    return bound if {"query", "key", "value"} <= bound.keys() else None


DEVICE_TYPES = ("cuda",)     # where aot's choice can fall on the math form (tests add "cpu")


def _is_4d_on_device(n) -> bool:
    t = n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.device.type in DEVICE_TYPES


def keep_attention_whole(gm: torch.fx.GraphModule) -> int:
    """Replace eligible SDPA calls of a Dynamo graph by ``fusion_compiler::sdpa``; how many."""
    if torch.is_grad_enabled():
        return 0
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        a = _bound(node)
        if a is None or not all(_is_4d_on_device(a[x]) for x in ("query", "key", "value")):
            continue
        dropout, causal, scale, gqa = a["dropout_p"], a["is_causal"], a["scale"], a["enable_gqa"]
        if (not isinstance(dropout, (int, float)) or dropout != 0
                or not isinstance(causal, bool) or not isinstance(gqa, bool)
                or not (scale is None or (isinstance(scale, (int, float)) and math.isfinite(scale)))):
            continue        # random, or a value only known at run time: leave it to aot
        mask = a["attn_mask"]
        if mask is not None and not isinstance(mask, torch.fx.Node):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.fusion_compiler.sdpa.default,
                (a["query"], a["key"], a["value"], mask, causal,
                 None if scale is None else float(scale), gqa))
        new.meta = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack")
                    if k in node.meta}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
