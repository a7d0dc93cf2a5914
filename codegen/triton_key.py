"""Triton's own cache key, kept on disk from one process to the next.

Every Triton compile and every lookup in Triton's kernel cache keys on
``triton.runtime.cache.triton_key()``: a SHA-256 of Triton's compiler, backend and language
sources and of ``libtriton.so`` (hundreds of MB). Triton computes it once per process: 0.41 s on
the CPU machine, in the first compile of every process, warm caches included. Its value depends
only on those files, so it is stored here under a signature of Triton's package folder (the
path, size, modification time and inode of every file in it: more than the key reads) and
given back to Triton from there. Any change to any of those files, a reinstall included, is a
new signature, and Triton computes the key again.

    <cache_dir>/triton_key/<signature>.txt     the key, as Triton computed it

``install`` replaces the module's function with one that returns the stored value (or the
computed one, then stores it): the same string, so Triton's cache entries are the ones it would
use anyway, shared with processes that do not use this module.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("fusion_compiler")


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


def stored(compute, package_dir: Path, folder: Path, version: str):
    """A function returning ``compute()``'s value, read from ``folder`` when an earlier process
    stored it for the same files, else computed and stored. A stored value that does not start
    with ``version`` is not trusted."""
    from .cache import atomic_write

    @functools.lru_cache(maxsize=None)
    def key():
        path = Path(folder) / f"{signature(package_dir)}.txt"
        try:
            value = path.read_text()
            if value.startswith(version):
                return value
        except OSError:
            pass
        value = compute()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, value)
        except OSError as exc:                    # the cache is an optimisation
            log.debug("fusion-compiler: Triton's key not stored (%s)", exc)
        return value
    key.fc_stored, key.fc_compute = True, compute
    return key


def install(cache_dir: Path) -> None:
    """Have Triton take its key from ``cache_dir`` (once per process; a Triton without the
    function this replaces is left as it is)."""
    import triton
    from triton.runtime import cache as triton_cache

    compute = getattr(triton_cache, "triton_key", None)
    if compute is None or getattr(compute, "fc_stored", False):
        return
    package_dir = Path(triton.__file__).resolve().parent
    triton_cache.triton_key = stored(compute, package_dir, Path(cache_dir) / "triton_key",
                                     triton.__version__)
