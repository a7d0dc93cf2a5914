"""Pictures for `fusion-compiler dump`: Graphviz DOT, and one HTML page with an SVG per graph.

Both take the dump document built by ``fusion_compiler.cli`` (plain data; schema in
docs/dump-format.md) and return a string. They show the ops of each fused group inside a box,
the ops left on ATen as grey boxes and the graph inputs they read. Views and broadcasts are
neither in a group nor on ATen (they became index arithmetic): edges pass through them.
"""
from __future__ import annotations

import html
import re
from collections import defaultdict

import networkx as nx

from .dump_format import (ATEN_COLOR, ATEN_HEADERS, COLORS, GROUP_HEADERS, GROUP_RIGHT,
                          NOT_GENERATED_COLOR, OTHER_COLOR, REFUSED_HEADERS, aten_rows,
                          graph_title, group_rows,
                          human_bytes, io_text, op_name, ops_text, options_text,
                          refused_sections, totals_rows)


# ---------------------------------------------------------------- graph model (DOT and SVG)

def graph_model(summary):
    """(member_of, aten, inputs, edges): node -> group id, ATen node -> op, the graph inputs
    read, and the edges between them, passed through every other node (views, broadcasts)."""
    member_of = {n: g["id"] for g in summary["groups"] for n in g["nodes"]}
    aten = {a["node"]: op_name(a["op"]) for a in summary["aten_ops"]}
    dag = nx.DiGraph([tuple(e) for e in summary.get("edges", [])])
    for n in [n for n in dag if n not in member_of and n not in aten and dag.in_degree(n)]:
        dag.add_edges_from((a, b) for a in dag.pred[n] for b in dag.succ[n] if a != b)
        dag.remove_node(n)
    inputs = [n for n in dag if n not in member_of and n not in aten and dag.out_degree(n)]
    return member_of, aten, inputs, list(dag.edges)


def _group_color(g) -> str:
    return COLORS.get(g["label"], OTHER_COLOR) if g["kernel"] else NOT_GENERATED_COLOR


