"""Rendering for `fusion-compiler dump`: the aligned text table, and the formatters the
pictures (dump_graphics.py: Graphviz DOT, one HTML page) share with it.

Every ``render_*`` function takes the dump document built by ``fusion_compiler.cli`` (plain
data; schema in docs/dump-format.md) and returns a string. Nothing here compiles anything.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from itertools import groupby


REFUSED_SHOWN = 20      # refused fusions the table lists (JSON lists them all)
OPS_WIDTH = 40          # ops column of the text table, in characters
COLORS = {"row reduction": "#dbeafe", "pointwise": "#dcfce7", "softmax": "#ffedd5"}
OTHER_COLOR, NOT_GENERATED_COLOR, ATEN_COLOR = "#ede9fe", "#fee2e2", "#e5e7eb"


# ---------------------------------------------------------------- small formatters

def human_bytes(n) -> str:
    """1135616 -> '1.14 MB' (decimal units, like the bandwidths of the cost model)."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    digits = 0 if unit == "B" or abs(n) >= 100 else 1 if abs(n) >= 10 else 2
    return f"{n:.{digits}f} {unit}"


def op_name(op: str) -> str:
    """'pow.Tensor_Scalar' -> 'pow', '<built-in function getitem>' -> 'getitem'."""
    return _builtins(str(op)).split(".")[0]


def _builtins(text: str) -> str:
    return re.sub(r"<built-in function (\w+)>", r"\1", text)


def ops_text(ops, width=OPS_WIDTH) -> str:
    """Op names with repeats folded ('mul x2'), cut to ``width`` characters ('... +3')."""
    runs = [(op, len(list(same))) for op, same in groupby(map(op_name, ops))]
    parts = [op if k == 1 else f"{op} x{k}" for op, k in runs]
    text = ", ".join(parts)
    if width is None or len(text) <= width:
        return text
    shown = []
    for i, part in enumerate(parts):
        tail = f", ... +{sum(k for _, k in runs[i:])}"
        if len(", ".join(shown + [part])) + len(tail) > width and shown:
            return ", ".join(shown) + tail
        shown.append(part)
    return text


def _shapes(tensors, most=3) -> str:
    text = " ".join("[" + ",".join(map(str, t["shape"])) + "]" for t in tensors[:most])
    return text + (f" +{len(tensors) - most}" if len(tensors) > most else "")


def io_text(group) -> str:
    return f"{_shapes(group['inputs'])} -> {_shapes(group['outputs'])}"


def nodes_text(names, most=2) -> str:
    text = ",".join(names[:most])
    return text + (f",+{len(names) - most}" if len(names) > most else "")


def text_table(headers, rows, right=(), indent="  ") -> list:
    """Lines of a plain-text table with aligned columns (``right``: right-aligned columns)."""
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]

    def line(cells):
        return indent + "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers)] + [line(r) for r in rows]


# ---------------------------------------------------------------- rows shared by table and HTML

GROUP_HEADERS = ["group", "label", "form", "ops", "in -> out", "bytes unfused -> fused",
                 "launches saved", "est. time saved"]
GROUP_RIGHT = {6, 7}        # the numbers' columns
ATEN_HEADERS = ["op", "count", "reason"]
REFUSED_HEADERS = ["producer -> consumer", "score", "bytes before -> after"]


def group_rows(summary, width=OPS_WIDTH):
    """(rows, notes): one row per fused group; notes maps a why_not reason to its mark."""
    rows, notes = [], {}
    for g in summary["groups"]:
        mark = ""
        if not g["kernel"]:
            mark = notes.setdefault(g["why_not"] or "no kernel", f"[{len(notes) + 1}]")
        rows.append([f"#{g['id']}{mark}", g["label"], g["form"], ops_text(g["ops"], width),
                     io_text(g),
                     f"{human_bytes(g['bytes_unfused'])} -> {human_bytes(g['bytes_fused'])}",
                     str(g["launches_saved"]), f"{g['time_saved_us']:.1f} us"])
    return rows, notes


def aten_rows(summary):
    """(op, count, reason) per distinct op and reason, most frequent first."""
    counts = Counter((op_name(a["op"]), _builtins(a["reason"])) for a in summary["aten_ops"])
    return [[op, str(k), reason] for (op, reason), k in counts.most_common()]


