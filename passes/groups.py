"""Fusion groups: what a candidate group computes, reads, writes and costs.

``GraphView`` answers graph questions the fuse pass asks often (sources through views, consumers
through views); ``analyze`` fills in a group's inputs, outputs and cost-model estimate.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..codegen import launch
from ..codegen.kernel_ir import CONSTANT_VALUE_ARG
from ..codegen.lowered import partner_of
from .classify import GATHERS, SCANS, OpKind
from .cost_model import NodeSizes, kernel_cost, tensor_bytes
from .shapes import hint

TRANSPARENT = {OpKind.VIEW, OpKind.BROADCAST}
DATA = {OpKind.POINTWISE, OpKind.INJECTIVE, OpKind.REDUCTION}


@dataclass
class FusionGroup:
    """A set of data nodes that becomes one kernel, with what it reads and writes."""
    id: int
    members: frozenset
    nodes: list = field(default_factory=list)     # members + inlined views, topological
    inputs: list = field(default_factory=list)    # FX nodes the kernel loads
    outputs: list = field(default_factory=list)   # members used outside the group
    cost: object = None
    ir: object = None                             # KernelIR once legal
    graph_symbols: tuple = ()
    error: str = ""                               # why it cannot be a kernel (if so)
    recomputed: frozenset = frozenset()           # members also computed in other groups
    extra_outputs: frozenset = frozenset()        # members another group's recomputation reads
    gathered: dict = field(default_factory=dict)  # input -> bytes, for tables read by index
    form: str = ""                                # the kernel's form as the cost model takes it

    @property
    def n_ops(self) -> int:
        return len(self.members)


class GraphView:
    """Read-only facts about the graph the pass needs: order, sources through views, users;
    and what one search would otherwise work out again for each candidate group."""

    def __init__(self, gm: torch.fx.GraphModule, size_hints: dict):
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.kind = {n: n.meta.get("fc_kind", OpKind.OPAQUE) for n in gm.graph.nodes}
        # set by the fuse pass: ops some group computes again, and the current groups
        self.recomputed_anywhere: set = set()
        self.groups: dict = {}
        # the graph does not change while the fuse pass runs: what each node reads and which
        # ops read it are worked out once (a search asks them for every candidate group)
        self._args: dict = {}
        self._consumers: dict = {}
        self._reads: dict = {}
        self.sizes = NodeSizes(size_hints)      # bytes and FLOPs of each node
        # the kernel IRs of the candidates checked (legality.py): the same candidate recurs in
        # every layer of a model
        self.kernel_irs: dict = {}      # fx_signature -> (IR, graph symbols, IR text)
        self.ir_templates: dict = {}    # node -> its part of a signature (fx_signature)
        self._parts: dict = {}          # id(IR) -> (IR, its multi-part split)

    def is_data(self, n) -> bool:
        return self.kind.get(n) in DATA

    def is_transparent(self, n) -> bool:
        return self.kind.get(n) in TRANSPARENT

    def tensor_args(self, n) -> tuple:
        found = self._args.get(n)
        if found is None:
            # a constant (full_like reads only its input's shape) reads no tensor
            found = self._args[n] = () if n.target in CONSTANT_VALUE_ARG else tuple(
                a for a in n.all_input_nodes if "fc_tensor" in a.meta)
        return found

    def sources(self, n, through: set):
        """Tensors ``n`` reads, following views; stops at members of ``through``."""
        out, stack = [], list(self.tensor_args(n))
        while stack:
            a = stack.pop()
            if a in through or not self.is_transparent(a):
                out.append(a)
            else:
                stack.extend(self.tensor_args(a))
        return out

    def reads(self, n) -> tuple:
        """(views, tensors): the views and expands between ``n`` and the tensors it reads, which
        a kernel computing ``n`` inlines, and those tensors (not views). The same whatever
        group ``n`` is in: a member is never a view."""
        found = self._reads.get(n)
        if found is None:
            views, tensors, stack = set(), set(), list(self.tensor_args(n))
            while stack:
                a = stack.pop()
                if not self.is_transparent(a):
                    tensors.add(a)
                elif a not in views:
                    views.add(a)
                    stack.extend(self.tensor_args(a))
            found = self._reads[n] = (frozenset(views), frozenset(tensors))
        return found

    def multipart_parts(self, ir):
        """``codegen.render.multipart_parts(ir)``, once per IR: equal candidates share one IR
        in a search (legality.py), and a legal group is split again to be costed. Keyed by
        identity (an IR's hash walks all of it); the entry holds its IR, so its id stays its
        own."""
        from ..codegen.render import multipart_parts

        found = self._parts.get(id(ir))
        if found is None:
            found = self._parts[id(ir)] = (ir, multipart_parts(ir))
        return found[1]

    def consumers(self, n) -> tuple:
        """Non-view users of ``n``, following views (an ATen view used by an output counts)."""
        found = self._consumers.get(n)
        if found is None:
            out, stack = [], list(n.users)
            while stack:
                u = stack.pop()
                if self.is_transparent(u) and any(True for _ in u.users):
                    stack.extend(u.users)
                else:
                    out.append(u)
            found = self._consumers[n] = tuple(out)
        return found


def _copy_elsewhere(c, m, members, view) -> bool:
    """True if another group computes its own copy of ``c`` (recomputation) without ``m``: that
    copy reads ``m`` from memory, so ``m`` must be written."""
    if c not in view.recomputed_anywhere:
        return False
    return any(c in g.members and m not in g.members and not g.members <= members
               for g in view.groups.values())


def analyze(group: FusionGroup, view: GraphView, ctx) -> FusionGroup:
    """Fill in nodes, inputs, outputs and cost of a group."""
    members = group.members
    nodes, inputs = set(members), set()
    for m in members:
        views, tensors = view.reads(m)
        nodes |= views
        inputs |= tensors
    inputs -= members
    group.nodes = sorted(nodes, key=view.order.__getitem__)
    group.inputs = sorted(inputs, key=view.order.__getitem__)
    # a recomputed member is computed again by every group that reads it: never written
    group.outputs = sorted((m for m in members if m in group.extra_outputs or (
        m not in group.recomputed and any(c not in members or _copy_elsewhere(c, m, members, view)
                                          for c in view.consumers(m)))),
        key=view.order.__getitem__)
    group.gathered = _gathered(group, ctx)
    passes, row_inputs, group.form = _looped_passes(group, view, ctx)
    group.cost = kernel_cost(group.inputs, group.outputs, passes, row_inputs, ctx.size_hints,
                             ctx.profile, group.members, gathered=group.gathered,
                             sizes=view.sizes)
    return group


def _gathered(group: FusionGroup, ctx) -> dict:
    """Inputs read only by gathers (embedding tables): the bytes of the elements gathered (at
    most the whole input), not its size (GPT-2's token table is 77 MB; 8 x 512 tokens read 6 MB
    of it)."""
    tables: dict = {}
    for m in group.members:
        if m.target in GATHERS:
            out = m.meta["fc_tensor"]
            tables[m.args[0]] = tables.get(m.args[0], 0) + hint(out.numel, ctx.size_hints) \
                * out.itemsize
    found = {}
    for table, rows in tables.items():
        readers = [u for u in table.users if u in group.nodes]
        if table in group.inputs and all(u.target in GATHERS and u.args[0] is table
                                         and table not in u.args[1:] for u in readers):
            found[table] = min(rows, tensor_bytes(table, ctx.size_hints))
    return found


def charge_parts(group: FusionGroup, view: GraphView, ctx) -> None:
    """Correct a legal group's cost (``group.ir`` set) if it is a multi-part kernel
    (codegen/multipart.py): each part loads the inputs it reads, so an input read by k parts
    is read k times (from HBM when those re-reads do not fit in half the L2)."""
    parts = view.multipart_parts(group.ir)
    if parts is None:
        return
    reads = Counter(i for _, ins, _ in parts for i in ins)
    reread = [group.inputs[i] for i, k in reads.items() for _ in range(k - 1)]
    if reread:
        group.cost = kernel_cost(group.inputs, group.outputs, 1, (), ctx.size_hints,
                                 ctx.profile, group.members, reread, group.gathered,
                                 sizes=view.sizes)


def _looped_passes(group: FusionGroup, view: GraphView, ctx):
    """(passes over each row, inputs re-read on every pass, the kernel's form) of a group's
    kernel: "pointwise", "rows" (a persistent row kernel: one pass), "rows, held" (the resident
    kernel: one pass) or "rows, N passes" (the looped kernel, or its split stages).

    A row too long for registers is streamed once per reduction level and once more for the
    per-element outputs: a LayerNorm over a long row reads its input three times (the mean,
    the variance, the output). A reduction with a partner (``codegen.lowered.partner_of``) is
    taken in its partner's pass: a softmax's sum of exps in its max's (the online softmax), a
    norm's variance in its mean's (Welford's update). A softmax or a LayerNorm reads its rows
    twice, a cross-entropy (per-row outputs alone) once, and so does a row whose per-element
    outputs no reduction feeds (a BatchNorm's backward with the gradient it passes on, where
    the sums are the weight's). A static row short enough for the
    resident kernel is read once, where its rows are too many to split across programs
    (``launch.split_settings``)."""
    reductions = [m for m in group.members if view.kind[m] is OpKind.REDUCTION]
    if not reductions:
        return 1, (), "pointwise"
    src = reductions[0].args[0].meta["fc_tensor"]
    n = hint(src.shape[-1], ctx.size_hints)
    if launch._next_pow2(n) <= ctx.config.max_persistent_block or any(
            m.target in SCANS for m in reductions):
        return 1, (), "rows"        # a scan's row is one block, whatever its length
    if src.shape[-1].is_Integer and _resident(group, src, n, ctx):
        return 1, (), "rows, held"
    level, graph = {}, _FXGraph(set(group.members))
    for m in sorted(group.members, key=view.order.__getitem__):
        up = [level[s] for s in view.sources(m, set()) if s in level]
        partner = partner_of(m, graph) if m in reductions else None
        if partner is not None and partner[1] in level:
            level[m] = level[partner[1]]
        else:
            level[m] = max(up, default=0) + (1 if m in reductions else 0)
    row_numel = hint(src.numel, ctx.size_hints)
    # a per-element output that no reduction feeds is stored in the first pass
    # (codegen/lower.py): only one a reduction feeds takes a pass of its own
    per_element = any(hint(o.meta["fc_tensor"].numel, ctx.size_hints) >= row_numel
                      and level.get(o, 0) > 0 for o in group.outputs)
    passes = max(level[r] for r in reductions) + (1 if per_element else 0)
    row_inputs = {i for i in group.inputs if hint(i.meta["fc_tensor"].numel, ctx.size_hints) >= row_numel}
    return passes, row_inputs, f"rows, {passes} pass{'es' * (passes != 1)}"


def _resident(group: FusionGroup, src, n: int, ctx) -> bool:
    """Whether the resident kernel holds the group's rows (of a static ``n``): rows too many to
    split (``launch.split_settings``) and values that fit its registers, as its code generator
    estimates them from its row loads (``resident._held_values``): here its inputs of more than
    ``n`` elements (a weight of ``n`` is loaded a chunk at a time), from the row's 16 bytes
    where the row is not on them."""
    cfg = ctx.config
    if not launch.resident(n, cfg.max_persistent_block, cfg.max_resident_row):
        return False
    if launch.split_settings(max(hint(src.numel, ctx.size_hints) // n, 1), n) is not None:
        return False
    sizes = [i.meta["fc_tensor"].dtype.itemsize for i in group.inputs
             if hint(i.meta["fc_tensor"].numel, ctx.size_hints) > n]
    width = min(sizes, default=src.dtype.itemsize)
    pad = 16 // width - 1 if n * width % 16 else 0
    return launch.resident_fits(launch.resident_chunks(n, pad), max(sum(sizes) / 4, 1))


class _FXGraph:
    """A group's FX nodes as ``codegen.lowered.partner_of`` reads them (a node outside the
    group is an input of its kernel, as in the kernel's IR)."""

    def __init__(self, members):
        self.members = members

    def op(self, node):
        if node not in self.members or node.op != "call_function":
            return None
        return str(node.target), node.args, node.kwargs

    @staticmethod
    def ref(arg):
        return arg if isinstance(arg, torch.fx.Node) else None

    @staticmethod
    def meta(node):
        t = node.meta["fc_tensor"]
        return t.dtype, tuple(str(d) for d in t.shape)


COPIES = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default,
          torch.ops.prims.convert_element_type.default)
# GPU time of one strided read of one element that a vectorized read would have shared: Mamba2's
# depthwise mixer ([4, 1024, 2304] bf16, four taps whose weights lie at a stride of 4) took 82 us
# on the H100 reading them across the grain and 26 us reading a contiguous copy: 56 us over 37.7M
# reads (the generated kernel and a hand-edited one, BENCHMARKS.md session 60)
STRIDED_READ_TIME = 1.5e-12


def read_across_the_grain(p: FusionGroup, c: FusionGroup, view: GraphView,
                          size_hints: dict) -> tuple:
    """(seconds, reason): what merging copy group ``p`` into ``c`` costs beyond the bytes, where
    ``p`` is copies alone (clone, dtype casts) of a small tensor read across its grain (a view
    whose last dim, of size > 1, has a stride above 1: ``w[:, 0].t()`` of a [C, 1, K] weight;
    not an expand's 0, which reads one element again) written with its last dim contiguous.
    Merged, ``c`` gathers that tensor with the stride again in each of its elements, loads of
    one element that cannot be vectorized; apart, it reads the copy in vectors. (0.0, "") for
    any other pair."""
    if not p.members or not p.outputs or any(m.target not in COPIES for m in p.members):
        return 0.0, ""
    size = max(hint(o.meta["fc_tensor"].numel, size_hints) for o in p.outputs)
    reader = max((hint(m.meta["fc_tensor"].numel, size_hints) for m in c.members), default=0)
    if not size or reader <= size:
        return 0.0, ""
    for m in p.members:
        src = m.args[0] if m.args else None
        info = getattr(src, "meta", {}).get("fc_tensor")
        if info is None or not info.shape or src in p.members:
            continue
        last, stride = hint(info.shape[-1], size_hints), hint(info.stride[-1], size_hints)
        if last > 1 and stride > 1 and hint(m.meta["fc_tensor"].stride[-1], size_hints) == 1:
            reads = reader * sum(_uses(o, c.members, view) for o in p.outputs)
            return reads * STRIDED_READ_TIME, (
                f"a small tensor read across its grain (stride {stride}) {reads} times: "
                "its copy kept apart, read contiguously")
    return 0.0, ""


def _uses(node, inside, view) -> int:
    """How many reads of ``node`` an element of a kernel computing ``inside`` makes: its
    consumers there (past views), counted through casts (the depthwise taps' four selects of
    one cast copy are four reads)."""
    return sum((_uses(u, inside, view) or 1) if u.target in COPIES else 1
               for u in view.consumers(node) if u in inside)
