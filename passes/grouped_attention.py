"""Attention reads grouped key/value heads as they are, not repeated copies (ATen graph, first
passes; inference graphs).

A model with grouped-query attention (GQA: Llama 2/3, Mistral, Qwen) has fewer key/value heads
than query heads, and often repeats each one for the attention call, as Hugging Face's
``repeat_kv`` does:

    k4 = k[:, :, None].expand(b, n_kv, rep, s, d).reshape(b, n_kv * rep, s, d)

The reshape of an expand is a copy: aot_autograd traces ``unsqueeze -> expand -> clone ->
_unsafe_view``, and the copy writes ``rep`` times the key's bytes, then the attention kernel
reads them. The fused attention kernels that torch picked here take the grouped heads directly
(query head h reads key/value head h // rep, what ``enable_gqa=True`` does), so

    attention(q, repeat(k), repeat(v))   ->   attention(q, k, v)

gives the same values and drops the copies. Llama-style 4 x 1024 (16 query heads, 4 key/value
heads, head size 128) on the H200: the key and value copies wrote 2 x 16.8 MB a layer, now 2 x
4.2 MB; cuDNN's attention takes 51.9 us on the grouped heads against 52.0 on the repeated ones,
bit for bit the same output (session 40, ``benchmarks/grouped_attention.py``).

Only where it is sure: the attention op is one whose kernel takes grouped heads (cuDNN, Flash,
the CPU's flash), with no mask and no dropout, only its output used (an inference graph: a
training forward saves the log-sum-exp for a backward that was traced with the repeated
heads), and both key and value are such repeats, of the same heads count, that nothing else
reads. The repeat is matched on its values' shapes, so ``x[:, :, None]`` (slices and an
unsqueeze), ``x.unsqueeze(2)`` and ``x.repeat_interleave(rep, dim=1)`` (gpt-fast's, which
decomposes to the same) all count; a tile (``x[:, None]``: head h reads x's head h % n) does
not, nor an expand-and-reshape of one head, which is a view of stride 0 (no copy). A key that
is not contiguous is copied into contiguous grouped heads (the layout the attention saw before,
at 1 / rep of the bytes).
"""
from __future__ import annotations

import logging
import operator

import torch

from .pad_gemm import _static, _val, contiguous

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")

# attention op -> (positions of its dropout_p and of its mask argument, None: none), for the ops
# whose kernels take fewer key/value heads than query heads
GROUPED_KERNELS = {
    aten._scaled_dot_product_cudnn_attention.default: (5, 3),
    aten._scaled_dot_product_flash_attention.default: (3, None),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (3, None),
}
RESHAPES = {aten._unsafe_view.default, aten.view.default, aten.reshape.default}


def run(gm: torch.fx.GraphModule, ctx) -> int:
    """Rewrite ``gm``'s attentions on repeated key/value heads to read the grouped heads, in
    place; how many."""
    if not ctx.config.grouped_attention:
        return 0
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in GROUPED_KERNELS \
                or not _output_only(node) or not _plain(node):
            continue
        q, k, v = node.args[:3]
        query = _val(q)
        heads = query.shape[1] if query is not None and query.dim() == 4 and _static(query) \
            else None
        key, value = _repeated(k, heads), _repeated(v, heads)
        if key is None or value is None or _val(key).shape[1] != _val(value).shape[1]:
            continue
        with gm.graph.inserting_before(node):
            new = [x if _val(x).is_contiguous() else contiguous(gm, x) for x in (key, value)]
        node.update_arg(1, new[0])
        node.update_arg(2, new[1])
        for chain in dict.fromkeys((k, v)):     # one repeat may be both key and value
            _erase_unused(gm, chain)
        done += 1
    if done:
        log.info("fusion-compiler: %d attentions read grouped key/value heads instead of "
                 "repeated copies", done)
    return done


def _output_only(node) -> bool:
    """Only the attention's output (item 0) is read: no log-sum-exp saved for a backward."""
    return all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0
               for u in node.users)


def _plain(node) -> bool:
    """No dropout and no mask: the arguments the grouped kernels treat alike either way."""
    dropout_at, mask_at = GROUPED_KERNELS[node.target]
    args = node.args
    dropout = args[dropout_at] if len(args) > dropout_at else node.kwargs.get("dropout_p", 0.0)
    mask = args[mask_at] if mask_at is not None and len(args) > mask_at \
        else node.kwargs.get("attn_mask", node.kwargs.get("attn_bias"))
    return dropout == 0 and mask is None


def _repeated(node, heads):
    """x where ``node`` is x's heads repeated to ``heads`` heads (head h is x's head h // rep)
    and nothing else reads the repeat; else None."""
    out = _val(node)
    if heads is None or out is None or out.dim() != 4 or out.shape[1] != heads \
            or node.target not in RESHAPES or len(node.users) != 1:
        return None
    clone = node.args[0]
    if clone.target is not aten.clone.default or len(clone.users) != 1:
        return None
    expand = clone.args[0]
    e = _val(expand)
    if expand.target is not aten.expand.default or len(expand.users) != 1 or e is None \
            or e.dim() != 5 or not _static(e) or not _static(out):
        return None
    b, n, rep, s, d = e.shape
    if tuple(out.shape) != (b, n * rep, s, d):
        return None
    x = _grouped_source(expand.args[0], (b, n, s, d))
    return x if x is not None and _val(x).dtype == out.dtype else None


def _grouped_source(node, shape):
    """The [b, n, s, d] tensor that ``node`` is with a size-1 dimension put at 2 (one unsqueeze,
    any full slices around it); else None."""
    unsqueezed = False
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        val = _val(node)
        if val is None:
            return None
        if node.target is aten.slice.Tensor and _val(node.args[0]) is not None \
                and tuple(_val(node.args[0]).shape) == tuple(val.shape) \
                and tuple(_val(node.args[0]).stride()) == tuple(val.stride()):
            node = node.args[0]         # a full slice: the same tensor
            continue
        if node.target is aten.unsqueeze.default and not unsqueezed and val.dim() == 5 \
                and node.args[1] % 5 == 2:
            unsqueezed = True
            node = node.args[0]
            continue
        break
    val = _val(node) if isinstance(node, torch.fx.Node) else None
    return node if unsqueezed and val is not None and tuple(val.shape) == tuple(shape) else None


def _erase_unused(gm, node) -> None:
    """Erase ``node`` and the producers it alone read, up to the first that has other users."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and not node.users:
        source = node.args[0] if node.args else None
        gm.graph.erase_node(node)
        node = source
