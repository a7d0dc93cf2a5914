"""Ops that aot_autograd's trace kept whole, decomposed in the ATen graph (first pass).

aot_autograd's trace sends every op a decomposition makes through functionalization, the proxy
and the fake mode, about 1 ms an op on the CPU: traced alone, GPT-2 8 x 512's inference graph
took 1.5 s with its 25 layer norms decomposed and 1.0 s with them whole (session 34); in the
backend, the cold compiles of GPT-2 and BERT spent 0.15-0.2 s less with this pass. Layers
repeat, so their signatures do too: each distinct call (the op, its arguments' layouts and
constants) is traced once, by ``make_fx`` with the backend's decomposition table on fake
tensors of those layouts, and the template's nodes are copied in place of every call with
that signature:

    out, mean, rstd = native_layer_norm(x, [768], w, b, 1e-5)     (25 calls, 1 signature)
        ->  x32 = _to_copy(x); mean = mean.dim(x32, [2], True); ...; out = _to_copy(add_1)

The nodes are the ones the trace would have made (the same table on the same layouts), so the
passes after this one see the graph they saw before; only the nodes the call's used outputs
need are copied, as the trace's dead-code elimination would leave them. Each copied value is a
fake tensor of the graph's mode with the template's layout.

Only inference graphs with static sizes keep these ops whole (``deferred``): a training
graph's forward and backward are partitioned inside aot_autograd, from the decomposed joint
graph. A call whose values have symbolic sizes, or that makes no template, stays an ATen op
(a failed trace raises under FUSION_COMPILER_STRICT, else warns).
"""
from __future__ import annotations

import functools
import logging
import operator
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from ..decompositions import full_table
from .shapes import fake_of_layout, static_layout

aten = torch.ops.aten
log = logging.getLogger("fusion_compiler")

# decomposed here rather than by the trace, in inference graphs with static sizes: the
# composite memory-bound ops of decompositions.py's table whose decompositions are pure
# functions of their arguments
DEFERRED = (aten.native_layer_norm.default, aten.gelu.default, aten.silu.default,
            aten._softmax.default, aten._log_softmax.default)


def deferred(gm: torch.fx.GraphModule, example_inputs) -> tuple:
    """The ops the trace of this Dynamo graph can keep whole: DEFERRED where aot_autograd will
    trace an inference graph (its own test: grad mode on and an input that requires grad make
    a training graph) and every size is static, else none."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in example_inputs):
        return ()
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or isinstance(value, torch.Tensor) and \
                static_layout(value) is None:
            return ()
    return DEFERRED


def run(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """Replace each call of a DEFERRED op by its decomposition's nodes."""
    calls = [node for op in DEFERRED for node in gm.graph.find_nodes(op="call_function",
                                                                     target=op)]
    for node in calls:
        signature = _signature(node)
        if signature is None:
            continue
        try:
            template = _template(*signature)
        except Exception as exc:  # noqa: BLE001 - not cached: the next graph tries again
            if ctx is None or ctx.config.strict:
                raise
            log.warning("fusion-compiler: %s left to ATen unfused: its decomposition did not "
                        "trace (%s: %s)", node.target, type(exc).__name__, exc)
            continue
        if template is not None:
            _inline(gm, node, template)
    return gm


class _TensorArg(NamedTuple):
    """A tensor argument in a call's signature: its layout (``shapes.static_layout``)."""
    layout: tuple


def _signature(node) -> tuple | None:
    """(op, args, kwargs) with each tensor argument as a ``_TensorArg``; None where an
    argument is not a static tensor or a hashable constant, or a keyword argument a tensor."""
    if any(isinstance(v, (torch.fx.Node, list, tuple)) for v in node.kwargs.values()):
        return None
    args = []
    for arg in node.args:
        if isinstance(arg, torch.fx.Node):
            value = arg.meta.get("val")
            layout = static_layout(value)
            if layout is None or getattr(value, "fake_mode", None) is None:
                return None
            arg = _TensorArg(layout)
        elif isinstance(arg, list):
            arg = tuple(arg)
        args.append(arg)
    signature = (node.target, tuple(args), tuple(sorted(node.kwargs.items())))
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


@functools.lru_cache(maxsize=256)
def _template(op, args, kwargs) -> torch.fx.GraphModule | None:
    """``op`` on fake tensors of these layouts, traced through the decomposition table; None
    where a value of it is not a static tensor. A failed trace raises (and is not cached)."""
    def call(*tensors):
        it = iter(tensors)
        return op(*[next(it) if isinstance(a, _TensorArg) else list(a) if isinstance(a, tuple)
                    else a for a in args], **dict(kwargs))

    with unset_fake_temporarily():      # a cold compile runs inside aot_autograd's mode
        mode = FakeTensorMode()
        fakes = [fake_of_layout(mode, *a.layout) for a in args if isinstance(a, _TensorArg)]
        with mode:
            template = make_fx(call, decomposition_table=full_table())(*fakes)
    if any(static_layout(n.meta.get("val")) is None for n in template.graph.nodes
           if n.op == "call_function"):
        return None         # a value the copies could not be given (not a static tensor)
    return template


def _inline(gm, node, template) -> None:
    """Copy ``template``'s nodes that ``node``'s used outputs need before it; rewire them."""
    graph = gm.graph
    outputs = template.graph.output_node().args[0]
    single = not isinstance(outputs, (tuple, list))
    outputs = [outputs] if single else list(outputs)
    if not single and any(u.target is not operator.getitem for u in node.users):
        return
    users = {} if single else {u: u.args[1] for u in node.users}
    wanted = [outputs[0]] if single else [outputs[i] for i in set(users.values())]
    needed = ancestors(wanted)
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
    env = dict(zip(template.graph.find_nodes(op="placeholder"), inputs))
    mode = inputs[0].meta["val"].fake_mode
    with graph.inserting_before(node):
        for t in template.graph.nodes:
            if t.op != "call_function" or t not in needed:
                continue
            # named as the trace names them (mean, sub_1: reports show the names)
            copy = graph.create_node("call_function", t.target,
                                     *torch.fx.map_arg((t.args, t.kwargs), env.__getitem__),
                                     name=t.name)
            copy.meta["val"] = fake_of_layout(mode, *static_layout(t.meta["val"]))
            env[t] = copy
    if single:
        node.replace_all_uses_with(env[outputs[0]])
    else:
        for user, index in users.items():
            user.replace_all_uses_with(env[outputs[index]])
            graph.erase_node(user)
    graph.erase_node(node)


def ancestors(nodes) -> set:
    """``nodes`` and every node they read, directly or through others."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
