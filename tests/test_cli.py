"""`fusion-compiler dump`: every output format, the options, and one-line errors.

The CLI runs in-process through ``fusion_compiler.cli.main`` (output captured with capsys), plus
one run of the installed console script. Models: examples/llama.py at its small defaults, and a
tiny factory module written to tmp_path for the error cases.
"""
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fusion_compiler.cli import SCHEMA, main

from conftest import HAS_CUDA

LLAMA = str(Path(__file__).resolve().parents[1] / "examples" / "llama.py")

TINY = '''
import torch


class Tiny(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x * 2 + 1).sum(-1)


def make_model_and_inputs(device="cpu", dtype=torch.float32):
    return Tiny(), (torch.randn(4, 8, device=device, dtype=dtype),)


def wide(device="cpu"):
    return Tiny(), (torch.randn(4096, 4096, device=device),)   # 64 MB: bytes bind, not launches


def one_tensor(device="cpu"):
    return Tiny(), torch.randn(4, 8, device=device)


def raises(device="cpu"):
    raise RuntimeError("no weights here")


def returns_int(device="cpu"):
    return 3


def returns_dict_inputs(device="cpu"):
    return Tiny(), {"x": torch.randn(2)}


def returns_bad_model(device="cpu"):
    return "model", (torch.randn(2),)


def needs_arg(path, device="cpu"):
    return Tiny(), (torch.randn(2),)


def no_dtype(device="cpu"):
    return Tiny(), (torch.randn(2),)


def bad_matmul(device="cpu"):
    return (lambda x: x @ torch.ones(3, 3)), (torch.ones(2, 4),)


def conv_net(device="cpu", dtype=torch.float32):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 96, 3), torch.nn.ReLU(),
                              torch.nn.Conv2d(96, 96, 1))
    return net.to(device, dtype), (torch.randn(2, 3, 9, 9, device=device, dtype=dtype),)


NOT_A_FUNCTION = 5
'''


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny_models.py"
    path.write_text(TINY)
    return path


