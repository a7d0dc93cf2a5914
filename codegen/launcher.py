"""Render a fused group's host launcher: the Python function its graph calls on every step.

It allocates the outputs, picks the launch settings through codegen/launch.py's shared rules,
and launches: through Triton the first time per key, then directly (``launch_static`` or the
compiled kernel's own launcher), so a call costs microseconds. The key holds what Triton
specializes on: pointer alignment, integer sizes' % 16, == 1 and width, the settings.
"""
from __future__ import annotations

import sympy
import torch

from . import launch as rules
from .indexing import print_expr
from .kernel_ir import KernelIR, ref_id
from .lowered import GATHERS, VIEWS, flat_args
from .ops import ELEMENTWISE
from .row_outputs import pad_slabs

# ELEMENTWISE: ops that read each element of their operands at the index they write: a kernel
# that reads an input only through these, at the output's shape and strides, reads each element
# of it before the same program writes that element of the output

INDEX_LIMIT = 2**31 - 1


def checks_indices(ir: KernelIR) -> bool:
    """Whether the kernel gathers by index (and asserts the indices in range)."""
    return any(op.target in GATHERS for op in ir.ops)


def py_expr(e) -> str:
    """A size or index expression as Python source."""
    return print_expr(sympy.sympify(e))


def stream_bytes(ir: KernelIR, shape) -> int:
    """Bytes per element a pointwise kernel over ``shape`` loads from inputs with as many
    distinct elements as it has (a broadcast bias or scale is read from cache, not counted)."""
    numel = sympy.expand(sympy.Mul(*shape))
    total = 0
    for v in ir.inputs:
        distinct = sympy.Mul(*(s for s, st in zip(v.shape, v.stride) if st != 0))
        if not v.host_scalar and sympy.expand(distinct - numel) == 0:
            total += v.dtype.itemsize
    return total


def inplace_outputs(ir: KernelIR, shape) -> dict:
    """{output position: (input position, reshaped)} of a pointwise kernel over ``shape``: the
    outputs it may write over an input instead of a fresh allocation, where the graph has no
    use of that input after the kernel (passes/inplace.py decides); ``reshaped``: the output
    is a view of the input at its shape. The input has the output's dtype and
    no storage offset, and each program reads the elements of it that it overwrites, before
    it stores them, and no others: only elementwise ops read it, at the output's shape and
    strides, or only reshapes to the output's shape do, the input and the output both
    contiguous (the same linear offsets: a GEMM's [B*H*W, C] output read as [B, H, W, C])."""
    readers = {}        # value id -> the targets of the ops that read it
    users = {}          # value id -> the ids of the values of the ops that read it
    n_in = len(ir.inputs)
    for k, op in enumerate(ir.ops):
        for a in flat_args(op.args + tuple(v for _, v in op.kwargs)):
            if ref_id(a) is not None:
                readers.setdefault(ref_id(a), set()).add(op.target)
                users.setdefault(ref_id(a), set()).add(n_in + k)

    def in_place_reads(j, shape) -> bool:
        """Whether every value computed from value j, however far down, is computed by
        elementwise ops at ``shape``: then each element of j is read where it is written.
        A value of j read elsewhere (a select, a slice, a flip, an expand of it: a sum over a
        small dim unrolled into slices, ``y = 2 * x; y + y.flip(0)``) would read elements
        another program has already overwritten."""
        stack, seen = list(users.get(j, ())), set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if ir.ops[v - n_in].target not in ELEMENTWISE or \
                    tuple(ir.values[v].shape) != tuple(shape):
                return False
            stack.extend(users.get(v, ()))
        return True
    views_of = {}       # input -> the value ids of the reshapes that read it
    for k, op in enumerate(ir.ops):
        if op.target in VIEWS and ref_id(op.args[0]) is not None and ref_id(op.args[0]) < n_in:
            views_of.setdefault(ref_id(op.args[0]), []).append(n_in + k)
    found, taken = {}, set()
    for p, o in enumerate(ir.outputs):
        out = ir.values[o]
        if o < n_in or tuple(out.shape) != tuple(shape):
            continue
        for j, v in enumerate(ir.inputs):
            if j in taken or not _may_hold(ir, j, out) or not readers.get(j):
                continue
            same_layout = (readers[j] <= ELEMENTWISE and tuple(v.shape) == tuple(out.shape)
                           and tuple(v.stride) == tuple(out.stride)
                           and in_place_reads(j, out.shape))
            reshaped = (readers[j] <= VIEWS and _contiguous(v.shape, v.stride)
                        and _contiguous(out.shape, out.stride)
                        and all(tuple(ir.values[w].shape) == tuple(out.shape)
                                and readers.get(w) and readers[w] <= ELEMENTWISE
                                and in_place_reads(w, out.shape)
                                for w in views_of.get(j, [])))
            if same_layout or reshaped:
                found[p] = (j, not same_layout)
                taken.add(j)
                break
    return found


