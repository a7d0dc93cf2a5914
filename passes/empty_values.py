"""Values with no elements are allocated, not computed.

A tensor with a dimension of static size 0 has nothing to compute, yet each ATen op that makes
one still runs its host path (the code generator refuses empty tensors: a kernel would launch
no program). A softmax over (0, 4096, 1024) is six such calls in the decomposed graph, 8.8-12.9
us on the H200's host, against 1.3 us for eager's one op and Inductor's call. Here a node whose
output has no elements, of an op the fusion pass would take (pointwise, injective, reduction,
by ``fc_kind``), becomes one ``empty_strided`` of the traced size, strides, dtype and device;
the nodes only it read become dead and are removed. A concatenation of one tensor with empty
ones that only attention reads (a KV cache's first update) is that tensor
(``_pass_through_cats``); any other concatenation drops its empty inputs (``_trim_cats``), so
that it can join a kernel: a kernel refuses empty tensors.

Left alone:
- views and expand: their output aliases their input, which the caller may rely on;
- a reduction over an extent that may be 0 (not a positive integer): eager's ``amax`` of a
  (0, 0) tensor is an error, which must stay one;
- sizes or strides that are not integers (a dynamic dimension may be 0 on one call only).
"""
from __future__ import annotations

import logging

import sympy
import torch

from .classify import SCANS, OpKind
from .constant_fold import is_pure

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")

_COMPUTED = (OpKind.POINTWISE, OpKind.INJECTIVE, OpKind.REDUCTION)


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Replace the computed empty values of ``gm`` in place; ``ctx.empty_values`` names them."""
    passed = _pass_through_cats(gm, ctx)
    trimmed = _trim_cats(gm, ctx)
    replaced = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.meta.get("fc_kind") not in _COMPUTED:
            continue
        info = node.meta.get("fc_tensor")
        if info is None or not _static_empty(info) or not is_pure(node.target):
            continue
        if node.meta["fc_kind"] is OpKind.REDUCTION and node.target not in SCANS:
            extent = node.args[0].meta["fc_tensor"].shape[-1]      # last-dim reductions only
            if not (isinstance(extent, sympy.Integer) and extent > 0):
                continue
        with gm.graph.inserting_before(node):
            empty = gm.graph.call_function(
                aten.empty_strided.default,
                ([int(s) for s in info.shape], [int(s) for s in info.stride]),
                {"dtype": info.dtype, "device": info.device})
        empty.meta.update(node.meta)
        empty.meta["fc_kind"] = OpKind.OPAQUE
        node.replace_all_uses_with(empty)
        gm.graph.erase_node(node)
        replaced.add(empty)
        ctx.empty_values.append(node.name)
    if not replaced and not passed and not trimmed:
        return gm
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users \
                and (node in replaced or is_pure(node.target)):
            gm.graph.erase_node(node)
    log.info("fusion-compiler: %d values with no elements allocated instead of computed, %d "
             "concatenations with empty tensors passed through", len(replaced), len(passed))
    return gm


# attention reads its key and value (arguments 1 and 2) at any strides, and lays out its
# output by the query alone
_ATTENTION_KV = (1, 2)


def _pass_through_cats(gm: torch.fx.GraphModule, ctx) -> set:
    """A KV cache's update with nothing cached: ``cat([empty, k], -2)`` (transformers' BART
    and Whisper layers, even with ``use_cache=False``) copies ``k`` to read it once, in
    attention. Where every reader is attention reading it as key or value, attention reads
    ``k`` itself (its layout is not the cat's, so no other reader qualifies: one laid out by
    its input, or a view, would see other strides than traced). ``ctx.passed_through``
    names them."""
    done = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        tensors = node.args[0]
        info = node.meta.get("fc_tensor")
        kept = [t for t in tensors
                if not (isinstance(t, torch.fx.Node) and "fc_tensor" in t.meta
                        and _static_empty(t.meta["fc_tensor"]))]
        if info is None or len(tensors) < 2 or len(kept) != 1 \
                or not isinstance(kept[0], torch.fx.Node):
            continue
        own = kept[0].meta.get("fc_tensor")
        if own is None or own.shape != info.shape or own.dtype != info.dtype:
            continue
        if not node.users or not all(
                "scaled_dot_product" in str(user.target) and node not in user.kwargs.values()
                and all(i in _ATTENTION_KV for i, a in enumerate(user.args) if a is node)
                for user in node.users):
            continue
        node.replace_all_uses_with(kept[0])
        gm.graph.erase_node(node)
        done.add(kept[0])
        ctx.passed_through.append(node.name)
    return done


def _trim_cats(gm: torch.fx.GraphModule, ctx) -> bool:
    """A concatenation that is read by more than attention (transformers' KV cache update,
    where the cache is a graph output: a Dynamo graph break inside the cache's constructor
    leaves it alive past the graph) still copies; without its empty inputs it is an injective
    op a kernel can compute, such as the kernel that computes its one remaining input (a
    key after RoPE). Only where every remaining input has the output's dtype (torch.cat
    promotes over empty inputs too) and the output's traced layout stays the node's own.
    ``ctx.trimmed_cats`` names them."""
    trimmed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        info = node.meta.get("fc_tensor")
        tensors = node.args[0]
        if info is None or _static_empty(info) or not all(
                isinstance(t, torch.fx.Node) and "fc_tensor" in t.meta for t in tensors):
            continue
        kept = [t for t in tensors if not _static_empty(t.meta["fc_tensor"])]
        if len(kept) == len(tensors) or not kept \
                or any(t.meta["fc_tensor"].dtype != info.dtype for t in kept):
            continue
        node.args = (kept,) + tuple(node.args[1:])
        ctx.trimmed_cats.append(node.name)
        trimmed = True
    return trimmed


def _static_empty(info) -> bool:
    values = (*info.shape, *info.stride)
    return all(isinstance(v, (int, sympy.Integer)) for v in values) and 0 in info.shape
