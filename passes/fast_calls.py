"""The ATen ops left in a compiled graph, called through torch's direct bindings.

A call through an ``OpOverload`` (``torch.ops.aten.mm.default(a, b)``) goes through Python
dispatch of the overload object: 1.2-1.6 us more per call than ``torch.mm(a, b)`` on the
development CPU. A Llama decoder's inference graph keeps ~210 such calls (views, permutes,
GEMMs) beside its 49 kernels, and every one runs on each step, so the launch-bound cases pay
it in full. The direct bindings reach the same ATen kernels: the results are the same tensors.

Only ops whose direct binding takes the same positional arguments are mapped, and only calls
without keyword arguments the binding would not accept. Before that, four rewrites remove
calls: a factory call with constant arguments that no kernel took in (``arange``, ``full``) is
made once, now, and kept (``constant_fold.factories``; 25-40 us of host time per call each on
the H200's host); a view repeated with the same arguments is made once; a GEMM of a transposed
weight is one ``linear`` call; a chain of views is one call. Runs last, after the report has
named the ops (reports and `dump` show ATen names).

A chain of views (GPT-2's attention: ``as_strided -> view -> permute`` for each of q, k and v,
``view -> permute -> view -> view`` after it) is replaced by one call that makes the chain's
final size, strides and offset from its root: ``_reinterpret_tensor``, the C++ helper Inductor's
generated code uses for the same purpose (1.4 us against 2.4 for view + permute on the
development CPU; ``aten.as_strided.default`` through its overload costs 8.8). That trusts the
root's strides to be the ones traced, so roots are only values whose layout is certain: graph
inputs (Dynamo guards their strides), the folded constants, the fused kernels' outputs
(allocated with the traced strides), the outputs of GEMMs, embeddings and attention (their fake
implementations give the real layout) and the calls made here. A chain that ends in a graph
output is left alone: aot_autograd inspects those views.
"""
from __future__ import annotations

import operator

import torch

from . import constant_fold

aten = torch.ops.aten

# overload -> (direct callable, keyword arguments it accepts)
FAST = {
    aten.view.default: (torch.Tensor.view, ()),
    aten._unsafe_view.default: (torch.Tensor.view, ()),
    aten.permute.default: (torch.permute, ()),
    aten.t.default: (torch.t, ()),
    aten.transpose.int: (torch.transpose, ()),
    aten.unsqueeze.default: (torch.unsqueeze, ()),
    aten.squeeze.dim: (torch.squeeze, ()),
    aten.expand.default: (torch.Tensor.expand, ()),
    aten.mm.default: (torch.mm, ()),
    aten.bmm.default: (torch.bmm, ()),
    aten.addmm.default: (torch.addmm, ("beta", "alpha")),
    aten.clone.default: (torch.clone, ("memory_format",)),
    aten.embedding.default: (torch.embedding, ()),
    # ConvNeXt-T keeps 22: 55 against 50 us a call of a small CPU convolution (development CPU)
    aten.convolution.default: (torch.convolution, ()),
    # passes/empty_values' allocations: 6.0 us through the overload, 1.2 direct (CPU)
    aten.empty_strided.default: (torch.empty_strided, ("dtype", "layout", "device", "pin_memory")),
}


# pure views: two calls with the same arguments give the same view
VIEWS = {aten.view.default, aten.permute.default, aten.t.default, aten.transpose.int,
         aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.slice.Tensor,
         aten.select.int, aten.alias.default}
# views a chain may be made of
CHAIN_VIEWS = VIEWS | {aten._unsafe_view.default, aten.as_strided.default, aten.squeeze.default,
                       aten.squeeze.dims, aten.unsqueeze.default}
# ops whose outputs have the layout their fake implementations give (roots of a chain)
LAYOUT_ROOTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.embedding.default}
ATTENTION = {aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default}
REINTERPRET = getattr(getattr(torch._C._dynamo, "guards", None), "_reinterpret_tensor", None)


