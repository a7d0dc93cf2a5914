"""What Triton's per-process cache key costs, and what codegen/triton_key.py leaves of it. (CPU)

    python benchmarks/triton_key_time.py

Three fresh processes share one empty store folder: Triton's own ``triton_key()`` (the SHA-256
of its sources and libtriton.so, computed at the first compile of every process), then the
installed function twice: the first computes and stores the key, the second reads it back.
Each prints the time of its first call and whether the value equals Triton's.
"""
import subprocess
import sys
import tempfile

CHILD = r'''
import sys, time
from triton.runtime import cache
original = cache.triton_key
if sys.argv[1] != "triton":
    from fusion_compiler.codegen import triton_key
    triton_key.install(sys.argv[2])
t0 = time.perf_counter()
value = cache.triton_key()
seconds = time.perf_counter() - t0
same = "" if sys.argv[1] == "triton" else f", equal to Triton's: {value == original()}"
print(f"{sys.argv[1]:28s} first call {seconds:.4f} s{same}")
'''


def main():
    store = tempfile.mkdtemp()
    for label in ("triton", "installed, empty store", "installed, stored"):
        out = subprocess.run([sys.executable, "-c", CHILD, label, store], capture_output=True,
                             text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
