"""Multi-part kernels: independent pointwise computations of different shapes in one launch.

Horizontal fusion merges sibling groups (RoPE on q and on k: ``[1, 16, 128, 128]`` and
``[1, 4, 4, 128, 128]``) that share no value. One kernel with one iteration space cannot hold
them; a multi-part kernel gives each part its own range of program ids:

    pid = tl.program_id(0)
    if pid < blocks(part 0):            part 0 at block pid
    elif pid < blocks(0) + blocks(1):   part 1 at block pid - blocks(0)
    ...

Each part is the ordinary pointwise kernel of its sub-IR, called as a jit function with its
block index. ``split`` finds the parts: the connected components of the IR's op graph (ops
joined by the values they compute). An input two parts read is loaded by each, and so is a
view of it (``cos.unsqueeze(1)`` read by RoPE on q and on k): views compute nothing, so each
part that reads one gets its own copy of it rather than being joined to the other.
"""
from __future__ import annotations

from .indexing import INDEX_OPS
from .kernel_ir import KernelIR, ref_id

VIEW_OPS = set(INDEX_OPS) | {"aten.view.default", "aten._unsafe_view.default",
                             "aten.reshape.default", "aten.expand.default",
                             "aten.as_strided.default"}


def split(ir: KernelIR) -> list[tuple[KernelIR, list[int], list[int]]]:
    """[(sub-IR, its inputs' ids in ``ir``, its outputs' positions in ``ir.outputs``)] for each
    independent part, in order of first output; one entry when nothing splits."""
    n_in = len(ir.inputs)
    parent = list(range(len(ir.values)))

    def find(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def refs(a):
        r = ref_id(a)
        if r is not None:
            yield r
        elif isinstance(a, tuple):
            for x in a:
                yield from refs(x)

    op_refs, shared = [], set()     # shared: views of inputs (only), copied into every reader
    for j, op in enumerate(ir.ops):
        vid = n_in + j
        used = list(refs(op.args)) + list(refs(tuple(v for _, v in op.kwargs)))
        op_refs.append(used)
        if op.target in VIEW_OPS and all(r < n_in or r in shared for r in used):
            shared.add(vid)
            continue
        for r in used:
            if r >= n_in and r not in shared:
                parent[find(r)] = find(vid)
    roots = []
    for o in ir.outputs:
        if find(o) not in roots:
            roots.append(find(o))
    parts = []
    for root in roots:
        own = {n_in + j for j in range(len(ir.ops)) if find(n_in + j) == root}
        stack = list(own)
        while stack:                # the shared views this part reads, and theirs
            for r in op_refs[stack.pop() - n_in]:
                if r in shared and r not in own:
                    own.add(r)
                    stack.append(r)
        ops = sorted(own)
        inputs = sorted({r for vid in ops for r in op_refs[vid - n_in] if r < n_in})
        ids = {old: new for new, old in enumerate(inputs)}
        for vid in ops:
            ids[vid] = len(ids)

        def remap(a):
            r = ref_id(a)
            if r is not None:
                return ("ref", ids[r])
            if isinstance(a, tuple):
                return tuple(remap(x) for x in a)
            return a

        sub_ops = tuple(type(ir.ops[vid - n_in])(ir.ops[vid - n_in].target,
                                                 remap(ir.ops[vid - n_in].args),
                                                 tuple((k, remap(v)) for k, v
                                                       in ir.ops[vid - n_in].kwargs))
                        for vid in ops)
        positions = [p for p, o in enumerate(ir.outputs) if find(o) == root]
        sub = KernelIR(tuple(ir.inputs[i] for i in inputs), sub_ops,
                       tuple(ir.values[v] for v in inputs + ops),
                       tuple(ids[ir.outputs[p]] for p in positions), ir.symbols, ir.device_type)
        parts.append((sub, inputs, positions))
    return parts
