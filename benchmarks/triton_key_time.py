"""What Triton's per-process cache key costs, and what codegen/triton_key.py leaves of it. (CPU)

    python benchmarks/triton_key_time.py

Fresh processes, one empty store folder: Triton's own ``triton_key()`` (the SHA-256 of its
sources and libtriton.so, computed at the first compile of every process), then the installed
function twice: the first computes and stores the key, the second reads it back. Last, with
another empty store, the helper process (what the backend starts on a GPU), asked after 1 s of
Python in the main process (aot_autograd's tracing comes first in a compile). Each prints the
time of its first call and whether the value equals Triton's. And why a process, not a thread:
a fixed amount of Python timed alone, then with Triton's own key computed on a thread beside it
(compare with the sum of the two alone).
"""
import subprocess
import sys
import tempfile

CHILD = r'''
import sys, threading, time
from triton.runtime import cache
original = cache.triton_key
if sys.argv[1] == "thread":
    def busy():                 # a fixed amount of Python, standing for the compile's
        n = 0
        for i in range(8_000_000):
            n += i
    t0 = time.perf_counter()
    busy()
    alone = time.perf_counter() - t0
    done = {}
    def hash_it():
        t = time.perf_counter()
        cache.triton_key()
        done["s"] = time.perf_counter() - t
    worker = threading.Thread(target=hash_it)
    t0 = time.perf_counter()
    worker.start()
    busy()
    worker.join()
    both = time.perf_counter() - t0
    print(f"thread: Python alone {alone:.3f} s; with the key on a thread beside it {both:.3f} s "
          f"(the key took {done['s']:.3f} s there)")
    sys.exit()
setup = 0.0
if sys.argv[1] != "triton":
    from fusion_compiler.codegen import triton_key
    helper = sys.argv[1].startswith("helper")
    t0 = time.perf_counter()
    triton_key.install(sys.argv[2], helper=helper)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    while helper and time.perf_counter() - t0 < 1.0:
        pass
t0 = time.perf_counter()
value = cache.triton_key()
seconds = time.perf_counter() - t0
same = "" if sys.argv[1] == "triton" else f", equal to Triton's: {value == original()}"
print(f"{sys.argv[1]:24s} install {setup:.4f} s + first call {seconds:.4f} s{same}")
'''


def main():
    store, other = tempfile.mkdtemp(), tempfile.mkdtemp()
    for label, folder in (("triton", store), ("installed, empty store", store),
                          ("installed, stored", store), ("helper, empty store", other),
                          ("thread", other)):
        out = subprocess.run([sys.executable, "-c", CHILD, label, folder], capture_output=True,
                             text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