def _q(text) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(doc) -> str:
    out = []
    for i, s in enumerate(doc["graphs"]):
        member_of, aten, inputs, edges = graph_model(s)
        name = _q(f"graph{i}_{s['kind']}")
        out += [f"digraph {name} {{",
                f"  label={_q(graph_title(i, s))}; labelloc=t; rankdir=LR;",
                '  node [shape=ellipse, fontsize=10, fontname="Helvetica"];']
        for g in s["groups"]:
            title = f"#{g['id']} {g['label']}" + ("" if g["kernel"] else " (not generated)")
            out += [f"  subgraph cluster_{re.sub(r'[^0-9A-Za-z_]', '_', str(g['id']))} {{",
                    f"    label={_q(title)}; style={'filled' if g['kernel'] else 'dashed'}; "
                    f"fillcolor={_q(_group_color(g))}; color=\"#64748b\";"]
            out += [f"    {_q(n)} [label={_q(op_name(op))}];"
                    for n, op in zip(g["nodes"], g["ops"])]
            out.append("  }")
        out += [f"  {_q(n)} [label={_q(op)}, shape=box, style=filled, fillcolor={_q(ATEN_COLOR)}];"
                for n, op in aten.items()]
        out += [f"  {_q(n)} [label={_q(n)}, shape=plaintext, fontcolor=\"#6b7280\"];"
                for n in inputs]
        out += [f"  {_q(a)} -> {_q(b)};" for a, b in edges]
        out.append("}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- SVG picture (HTML page)

W, HGAP, VGAP, PAD, LINE = 170, 60, 14, 16, 14     # unit width, gaps, padding, text line (px)
MAX_LINES = 10                                     # op lines shown in a group box


def _units(summary):
    """Boxes to draw: uid -> dict(kind, title, lines, tip, color, h); edges between uids."""
    member_of, aten, inputs, edges = graph_model(summary)
    units = {}
    for g in summary["groups"]:
        lines = ops_text(g["ops"], None).split(", ")
        if len(lines) > MAX_LINES:
            lines = lines[:MAX_LINES - 1] + [f"... +{len(lines) - MAX_LINES + 1}"]
        tip = (f"group #{g['id']} ({g['label']}): {', '.join(g['nodes'])}\n{io_text(g)}\n"
               f"bytes {human_bytes(g['bytes_unfused'])} -> {human_bytes(g['bytes_fused'])}, "
               f"est. {g['time_saved_us']:.1f} us saved"
               + ("" if g["kernel"] else f"\nnot generated: {g['why_not']}"))
        units[f"#{g['id']}"] = dict(kind="group", title=f"#{g['id']} {g['label']}", lines=lines,
                                    tip=tip, color=_group_color(g), h=22 + LINE * len(lines),
                                    dashed=not g["kernel"])
    for n, op in aten.items():
        units[n] = dict(kind="aten", title=op, lines=[], tip=f"{n}: {op} on ATen",
                        color=ATEN_COLOR, h=24, dashed=False)
    for n in inputs:
        units[n] = dict(kind="input", title=n, lines=[], tip=f"input {n}", color="#ffffff",
                        h=18, dashed=False)
    uid = lambda n: f"#{member_of[n]}" if n in member_of else n  # noqa: E731
    uedges = list(dict.fromkeys((uid(a), uid(b)) for a, b in edges if uid(a) != uid(b)))
    return units, uedges


def _layout(units, uedges):
    """uid -> (x, y): layers left to right (longest path), inputs just before their first
    reader; in a column each box goes as near its predecessors' mean height as it can."""
    dag = nx.DiGraph(uedges)
    dag.add_nodes_from(units)
    rank = {u: i for i, u in enumerate(units)}
    inner = [u for u in units if units[u]["kind"] != "input"]
    try:
        order = list(nx.lexicographical_topological_sort(dag.subgraph(inner), key=rank.get))
    except nx.NetworkXUnfeasible:       # a cycle would be a compiler bug; draw it anyway
        order = inner
    preds, succs = dag.pred, dag.succ
    layer = {}
    for u in order:
        layer[u] = 1 + max((layer.get(p, 0) for p in preds[u] if units[p]["kind"] != "input"),
                           default=0)
    for u in units:
        if units[u]["kind"] == "input":
            layer[u] = max(0, min((layer[v] for v in succs[u] if v in layer), default=1) - 1)
    pos, columns = {}, defaultdict(list)

    def place(u, desired):
        h, busy = units[u]["h"], columns[layer[u]]
        y, moved = max(PAD + 20, desired), True
        while moved:
            moved = False
            for a, b in busy:
                if y < b + VGAP and y + h + VGAP > a:
                    y, moved = b + VGAP, True
        busy.append((y, y + h))
        pos[u] = (PAD + layer[u] * (W + HGAP), y)

    center = lambda u: pos[u][1] + units[u]["h"] / 2  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else 0  # noqa: E731
    for col in sorted({layer[u] for u in inner}):
        want = {u: mean([center(p) for p in preds[u] if p in pos])
                for u in order if layer[u] == col}
        for u in sorted(want, key=want.get):
            place(u, want[u] - units[u]["h"] / 2)
    want = {u: mean([center(v) for v in succs[u]]) for u in units if units[u]["kind"] == "input"}
    for u in sorted(want, key=want.get):          # inputs last, next to their readers
        place(u, want[u] - units[u]["h"] / 2)
    return pos


def render_svg(summary, index=0) -> str:
    """An inline <svg> of one graph (no namespace URL: HTML5 needs none)."""
    units, uedges = _units(summary)
    pos = _layout(units, uedges)
    width = max((x + W for x, _ in pos.values()), default=W) + PAD
    height = max((y + units[u]["h"] for u, (_, y) in pos.items()), default=40) + PAD
    e = html.escape
    out = [f'<svg width="{width}" height="{height:.0f}" viewBox="0 0 {width} {height:.0f}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="11" role="img">',
           f'<defs><marker id="arrow{index}" viewBox="0 0 10 10" refX="10" refY="5" '
           'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
           '<path d="M 0 0 L 10 5 L 0 10 z" fill="#64748b"/></marker></defs>']
    for a, b in uedges:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        x1, y1, y2 = x1 + W, y1 + units[a]["h"] / 2, y2 + units[b]["h"] / 2
        dx = max(30, (x2 - x1) / 2)
        out.append(f'<path d="M {x1} {y1:.1f} C {x1 + dx} {y1:.1f}, {x2 - dx} {y2:.1f}, {x2} '
                   f'{y2:.1f}" fill="none" stroke="#94a3b8" marker-end="url(#arrow{index})"/>')
    for u, (x, y) in pos.items():
        d, top = units[u], 13 if units[u]["kind"] == "input" else 15
        style = {"group": ' font-weight="bold"', "input": ' fill="#6b7280"'}.get(d["kind"], "")
        dash = ' stroke-dasharray="4 3"' if d["dashed"] else ""
        out += [f'<g><title>{e(d["tip"])}</title><rect x="{x}" y="{y:.1f}" width="{W}" '
                f'height="{d["h"]}" rx="{9 if d["kind"] == "input" else 4}" fill="{d["color"]}" '
                f'stroke="#64748b"{dash}/>',
                f'<text x="{x + 6}" y="{y + top:.1f}"{style}>{e(d["title"])}</text>']
        out += [f'<text x="{x + 12}" y="{y + 16 + LINE * (k + 1):.1f}">{e(t)}</text>'
                for k, t in enumerate(d["lines"])] + ["</g>"]
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------- HTML page

CSS = """body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#111827}h1{font-size:20px}
h2{font-size:17px;margin-top:32px;border-bottom:1px solid #d1d5db}h3{font-size:14px;margin:18px 0}
table{border-collapse:collapse;font-size:12px}th{background:#f3f4f6}td.num{text-align:right}
td,th{border:1px solid #e5e7eb;padding:3px 8px;text-align:left;vertical-align:top}
.meta,.note{color:#4b5563;font-size:12px}.key span{padding:1px 8px;margin-right:6px;border:1px solid
#64748b;font-size:12px}.picture{overflow:auto;border:1px solid #e5e7eb;max-height:720px}
pre{background:#f9fafb;border:1px solid #e5e7eb;padding:8px;font-size:11px;overflow:auto}"""


def html_table(headers, rows, right=()) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in right else ""}>{e(str(c))}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(doc) -> str:
    e = html.escape
    key = "".join(f'<span style="background:{c}">{e(name)}</span>' for name, c in
                  [*COLORS.items(), ("other group", OTHER_COLOR),
                   ("not generated", NOT_GENERATED_COLOR), ("on ATen", ATEN_COLOR)])
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>fusion-compiler dump {e(doc['target'])}</title><style>{CSS}</style></head>",
           f"<body><h1>fusion-compiler dump {e(doc['target'])}</h1>",
           f'<p class="meta">{e(options_text(doc))}; schema {e(doc["schema"])}</p>']
    if not doc["graphs"]:
        out.append("<p>No graph was compiled.</p>")
    for i, s in enumerate(doc["graphs"]):
        rows, notes = group_rows(s, width=80)
        out += [f"<section><h2>{e(graph_title(i, s))}</h2>",
                html_table(["", "before -> after", ""], totals_rows(s)),
                f'<h3>graph</h3><p class="key">{key}</p>',
                f'<div class="picture">{render_svg(s, i)}</div>',
                f"<h3>fused groups ({len(rows)})</h3>", html_table(GROUP_HEADERS, rows, GROUP_RIGHT)]
        out += [f'<p class="note">{e(m)} not generated, stays on ATen: {e(w)}</p>'
                for w, m in notes.items()]
        out += [f"<h3>left on ATen ({len(s['aten_ops'])} ops)</h3>",
                html_table(ATEN_HEADERS, aten_rows(s), {1}),
                f"<h3>refused fusions ({len(s['refused'])})</h3>",
                '<p class="note">score: estimated time the fusion would have saved</p>']
        for reason, count, rs in refused_sections(s, limit=200):
            more = f" (showing {len(rs)})" if count > len(rs) else ""
            out += [f"<p><b>{e(reason)}</b>: {count}{more}</p>",
                    html_table(REFUSED_HEADERS, rs, {1})]
        if doc["options"]["code"]:
            out.append(f"<h3>kernel sources ({len(s.get('kernels', []))})</h3>")
            out += [f"<details><summary>group #{k['group']} {e(k['label'])}</summary>"
                    f"<pre>{e(k.get('source') or '(source not readable)')}</pre></details>"
                    for k in s.get("kernels", [])]
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
