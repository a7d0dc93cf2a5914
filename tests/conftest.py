"""Test setup: generated kernels run on the GPU when there is one, else in Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is decided here, first.
"""
import atexit
import os
import shutil
import tempfile

import pytest

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FUSION_COMPILER_STRICT"] = "1"
if "FUSION_COMPILER_CACHE_DIR" not in os.environ:
    # One kernel cache for the run, made by the first process (xdist's workers inherit the
    # variable) and removed when that process exits: it holds about 90 MB after the suite.
    _cache_dir = tempfile.mkdtemp(prefix="fc-test-cache-")
    os.environ["FUSION_COMPILER_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty kernel cache folder for this test, and no KernelCache objects from earlier tests."""
    from fusion_compiler import backend
    d = tmp_path / "kernel-cache"
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(d))
    monkeypatch.setattr(backend, "_caches", {})
    return d


@pytest.fixture
def small_steps(monkeypatch):
    """Looped row kernels on small rows: rows longer than 16 loop in steps of 16 columns, one
    program a row (never split: a test that splits takes ``small_chunks``; never held in
    registers: a test of that takes ``small_resident``); yields ``monkeypatch`` for further
    settings."""
    from fusion_compiler.codegen import launch
    monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", "16")
    monkeypatch.setenv("FUSION_COMPILER_MAX_RESIDENT_ROW", "0")
    monkeypatch.setattr(launch, "LOOPED_RBLOCK", 16)
    monkeypatch.setattr(launch, "SPLIT_MIN_CHUNK", 1 << 30)
    launch.row_settings.cache_clear()
    launch.split_settings.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    launch.row_settings.cache_clear()
    launch.split_settings.cache_clear()


@pytest.fixture
def small_chunks(small_steps):
    """``small_steps``, and rows split across programs where they make two chunks: a chunk
    takes at least 32 columns, in steps of 16."""
    from fusion_compiler.codegen import launch
    small_steps.setattr(launch, "SPLIT_RBLOCK", 16)
    small_steps.setattr(launch, "SPLIT_MIN_CHUNK", 32)
    launch.split_settings.cache_clear()


@pytest.fixture
def small_resident(small_steps):
    """``small_steps``, and rows of up to 208 elements held in registers by the resident kernel
    as chunks of 16 columns (13 chunks, as the default's 53248 in chunks of 4096)."""
    from fusion_compiler.codegen import launch
    small_steps.setenv("FUSION_COMPILER_MAX_RESIDENT_ROW", "208")
    small_steps.setattr(launch, "RESIDENT_RBLOCK", 16)
    return small_steps
