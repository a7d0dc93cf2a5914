"""The on-disk kernel cache (codegen/cache.py) seen through the backend.

Every test points FUSION_COMPILER_CACHE_DIR at its own folder and empties ``backend._caches``,
so the counters (``KernelCache.generated`` / ``.hits``) count only what the test did. Tests that
need a second process run a short script with ``sys.executable`` (a few seconds each, mostly
``import torch``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

from fusion_compiler import backend
from helpers import assert_close, compile_and_run, current_cache

# The model the cache tests compile: a softmax row kernel and a pointwise tail on another shape
# (two kernels), identical in this process and in the child processes (the source is shared).
MODEL_SRC = '''
import torch


def model(x, w):
    h = torch.softmax(x * w, dim=-1)
    return torch.nn.functional.gelu(h + 1) * x, (w * 3).sigmoid()


def model_inputs(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=g).to(device)
    w = torch.randn(32, generator=g).to(device)
    return x, w
'''
_ns: dict = {}
exec(compile(MODEL_SRC, "<cache-test-model>", "exec"), _ns)
model, model_inputs = _ns["model"], _ns["model_inputs"]

SUBPROCESS_TIMEOUT = 180


# ------------------------------------------------------------------------------------ helpers
def forget_loaded_kernels(monkeypatch):
    """Drop the in-memory KernelCache objects: the next compile reads the disk like a new process."""
    monkeypatch.setattr(backend, "_caches", {})
    torch._dynamo.reset()


def kernel_keys(reports):
    return [k["key"] for r in reports for k in r.kernels]


def entry_files(root: Path) -> dict:
    """{relative path: sha256 of the bytes} of every file in the cache (bytecode excluded, and
    Triton's stored key: on a GPU the first process of a Triton install writes it, into the
    cache of whichever test compiled first)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
            and p.relative_to(root).parts[0] != "triton_key"}


def assert_valid_entries(root: Path) -> int:
    """Every kernel entry is a .py with a .json naming its key and sha256, every fusion decision
    entry (graphs/) a .pkl under its key prefix, Triton's stored key (triton_key/) a .txt; no
    temporaries are left."""
    files = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    decisions = [p for p in files if p.relative_to(root).parts[0] == "graphs"]
    for p in decisions:
        assert p.suffix == ".pkl" and not p.name.startswith(".") and p.parent.name == p.stem[:2], p
    keys = [p for p in files if p.relative_to(root).parts[0] == "triton_key"]
    for p in keys:      # Triton's key, stored by codegen/triton_key.py
        assert p.suffix == ".txt" and re.fullmatch("[0-9a-f]{32}", p.stem), p
        assert p.read_text().startswith(triton.__version__), p
    # aot_autograd's results (fusion_compiler/aot_cache.py), in torch's AOTAutograd cache
    # layout: aot/<namespace>/<key>/<entry>
    aot = [p for p in files if p.relative_to(root).parts[0] == "aot"]
    for p in aot:
        namespace, key, _ = p.relative_to(root).parts[1:]
        assert re.fullmatch("[0-9a-f]{16}", namespace) and key.startswith("a"), p
        assert not p.name.startswith(".") and not p.name.endswith(".tmp"), p
    files = [p for p in files if p not in decisions and p not in keys and p not in aot]
    sources = {p.stem: p for p in files if p.suffix == ".py"}
    metas = {p.stem: p for p in files if p.suffix == ".json"}
    leftovers = [str(p) for p in files if p.suffix not in (".py", ".json") or p.name.startswith(".")]
    assert not leftovers, f"files that are no cache entry: {leftovers}"
    assert sources.keys() == metas.keys(), f"unpaired entries: {sources.keys() ^ metas.keys()}"
    for key, py in sources.items():
        assert py.parent.name == key[:2], f"{py} is not under its key prefix"
        meta = json.loads(metas[key].read_text())
        assert meta["key"] == key
        assert meta["sha256"] == hashlib.sha256(py.read_bytes()).hexdigest(), f"{py}: checksum"
        assert meta["triton"] == triton.__version__
    return len(sources)


def entry_paths(root: Path, key: str):
    py = root / key[:2] / f"{key}.py"
    return py, py.with_suffix(".json")


def check_model(device):
    """Compile and run the model; compare with eager; return the reports."""
    x, w = model_inputs(device)
    out, reports = compile_and_run(model, (x, w))
    expected = model(x, w)
    for k, (a, e) in enumerate(zip(out, expected)):
        assert_close(a, e, name=f"output {k}")
    return reports


