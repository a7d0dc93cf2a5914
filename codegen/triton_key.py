"""Triton's own cache key: kept on disk from one process to the next, and computed off the
main process the first time.

Every Triton compile and every lookup in Triton's kernel cache keys on
``triton.runtime.cache.triton_key()``: a SHA-256 of Triton's compiler, backend and language
sources and of ``libtriton.so`` (hundreds of MB). Triton computes it once per process: 0.41-0.51 s
on the CPU machine, in the first compile of every process, warm caches included. On a thread
it would not overlap the compile's Python: it hashes many files, and each takes the GIL again.

Its value depends only on those files, so it is stored under a signature of Triton's package
folder (path, size, modification time and inode of every file in it: more than the key reads)
and given back to Triton from there. Any change to any of those files, a reinstall included, is
a new signature, and the key is computed again.

    <cache_dir>/triton_key/<signature>.txt     the key, as Triton computes it

When nothing is stored yet and kernels will be compiled for a GPU, ``install`` (called as the
backend starts, before aot_autograd traces) starts a helper process that imports Triton and
prints the key; it runs beside the tracing and the passes, and the first compile takes its
answer. The answer is used only if the helper's Triton is this process's (the same package
folder) and it has the form of Triton's key; otherwise, if the helper fails, or if it has not
answered within ``HELPER_WAIT_S`` of being asked, the key is computed here as before.

``install`` replaces the module's function with one that returns the stored, helper's or
computed value: the same string in every case, so Triton's cache entries are those it would use
anyway, shared with processes that do not use this module.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger("fusion_compiler")

HELPER = ("import os, triton\n"
          "from triton.runtime.cache import triton_key\n"
          "print(os.path.dirname(os.path.realpath(triton.__file__)))\n"
          "print(triton_key())\n")
HELPER_WAIT_S = 1.0     # once asked, wait this long for the helper (its whole run: ~0.7 s on the
                        # CPU machine), then compute here instead


def signature(package_dir: Path) -> str:
    """Hash of the path, size, modification time and inode of every file under the folder."""
    h = hashlib.sha256(str(package_dir).encode())
    for root, dirs, files in os.walk(package_dir):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()[:32]


def helper_command() -> list:
    """The helper: this interpreter, with this process's import path first."""
    return [sys.executable, "-c", HELPER]


def _read(path: Path, version: str):
    try:
        value = path.read_text()
    except OSError:
        return None
    return value if value.startswith(version) else None


def _start(command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, env=env, text=True)
    except OSError as exc:
        log.debug("fusion-compiler: Triton's key helper not started (%s)", exc)
        return None


def _answer(child, package_dir: Path, version: str):
    """The helper's key, if it ran this process's Triton and printed a key; else None."""
    try:
        out, _ = child.communicate(timeout=HELPER_WAIT_S)
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        child.kill()
        child.wait()
        log.debug("fusion-compiler: Triton's key helper failed (%s)", exc)
        return None
    lines = out.splitlines()
    if (child.returncode != 0 or len(lines) != 2 or lines[0] != str(package_dir)
            or not lines[1].startswith(version)):
        return None
    return lines[1]


def stored(compute, package_dir: Path, folder: Path, version: str, helper=None):
    """A function returning ``compute()``'s value: read from ``folder`` when an earlier process
    stored it for the same files; else the answer of ``helper`` (a command, started now, that
    prints the package folder and the key), or ``compute()`` itself; then stored. A value that
    does not start with ``version`` is not trusted."""
    from .cache import atomic_write

    path = Path(folder) / f"{signature(package_dir)}.txt"
    known = _read(path, version)
    child = _start(helper) if known is None and helper else None
    lock = threading.Lock()         # the compile threads ask at once; the helper answers once

    @functools.lru_cache(maxsize=None)
    def key():
        if known is not None:
            return known
        with lock:
            value = _read(path, version)    # another process may have stored it meanwhile
            if value is None and child is not None:
                value = _answer(child, package_dir, version)
            if value is None:
                value = compute()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, value)
            except OSError as exc:                # the store is an optimisation
                log.debug("fusion-compiler: Triton's key not stored (%s)", exc)
            key.fc_known = value
            return value
    key.fc_stored, key.fc_compute, key.fc_known = True, compute, known
    return key


def install(cache_dir: Path, helper: bool = False):
    """Have Triton take its key from here (once per process; a Triton without the function this
    replaces is left as it is). ``helper``: start the helper process if nothing is stored.
    Returns the key if it is known yet (stored by an earlier process, or computed in this
    one), else None."""
    import triton
    from triton.runtime import cache as triton_cache

    compute = getattr(triton_cache, "triton_key", None)
    if compute is None:
        return None
    if not getattr(compute, "fc_stored", False):
        package_dir = Path(os.path.realpath(triton.__file__)).parent
        triton_cache.triton_key = stored(compute, package_dir, Path(cache_dir) / "triton_key",
                                         triton.__version__, helper_command() if helper else None)
    return triton_cache.triton_key.fc_known