def refused_sections(summary, limit=REFUSED_SHOWN):
    """[(reason, count, rows)]: refusals grouped by reason, best score first, ~``limit`` rows."""
    by_reason = defaultdict(list)
    for r in summary["refused"]:
        by_reason[_builtins(r["reason"])].append(r)
    reasons = sorted(by_reason, key=lambda k: -len(by_reason[k]))
    cap = max(2, limit // max(1, len(reasons)))
    out = []
    for reason in reasons:
        items = sorted(by_reason[reason], key=lambda r: -r["score_us"])[:cap]
        rows = [[f"{nodes_text(r['producer'])} -> {nodes_text(r['consumer'])}",
                 f"{r['score_us']:.2f} us",
                 f"{human_bytes(r['bytes_before'])} -> {human_bytes(r['bytes_after'])}"]
                for r in items]
        out.append((reason, len(by_reason[reason]), rows))
    return out


def totals_rows(summary):
    t = summary["totals"]
    before, after = t["time_before_us"], t["time_after_us"]
    speedup = f"  ({before / after:.1f}x)" if after > 0 else ""
    return [["kernels", f"{t['kernels_before']} -> {t['kernels_after']}",
             f"(+{t['aten_ops']} ops on ATen)"],
            ["bytes", f"{human_bytes(t['bytes_before'])} -> {human_bytes(t['bytes_after'])}", ""],
            ["est. time", f"{before:.1f} us -> {after:.1f} us{speedup}", ""]]


def options_text(doc) -> str:
    o = doc["options"]
    return ", ".join([f"device {o['device']}", f"dtype {o['dtype'] or 'factory default'}",
                      "training" if o["training"] else "inference",
                      *(["dynamic shapes"] if o["dynamic"] else []), f"profile {o['profile']}"])


def graph_title(i, s) -> str:
    ran = "" if s.get("ran_kernels", True) else ", analysis only: the kernels did not run here"
    return f"graph {i}: {s['kind']} (profile {s['profile']}{ran})"


# ---------------------------------------------------------------- text table

def render_table(doc) -> str:
    out = [f"fusion-compiler dump {doc['target']}  ({options_text(doc)})"]
    if not doc["graphs"]:
        out.append("no graph was compiled (did the model run any tensor op?)")
    for i, s in enumerate(doc["graphs"]):
        out += ["", f"== {graph_title(i, s)} =="]
        if s.get("error"):
            out.append(f"compiling this graph failed; it runs on ATen unfused: {s['error']}")
            continue
        rows, notes = group_rows(s)
        out += [f"fused groups ({len(rows)})"] + (text_table(GROUP_HEADERS, rows, GROUP_RIGHT)
                                                    if rows else [])
        out += [f"  {mark} not generated, stays on ATen: {why}" for why, mark in notes.items()]
        out += ["", f"left on ATen ({len(s['aten_ops'])} ops)"]
        if s["aten_ops"]:
            out += text_table(ATEN_HEADERS, aten_rows(s), right={1})
        if s.get("constants"):
            out += ["", f"computed once, at compile time ({len(s['constants'])} constants, "
                        f"{human_bytes(sum(c['bytes'] for c in s['constants']))}): "
                        + ", ".join(c["node"] for c in s["constants"])]
        if s.get("contractions"):
            out += ["", "summed broadcast products run as batched GEMMs (bmm), not reductions "
                        f"that read the operands again for each output ({len(s['contractions'])}): "
                        + ", ".join(f"{c['node']} {c['batch']} x [{c['m']}, {c['k']}] @ "
                                    f"[{c['k']}, {c['n']}]" for c in s["contractions"])]
        if s.get("contractions_kept"):
            out += ["", "summed broadcast products that are matrix products, kept fused "
                        f"reductions ({len(s['contractions_kept'])}):"]
            out += [f"  {c['node']} {c['batch']} x [{c['m']}, {c['k']}] @ [{c['k']}, {c['n']}]: "
                    f"{c['reason']}" for c in s["contractions_kept"]]
        if s.get("depthwise_convs"):
            out += ["", "depthwise 1-d convolutions computed as fused sums of shifted products, "
                        f"not on cuDNN ({len(s['depthwise_convs'])}): "
                        + ", ".join(f"{c['node']} {c['shape']} ({c['taps']} taps)"
                                    for c in s["depthwise_convs"])]
        if s.get("layout"):
            out += ["", f"convolution activations: {s['layout']} (passes/channels_last.py)"]
        if s.get("inplace"):
            out += ["", "outputs written over an input that dies with the kernel, no memory "
                        f"of their own ({len(s['inplace'])}): "
                        + ", ".join(f"group {w['group']} over {w['over']}" for w in s["inplace"])]
        if s.get("input_writes"):
            out += ["", "graph inputs (buffers) written by the kernel that computes their new "
                        f"value, no copy ({len(s['input_writes'])}): "
                        + ", ".join(f"group {w['group']} into {w['into']}"
                                    for w in s["input_writes"])]
        if s.get("empty"):
            out += ["", f"no elements, allocated instead of computed ({len(s['empty'])}): "
                        + ", ".join(s["empty"])]
        if s.get("passed_through"):
            out += ["", "concatenations with empty tensors that attention reads: the one "
                        f"tensor passed through, not copied ({len(s['passed_through'])}): "
                        + ", ".join(s["passed_through"])]
        if s.get("trimmed_cats"):
            out += ["", "concatenations whose empty inputs were dropped, so that a kernel computes "
                        f"them ({len(s['trimmed_cats'])}): " + ", ".join(s["trimmed_cats"])]
        out += ["", f"refused fusions ({len(s['refused'])}; score: estimated time the fusion "
                    "would have saved)"]
        sections = refused_sections(s)
        if sections:
            rows = [r for _, _, rs in sections for r in rs]
            lines = iter(text_table(REFUSED_HEADERS, rows, right={1}, indent="    "))
            out.append(next(lines))
            for reason, count, rs in sections:
                out.append(f"  {reason} ({count})")
                out += [next(lines) for _ in rs]
                if count > len(rs):
                    out.append(f"    ... {count - len(rs)} more (--format json lists them all)")
        out += ["", "totals (before -> after fusion)"]
        out += text_table(["", "", ""], totals_rows(s))[1:]
        if s.get("measured") is not None:
            out += ["", *measured_lines(s)]
        if doc["options"]["code"]:
            out += ["", f"kernel sources ({len(s['kernels'])})"] + _code_text(s)
    return "\n".join(out) + "\n"


MEASURED_HEADERS = ["group", "label", "fused: predicted", "measured", "error",
                    "unfused: predicted", "measured", "at", ""]


def measured_lines(summary) -> list:
    """The --measure section: each fused kernel and its unfused ops, timed beside the model."""
    m = summary["measured"]
    labels = {g["id"]: g["label"] for g in summary["groups"]}
    rows = [[f"#{r['group']}", labels.get(r["group"], ""), f"{r['predicted_fused_us']:.1f} us",
             f"{r['measured_fused_us']:.1f} us", f"{r['error']:+.0%}",
             f"{r['predicted_unfused_us']:.1f} us", f"{r['measured_unfused_us']:.1f} us",
             f"{r['at_s']:.1f} s" if "at_s" in r else "",
             "SLOWER FUSED" if r["group"] in m["slower_fused"] else ""] for r in m["groups"]]
    head = (f"measured vs predicted ({m['groups_measured']} kernels; medians of repeated runs"
            + ("; Triton interpreter timings, not a GPU's" if m.get("interpreted") else "")
            + ")")
    out = [head] + (text_table(MEASURED_HEADERS, rows, {2, 3, 4, 5, 6, 7}) if rows else [])
    if m["median_abs_error"] is not None:
        out.append(f"median |error| of the fused predictions: {m['median_abs_error']:.0%}; "
                   f"measured slower fused than unfused: {len(m['slower_fused'])}")
    return out


def _code_text(summary) -> list:
    return [f"\n# ---- kernel of group #{k['group']} ({k['label']}): {k['path']}\n"
            + (k.get("source") or "# (source not readable)").rstrip() for k in summary["kernels"]]
