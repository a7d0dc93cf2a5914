"""On-disk kernel cache: generated source keyed by kernel IR, dtypes, codegen and Triton versions.

    <cache_dir>/<key[:2]>/<key>.py     the generated module (jit kernels + launcher)
    <cache_dir>/<key[:2]>/<key>.json   {"key", "sha256" of the source, versions}

Writes are atomic (write a temporary file, then rename), so a reader sees a whole entry or none.
An entry whose metadata is missing, whose checksum does not match its source, or whose module
fails to import is rebuilt, never trusted. A cache folder that cannot be written is bypassed
with one warning: the kernel then lives in a temporary folder for this process.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import triton

from . import ops, row_loops, triton_lib
from .triton_lib import interpreting

log = logging.getLogger("fusion_compiler")

CODEGEN_VERSION = "1"


def source_fingerprint(*folders: Path, salt: str = "") -> str:
    """Hash of the ``*.py`` sources in ``folders``: any change to them is a new cache namespace."""
    h = hashlib.sha256(salt.encode())
    for folder in folders:
        for path in sorted(Path(folder).glob("*.py")):
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _codegen_fingerprint() -> str:
    """Hash of the code generator's own source."""
    return source_fingerprint(Path(__file__).parent, salt=CODEGEN_VERSION)


CODEGEN_FINGERPRINT = _codegen_fingerprint()


class KernelCache:
    """Source of generated kernels on disk, and their imported modules in this process."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._modules = {False: {}, True: {}}    # per Triton mode: interpreted or not
        self.generated = 0      # sources written by this process
        self.hits = 0           # sources found on disk
        self._fallback = None

    @property
    def modules(self) -> dict:
        """key -> imported kernel module, in the Triton mode this process is in now."""
        return self._modules[interpreting()]

    @staticmethod
    def salt() -> tuple:
        # torch's fp8 conversion rule (saturating or not) decides what the kernels emit, and
        # FUSION_COMPILER_PREFETCH whether looped kernels load a step ahead,
        # FUSION_COMPILER_EVICT their eviction hints
        return (CODEGEN_FINGERPRINT, triton.__version__, f"fp8-saturates={ops.FP8_SATURATES}",
                f"prefetch={row_loops.PREFETCH}", f"evict={row_loops.EVICT}")

    def load(self, key: str, make_source):
        """Module for ``key``: from memory, from disk, or built with ``make_source()``.
        One module per Triton mode: jit functions made for the interpreter do not run compiled,
        nor the other way round (TRITON_INTERPRET is read when a module is imported)."""
        interpret = interpreting()
        module = self._modules[interpret].get(key)
        if module is not None:
            return module
        path = self._path(self.root, key)
        source = self._read_valid(path, key)
        if source is not None:
            module = self._import(path, key, source, interpret)
            if module is not None:
                self.hits += 1
        if module is None:
            source = make_source()
            self.generated += 1
            path = self._write(key, source)
            module = self._import(path, key, source, interpret)
            if module is None:
                raise RuntimeError(f"fusion-compiler: generated kernel {path} does not import")
        self._modules[interpret][key] = module
        return module

    @staticmethod
    def _path(root: Path, key: str) -> Path:
        return root / key[:2] / f"{key}.py"

    def _read_valid(self, path: Path, key: str):
        meta_path = path.with_suffix(".json")
        if not path.exists() and not meta_path.exists():
            return None     # not cached yet
        try:
            meta = json.loads(meta_path.read_text())
            source = path.read_text()
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.warning("fusion-compiler: kernel cache entry %s is damaged (%s); rebuilding",
                        path, exc)
            return None
        if (not isinstance(meta, dict) or meta.get("key") != key
                or meta.get("sha256") != hashlib.sha256(source.encode()).hexdigest()
                or meta.get("triton") != triton.__version__
                or meta.get("codegen") != CODEGEN_FINGERPRINT):
            log.warning("fusion-compiler: kernel cache entry %s is damaged or stale; rebuilding", path)
            return None
        return source

    def _write(self, key: str, source: str) -> Path:
        meta = {"key": key, "sha256": hashlib.sha256(source.encode()).hexdigest(),
                "triton": triton.__version__, "codegen": CODEGEN_FINGERPRINT}
        if self._fallback is None:
            try:
                return _write_entry(self._path(self.root, key), source, meta)
            except OSError as exc:
                log.warning("fusion-compiler: cannot write the kernel cache at %s (%s); "
                            "using a temporary folder for this process", self.root, exc)
                self._fallback = Path(tempfile.mkdtemp(prefix="fusion-compiler-"))
        return _write_entry(self._path(self._fallback, key), source, meta)

    def _import(self, path: Path, key: str, source: str, interpret: bool):
        """Module from the checked source; compiled here, so no stale bytecode is ever used.
        (Triton reads the kernel's source back through ``path``.)"""
        name = f"fusion_kernel_{key}" + ("_interpreted" if interpret else "")
        try:
            module = types.ModuleType(name)
            module.__file__ = str(path)
            sys.modules[name] = module
            with triton_lib.triton_mode(interpret):     # the mode asked, whatever the env says
                exec(compile(source, str(path), "exec"), module.__dict__)
            module.fl = triton_lib.for_mode(interpret)      # the helpers of the same mode
            module.launch  # noqa: B018  (a module without its launcher is damaged)
            return module
        except Exception as exc:  # a damaged file can fail in any way: rebuild it
            sys.modules.pop(name, None)
            log.warning("fusion-compiler: kernel cache entry %s fails to import (%s); rebuilding",
                        path, exc)
            return None


def _write_entry(path: Path, source: str, meta: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, source)
    atomic_write(path.with_suffix(".json"), json.dumps(meta))
    return path


def atomic_write(path: Path, data) -> None:
    """Write ``data`` (str or bytes) to ``path`` so that readers see all of it or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
