"""The ATen ops left in a compiled graph, called through torch's direct bindings.

A call through an ``OpOverload`` (``torch.ops.aten.mm.default(a, b)``) goes through Python
dispatch of the overload object: 1.2-1.6 us more per call than ``torch.mm(a, b)`` on the
development CPU. A Llama decoder's inference graph keeps ~210 such calls (views, permutes,
GEMMs) beside its 49 kernels, and every one runs on each step, so the launch-bound cases pay
it in full. The direct bindings reach the same ATen kernels: the results are the same tensors.

Only ops whose direct binding takes the same positional arguments are mapped, and only calls
without keyword arguments the binding would not accept. Before that, two rewrites remove calls:
a view repeated with the same arguments is made once, and a GEMM of a transposed weight is one
``linear`` call. Runs last, after the report has named the ops (reports and `dump` show ATen
names).
"""
from __future__ import annotations

import torch

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
}


# pure views: two calls with the same arguments give the same view
VIEWS = {aten.view.default, aten.permute.default, aten.t.default, aten.transpose.int,
         aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.slice.Tensor,
         aten.select.int, aten.alias.default}


def run(gm: torch.fx.GraphModule) -> int:
    """Rewrite the call path of ``gm`` in place; how many calls were removed or swapped."""
    changed = _same_views(gm) + _linear(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in FAST:
            continue
        fn, allowed = FAST[node.target]
        if set(node.kwargs) <= set(allowed):
            node.target = fn
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _same_views(gm) -> int:
    """One call for views repeated with the same arguments (q, k and v projections each view
    the normed hidden states the same way). Views that are graph outputs are left alone:
    aot_autograd's output handling expects the tensors it traced."""
    seen, removed = {}, 0
    outputs = set(next(n for n in reversed(gm.graph.nodes) if n.op == "output").all_input_nodes)
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


def _ndim(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None