def dump(capsys, *args):
    """(exit status, stdout, stderr) of `fusion-compiler dump ARGS`."""
    rc = main(["dump", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def dump_json(capsys, *args):
    rc, out, err = dump(capsys, *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- JSON schema (docs/dump-format.md)

NUM = (int, float)
TOP = {"schema": str, "version": str, "target": str, "factory": str, "options": dict,
       "factory_kwargs": dict, "graphs": list}
OPTIONS = {"device": str, "dtype": (str, type(None)), "dynamic": bool, "training": bool,
           "profile": str, "code": bool, "measure": bool}
GRAPH = {"index": int, "kind": str, "profile": str, "layout": (str, type(None)),
         "ran_kernels": bool, "groups": list,
         "aten_ops": list, "refused": list, "edges": list, "totals": dict, "kernels": list}
GROUP = {"id": int, "label": str, "ops": list, "nodes": list, "inputs": list, "outputs": list,
         "bytes_unfused": int, "bytes_fused": int, "launches_saved": int, "time_unfused_us": NUM,
         "time_fused_us": NUM, "time_saved_us": NUM, "kernel": bool, "why_not": str, "form": str}
TENSOR = {"name": str, "shape": list, "dtype": str}
ATEN = {"node": str, "op": str, "reason": str}
REFUSED = {"producer": list, "consumer": list, "score_us": NUM, "bytes_before": int,
           "bytes_after": int, "taken": bool, "reason": str}
TOTALS = {"fusible_ops": int, "kernels_before": int, "kernels_after": int, "aten_ops": int,
          "bytes_before": int, "bytes_after": int, "time_before_us": NUM, "time_after_us": NUM}
KERNEL = {"group": int, "key": str, "label": str, "path": str, "ops": list, "runs": bool}


def check(obj, spec, where):
    assert isinstance(obj, dict), f"{where}: not an object"
    for key, typ in spec.items():
        assert key in obj, f"{where}: missing {key!r}"
        assert isinstance(obj[key], typ) and not (typ is int and isinstance(obj[key], bool)), \
            f"{where}.{key}: {type(obj[key]).__name__}, expected {typ}"


def check_schema(doc):
    check(doc, TOP, "dump")
    assert doc["schema"] == SCHEMA == "fusion-compiler.dump/1"
    check(doc["options"], OPTIONS, "options")
    for i, g in enumerate(doc["graphs"]):
        check(g, GRAPH, f"graphs[{i}]")
        assert g["index"] == i and g["kind"] in ("inference", "forward", "backward")
        check(g["totals"], TOTALS, f"graphs[{i}].totals")
        for grp in g["groups"]:
            check(grp, GROUP, f"group {grp.get('id')}")
            assert all(isinstance(o, str) for o in grp["ops"] + grp["nodes"])
            for t in grp["inputs"] + grp["outputs"]:
                check(t, TENSOR, "tensor")
                assert all(isinstance(d, int) for d in t["shape"])
        for a in g["aten_ops"]:
            check(a, ATEN, "aten op")
        for r in g["refused"]:
            check(r, REFUSED, "refusal")
            assert r["taken"] is False
        for k in g["kernels"]:
            check(k, KERNEL, "kernel")
        assert all(isinstance(e, list) and len(e) == 2 and all(isinstance(n, str) for n in e)
                   for e in g["edges"])


# ---------------------------------------------------------------- a small DOT parser

TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(->)|([{}\[\];=,])|([\w.#]+))')


def parse_dot(text):
    """Graphs of a DOT file: [{"nodes": set, "edges": [(a, b)], "clusters": [name]}]; asserts
    balanced braces and brackets and that every edge endpoint is declared."""
    pos, tokens = 0, []
    while pos < len(text.rstrip()):
        m = TOKEN.match(text, pos)
        assert m and m.end() > pos, f"cannot tokenize DOT at {text[pos:pos + 40]!r}"
        tokens.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    graphs, depth, stmt, in_attrs = [], 0, [], False
    for tok in tokens + [";"]:
        if in_attrs:
            in_attrs = tok != "]"
            continue
        if tok == "[":
            in_attrs = True
            stmt.append("[")
        elif tok in "{};":
            if stmt[:1] == ["digraph"]:
                graphs.append({"nodes": set(), "edges": [], "clusters": []})
            elif stmt[:1] == ["subgraph"]:
                graphs[-1]["clusters"].append(stmt[1])
            elif "->" in stmt:
                ids = [t.strip('"') for t in stmt if t not in ("->", "[")]
                graphs[-1]["edges"] += list(zip(ids, ids[1:]))
            elif stmt and stmt[0] not in ("node", "edge", "graph") and "=" not in stmt:
                graphs[-1]["nodes"].add(stmt[0].strip('"'))
            depth += {"{": 1, "}": -1}.get(tok, 0)
            assert depth >= 0, "unbalanced braces"
            stmt = []
        else:
            stmt.append(tok)
    assert depth == 0 and not in_attrs, "unbalanced braces or brackets"
    for g in graphs:
        undeclared = {n for e in g["edges"] for n in e} - g["nodes"]
        assert not undeclared, f"edge endpoints never declared: {sorted(undeclared)[:5]}"
    return graphs


# ---------------------------------------------------------------- formats

def test_table_shows_llama_groups_aten_ops_refusals_and_totals(capsys):
    rc, out, err = dump(capsys, LLAMA)
    assert rc == 0, err
    assert re.search(r"== graph 0: inference \(profile \w+", out)
    rows = [ln for ln in out.splitlines() if re.match(r"\s+#\d+", ln)]
    rmsnorm = [r for r in rows if " rmsnorm " in r and "mean" in r]
    rope = [r for r in rows if " rope " in r and "neg, cat" in r]
    swiglu = [r for r in rows if " swiglu " in r and "sigmoid, mul x2" in r]
    # 2 layers: 2 RMSNorms each + the final one; RoPE of q and k per layer (one multi-part
    # kernel); one SwiGLU per layer
    assert (len(rmsnorm), len(rope), len(swiglu)) == (5, 2, 2), "\n".join(rows)
    assert re.search(r"\d KB -> \d+(\.\d+)? KB", rmsnorm[0]) and " us" in rmsnorm[0]
    assert re.search(r"mm\s+\d+\s+GEMM \(cuBLAS\)", out)
    assert "refused fusions" in out
    before, after = map(int, re.search(r"kernels\s+(\d+) -> (\d+)", out).groups())
    assert after < before
    t_before, t_after = map(float, re.search(r"est\. time\s+([\d.]+) us -> ([\d.]+) us",
                                             out).groups())
    assert t_after < t_before


def test_json_matches_the_documented_schema(capsys):
    doc = dump_json(capsys, LLAMA)
    check_schema(doc)
    assert doc["target"] == LLAMA and doc["options"]["training"] is False
    (graph,) = doc["graphs"]
    assert graph["kind"] == "inference" and graph["groups"] and graph["edges"]
    nodes = {n for g in graph["groups"] for n in g["nodes"]}
    assert nodes <= {n for e in graph["edges"] for n in e}


def test_kernel_records_list_their_ops_in_graph_order(capsys):
    """A kernel's ops come in its group's graph order: a group's members are a set, whose
    order changed from one process to the next (the same dump differed between runs)."""
    doc = dump_json(capsys, LLAMA)
    (graph,) = doc["graphs"]
    groups = {g["id"]: g for g in graph["groups"]}
    multi = [k for k in graph["kernels"] if len(k["ops"]) > 2]
    assert multi
    for k in graph["kernels"]:
        short = [op.replace("aten.", "").replace("prims.", "").replace(".default", "")
                 for op in k["ops"]]
        assert short == groups[k["group"]]["ops"], k["group"]


def test_dot_parses_with_one_cluster_per_group(capsys, tmp_path):
    out_file = tmp_path / "llama.dot"
    rc, out, err = dump(capsys, LLAMA, "--format", "dot", "-o", out_file)
    assert rc == 0 and out == "", err
    text = out_file.read_text()
    (graph,) = parse_dot(text)
    doc = dump_json(capsys, LLAMA)
    groups = doc["graphs"][0]["groups"]
    assert graph["clusters"] == [f"cluster_{g['id']}" for g in groups]
    assert {n for g in groups for n in g["nodes"]} <= graph["nodes"]
    assert {a["node"] for a in doc["graphs"][0]["aten_ops"]} <= graph["nodes"]
    assert len(graph["edges"]) > len(groups)
    try:
        import pydot
    except ImportError:
        return
    assert len(pydot.graph_from_dot_data(text)) == 1


def test_html_is_one_self_contained_file_with_an_svg(capsys, tmp_path):
    out_file = tmp_path / "llama.html"
    rc, out, err = dump(capsys, LLAMA, "--format", "html", "--training", "-o", out_file)
    assert rc == 0, err
    page = out_file.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"https?://", page)
    assert not re.search(r"<script|<link|<img|src=|@import", page, re.I)
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2                           # forward and backward
    for svg in svgs:
        root = ET.fromstring(svg)                   # well-formed
        assert len(root.findall(".//rect")) > 10
    assert "rmsnorm" in page and "left on ATen" in page


def test_code_prints_kernel_sources(capsys):
    rc, out, err = dump(capsys, LLAMA, "--code")
    assert rc == 0, err
    assert "@triton.jit" in out and "kernel sources" in out


def test_training_dumps_forward_and_backward(capsys):
    doc = dump_json(capsys, LLAMA, "--training")
    check_schema(doc)
    assert [g["kind"] for g in doc["graphs"]] == ["forward", "backward"]
    assert doc["graphs"][1]["groups"]


def test_dump_says_how_convolutions_are_laid_out(capsys, tiny, device):
    """The layout pass's decision, in the table and the JSON (passes/channels_last.py). On the
    device the tests run kernels on (a CPU model's convolutions keep their layout on a GPU
    machine, where its kernels would not run: "convolutions on cpu"), with the H200's profile."""
    where = ("--device", device, "--profile", "h200")
    rc, out, err = dump(capsys, f"{tiny}:conv_net", *where)
    assert rc == 0, err
    note = "channels-last: 2 convolutions, estimated time channels-last 0.82x of contiguous"
    assert f"convolution activations: {note} (passes/channels_last.py)" in out
    doc = dump_json(capsys, f"{tiny}:conv_net", "--training", *where)
    check_schema(doc)
    assert [g["layout"] for g in doc["graphs"]] == [note] * 2    # training: the same rule
    assert dump_json(capsys, tiny)["graphs"][0]["layout"] is None        # no convolution


def test_profile_changes_estimated_times(capsys, tiny, monkeypatch):
    # 64 MB read: bytes, not launches, bind, and the A100 moves them at 1.7 TB/s, not 4.22.
    # Analysis only: the interpreter would run the kernels on 16M elements for minutes
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h200 = dump_json(capsys, f"{tiny}:wide", "--profile", "h200")["graphs"][0]
    a100 = dump_json(capsys, f"{tiny}:wide", "--profile", "A100")["graphs"][0]
    assert (h200["profile"], a100["profile"]) == ("h200", "a100")
    assert a100["totals"]["bytes_before"] == h200["totals"]["bytes_before"]
    assert a100["totals"]["time_before_us"] > h200["totals"]["time_before_us"]
    assert a100["totals"]["time_after_us"] > h200["totals"]["time_after_us"]


def test_module_target_dtype_and_single_tensor_inputs(capsys, tiny, monkeypatch):
    monkeypatch.chdir(tiny.parent)                  # package.module targets import from cwd
    doc = dump_json(capsys, "tiny_models:make_model_and_inputs", "--dtype", "bfloat16")
    assert doc["factory_kwargs"] == {"device": "cpu", "dtype": "bfloat16"}
    (graph,) = doc["graphs"]
    assert graph["groups"][0]["inputs"][0]["dtype"] == "bfloat16"
    assert dump_json(capsys, f"{tiny}:one_tensor")["graphs"][0]["groups"]


def test_console_script(tmp_path, tiny):
    exe = shutil.which("fusion-compiler") or str(Path(sys.executable).with_name("fusion-compiler"))
    proc = subprocess.run([exe, "dump", str(tiny), "--format", "json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_schema(json.loads(proc.stdout))
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+\s*", proc.stdout)


# ---------------------------------------------------------------- errors: one line, status 2

ERRORS = [
    (["{dir}/missing.py"], "no such file"),
    (["{dir}"], "not a Python file"),
    (["{tiny}:nope"], "has no 'nope'"),
    (["{broken}"], "SyntaxError"),
    (["{tiny}:raises"], "RuntimeError: no weights here"),
    (["{tiny}:returns_int"], "must return (model, example_inputs)"),
    (["{tiny}:returns_dict_inputs"], "example_inputs"),
    (["{tiny}:returns_bad_model"], "nn.Module or a function"),
    (["{tiny}:needs_arg"], "missing a required argument"),
    (["{tiny}:NOT_A_FUNCTION"], "not a function"),
    (["{tiny}:no_dtype", "--dtype", "float16"], "takes no dtype"),
    (["no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
    (["{tiny}", "--device", "mps"], "compiles for cpu and cuda"),
    (["{tiny}", "--device", "nonsense"], "not a device name"),
    *([(["{tiny}", "--device", "cuda"], "no CUDA device")] if not HAS_CUDA else []),
    (["{tiny}", "--profile", "b200"], "invalid choice"),
    (["{tiny}", "--dtype", "int8"], "invalid choice"),
    (["{tiny}", "--format", "pdf"], "invalid choice"),
    (["{tiny}", "--format", "dot", "--code"], "--code"),
    (["{tiny}", "-o", "{dir}/no/such/folder/out.txt"], "does not exist"),
    (["{tiny}", "--training"], "requires grad"),      # Tiny has no parameters
]


@pytest.mark.parametrize("argv,expected", ERRORS, ids=[e[1][:24] for e in ERRORS])
def test_errors_are_one_line_with_status_2(capsys, tmp_path, tiny, argv, expected):
    broken = tmp_path / "broken.py"
    broken.write_text("def make_model_and_inputs(:\n")
    args = [a.format(dir=tmp_path, tiny=tiny, broken=broken) for a in argv]
    rc = main(["dump", *args])
    out, err = capsys.readouterr()
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusion-compiler: error: "), err
    assert expected in lines[0] and "Traceback" not in err and out == ""


def test_compile_failure_is_one_line_with_status_1(capsys, tiny):
    rc, out, err = dump(capsys, f"{tiny}:bad_matmul")
    lines = err.strip().splitlines()
    assert rc == 1 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fusion-compiler: error: compiling the model of ")
    assert "same reduction dim" in lines[0]                 # the error under dynamo's wrapper


def test_a_graph_the_compiler_failed_on_is_reported_in_every_format(capsys, tiny, monkeypatch,
                                                                    tmp_path):
    """An internal error in a pass leaves the graph on ATen (the model still runs); the dump says
    so, with the error, in every format, instead of failing itself."""
    from fusion_compiler.passes import fuse

    def broken(gm, ctx):
        raise RuntimeError("pass broke here")
    monkeypatch.setattr(fuse, "run", broken)
    monkeypatch.delenv("FUSION_COMPILER_STRICT")        # the tests' default: raise
    rc, out, err = dump(capsys, tiny)
    assert rc == 0, err
    assert "compiling this graph failed; it runs on ATen unfused: RuntimeError: pass broke here" \
        in out, out
    (graph,) = dump_json(capsys, tiny)["graphs"]
    assert graph["error"] == "RuntimeError: pass broke here" and graph["groups"] == []
    for fmt in ("dot", "html"):
        rc, _, err = dump(capsys, tiny, "--format", fmt, "-o", tmp_path / f"d.{fmt}")
        assert rc == 0, err


def test_missing_target_is_an_argparse_error(capsys):
    assert main(["dump"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-compiler: error: ") and "TARGET" in err


def test_debug_shows_the_traceback(capsys, tiny):
    rc, _, err = dump(capsys, f"{tiny}:raises", "--debug")
    assert rc == 2 and "Traceback" in err and "no weights here" in err
    assert err.strip().splitlines()[-1].startswith("fusion-compiler: error: ")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __import__("fusion_compiler").__version__


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is visible: calibration would run")
def test_calibrate_without_a_gpu_says_so(capsys):
    assert main(["calibrate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibrate measures a CUDA GPU" in err[0]


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is visible: bench would run")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "add_rmsnorm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA GPU" in err[0]
    assert err[0].startswith("fusion-compiler: error:")


def test_bench_rejects_unknown_options(capsys):
    assert main(["bench", "add_rmsnorm", "--mode", "sideways"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_decisions_are_logged_while_torch_compile_runs(caplog):
    import logging

    import torch
    caplog.set_level(logging.INFO, logger="fusion_compiler")
    torch._dynamo.reset()
    x = torch.randn(7, 41)
    torch.compile(lambda t: torch.softmax(t * 2.0, -1), backend="fusion")(x)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "fusion_compiler")
    assert "fused groups (1)" in text and "softmax" in text and "totals" in text


def test_bench_max_error_sees_nan_and_inf_mismatches():
    import torch

    from fusion_compiler.bench import max_error
    nan, inf = float("nan"), float("inf")
    assert max_error(torch.tensor([1.0, nan, inf]), torch.tensor([1.5, nan, inf])) == 0.5
    assert max_error(torch.tensor([nan, 2.0]), torch.tensor([1.0, 2.0])) == inf
    assert max_error(torch.tensor([inf]), torch.tensor([-inf])) == inf
    assert max_error((torch.tensor([1.0]),), (torch.tensor([1.25]),)) == 0.25


# ------------------------------------------------------------------------------- --measure
MEASURED = {"groups": list, "groups_measured": int, "median_abs_error": NUM,
            "slower_fused": list, "interpreted": bool}
MEASURED_ROW = {"group": int, "predicted_fused_us": NUM, "measured_fused_us": NUM,
                "predicted_unfused_us": NUM, "measured_unfused_us": NUM, "error": NUM,
                "at_s": NUM}


def test_measure_times_every_fused_kernel_beside_its_prediction(capsys, tiny, monkeypatch):
    """One row per generated kernel, with both predictions, both measurements and the error:
    on the GPU for real, on a CPU machine in the interpreter (which conftest turned on)."""
    import torch

    gpu = torch.cuda.is_available()
    doc = dump_json(capsys, tiny, "--measure", *(["--device", "cuda"] if gpu else []))
    check_schema(doc)
    (graph,) = doc["graphs"]
    m = graph["measured"]
    check(m, MEASURED, "measured")
    assert m["interpreted"] is not gpu and m["groups_measured"] == len(graph["kernels"]) >= 1
    for row in m["groups"]:
        check(row, MEASURED_ROW, "measured row")
        assert row["measured_fused_us"] > 0 and row["measured_unfused_us"] > 0
        assert row["error"] == pytest.approx(
            (row["predicted_fused_us"] - row["measured_fused_us"]) / row["measured_fused_us"])
    assert {r["group"] for r in m["groups"]} == {k["group"] for k in graph["kernels"]}
    at = [r["at_s"] for r in m["groups"]]
    assert at[0] < 1.0 and at == sorted(at) and len(set(at)) == len(at)
    rc, out, err = dump(capsys, tiny, "--measure", *(["--device", "cuda"] if gpu else []))
    assert rc == 0 and "measured vs predicted" in out
    assert ("interpreter timings" in out) is not gpu


def test_measure_copies_keep_their_strides(device):
    """The rotating copies --measure times a kernel on keep each input's strides, which the
    kernel bakes in: a slice with gaps (a contiguous clone was read past its end), a
    transposed view, an expand; same values."""
    import torch

    from fusion_compiler.measure import rotated
    base = torch.randn(4, 6, 10, device=device)
    values = [base[..., 2:7], base.transpose(1, 2), torch.randn(5, 1, device=device).expand(5, 3),
              torch.randn(7, device=device), 3]
    first, *copies = rotated(values, 3)
    assert first is values
    for copy in copies:
        assert copy[-1] == 3
        for v, c in zip(values[:-1], copy[:-1]):
            assert c.stride() == v.stride() and torch.equal(c, v)
            assert c.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()


def test_measure_of_cpu_tensors_without_the_interpreter_is_a_clear_error(capsys, tiny,
                                                                        monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, out, err = dump(capsys, tiny, "--measure")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--measure" in err and "--device cuda" in err


def test_dump_reports_a_group_the_code_generator_refuses(capsys, tiny, monkeypatch):
    """The dump generates every kernel (on a CPU machine too), so a group whose code generation
    fails is shown as not generated, with the reason, never as fused."""
    from fusion_compiler.codegen.kernel_ir import NotFusable
    from fusion_compiler.passes import generate

    def refuse(*args, **kwargs):
        raise NotFusable("no kernel for this one (test)")
    monkeypatch.setattr(generate, "generate", refuse)
    monkeypatch.setenv("FUSION_COMPILER_STRICT", "0")
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tiny.parent / "fresh-cache"))
    doc = dump_json(capsys, tiny)
    (graph,) = doc["graphs"]
    assert graph["groups"] and not any(g["kernel"] for g in graph["groups"])
    assert all("code generation: no kernel for this one" in g["why_not"] for g in graph["groups"])


EINSUM = '''
import torch


def make_model_and_inputs(device="cpu", dtype=torch.bfloat16):
    class G(torch.nn.Module):
        def forward(self, c, b):
            return (c[:, :, None, :] * b[:, None, :, :]).sum(-1)
    return G(), tuple(torch.randn(3, 20, 16, device=device, dtype=dtype) for _ in range(2))
'''


@pytest.mark.parametrize("dtype,kept", [("bfloat16", True), ("float32", False)])
def test_dump_says_why_a_matrix_product_stays_a_reduction(dtype, kept, tmp_path, capsys):
    """In bf16 the summed product is a matrix product kept a fused reduction, and the table
    and the JSON say why; in fp32 it is a bmm."""
    path = tmp_path / "einsum.py"
    path.write_text(EINSUM)
    rc, out, err = dump(capsys, path, "--dtype", dtype)
    assert rc == 0, err
    doc = dump_json(capsys, path, "--dtype", dtype)
    (g,) = doc["graphs"]
    if kept:
        assert g["contractions"] == []
        assert g["contractions_kept"] == [{"node": "sum_1", "batch": 3, "m": 20, "k": 16, "n": 20,
                                           "reason": "bfloat16, not fp32: eager rounds each "
                                                     "product before the sum, a bmm would not"}]
        assert "kept fused reductions (1):\n  sum_1 3 x [20, 16] @ [16, 20]: bfloat16" in out
        assert [k["label"] for k in g["kernels"]] == ["reduction"]
    else:
        assert g["contractions_kept"] == []
        (c,) = g["contractions"]
        assert (c["batch"], c["m"], c["k"], c["n"]) == (3, 20, 16, 20)
        assert "kept fused reductions" not in out
        assert [a["op"] for a in g["aten_ops"]] == ["bmm"]