def child_env(cache: Path, device: str) -> dict:
    env = dict(os.environ)
    env["FUSION_COMPILER_CACHE_DIR"] = str(cache)
    env["FUSION_COMPILER_STRICT"] = "1"
    env["FC_TEST_DEVICE"] = device
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


CHILD_SRC = MODEL_SRC + '''
import json, os, sys, time
from pathlib import Path

import fusion_compiler
from fusion_compiler import backend
from fusion_compiler.config import Config

device = os.environ["FC_TEST_DEVICE"]
go = os.environ.get("FC_TEST_GO")
if go:  # start line: say we are ready, then wait for the parent's signal
    Path(go + ".ready." + sys.argv[1]).touch()
    deadline = time.time() + 120
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.005)
import logging
key_lines = []


class KeyLines(logging.Handler):
    def emit(self, record):
        if "AOT cache key" in record.getMessage():
            key_lines.append(record.getMessage())


logging.getLogger("fusion_compiler").setLevel(logging.DEBUG)
logging.getLogger("fusion_compiler").addHandler(KeyLines())
x, w = model_inputs(device)
with fusion_compiler.capture_compiles() as reports:
    out = torch.compile(model, backend="fusion", fullgraph=True)(x, w)
expected = model(x, w)
cache = backend.kernel_cache(Config.from_env())
from fusion_compiler.codegen.cache import CODEGEN_FINGERPRINT
from torch._dynamo.utils import counters
print("RESULT " + json.dumps({
    "generated": cache.generated, "hits": cache.hits, "codegen": CODEGEN_FINGERPRINT,
    "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    "aot_keys": key_lines,
    "keys": [k["key"] for r in reports for k in r.kernels],
    "max_err": max((a - e).abs().max().item() for a, e in zip(out, expected)),
}))
'''


def write_child(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD_SRC)
    return script