def row_inplace_outputs(lk) -> dict:
    """``inplace_outputs`` of a persistent row kernel (``lk``, its lowering; the launcher hands
    no input over where it picks a looped kernel instead): an output may take the memory of an input of the same
    dtype, shape and strides (or both contiguous, of as many elements: the output is then a
    view of the input), no storage offset, whose every load is at the output's store
    address (a norm's residual sum over the residual, its output over the sum's other
    operand; a per-row value over a per-row input), where each load of the input comes
    before each store of the output in the kernel's order and the output's value is computed
    from the input. A program then reads every element it overwrites, as the value it stores
    needs it, and no element after."""
    ir = lk.ir
    n_in = len(ir.inputs)
    order = [st for ph in lk.phases for st in ph.outer + ph.body] + list(lk.tail)
    sources = {}        # value id -> the inputs it is computed from

    def inputs_of(vid):
        if vid < n_in:
            return {vid}
        if vid not in sources:
            op = ir.ops[vid - n_in]
            sources[vid] = set().union(*(inputs_of(ref_id(a)) for a in flat_args(
                op.args + tuple(v for _, v in op.kwargs)) if ref_id(a) is not None))
        return sources[vid]
    found, taken = {}, set()
    for p, o in enumerate(ir.outputs):
        out = ir.values[o]
        stores = [i for i, st in enumerate(order) if st[0] == "store" and st[1] == p]
        offsets = {sympy.expand(order[i][3]) for i in stores}
        # stores at one address, all per element or all per row (a per-row value over an
        # input of its layout read at the row's address: BN's running mean, in the kernel
        # that combines the batch's statistics; its store ends the kernel, after every load)
        if o < n_in or not stores or len(offsets) != 1 \
                or len({bool(order[i][4]) for i in stores}) != 1:
            continue
        (offset,) = offsets
        for j, v in enumerate(ir.inputs):
            if j in taken or not _may_hold(ir, j, out) or j not in inputs_of(o):
                continue
            same_layout = (tuple(v.shape) == tuple(out.shape)
                           and tuple(v.stride) == tuple(out.stride))
            # a view of the input at the output's shape (BLOOM's [B*H, S, S] attention
            # scores under its [B, H, S, S] softmax): the same elements at the same offsets
            reshaped = (_contiguous(v.shape, v.stride) and _contiguous(out.shape, out.stride)
                        and sympy.expand(sympy.Mul(*v.shape) - sympy.Mul(*out.shape)) == 0)
            loads = [i for i, st in enumerate(order) if st[0] == "load" and st[2] == j]
            if ((same_layout or reshaped) and loads and max(loads) < min(stores)
                    and all(not order[i][4] and sympy.expand(order[i][3] - offset) == 0
                            for i in loads)):
                found[p] = (j, not same_layout)
                taken.add(j)
                break
    return found


def _may_hold(ir: KernelIR, j: int, out) -> bool:
    """Whether input ``j`` of ``ir`` could hold output value ``out``: a tensor of its dtype,
    with no storage offset, that the kernel does not return as well."""
    v = ir.inputs[j]
    return (not v.host_scalar and v.dtype == out.dtype and j not in ir.outputs
            and sympy.sympify(v.storage_offset) == 0)


def _contiguous(shape, stride) -> bool:
    """Row-major, dims of size 1 aside."""
    expect = sympy.Integer(1)
    for size, st in reversed(list(zip(shape, stride))):
        size = sympy.sympify(size)
        if size != 1 and sympy.expand(sympy.sympify(st) - expect) != 0:
            return False
        expect = expect * size
    return True


def _max_offset(shape, stride):
    return sum(((s - 1) * st for s, st in zip(shape, stride)), sympy.Integer(0))


