"""What Triton's per-process cache key costs, and what codegen/triton_key.py leaves of it. (CPU)

    python benchmarks/triton_key_time.py

Fresh processes, one empty store folder: Triton's own ``triton_key()`` (the SHA-256 of its
sources and libtriton.so, computed at the first compile of every process), then the installed
function twice: the first computes and stores the key, the second reads it back. Last, with
another empty store, the helper process (what the backend starts on a GPU), asked after 1 s of
Python in the main process (aot_autograd's tracing comes first in a compile). Each prints the
time of its first call and whether the value equals Triton's.
"""
import subprocess
import sys
import tempfile

CHILD = r'''
import sys, time
from triton.runtime import cache
original = cache.triton_key
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
                          ("installed, stored", store), ("helper, empty store", other)):
        out = subprocess.run([sys.executable, "-c", CHILD, label, folder], capture_output=True,
                             text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