def child_result(proc_stdout: str, proc_stderr: str) -> dict:
    lines = [ln for ln in proc_stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child printed no result\nstdout:\n{proc_stdout}\nstderr:\n{proc_stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    check_same_codegen(res["codegen"])
    return res


def check_same_codegen(child_fingerprint: str) -> None:
    """The child must see the code generator this process compiled with.

    The fingerprint hashes codegen/*.py: if those files changed on disk while the test ran
    (others edit the compiler), the child rightly uses another cache namespace; skip then. A
    fingerprint that differs for the same files would be a real bug (non-deterministic key)."""
    from fusion_compiler.codegen import cache as cache_mod

    now = cache_mod._codegen_fingerprint()
    if now != cache_mod.CODEGEN_FINGERPRINT:
        pytest.skip("codegen/*.py changed on disk while the test ran")
    assert child_fingerprint == now, "codegen fingerprint differs between processes"


# ------------------------------------------------------------------ written once, reused
def test_kernel_written_once_and_reused_in_process(cache_dir, device):
    reports = check_model(device)
    keys = kernel_keys(reports)
    cache = current_cache()
    assert len(keys) >= 2 and len(set(keys)) == len(keys)
    assert cache.generated == len(keys) and cache.hits == 0
    assert assert_valid_entries(cache_dir) == len(keys)
    for key in keys:
        assert entry_paths(cache_dir, key)[0].is_file()
    files = entry_files(cache_dir)
    mtimes = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()}
    modules = {k: cache.modules[k] for k in keys}

    # Same function again after a dynamo reset: same kernels, nothing generated or re-read.
    reports2 = check_model(device)
    assert kernel_keys(reports2) == keys
    assert current_cache() is cache
    assert cache.generated == len(keys) and cache.hits == 0
    assert all(cache.modules[k] is modules[k] for k in keys), "kernel modules were re-imported"
    assert entry_files(cache_dir) == files
    assert {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*") if p.is_file()} == mtimes


def test_fresh_cache_object_reads_the_disk(cache_dir, device, monkeypatch):
    keys = kernel_keys(check_model(device))
    files = entry_files(cache_dir)
    forget_loaded_kernels(monkeypatch)
    keys2 = kernel_keys(check_model(device))
    cache = current_cache()
    assert keys2 == keys
    assert cache.generated == 0 and cache.hits == len(keys)
    assert entry_files(cache_dir) == files


def _key_parts(lines) -> dict:
    """{key: {part: hash}} from the AOT cache's debug lines (aot_cache._key)."""
    parts = {}
    for line in lines:
        key, _, fields = line.split("AOT cache key ", 1)[1].partition(": ")
        parts[key] = json.loads(fields)
    return parts


def _run_child(script: Path, cache_dir: Path, device: str) -> dict:
    proc = subprocess.run([sys.executable, str(script)], cwd=script.parent,
                          env=child_env(cache_dir, device), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return child_result(proc.stdout, proc.stderr)


def test_second_process_generates_nothing(cache_dir, device, tmp_path):
    # Both compiles in fresh processes, as a user's two runs: this one's state (pytest's, earlier
    # tests') stays out of what the first one writes. On the H200 (session 34) a compile inside
    # pytest gave aot_autograd's arguments other sources (``args[0]``) than the same compile in
    # a script (``x``), and the sources are part of torch's key.
    script = write_child(tmp_path)
    first = _run_child(script, cache_dir, device)
    keys = first["keys"]
    assert first["generated"] == len(keys) > 0 and first["hits"] == 0, first
    assert first["aot"] == {"autograd_cache_miss": 1, "autograd_cache_saved": 1}, first
    assert first["max_err"] < 1e-5, first
    assert len(_key_parts(first["aot_keys"])) == 1, first["aot_keys"]
    before = entry_files(cache_dir)
    kernel_files = [f for f in before if not f.startswith(("graphs", "aot"))]
    # beside the kernels: one decision entry, one aot_autograd result (the inference graph)
    assert len(kernel_files) == 2 * len(keys) and len(before) == len(kernel_files) + 2
    second = _run_child(script, cache_dir, device)
    assert second["generated"] == 0, second
    assert second["hits"] == len(keys), second
    if second["aot"] != {"autograd_cache_hit": 1}:
        first_keys, second_keys = _key_parts(first["aot_keys"]), _key_parts(second["aot_keys"])
        differ = {name: (hashes[name], later.get(name)) for later in second_keys.values()
                  for hashes in first_keys.values() for name in hashes
                  if later.get(name) != hashes.get(name)}
        raise AssertionError(f"the second process missed the AOT cache: {second['aot']}; keys "
                             f"{list(first_keys)} -> {list(second_keys)}; parts that differ "
                             f"(first, second): {differ}")
    assert second["keys"] == keys
    assert second["max_err"] < 1e-5
    assert entry_files(cache_dir) == before, "the second process changed the cache"


# --------------------------------------------------------------------------- damaged entries
def _truncate(py, meta):
    data = py.read_bytes()
    py.write_bytes(data[: len(data) // 2])


def _flip_byte(py, meta):
    data = bytearray(py.read_bytes())
    i = data.index(b"tl.load")  # inside a kernel: a silent change of code if it were trusted
    data[i + 3] = ord("X")
    py.write_bytes(bytes(data))


def _bad_utf8(py, meta):
    data = bytearray(py.read_bytes())
    data[len(data) // 2] = 0xFF
    py.write_bytes(bytes(data))


def _delete_json(py, meta):
    meta.unlink()


def _garble_json(py, meta):
    meta.write_text('{"key": "3a5362f9", "sha2')


def _raises_on_import(py, meta):
    # A source whose checksum matches (metadata rewritten): only the import can tell.
    src = "raise RuntimeError('damaged kernel module')\n" + py.read_text()
    py.write_text(src)
    m = json.loads(meta.read_text())
    m["sha256"] = hashlib.sha256(src.encode()).hexdigest()
    meta.write_text(json.dumps(m))


def _no_launcher(py, meta):
    src = py.read_text().replace("def launch(", "def not_launch(")
    py.write_text(src)
    m = json.loads(meta.read_text())
    m["sha256"] = hashlib.sha256(src.encode()).hexdigest()
    meta.write_text(json.dumps(m))


DAMAGE = {"truncate": _truncate, "flip_byte": _flip_byte, "bad_utf8": _bad_utf8,
          "delete_json": _delete_json, "garble_json": _garble_json,
          "raises_on_import": _raises_on_import, "no_launcher": _no_launcher}


def _damage_and_recompile(kind, cache_dir, device, monkeypatch, caplog):
    """Build the cache, damage the first kernel's entry, compile in a 'new process'."""
    keys = kernel_keys(check_model(device))
    victim = keys[0]
    py, meta = entry_paths(cache_dir, victim)
    original = py.read_bytes()
    DAMAGE[kind](py, meta)
    forget_loaded_kernels(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        reports = check_model(device)           # still correct vs eager
    cache = current_cache()
    assert kernel_keys(reports) == keys
    assert cache.generated == 1, "exactly the damaged entry is rebuilt"
    assert cache.hits == len(keys) - 1
    assert py.read_bytes() == original, "the rebuilt source differs from the original"
    assert assert_valid_entries(cache_dir) == len(keys)
    warnings = [r for r in caplog.records
                if r.name == "fusion_compiler" and r.levelno >= logging.WARNING]
    return victim, py, warnings


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_entry_is_rebuilt(kind, cache_dir, device, monkeypatch, caplog):
    _damage_and_recompile(kind, cache_dir, device, monkeypatch, caplog)


@pytest.mark.parametrize("kind", [
    "truncate", "flip_byte", "bad_utf8", "delete_json", "garble_json",
    "raises_on_import", "no_launcher"])
def test_damaged_entry_is_reported(kind, cache_dir, device, monkeypatch, caplog):
    victim, py, warnings = _damage_and_recompile(kind, cache_dir, device, monkeypatch, caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert victim in msg and "rebuilding" in msg, msg


def test_rebuild_after_import_failure_ignores_stale_bytecode(tmp_path, monkeypatch):
    from fusion_compiler.codegen.cache import KernelCache

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    good = "def launch():\n    return 'good'\n"
    bad = "raise RuntimeError('bad')\n"
    bad += "#" * (len(good) - len(bad) - 1) + "\n"     # same size as the good source
    assert len(bad) == len(good)
    key = "ab" + "0" * 30
    while time.time() % 1 > 0.5:                        # keep both writes in one mtime second
        time.sleep(0.05)
    cache = KernelCache(tmp_path / "c")
    cache._write(key, bad)                              # checksum-valid, fails on import
    assert cache.load(key, lambda: good).launch() == "good"


# ------------------------------------------------------------------------ unwritable folder
@pytest.fixture
def unwritable_cache_dir(tmp_path, monkeypatch):
    """A cache path that cannot be created or written, even by root."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    probe = ro / "probe"
    try:
        probe.mkdir()
    except OSError:
        target = ro / "cache"                   # chmod works: an ordinary user
    else:                                       # root ignores permissions: a path under a FILE
        probe.rmdir()
        blocker = tmp_path / "a-regular-file"
        blocker.write_text("not a folder")
        target = blocker / "cache"
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(target))
    monkeypatch.setattr(backend, "_caches", {})
    yield target
    ro.chmod(0o700)
    for cache in backend._caches.values():
        if cache._fallback is not None:
            shutil.rmtree(cache._fallback, ignore_errors=True)


def _unwritable_run(unwritable_cache_dir, device, caplog):
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        reports = check_model(device)
    keys = kernel_keys(reports)
    assert len(keys) >= 2 and all(r.ran_kernels for r in reports)
    for k in reports[0].kernels:
        assert not Path(k["path"]).is_relative_to(unwritable_cache_dir)
        assert Path(k["path"]).is_file()
    assert not unwritable_cache_dir.exists()
    return [r.getMessage() for r in caplog.records
            if r.name == "fusion_compiler" and r.levelno >= logging.WARNING
            and "cannot write the kernel cache" in r.getMessage()]


def test_unwritable_cache_dir_warns_and_still_works(unwritable_cache_dir, device, caplog):
    warnings = _unwritable_run(unwritable_cache_dir, device, caplog)
    assert warnings and str(unwritable_cache_dir) in warnings[0]


def test_unwritable_cache_dir_warns_once(unwritable_cache_dir, device, caplog):
    warnings = _unwritable_run(unwritable_cache_dir, device, caplog)
    assert len(warnings) == 1, warnings


# ------------------------------------------------------------------------------ cache keys
def _pointwise(a):
    return (a * 2).sigmoid() + 1


def test_key_changes_with_dtype(cache_dir, device):
    keys = {}
    for dtype in (torch.float32, torch.float64, torch.float16):
        x = torch.randn(6, 10, device=device, dtype=dtype)
        out, reports = compile_and_run(_pointwise, (x,))
        assert_close(out, _pointwise(x))
        keys[dtype] = kernel_keys(reports)
        assert len(keys[dtype]) == 1
    assert len({k[0] for k in keys.values()}) == 3, keys


def test_key_changes_with_triton_version(cache_dir, device, monkeypatch):
    x = torch.randn(6, 10, device=device)
    _, reports = compile_and_run(_pointwise, (x,))
    (old,) = kernel_keys(reports)
    monkeypatch.setattr(triton, "__version__", triton.__version__ + ".post999")
    out, reports = compile_and_run(_pointwise, (x,))
    assert_close(out, _pointwise(x))
    (new,) = kernel_keys(reports)
    assert new != old
    assert current_cache().generated == 2
    meta = json.loads(entry_paths(cache_dir, new)[1].read_text())
    assert meta["triton"] == triton.__version__


def test_key_changes_with_max_persistent_block_and_resident_row(cache_dir, device, monkeypatch):
    x = torch.randn(4, 100, device=device)

    def softmax(a):
        return torch.softmax(a * 2, -1)
    _, reports = compile_and_run(softmax, (x,))
    (default_key,) = kernel_keys(reports)
    monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "16")
    out, reports = compile_and_run(softmax, (x,))
    assert_close(out, softmax(x))
    (small_key,) = kernel_keys(reports)
    assert "_resident_kernel" in Path(reports[0].kernels[0]["path"]).read_text()
    assert small_key != default_key
    # the longest row held in registers: 0 streams the row (the looped kernel)
    monkeypatch.setenv("FUSION_COMPILER_MAX_RESIDENT_ROW", "0")
    out, reports = compile_and_run(softmax, (x,))
    assert_close(out, softmax(x))
    (looped_key,) = kernel_keys(reports)
    assert "_looped_kernel" in Path(reports[0].kernels[0]["path"]).read_text()
    assert looped_key not in (small_key, default_key)


def test_key_ignores_graph_symbol_names(cache_dir, device, monkeypatch):
    """The same kernel in two graphs whose size symbols have other names shares one key."""
    from fusion_compiler.passes import legality

    seen = []
    real = legality.build_kernel_ir

    def spy(*args, **kwargs):
        ir, syms = real(*args, **kwargs)
        seen.append(([str(s) for s in syms], ir.text()))
        return ir, syms
    monkeypatch.setattr(legality, "build_kernel_ir", spy)

    def first(a):
        return (a * 2).relu() - 1

    def second(m, b):  # m takes the first symbols, so b's sizes get other names
        return torch.mm(m, m), (b * 2).relu() - 1

    a = torch.randn(5, 7, device=device)
    m = torch.randn(3, 3, device=device)
    out1, rep1 = compile_and_run(first, (a,), dynamic=True)
    syms1 = [s for s, _ in seen]
    seen.clear()
    out2, rep2 = compile_and_run(second, (m, a), dynamic=True)
    syms2 = [s for s, text in seen if "relu" in text]
    assert_close(out1, first(a))
    assert_close(out2[1], second(m, a)[1])
    assert_close(out2[0], second(m, a)[0], atol=1e-5, rtol=1e-5)
    (k1,) = kernel_keys(rep1)
    (k2,) = kernel_keys(rep2)
    assert syms1 and syms2 and syms1[0] != syms2[0], (syms1, syms2)   # really other names
    assert k1 == k2
    assert current_cache().generated == 1


def test_key_ignores_symbol_names_in_kernel_ir():
    """build_kernel_ir renames size symbols k0, k1, ... (unit level, no compile)."""
    import sympy

    from fusion_compiler.codegen.kernel_ir import build_kernel_ir
    from fusion_compiler.passes.shapes import TensorInfo

    def ir_for(s_rows, s_cols):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        mul = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
        relu = g.call_function(torch.ops.aten.relu.default, (mul,))
        info = TensorInfo((s_rows, s_cols), (s_cols, sympy.Integer(1)), torch.float32,
                          torch.device("cpu"), sympy.Integer(0))
        for n in (x, mul, relu):
            n.meta["fc_tensor"] = info
        return build_kernel_ir([mul, relu], [x], [relu])

    sym = lambda n: sympy.Symbol(n, integer=True, positive=True)  # noqa: E731
    ir1, g1 = ir_for(sym("s0"), sym("s1"))
    ir2, g2 = ir_for(sym("s27"), sym("s3"))
    assert g1 != g2
    assert ir1.text() == ir2.text()
    assert ir1.key("a", "b") == ir2.key("a", "b")
    assert ir1.key("a", "b") != ir1.key("a", "c")


def test_source_of_a_key_does_not_depend_on_example_sizes(tmp_path, device, monkeypatch):
    def fn(a):
        return torch.softmax(a * 2, -1)
    sources = {}
    for n, shape in enumerate([(4, 16), (9, 40)]):
        monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path / f"c{n}"))
        monkeypatch.setattr(backend, "_caches", {})
        x = torch.randn(*shape, device=device)
        out, reports = compile_and_run(fn, (x,), dynamic=True)
        assert_close(out, fn(x))
        (k,) = reports[0].kernels
        sources[k["key"]] = sources.get(k["key"], set()) | {Path(k["path"]).read_text()}
    assert len(sources) == 1, "expected one key for both sizes"
    assert len(next(iter(sources.values()))) == 1, "one key, two different sources"


# ------------------------------------------------------------------------------ concurrency
def test_two_processes_fill_one_cache_at_once(cache_dir, device, tmp_path):
    script = write_child(tmp_path)
    go = tmp_path / "go"
    env = child_env(cache_dir, device)
    env["FC_TEST_GO"] = str(go)
    procs = [subprocess.Popen([sys.executable, str(script), str(i)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        deadline = time.time() + SUBPROCESS_TIMEOUT
        while not all((tmp_path / f"go.ready.{i}").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs), "a child died before the start line"
            assert time.time() < deadline, "children never got ready"
            time.sleep(0.01)
        go.touch()                                      # both compile from here, together
        outs = [p.communicate(timeout=SUBPROCESS_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-4000:]
        results.append(child_result(stdout, stderr))
    keys = results[0]["keys"]
    assert keys and results[1]["keys"] == keys
    for res in results:
        assert res["max_err"] < 1e-5, res
        assert res["generated"] + res["hits"] == len(keys), res
    assert assert_valid_entries(cache_dir) == len(keys)

    # The entries they left are usable: a third reader (this process) only hits.
    reports = check_model(device)
    assert kernel_keys(reports) == keys
    assert current_cache().generated == 0 and current_cache().hits == len(keys)


# ------------------------------------------------------------------- fusion decision cache
def _summary_text(reports):
    return json.dumps([r.summary for r in reports], default=str, sort_keys=True)


def test_second_compile_restores_fusion_decisions(cache_dir, device, monkeypatch):
    """The fuse search runs once per graph: a second compile (another process, or after a
    reset) restores the groups and decisions from disk, with the same kernels and results."""
    from fusion_compiler.passes import fuse
    x, w = model_inputs(device)
    out1, rep1 = compile_and_run(model, (x, w))
    entries = list((cache_dir / "graphs").rglob("*.pkl"))
    assert len(entries) == 1
    forget_loaded_kernels(monkeypatch)

    def no_search(*a, **k):
        raise AssertionError("the fuse search ran although its result was cached")
    monkeypatch.setattr(fuse, "_search", no_search)
    out2, rep2 = compile_and_run(model, (x, w))
    assert kernel_keys(rep2) == kernel_keys(rep1) and len(kernel_keys(rep1)) == 2
    assert _summary_text(rep2) == _summary_text(rep1)
    assert rep2[0].decisions == rep1[0].decisions and rep1[0].decisions
    for a, b in zip(out2, out1):
        assert torch.equal(a, b)


def test_damaged_decision_entry_is_decided_again(cache_dir, device, monkeypatch, caplog):
    x, w = model_inputs(device)
    out1, rep1 = compile_and_run(model, (x, w))
    (entry,) = list((cache_dir / "graphs").rglob("*.pkl"))
    entry.write_bytes(entry.read_bytes()[:40])            # truncated
    forget_loaded_kernels(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        out2, rep2 = compile_and_run(model, (x, w))
    assert any("decision cache entry" in r.getMessage() for r in caplog.records)
    assert _summary_text(rep2) == _summary_text(rep1)
    assert_close(out2[0], model(x, w)[0])
    assert len(entry.read_bytes()) > 40                   # rewritten whole


@pytest.mark.parametrize("option,value", [("MAX_GROUP_OPS", "3"), ("TILES", "0")])
def test_decision_cache_key_follows_the_config(cache_dir, device, monkeypatch, option, value):
    """Another max_group_ops is another search, never a restored one; so are tiles off
    (legality asks whether a tile of rows writes a layout copy: lower.Lowering's
    ``row_tiles``)."""
    x, w = model_inputs(device)
    compile_and_run(model, (x, w))
    monkeypatch.setenv(f"FUSION_COMPILER_{option}", value)
    forget_loaded_kernels(monkeypatch)
    out, reports = compile_and_run(model, (x, w))
    assert len(list((cache_dir / "graphs").rglob("*.pkl"))) == 2
    if option == "MAX_GROUP_OPS":
        assert all(len(g["ops"]) <= 3 for g in reports[0].summary["groups"])
    assert_close(out[0], model(x, w)[0])


# ------------------------------------------------------------------------------ a full disk
def _full_disk(monkeypatch, full_roots):
    """Files written under any of ``full_roots`` fail as on a full disk: half the data lands,
    then ENOSPC (what a write into a full file system does)."""
    import errno
    real_fdopen = os.fdopen

    class HalfWriter:
        def __init__(self, f, path):
            self.f, self.path = f, path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", self.path)

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if any(Path(path).is_relative_to(root) for root in full_roots):
            return HalfWriter(f, path)
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)


def _entries(root: Path):
    """The files of the backend's own caches under ``root``: aot_autograd's results (aot/) are
    written by torch's AOTAutograd cache, through its own writer, which catches a failed write
    and compiles on; the fake full disk (``_full_disk``) does not reach it."""
    return sorted(p.name for p in root.rglob("*") if p.is_file()
                  and p.relative_to(root).parts[0] != "aot")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_full_cache_disk_warns_and_keeps_kernels_in_a_temporary_folder(cache_dir, device,
                                                                       monkeypatch, caplog):
    cache_dir.mkdir(parents=True)
    _full_disk(monkeypatch, [cache_dir])
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        reports = check_model(device)               # compared with eager
    assert len(kernel_keys(reports)) >= 2 and all(r.ran_kernels for r in reports)
    for k in reports[0].kernels:
        assert not Path(k["path"]).is_relative_to(cache_dir) and Path(k["path"]).is_file()
    warnings = [r.getMessage() for r in caplog.records if "cannot write the kernel cache"
                in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0]
    assert _entries(cache_dir) == []                # no half-written entry, no temporary file
    for cache in backend._caches.values():
        if cache._fallback is not None:
            shutil.rmtree(cache._fallback, ignore_errors=True)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_disk_full_everywhere_runs_the_graph_on_aten(cache_dir, device, monkeypatch, caplog):
    # the cache folder and the temporary folder both full: no kernel can be written, so the
    # graph runs on ATen, with a warning, and the results are eager's
    import tempfile
    cache_dir.mkdir(parents=True)
    _full_disk(monkeypatch, [cache_dir, Path(tempfile.gettempdir())])
    monkeypatch.setenv("FUSION_COMPILER_STRICT", "0")
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        reports = check_model(device)
    assert reports and all(r.error and "No space left" in r.error for r in reports)
    assert all(r.num_kernels == 0 for r in reports)
    assert any("running it on ATen unfused" in r.getMessage() for r in caplog.records)
    assert _entries(cache_dir) == []
    for cache in backend._caches.values():
        if cache._fallback is not None:
            assert _entries(cache._fallback) == []
            shutil.rmtree(cache._fallback, ignore_errors=True)


# ------------------------------------------------------------------ Triton's key (triton_key.py)
def _fake_package(root: Path) -> Path:
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("a = 1\n")
    (pkg / "sub" / "lib.so").write_bytes(b"\0" * 100)
    return pkg


def test_triton_key_is_stored_once_and_read_back_by_the_next_process(tmp_path):
    from fusion_compiler.codegen import triton_key as K

    pkg, store = _fake_package(tmp_path), tmp_path / "store"
    calls = []

    def compute():
        calls.append(1)
        return "9.9.9-abc"
    first = K.stored(compute, pkg, store, "9.9.9")
    assert first.fc_known is None                   # what compile workers are given: not yet
    assert first() == "9.9.9-abc" and first() == "9.9.9-abc"
    assert first.fc_known == "9.9.9-abc"
    assert len(calls) == 1                          # once per process
    (entry,) = store.iterdir()
    assert entry.read_text() == "9.9.9-abc"

    def never():
        raise AssertionError("the stored key was not used")
    later = K.stored(never, pkg, store, "9.9.9")
    assert later.fc_known == "9.9.9-abc" and later() == "9.9.9-abc"   # a later process


def test_triton_key_is_computed_again_when_a_file_changes_or_the_entry_is_bad(tmp_path):
    from fusion_compiler.codegen import triton_key as K

    pkg, store = _fake_package(tmp_path), tmp_path / "store"
    assert K.stored(lambda: "9.9.9-old", pkg, store, "9.9.9")() == "9.9.9-old"
    (pkg / "sub" / "lib.so").write_bytes(b"\1" * 101)          # Triton reinstalled or changed
    assert K.stored(lambda: "9.9.9-new", pkg, store, "9.9.9")() == "9.9.9-new"
    for entry in store.iterdir():                               # a damaged entry
        entry.write_text("garbage")
    assert K.stored(lambda: "9.9.9-again", pkg, store, "9.9.9")() == "9.9.9-again"


def test_triton_key_works_without_a_writable_store(tmp_path):
    from fusion_compiler.codegen import triton_key as K

    pkg = _fake_package(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")                  # the store's folder would be inside a file
    assert K.stored(lambda: "9.9.9-x", pkg, blocker / "store", "9.9.9")() == "9.9.9-x"


def test_triton_key_install_gives_triton_its_own_value(tmp_path, monkeypatch):
    from triton.runtime import cache as triton_cache

    from fusion_compiler.codegen import triton_key as K

    original = triton_cache.triton_key
    original = getattr(original, "fc_compute", original)    # installed earlier in this process
    monkeypatch.setattr(triton_cache, "triton_key", original)   # restored after the test
    K.install(tmp_path)
    installed = triton_cache.triton_key
    assert installed is not original and installed.fc_stored
    assert installed() == original()                 # the very string Triton computes
    K.install(tmp_path)                              # once per process
    assert triton_cache.triton_key is installed
    assert list((tmp_path / "triton_key").iterdir())


def test_triton_key_helper_answers_for_the_first_compile(tmp_path):
    import sys

    from fusion_compiler.codegen import triton_key as K

    pkg, store = _fake_package(tmp_path), tmp_path / "store"

    def never():
        raise AssertionError("computed although the helper answered")
    helper = [sys.executable, "-c", f"print({str(pkg)!r}); print('9.9.9-child')"]
    key = K.stored(never, pkg, store, "9.9.9", helper)
    assert key() == "9.9.9-child"
    assert K.stored(never, pkg, store, "9.9.9")() == "9.9.9-child"      # and stored


@pytest.mark.parametrize("script", [
    "print('/elsewhere/triton'); print('9.9.9-child')",    # another Triton than this process's
    "print(PKG); print('no version')",                     # not a key
    "import sys; sys.exit(3)",                             # the helper failed
])
def test_triton_key_helper_is_not_trusted_unless_it_ran_this_triton(tmp_path, script):
    import sys

    from fusion_compiler.codegen import triton_key as K

    pkg, store = _fake_package(tmp_path), tmp_path / "store"
    helper = [sys.executable, "-c", f"PKG = {str(pkg)!r}\n" + script]
    assert K.stored(lambda: "9.9.9-here", pkg, store, "9.9.9", helper)() == "9.9.9-here"


def test_triton_key_helper_prints_this_processes_triton_and_key(tmp_path):
    import subprocess

    from triton.runtime import cache as triton_cache

    from fusion_compiler.codegen import triton_key as K

    original = triton_cache.triton_key
    original = getattr(original, "fc_compute", original)
    out = subprocess.run(K.helper_command(), capture_output=True, text=True, check=True)
    folder, key = out.stdout.splitlines()
    assert folder == os.path.dirname(os.path.realpath(triton.__file__))
    assert key == original()


def test_triton_key_helper_that_does_not_answer_in_time_is_not_waited_for(tmp_path, monkeypatch):
    import sys
    import time

    from fusion_compiler.codegen import triton_key as K

    monkeypatch.setattr(K, "HELPER_WAIT_S", 0.2)
    pkg, store = _fake_package(tmp_path), tmp_path / "store"
    helper = [sys.executable, "-c", "import time; time.sleep(30)"]
    t0 = time.perf_counter()
    assert K.stored(lambda: "9.9.9-here", pkg, store, "9.9.9", helper)() == "9.9.9-here"
    assert time.perf_counter() - t0 < 10
