"""Generated kernels timed alone, each against its floor (GPU).

    python benchmarks/kernel_files.py CACHE_DIR_OR_FILE ... [--kind row] [--min-mb 30]

Each kernel module of a cache folder (``FUSION_COMPILER_CACHE_DIR``, filled by a `bench` or
`dump` of a model) is loaded and its ``launch`` called on random inputs of the shapes its
kernel's signature comments give (contiguous, floats scaled by 0.1), after a first call that
compiles it: do_bench median, L2 flushed, and % of the floor (the bytes its header says it
moves over the copy bandwidth measured here). The slowest first. Comparing two caches of the
same model made by two commits (gpu_check's ``ab`` step makes them) shows which kernels a change
moved; ``kernel_table.py --groups`` gives the same kernels' times inside the model's call.
Kernels with symbolic sizes or other launch arguments are skipped; arguments with a default
(an output buffer to reuse) keep it.

``--reference FILE``: hand-edited copies of one kernel (other tiles, warps, statements) checked
before they are timed: each file taking the same inputs runs on the reference's inputs, and
the largest difference of each of its outputs from the reference's is printed and kept
(``max_diff``; an output a copy leaves unwritten differs by garbage).
"""
import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patterns import copy_bandwidth  # noqa: E402

from fusion_compiler.codegen.render import bytes_moved  # noqa: E402

SIGNATURE = re.compile(r"def launch\(DEVICE, ([^)]*)\)")
INPUT = re.compile(r"^\s+(in\d+),  # torch\.(\w+) (\[[^\]]*\])", re.M)


def kernel_files(paths, kind):
    for p in map(Path, paths):
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            text = f.read_text()
            if kind is None or f"({kind} kernel)" in text.splitlines()[0]:
                yield f, text


def input_specs(text):
    """[(dtype, shape)] of the module's ``launch`` arguments, or None where it takes others."""
    m = SIGNATURE.search(text)
    shapes = {name: (dtype, json.loads(shape)) for name, dtype, shape in INPUT.findall(text)}
    # arguments with a default (a buffer to reuse, ``r0=None``) keep it
    names = [a for a in m.group(1).split(", ") if "=" not in a] if m else None
    if not names or any(a not in shapes for a in names):
        return None
    return [(getattr(torch, shapes[a][0]), shapes[a][1]) for a in names]


def inputs_for(specs):
    """Random inputs of ``specs`` (``input_specs``) on the GPU."""
    return [torch.randn(shape, device="cuda").mul_(0.1).to(dtype) if dtype.is_floating_point
            else torch.randint(0, 2, shape, device="cuda").to(dtype) for dtype, shape in specs]


def reference(path, device):
    """(``input_specs``, the inputs, the outputs) of the kernel file ``path``, on inputs
    drawn once (seed 0)."""
    specs = input_specs(Path(path).read_text())
    if specs is None:
        sys.exit(f"{path}: its launch takes arguments other than inputs of static shapes")
    torch.manual_seed(0)
    args = inputs_for(specs)
    spec = importlib.util.spec_from_file_location("kernel_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = [o.clone() for o in module.launch(device, *args)]
    return specs, args, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="cache folders or kernel files")
    ap.add_argument("--kind", default=None, help="row, pointwise, ... (the header's kind)")
    ap.add_argument("--min-mb", type=float, default=30.0, help="skip kernels moving less")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reference", default=None,
                    help="a kernel file whose outputs the others taking its inputs must match")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_files.py times kernels on a CUDA GPU and none is visible")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    device = torch.device("cuda", torch.cuda.current_device())
    ref = reference(a.reference, device) if a.reference else None
    for f, text in kernel_files(a.paths, a.kind):
        nbytes = bytes_moved(text) or 0
        specs = input_specs(text) if nbytes >= a.min_mb * 1e6 else None
        if specs is None:
            continue
        same = ref is not None and specs == ref[0]
        args = ref[1] if same else inputs_for(specs)
        spec = importlib.util.spec_from_file_location(f"kernel_{f.stem}", f)
        module = importlib.util.module_from_spec(spec)
        try:        # one kernel that does not compile or launch (e.g. a hand-edited tile out of
            spec.loader.exec_module(module)     # shared memory) costs its row, not the table
            out = module.launch(device, *args)
            torch.cuda.synchronize()
            diff = [float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref[2])] \
                if same else None
            if same:
                print(f"{f}: max difference of each output from the reference {diff}",
                      flush=True)
            us = do_bench(lambda: module.launch(device, *args), warmup=25, rep=200,
                          return_mode="median") * 1e3
        except Exception as e:
            print(f"{f}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        floor = nbytes / bw * 1e6
        rows.append({"file": str(f), "us": us, "floor_us": floor, "bytes": nbytes,
                     "title": text.splitlines()[0][len("# fusion-compiler: "):],
                     "ops": text.splitlines()[1][:90], "max_diff": diff})
        del args, out
    for r in sorted(rows, key=lambda r: -r["us"]):
        print(f"{r['us']:9.1f} us  floor {r['floor_us']:8.1f} ({100 * r['floor_us'] / r['us']:5.1f}%)"
              f"  {r['bytes'] / 1e6:8.1f} MB  {Path(r['file']).stem[:10]}  {r['title']}"
              f"  {r['ops'][len('# fused ops '):]}")
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_TBps": bw / 1e12, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