def run(gm: torch.fx.GraphModule) -> int:
    """Rewrite the call path of ``gm``'s graph in place; how many calls were removed or
    swapped. The caller compiles the graph's code (``gm.recompile()``)."""
    changed = constant_fold.factories(gm)
    outputs = constant_fold.graph_outputs(gm)
    # no rewrite here touches the output node's arguments: the set holds throughout
    changed += _same_views(gm, outputs) + _linear(gm) + _view_chains(gm, outputs)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in FAST:
            continue
        if node.target is aten._unsafe_view.default and node in outputs:
            # not a view to autograd, where ``Tensor.view`` is: a graph output returned as a
            # view of a tensor made in the graph is marked the view of a function with several
            # outputs, and an in-place write into it then fails (wav2vec2's masked time steps
            # after a graph break: ``hidden_states[mask] = ...`` on the projection's output)
            continue
        fn, allowed = FAST[node.target]
        if set(node.kwargs) <= set(allowed):
            node.target = fn
            changed += 1
    return changed


def _same_views(gm, outputs: set) -> int:
    """One call for views repeated with the same arguments (q, k and v projections each view
    the normed hidden states the same way). Views that are graph outputs are left alone:
    aot_autograd's output handling expects the tensors it traced."""
    seen, removed = {}, 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in VIEWS or node in outputs:
            continue
        key = (node.target, _hashable(node.args), _hashable(tuple(sorted(node.kwargs.items()))))
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            removed += 1
    return removed


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _linear(gm) -> int:
    """``mm(a, permute(w, [1, 0]))`` -> ``linear(a, w)`` and ``addmm(b, a, permute(w, [1, 0]))``
    -> ``linear(a, w, b)`` for a 1-d ``b``, where the transpose has no other user: one call
    instead of two. For a 2-d input ATen's linear is that mm (or addmm) of ``w.t()``: the
    same kernel, result and layout."""
    swapped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is aten.mm.default:
            a, wt = node.args
            bias = None
        elif node.target is aten.addmm.default and len(node.args) == 3:
            bias, a, wt = node.args
            if _ndim(bias) != 1:
                continue
        else:
            continue
        if not (isinstance(wt, torch.fx.Node) and wt.op == "call_function"
                and len(wt.users) == 1 and _ndim(wt.args[0]) == 2
                and (wt.target is aten.t.default
                     or (wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]))):
            continue
        node.target = torch._C._nn.linear
        node.args = (a, wt.args[0]) if bias is None else (a, wt.args[0], bias)
        gm.graph.erase_node(wt)
        swapped += 1
    return swapped


def _layout(node):
    """(sizes, strides, storage offset) of a node's traced tensor, if all are plain ints."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    try:
        layout = (tuple(val.shape), val.stride(), val.storage_offset())
    except (RuntimeError, NotImplementedError):
        return None
    ints = all(type(v) is int for v in (*layout[0], *layout[1], layout[2]))
    return layout if ints else None


def _trusted_root(node) -> bool:
    """Whether ``node``'s tensor has, when the graph runs, the strides traced for it."""
    if node.op == "placeholder" or (node.op == "get_attr"
                                    and node.target.startswith(constant_fold.PREFIX)):
        return True
    if node.op != "call_function":
        return False
    if node.target is REINTERPRET:      # a chain made one call here: its traced layout
        return True
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and (
            source.meta.get("fc_launcher") is not None
            or (source.target in ATTENTION and node.args[1] == 0))
    return node.target in LAYOUT_ROOTS or node.target is torch._C._nn.linear


def _view_chains(gm, outputs: set) -> int:
    """Each chain of views from a trusted root, one ``_reinterpret_tensor`` call (a single view
    too: 1.2 us against 4.5 for ``Tensor.view`` on the H200's host)."""
    if REINTERPRET is None:
        return 0
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in CHAIN_VIEWS or node in outputs \
                or all(u.op == "call_function" and u.target in CHAIN_VIEWS for u in node.users):
            continue                    # not the end of a chain
        root, length = node, 0
        while root.op == "call_function" and root.target in CHAIN_VIEWS:
            root, length = root.args[0], length + 1
        end, start = _layout(node), _layout(root)
        if end is None or start is None or not _trusted_root(root):
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(REINTERPRET, (root, end[0], end[1], end[2] - start[2]))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        while node is not root and not node.users:       # the chain's views nothing else uses
            parent = node.args[0]
            gm.graph.erase_node(node)
            node = parent
        removed += length - 1
    return removed


def _ndim(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None