def render_launcher(ir: KernelIR, kind, shape, kernels: dict, max_persistent_block,
                    hoists: bool = False, strided: int = 0, partials: int = 0,
                    reuse=None, looped_block: int = rules.LOOPED_RBLOCK,
                    block_cap: int | None = None, row_bounds: tuple | None = None) -> str:
    """Source of ``launch(DEVICE, in0, ..., sizes)``, the function a graph calls for the group:
    ``kind`` "pointwise", "row" or "multipart" over ``shape`` (a list of shapes for multipart);
    ``kernels`` maps each kernel's name to its runtime size arguments; ``hoists``: the
    persistent row kernel has a HOIST switch, set on small grids; ``strided``: its rows' elements
    lie apart and consecutive rows side by side, its kind 1 or 2 (statements.strided_kind,
    ``row_settings``; the module's ``STRIDED``);
    ``partials``: the looped kernel's reductions, where its split stages ``split0``... exist
    (few long rows: ``split_settings``); ``reuse``: a row kernel's outputs it may write over
    dead inputs (``row_inplace_outputs``; a pointwise kernel's are ``inplace_outputs``);
    ``looped_block``: the looped kernel's and split stages' step (``launch.row_limits``);
    ``block_cap``: the most elements a program of a tiled pointwise kernel (or part) takes, so
    that its tiles divide their dims (codegen/tiles.py); ``row_bounds``: (least, most) rows a
    program of a tiled persistent row kernel takes and its least warps (tiles.RowTile)."""
    syms = [s.name for s in ir.symbols]
    ins = [f"in{i}" for i in range(len(ir.inputs))]
    # DEVICE first: the generate pass binds it per graph (one module may serve several devices)
    lines = [f"def launch({', '.join(['DEVICE'] + ins + syms)}):"]
    # 0-dim CPU tensors reach a GPU kernel by value
    spec = []       # the lean launch key: what Triton specializes each argument on
    # the direct launch passes addresses, not tensors: for a tensor Triton's C launcher calls
    # data_ptr() and asks the driver whether it is a device pointer (cuPointerGetAttribute),
    # about a microsecond per argument on the H200's host; Dynamo's device guards and the
    # allocations below already make every address a device one
    addrs = []
    for i, v in enumerate(ir.inputs):
        if v.host_scalar:
            lines.append(f"    s{i} = in{i}.item()")
            ins[i] = f"s{i}"
            addrs.append(f"s{i}")
            if not v.dtype.is_floating_point and v.dtype != torch.bool:
                spec += [f"s{i} & 15", f"s{i} == 1"]
        else:
            lines.append(f"    p{i} = in{i}.data_ptr()")
            addrs.append(f"p{i}")
            spec.append(f"p{i} & 15")
    # fresh allocations: always 16-byte aligned, no key part needed; an output written over a
    # dead input (``r{p}``, inplace_outputs) is that input, with no offset: as aligned
    if kind == "pointwise":
        reuse = inplace_outputs(ir, shape)
    reuse = dict(reuse or {})
    # a row kernel writes over an input only where the persistent kernel runs (each row read
    # once): not where row_settings picks the looped one, for a row longer than its block
    persistent_only = ""
    if kind == "row" and ("looped" in kernels or "resident" in kernels):
        block = 1 << (max_persistent_block.bit_length() - 1)     # row_settings' test
        persistent_only = f" and {py_expr(shape[-1])} <= {block}"
    # a row kernel's padded outputs: it stores what lies inside the pad, these lines zero the
    # margins (row_outputs.pad_slabs)
    zeroed = []
    for p, o in enumerate(ir.outputs):
        for d, start, length in (pad_slabs(ir, o, shape) if kind == "row" else []):
            zeroed.append(f"    out{p}.narrow({d}, {py_expr(start)}, {py_expr(length)}).zero_()")
            reuse.pop(p, None)
    if reuse:
        lines[0] = lines[0][:-2] + "".join(f", r{p}=None" for p in reuse) + "):"
    outs = []
    fast, slow = [], []
    for p, o in enumerate(ir.outputs):
        v = ir.values[o]
        size = f"({''.join(py_expr(s) + ', ' for s in v.shape)})"
        stride = f"({''.join(py_expr(s) + ', ' for s in v.stride)})"
        over = ""
        if p in reuse:      # the input's memory at the output's shape (launch.reinterpret)
            over = f"reinterpret(r{p}, {size}, {stride}, 0)"
            if not reuse[p][1]:     # the input itself, unless autograd sees it as a view
                over = f"(r{p} if r{p}._base is None else {over})"
            over += f" if r{p} is not None{persistent_only} else "
        fast.append(f"        out{p} = {over}empty_cuda({size}, {stride}, {v.dtype})")
        slow.append(f"        out{p} = {over}torch.empty_strided({size}, {stride}, "
                    f"dtype={v.dtype}, device=DEVICE)")
        outs.append(f"out{p}")
    lines.append("    dev = current_device()")
    if outs:
        lines += ["    if FAST_ALLOC and DEVICE.index == dev:", *fast, "    else:", *slow]
    lines += zeroed
    numels = [sympy.Mul(*sh) for sh in shape] if kind == "multipart" else [sympy.Mul(*shape)]
    extents = numels + [_max_offset(v.shape, v.stride) + 1 for v in ir.inputs
                        if not v.host_scalar]
    extents += [_max_offset(ir.values[o].shape, ir.values[o].stride) + 1 for o in ir.outputs]
    # one test per distinct extent: this runs on every call
    dynamic = sorted({py_expr(sympy.expand(e)) for e in extents if not sympy.sympify(e).is_Integer})
    static64 = any(int(e) > INDEX_LIMIT for e in extents if sympy.sympify(e).is_Integer)
    index64 = ("True" if static64 else
               " or ".join(f"{e} > {INDEX_LIMIT}" for e in dynamic) or "False")
    ptrs = ins + outs
    addrs += [f"{o}.data_ptr()" for o in outs]

    def launch(name, grid, runtime, constexprs, settings, ind, scratch=(), keyed=False):
        """Lines launching ``name``: through Triton once per key, then directly. ``scratch``:
        tensors allocated here that the kernel takes after its outputs (fresh, so aligned);
        ``keyed``: ``key`` is already the one these arguments make (an earlier launch's)."""
        # R is not specialized (do_not_specialize); a size fixed in the IR is the same on
        # every call of this module, so it needs no key part. Each integer's width is in the
        # key, as in Triton's (i32 up to 2**31 - 1, i64 past it): a kernel compiled for an i32
        # size would be handed a wider one by the direct relaunch
        ints = [a for a in runtime if a != "R" and a not in static]
        wide = [a for a in runtime if a not in static]
        key = ", ".join(["dev", *settings, "index64", *spec]
                        + [f"{a} & 15, {a} == 1" for a in ints]
                        + [f"{a} > 2147483647" for a in wide])
        pointers = addrs + [f"{t}.data_ptr()" for t in scratch]
        pos = ", ".join(pointers + runtime + constexprs)
        kw = ", ".join(ptrs + list(scratch) + runtime
                       + [f"{c}={c}" for c in constexprs if c != "index64"]
                       + ["INDEX64=index64", "num_warps=num_warps"]
                       # debug would also check every int32 add for overflow, as Inductor's
                       # kernels with index asserts, it asks for the asserts alone
                       + (["sanitize_overflow=False"] if checks_indices(ir) else []))
        pad = " " * ind
        values = ", ".join(pointers + runtime)
        return ([] if keyed else [f"{pad}key = ({key},)"]) + [
            f"{pad}k = _COMPILED_{name}.get(key)",
            f"{pad}if k is None:",
            f"{pad}    first_launch(_COMPILED_{name}, key, _{name}_kernel, {grid}, {kw})",
            f"{pad}elif k[0] is None:",
            f"{pad}    launch_static(k[1], {grid}, 1, 1, k[2], k[3], k[4], ({values}, *k[5]), "
            f"raw_stream(dev))",
            f"{pad}else:",
            f"{pad}    k[0]({grid}, 1, 1, raw_stream(dev), k[1], k[2], k[3], None, None, k[4], "
            f"None, None, None, {pos})"]

    if kind == "multipart":
        sized = [(f"numel{i}", n) for i, n in enumerate(numels)]
    else:
        sized = [("numel", numels[0]), ("N", shape[-1] if shape else 1),
                 ("R", sympy.Mul(*shape[:-1]) if shape else 1)]
    static = {name for name, e in sized if sympy.sympify(e).is_Integer}
    lines += [f"    index64 = {index64}"]
    if kind == "multipart":
        # every part is non-empty (iteration_space refuses empty tensors)
        names = [f"numel{i}" for i in range(len(numels))]
        lines += [f"    {name} = {py_expr(n)}" for name, n in zip(names, numels)]
        lines += [f"    BLOCK, num_warps = pointwise_settings(max({', '.join(names)}))",
                  *([f"    BLOCK = min(BLOCK, {block_cap})"] if block_cap else []),
                  "    grid = " + " + ".join(f"({n} + BLOCK - 1) // BLOCK" for n in names)]
        lines += launch("multipart", "grid", kernels["multipart"] + names,
                        ["BLOCK", "index64"], ["BLOCK", "num_warps"], 4)
    elif kind == "pointwise":
        lines += [f"    numel = {py_expr(sympy.Mul(*shape))}",
                  "    if numel > 0:",
                  f"        BLOCK, num_warps = pointwise_settings(numel, {stream_bytes(ir, shape)})",
                  *([f"        BLOCK = min(BLOCK, {block_cap})"] if block_cap else []),
                  "        grid = (numel + BLOCK - 1) // BLOCK",
                  "        EVEN = numel % BLOCK == 0"]
        lines += launch("pointwise", "grid", kernels["pointwise"] + ["numel"],
                        ["BLOCK", "index64", "EVEN"], ["BLOCK", "num_warps", "EVEN"], 8)
    else:
        lines += [f"    R = {py_expr(sympy.Mul(*shape[:-1]))}",
                  f"    N = {py_expr(shape[-1])}",
                  "    if R > 0:"]
        if "resident" in kernels and "persistent" not in kernels:
            # the split stages' and the resident kernel's settings are their own: no rule asked
            lines.append("        XBLOCK = 1  # a program a row")
        else:
            step = "" if looped_block == rules.LOOPED_RBLOCK else f", looped_block={looped_block}"
            lines += [f"        XBLOCK, RBLOCK, looped, num_warps = row_settings(R, N, "
                      f"{max_persistent_block}" + (", STRIDED" if strided else "") + step + ")"]
            if row_bounds:
                lines.append(f"        XBLOCK = min(max(XBLOCK, {row_bounds[0]}), {row_bounds[1]})"
                             "  # tiles of rows")
                if row_bounds[2] > 1:
                    lines.append(f"        num_warps = max(num_warps, {row_bounds[2]})")
            lines.append("        grid = (R + XBLOCK - 1) // XBLOCK")
        settings = ["XBLOCK", "RBLOCK", "num_warps"]
        constexprs = ["XBLOCK", "RBLOCK", "index64"]

        def persistent(ind):
            if not hoists:
                return launch("persistent", "grid", kernels["persistent"] + ["R", "N"],
                              constexprs, settings, ind)
            return [" " * ind + "HOIST = few_programs(grid)"] + launch(
                "persistent", "grid", kernels["persistent"] + ["R", "N"],
                constexprs + ["HOIST"], settings + ["HOIST"], ind)

        def looped(ind):
            if "resident" in kernels:   # the row held in registers, a program a row
                one = [f"{' ' * ind}XBLOCK, RBLOCK, num_warps = 1, {rules.RESIDENT_RBLOCK}, "
                       f"{rules.RESIDENT_WARPS}"] + launch("resident", "R", kernels["resident"]
                                                     + ["R", "N"], constexprs, settings, ind)
            else:
                one = launch("looped", "grid", kernels["looped"] + ["R", "N"], constexprs,
                             settings, ind)
            if not partials:
                return one
            # few long rows: each split across S programs, one kernel per phase, the partial
            # reductions in between in ws (row_loops.split_phases)
            pad = " " * ind
            size, stride = f"({partials}, R, S)", "(R * S, S, 1)"
            step = "" if looped_block == rules.LOOPED_RBLOCK else f", {looped_block}"
            lines = [f"{pad}split = split_settings(R, N{step})",
                     f"{pad}if split is not None:",
                     f"{pad}    S, CHUNK, SBLOCK, RBLOCK, num_warps = split",
                     f"{pad}    if FAST_ALLOC and DEVICE.index == dev:",
                     f"{pad}        ws = empty_cuda({size}, {stride}, torch.float32)",
                     f"{pad}    else:",
                     f"{pad}        ws = torch.empty_strided({size}, {stride}, "
                     "dtype=torch.float32, device=DEVICE)"]
            stages = sorted((k for k in kernels if k.startswith("split")), key=lambda k: int(k[5:]))
            for i, name in enumerate(stages):
                # a stage taking the arguments of the one before has its key
                same = i > 0 and kernels[name] == kernels[stages[i - 1]]
                lines += launch(name, "R * S", kernels[name] + ["R", "N", "S", "CHUNK"],
                                ["XBLOCK", "RBLOCK", "SBLOCK", "index64"], settings + ["SBLOCK"],
                                ind + 4, ["ws"], keyed=same)
            return lines + [f"{pad}else:"] + ["    " + ln for ln in one]
        if "looped" not in kernels and "resident" not in kernels:
            lines += persistent(8)
        elif "persistent" not in kernels:
            lines += looped(8)
        else:
            lines += ["        if looped:"] + looped(12)
            lines += ["        else:"] + persistent(12)
    lines.append(f"    return ({''.join(o + ', ' for o in outs)})")
    tables = "".join(f"_COMPILED_{name} = {{}}\n" for name in kernels)
    # the outputs the graph may have written over a dead input: output -> input position
    tables += f"INPLACE = {({p: j for p, (j, _) in reuse.items()})!r}\n"
    # whether the launcher writes over what it is handed every time (not where a looped row
    # kernel may run instead): passes/input_writes.py drops a copy only then
    tables += f"INPLACE_ALWAYS = {not persistent_only!r}\n"
    return tables + "\n\n" + "\n".join(lines)
