"""Legality of a fusion: can the code generator make one kernel of a group? (Lowered once per
distinct candidate in a process: the same candidate recurs in every layer of a model.)"""
from __future__ import annotations

from ..codegen.kernel_ir import NotFusable, build_kernel_ir, canonical_hints
from ..codegen.lower import Lowering
from ..codegen.render import multipart_parts
from .groups import FusionGroup


def check_legal(group: FusionGroup, ctx) -> None:
    """Raise NotFusable unless the code generator can make one kernel of ``group``."""
    if group.n_ops > ctx.config.max_group_ops:
        raise NotFusable(f"group would hold {group.n_ops} ops (max_group_ops="
                         f"{ctx.config.max_group_ops})")
    if not group.outputs:
        raise NotFusable("group has no outputs")
    ir, syms = build_kernel_ir(group.nodes, group.inputs, group.outputs)
    hints = canonical_hints(syms, ir, ctx.size_hints)
    # the IR text is canonical (node and symbol names renamed): the same candidate in every
    # layer of a model is lowered once
    key = (ir.text(), tuple(sorted((str(k), v) for k, v in hints.items())))
    verdict = _LOWERED.get(key)
    if verdict is None:
        try:
            parts = multipart_parts(ir)     # independent pointwise parts of different shapes
            for sub in ([ir] if parts is None else [sub for sub, _, _ in parts]):
                Lowering(sub, hints, persistent=True).run()
            verdict = ""
        except NotFusable as exc:
            verdict = str(exc) or "not fusable"
        if len(_LOWERED) > 4096:
            _LOWERED.clear()
        _LOWERED[key] = verdict
    if verdict:
        raise NotFusable(verdict)
    group.ir, group.graph_symbols = ir, syms


_LOWERED: dict = {}     # (IR text, hints) -> "" if it lowers, else why not (this process)
