"""Kernel IR: one fused group, free of FX, canonical, hashable.

A group of FX nodes becomes a small DAG of values:

    values 0 .. len(inputs)-1   tensors the kernel loads (pointer arguments)
    values len(inputs) ..       one per op, in topological order
    outputs                     value ids the kernel stores (allocated by the launcher)

Size symbols are renamed k0, k1, ... in order of first use, so two groups of the same structure
in different graphs (or processes) print the same IR, hash to the same key and share one kernel.
``symbols`` keeps the graph symbol behind each k, for the call site.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sympy
import torch

from ..passes.shapes import TensorInfo


# Constant-producing ops: their one meaningful argument is the value at this position; a
# tensor argument (full_like's) only gives the shape and dtype, which the IR value records.
CONSTANT_VALUE_ARG = {torch.ops.aten.full_like.default: 1, torch.ops.aten.scalar_tensor.default: 0,
                      torch.ops.aten.full.default: 1}


class NotFusable(Exception):
    """The group cannot be one generated kernel; the message says why."""


@dataclass(frozen=True)
class IRValue:
    shape: tuple
    stride: tuple           # inputs: strides in memory; ops: () (values live in registers)
    dtype: torch.dtype
    storage_offset: sympy.Expr = sympy.Integer(0)   # inputs only (as_strided is absolute)
    host_scalar: bool = False   # inputs only: a 0-dim CPU tensor passed by value to a GPU kernel


@dataclass(frozen=True)
class IROp:
    target: str             # e.g. "aten.add.Tensor"
    args: tuple             # ("ref", id) for values, sympy expressions, python scalars, tuples
    kwargs: tuple           # sorted (name, value) pairs, same encoding as args


@dataclass(frozen=True)
class KernelIR:
    inputs: tuple           # IRValue per pointer argument
    ops: tuple              # IROp per computed value
    values: tuple           # IRValue for every value id (inputs first)
    outputs: tuple          # value ids stored by the kernel
    symbols: tuple          # canonical size symbols k0, k1, ... (runtime int arguments)
    device_type: str = "cuda"   # where the kernel's tensors live: ATen's scalar rules differ

    def text(self) -> str:
        """Canonical text of the IR: what the cache key hashes and what `dump --ir` shows."""
        lines = [f"device {self.device_type}", f"symbols {' '.join(map(str, self.symbols))}"]
        for i, v in enumerate(self.inputs):
            lines.append(f"%{i} = input {v.dtype} shape={_fmt(v.shape)} stride={_fmt(v.stride)} "
                         f"offset={_fmt(v.storage_offset)}"
                         + (" host-scalar" if v.host_scalar else ""))
        for j, op in enumerate(self.ops):
            vid = len(self.inputs) + j
            v = self.values[vid]
            lines.append(f"%{vid} = {op.target}{_fmt(op.args)} {_fmt(dict(op.kwargs))} -> "
                         f"{v.dtype} {_fmt(v.shape)}")
        lines.append("outputs " + ", ".join(f"%{o} stride={_fmt(self.values[o].stride)}"
                                            for o in self.outputs))
        return "\n".join(lines)

    def key(self, *salt: str) -> str:
        h = hashlib.sha256(self.text().encode())
        for s in salt:
            h.update(b"\0" + s.encode())
        return h.hexdigest()[:32]


_PRINTED: dict = {}      # sympy expression -> its text (sympy's printer is slow; the IR
                        # of every candidate group is printed, and the same sizes recur)


def _fmt(obj) -> str:
    """``repr(obj)`` for the IR's tuples, dicts and scalars, with sympy expressions printed
    once each."""
    if isinstance(obj, sympy.Basic):
        text = _PRINTED.get(obj)
        if text is None:
            if len(_PRINTED) > 65536:
                _PRINTED.clear()
            text = _PRINTED[obj] = str(obj)
        return text
    if isinstance(obj, tuple):
        inner = ", ".join(map(_fmt, obj))
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if isinstance(obj, list):
        return f"[{', '.join(map(_fmt, obj))}]"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{_fmt(k)}: {_fmt(v)}" for k, v in obj.items()) + "}"
    return repr(obj)


def ref_id(arg):
    return arg[1] if isinstance(arg, tuple) and len(arg) == 2 and arg[0] == "ref" else None


class _Canon:
    """Renames graph size symbols to k0, k1, ... in order of first use."""

    def __init__(self):
        self.mapping: dict = {}

    def expr(self, e):
        if isinstance(e, sympy.Integer):
            return e
        if type(e) is int:
            return sympy.Integer(e)
        e = sympy.sympify(e)
        for s in sorted(e.free_symbols, key=lambda s: s.name):
            if s not in self.mapping:
                self.mapping[s] = sympy.Symbol(f"k{len(self.mapping)}", integer=True, positive=True)
        return e.xreplace(self.mapping)

    def tup(self, t):
        return tuple(self.expr(x) for x in t)


def build_kernel_ir(nodes, inputs, outputs) -> tuple[KernelIR, tuple]:
    """IR of a group: ``nodes`` (topologically ordered FX nodes computed in the kernel, views
    included), ``inputs`` (FX nodes loaded from memory), ``outputs`` (nodes stored).
    Returns the IR and the graph symbols in canonical order."""
    devices = {n.meta["fc_tensor"].device for n in outputs}
    if len(devices) != 1:
        raise NotFusable(f"outputs on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    canon = _Canon()
    ids: dict = {}
    values, ir_inputs, ops = [], [], []
    for node in inputs:
        info: TensorInfo = node.meta["fc_tensor"]
        host_scalar = info.device != device and info.device.type == "cpu" and info.ndim == 0
        if info.device != device and not host_scalar:
            raise NotFusable(f"input {node.name} is on {info.device}, the kernel on {device}")
        v = IRValue(canon.tup(info.shape), canon.tup(info.stride), info.dtype,
                    canon.expr(info.storage_offset), host_scalar)
        ids[node] = len(values)
        values.append(v)
        ir_inputs.append(v)

    def encode(a):
        if isinstance(a, torch.fx.Node):
            if a in ids:
                return ("ref", ids[a])
            if "fc_symint" in a.meta:
                return canon.expr(a.meta["fc_symint"])
            raise NotFusable(f"{a.name} is neither computed in the group nor loaded by it")
        if isinstance(a, (list, tuple)):
            return tuple(encode(x) for x in a)
        if isinstance(a, torch.SymInt):
            return canon.expr(a.node.expr)
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(a)
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise NotFusable(f"argument of type {type(a).__name__} is not supported in a kernel")

    for node in nodes:
        info: TensorInfo = node.meta["fc_tensor"]
        args, kwargs = tuple(node.args), node.kwargs
        if node.target in CONSTANT_VALUE_ARG:       # only the value: shape and dtype are info's
            at = CONSTANT_VALUE_ARG[node.target]
            args, kwargs = args[at:at + 1], {}
        ops.append(IROp(str(node.target), encode(args),
                        tuple(sorted((k, encode(v)) for k, v in kwargs.items()))))
        ids[node] = len(values)
        values.append(IRValue(canon.tup(info.shape), (), info.dtype))
    for node in outputs:
        info: TensorInfo = node.meta["fc_tensor"]
        stride = canon.tup(info.stride)
        values[ids[node]] = IRValue(values[ids[node]].shape, stride, info.dtype)
    ir = KernelIR(tuple(ir_inputs), tuple(ops), tuple(values),
                  tuple(ids[n] for n in outputs), tuple(canon.mapping.values()), device.type)
    graph_symbols = tuple(canon.mapping.keys())
    return ir, graph_symbols


def fx_signature(nodes, inputs, outputs, templates: dict) -> tuple | None:
    """A hashable summary of everything ``build_kernel_ir`` reads of a group: within one graph,
    two groups with equal signatures get the same IR, IR text and graph symbols. The fuse
    search meets the same candidate in every layer of a model; with this it builds and prints
    its IR once. Sizes are ``TensorInfo.key`` (exact text, in the graph's own symbols: one
    graph, one name per symbol); each node's part is made once (``templates``, node -> part,
    for one graph) and the FX nodes it reads are then given by their position in the group,
    as in the IR. None where build_kernel_ir may refuse the group: it raises, saying why.

    A node the group neither computes nor loads has no position (None): build_kernel_ir
    raises for it, so such a signature is never one of a built IR."""
    try:
        position = {n: i for i, n in enumerate(inputs)}
        parts = [n.meta["fc_tensor"].key for n in inputs]
        for node in nodes:
            template = templates.get(node)
            if template is None:
                template = templates[node] = _node_template(node)
            if template is _NO_TEMPLATE:
                return None
            part, reads = template
            parts.append((part, tuple(position.get(a) for a in reads)))
            position[node] = len(position)
        parts.append(tuple((position.get(n), n.meta["fc_tensor"].key) for n in outputs))
    except KeyError:            # no fc_tensor: build_kernel_ir says what is wrong
        return None
    return tuple(parts)


_NO_TEMPLATE = object()     # a node with an argument build_kernel_ir refuses


def _node_template(node):
    """(what build_kernel_ir encodes of ``node``, with each FX node it reads as a marker; those
    FX nodes in order) or _NO_TEMPLATE. Scalars are tagged by type (True == 1 == 1.0 and
    0.0 == -0.0, which the IR prints apart)."""
    reads = []

    def part(a):
        if isinstance(a, torch.fx.Node):
            reads.append(a)     # a ref where the group has it, else its symbolic int
            return ("node", a.meta.get("fc_symint"))
        if isinstance(a, (list, tuple)):
            return tuple(part(x) for x in a)
        if isinstance(a, torch.SymInt):
            return ("symint", a.node.expr)
        if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return str(a)
        if type(a) is float:
            return (float, repr(a))
        if a is None or type(a) in (bool, int, str):
            return (type(a), a)
        raise _NoTemplate

    args, kwargs = tuple(node.args), node.kwargs
    if node.target in CONSTANT_VALUE_ARG:
        at = CONSTANT_VALUE_ARG[node.target]
        args, kwargs = args[at:at + 1], {}
    try:
        encoded = (node.target, node.meta["fc_tensor"].key, part(args),
                   tuple(sorted((k, part(v)) for k, v in kwargs.items())))
    except (_NoTemplate, KeyError):
        return _NO_TEMPLATE
    return encoded, tuple(reads)


class _NoTemplate(Exception):
    """An argument ``build_kernel_ir`` refuses."""


def canonical_hints(graph_symbols, ir: KernelIR, size_hints: dict) -> dict:
    """Size hints keyed by the IR's canonical symbols (k0, k1, ...)."""
    return {k: size_hints.get(s, 1) for s, k in zip(graph_symbols, ir.symbols)}
