"""Worker processes that compile a graph's Triton kernels beside the main process.

Threads compile kernels in this process (codegen/precompile.py), but Triton's front end is
Python and holds the GIL, and the first compile of a process pays Triton's lazy imports and
set-up: on the H200 device's host a cold Triton phase took 0.65-1.11 s for 5-6 kernels
(session 14). Workers (codegen/compile_worker.py) import Triton only, start as the backend does
(``start``, before aot_autograd traces; not for a graph the AOT cache loads), and are warm by
the time the kernels are known. Each compiles a kernel into Triton's on-disk cache; this
process's compile of it is then a cache hit. The request names the kernel by its module's
file and carries the arguments Triton's own ``JITFunction.run`` would compile with
(``precompile.bind_for_target``), so the worker's cache entry is the one this process looks up.

Nothing depends on a worker: one that is not ready yet takes no kernel, one that fails a
kernel or dies leaves it to this process's threads, which compile it as before (and report
its error, if it has one). A pool unused for ``IDLE_S`` seconds is closed; the next graph
starts another.
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("fusion_compiler")

WORKER = Path(__file__).with_name("compile_worker.py")
TRITON_LIB = Path(__file__).with_name("triton_lib.py")
COMPILE_TIMEOUT_S = 300.0       # one request (a kernel's launches); then the worker is dropped
IDLE_S = 60.0       # a pool unused this long is closed (its workers exit); a later graph starts
                    # another: idle workers hold ~0.2 GB of host memory each


class Worker:
    """One worker process; used by one thread at a time (``CompilePool.lock``)."""

    def __init__(self, arch: int, key: str | None):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if key:
            env["FUSION_COMPILER_TRITON_KEY"] = key
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(TRITON_LIB), str(arch)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.started_at = time.perf_counter()
        self.ready = False
        self.alive = True
        self.ready_seconds = None       # the worker's start-up, as it measured it

    def _receive(self, timeout: float):
        """The next message, or None if there is none within ``timeout`` seconds (the worker
        is then still alive); a worker that has ended is marked dead and gives ("dead",)."""
        if not self.alive:
            return ("dead",)
        readable, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not readable:
            return None
        try:
            return pickle.load(self.proc.stdout)
        except Exception as exc:   # ended, or wrote something that is not a message
            self.stop(f"no answer ({type(exc).__name__})")
            return ("dead",)

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """Whether the worker is ready, waiting up to ``timeout`` seconds for it."""
        if not self.ready and self.alive:
            message = self._receive(timeout)
            if message is not None and message[0] == "ready":
                self.ready, self.ready_seconds = True, message[1]
        return self.ready

    def compile(self, requests: list):
        """Compile ``requests`` (a list of ``bind_for_target`` tuples); returns a list with,
        per request, None or the worker's error text; or None if the worker is gone."""
        try:
            pickle.dump(requests, self.proc.stdin)
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            self.stop(f"request not sent ({type(exc).__name__})")
            return None
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        while True:
            message = self._receive(deadline - time.monotonic())
            if message is None:
                self.stop(f"no answer in {COMPILE_TIMEOUT_S:.0f} s")
                return None
            if message[0] == "done":
                return message[1]
            if message[0] == "dead":
                return None

    def stop(self, why: str = "") -> None:
        if self.alive:
            self.alive = self.ready = False
            if why:
                log.debug("fusion-compiler: compile worker %d dropped: %s", self.proc.pid, why)
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except Exception:       # already gone
                pass
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except Exception:
                    pass


class CompilePool:
    """Workers for one GPU architecture. They are started on a thread (a process start took
    ~12 ms of the main thread on the H200 device's host, a tenth of a second for eight);
    ``started`` waits for that and gives them."""

    def __init__(self, size: int, arch: int, key: str | None = None):
        self.arch = arch
        self.lock = threading.Lock()        # held while in use
        self.last_used = time.monotonic()
        self.workers: list = []
        self._starting = threading.Thread(target=self._start, args=(size, arch, key),
                                          name="fc-compile-start", daemon=True)
        self._starting.start()

    def _start(self, size: int, arch: int, key) -> None:
        for _ in range(size):
            try:
                self.workers.append(Worker(arch, key))
            except OSError as exc:      # cannot start processes here: threads alone
                log.debug("fusion-compiler: compile worker not started (%s)", exc)
                break

    def started(self) -> list:
        self._starting.join()
        return self.workers

    def close(self) -> None:
        for w in self.started():
            if w.alive:
                try:
                    w.proc.stdin.close()        # end of input: the worker exits
                    w.proc.wait(timeout=2)
                except Exception:
                    pass
                w.stop()


_POOL: CompilePool | None = None
_POOL_LOCK = threading.Lock()


def workers_for(requested: int) -> int:
    """Workers to start for ``requested``: at most the cores this process may use less two
    (one for this process, one for the rest), so none on a machine of three cores or fewer."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        cores = os.cpu_count() or 1
    return max(0, min(requested, cores - 2))


def start(requested: int, arch: int, key: str | None = None) -> CompilePool | None:
    """The process's pool, started on first use with ``workers_for(requested)`` workers
    compiling for ``arch`` (e.g. 90 for sm_90); None if that is none. A pool left unused for
    ``IDLE_S`` seconds is closed, and the next call starts another."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            size = workers_for(requested)
            if size == 0:
                return None
            _POOL = CompilePool(size, arch, key)
            threading.Thread(target=_close_when_idle, args=(_POOL,), name="fc-compile-idle",
                             daemon=True).start()
        _POOL.last_used = time.monotonic()
        return _POOL


def _close_when_idle(pool: CompilePool) -> None:
    global _POOL
    while True:
        time.sleep(min(IDLE_S / 4, 5.0))
        with _POOL_LOCK:
            if _POOL is not pool:
                return
            if time.monotonic() - pool.last_used < IDLE_S or not pool.lock.acquire(blocking=False):
                continue
            _POOL = None
        try:
            pool.close()
        finally:
            pool.lock.release()
        return


@atexit.register
def _close_at_exit() -> None:
    pool = _POOL
    if pool is not None:
        pool.close()


def current() -> CompilePool | None:
    return _POOL
