"""Legality of a fusion: can the code generator make one kernel of a group? (Lowered once per
distinct candidate in a process: the same candidate recurs in every layer of a model.)"""
from __future__ import annotations

from ..codegen.kernel_ir import NotFusable, build_kernel_ir, canonical_hints, fx_signature
from ..codegen.lower import Lowering, iteration_space
from ..codegen.render import lower_rows
from .groups import FusionGroup, GraphView


def check_legal(group: FusionGroup, view: GraphView, ctx) -> None:
    """Raise NotFusable unless the code generator can make one kernel of ``group``."""
    if group.n_ops > ctx.config.max_group_ops:
        raise NotFusable(f"group would hold {group.n_ops} ops (max_group_ops="
                         f"{ctx.config.max_group_ops})")
    if not group.outputs:
        raise NotFusable("group has no outputs")
    ir, syms, text = _kernel_ir(group, view)
    hints = canonical_hints(syms, ir, ctx.size_hints)
    # the IR text is canonical (node and symbol names renamed): the same candidate in every
    # layer of a model is lowered once
    config = ctx.config
    key = (text, tuple(sorted((str(k), v) for k, v in hints.items())), config.tiles,
           config.max_persistent_block)
    verdict = _LOWERED.get(key)
    if verdict is None:
        try:
            parts = view.multipart_parts(ir)    # independent pointwise parts of other shapes
            if parts is not None:
                for sub, _, _ in parts:
                    Lowering(sub, hints, persistent=True, row_tiles=config.tiles).run()
            else:
                kind, shape = iteration_space(ir)
                if kind == "pointwise":
                    Lowering(ir, hints, persistent=True, row_tiles=config.tiles).run()
                else:       # the generator's own lowerings: persistent, looped or both
                    lower_rows(ir, hints, shape[-1], config.max_persistent_block, config.tiles)
            verdict = ""
        except NotFusable as exc:
            verdict = str(exc) or "not fusable"
        if len(_LOWERED) > 4096:
            _LOWERED.clear()
        _LOWERED[key] = verdict
    if verdict:
        raise NotFusable(verdict)
    group.ir, group.graph_symbols = ir, syms


def _kernel_ir(group: FusionGroup, view: GraphView) -> tuple:
    """(IR, graph symbols, IR text) of a group, built once per signature in a search: Llama
    1 x 128's 280 checks have 35 distinct IRs; building them all took 63 ms and
    printing them 35, their signatures take 10."""
    signature = fx_signature(group.nodes, group.inputs, group.outputs, view.ir_templates)
    built = view.kernel_irs.get(signature) if signature is not None else None
    if built is None:
        ir, syms = build_kernel_ir(group.nodes, group.inputs, group.outputs)
        built = (ir, syms, ir.text())
        if signature is not None:
            view.kernel_irs[signature] = built
    return built


_LOWERED: dict = {}     # (IR text, hints) -> "" if it lowers, else why not (this process)
