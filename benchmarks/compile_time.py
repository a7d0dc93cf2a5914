"""Compile time of a model's first call, each run in a fresh process: cold caches, then warm.

    python benchmarks/compile_time.py examples/llama.py:bench_4x1024 examples/gpt2.py:bench_8x512
    python benchmarks/compile_time.py examples/llama.py:bench_4x1024 --compile-threads 0 8
    python benchmarks/compile_time.py examples/bert.py:bench_16x256 --no-inductor \
        --profile-cold 60 --sample        # where the cold compile's main thread spends its time
    python benchmarks/compile_time.py examples/gpt2.py:bench_8x512 --repeat 3
    python benchmarks/compile_time.py examples/llama.py:bench_1x128 --repeat 5 --no-inductor \
        --against /path/to/other/checkout      # A/B: both versions' cold compiles, interleaved

For each target, in this order, each in its own Python process (so nothing is cached in memory):
  aot_eager          Dynamo + aot_autograd, no compiler: what every backend pays before its own work
  inductor cold      torch.compile's default, empty Inductor and Triton caches
  inductor warm      the same caches, a second process
  fusion cold        empty kernel, decision and Triton caches
  fusion warm        the same caches, a second process
Each row is the first call's wall time (inputs built and the GPU synchronized before the clock
starts). The columns:
  backend s       that time minus aot_eager's: the compiler's own share, Triton's compilation
                  or loading of its kernels included. A difference of two processes' first
                  calls: it carries their noise (aot_eager's own first call moved 2.7-5.5 s
                  between machines), so it is read beside the next two
  in backend s    time inside the backend callable (Dynamo's OutputGraph.call_user_compiler
                  metric): aot_autograd's tracing and the compiler, not Dynamo's tracing
  own s           in backend s minus aot_eager's: the compiler alone, measured inside each
                  process (work a backend leaves to its first launches is not in it: see
                  after s)
  after s         the first call's time outside Dynamo's compile (its _compile.compile_inner
                  metric): running the graph once, with whatever loading its first launches do
  passes s        (fusion) the time in the backend's passes, from the compile reports;
                  it includes compiling the Triton kernels, which the generate pass does on
                  threads (codegen/precompile.py; ``--compile-threads 0`` leaves that to the
                  first launches, outside this column)
  of which        (fusion) the passes' phases, from the reports: analyze (the fusion
                  decisions), sources (kernel modules written or loaded; each kernel starts
                  compiling as its module is ready), triton (the wait for Triton's compiles or
                  cache loads, on the compile threads and in the compile workers, after the
                  graph was partitioned and made ready meanwhile: codegen/precompile.py,
                  compile_pool.py), autotune (timing launch settings, or
                  loading the stored choices; 0 when autotuning is off, as by default:
                  ``--autotune K`` adds runs with it on); "(workers: N of M)": N of the M
                  Triton kernels compiled at compile time were compiled by worker processes
With ``--repeat N`` (N > 1), N - 1 more rounds follow: an aot_eager process, then a fusion cold
one on empty caches of its own and a fusion warm one on those caches; a last line per target
gives the medians of the N aot_eager, N fusion cold and N fusion warm "in backend" times, the
cold one less the aot_eager one (own, median) and its ratio to Inductor's own: one aot_eager process's noise no longer decides the ratio (session 34: a GPT-2
reading of 0.28 came from an aot_eager process 0.5-0.7 s faster than two others).
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json, sys, time, torch
from fusion_compiler.targets import load_factory
import fusion_compiler
target, backend = sys.argv[1], sys.argv[2]
model, inputs = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
profiler = sampler = None
if len(sys.argv) > 4:
    # the main thread alone, sampled: cProfile (built on sys.monitoring from Python 3.12)
    # also records the compile threads, whose time overlaps the main thread's
    import collections, threading
    main, stop = threading.main_thread().ident, threading.Event()
    leaf, inclusive, samples = collections.Counter(), collections.Counter(), [0]

    def where(code):
        return "/".join(code.co_filename.split("/")[-2:]) + ":" + code.co_name

    def sample():
        while not stop.wait(0.002):
            frame, seen = sys._current_frames().get(main), set()
            samples[0] += 1
            if frame is not None:
                leaf[where(frame.f_code)] += 1
            while frame is not None:
                seen.add(where(frame.f_code))
                frame = frame.f_back
            inclusive.update(seen)
    sampler = threading.Thread(target=sample, daemon=True)
elif len(sys.argv) > 3:
    import cProfile
    profiler = cProfile.Profile()
with fusion_compiler.capture_compiles() as reports, torch.no_grad():
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    if sampler:
        sampler.start()
    torch.compile(model, backend=backend)(*inputs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
if profiler:
    import pstats
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(int(sys.argv[3]))
if sampler:
    stop.set()
    sampler.join()
    per = seconds / max(samples[0], 1)
    for title, counts in (("main thread, inclusive", inclusive), ("main thread, self", leaf)):
        print(f"{title} (s, {samples[0]} samples of the first call's {seconds:.2f} s):")
        for name, n in counts.most_common(int(sys.argv[3])):
            print(f"  {n * per:7.3f}  {name}")
from torch._dynamo.utils import compilation_time_metrics as metrics
phases = {}
for r in reports:
    for k, v in r.phase_seconds.items():
        phases[k] = phases.get(k, 0.0) + v
tuned = [k["tuned"] for r in reports for k in r.kernels if "tuned" in k]
print(json.dumps({"seconds": seconds, "passes": sum(r.compile_seconds for r in reports),
                  "phases": phases, "tuned": len(tuned),
                  "by_workers": [sum(getattr(r, "kernels_by_workers", (0, 0))[i] for r in reports)
                                 for i in (0, 1)],
                  "retuned": sum(t["settings"] != t["rule"] for t in tuned),
                  "in_backend": sum(metrics.get("OutputGraph.call_user_compiler", [])),
                  "dynamo": sum(metrics.get("_compile.compile_inner", []))}))
'''


def first_call(target: str, backend: str, env: dict, profile: int = 0,
               sample: bool = False, cwd: str | None = None) -> dict:
    """The child's result; with ``profile`` it runs under cProfile (``sample``: its main thread
    sampled every 2 ms instead) and its ``profile`` costliest functions are printed first.
    ``cwd``: where it runs (its ``fusion_compiler`` package is the one there, if any)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, target, backend]
                          + ([str(profile)] if profile else [])
                          + (["sample"] if profile and sample else []), env=env,
                          capture_output=True, text=True, timeout=600, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{target} with {backend} failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.strip().splitlines()
    if profile:
        print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


HEADER = (f"{'target':34s} {'run':15s} {'first call s':>12s} {'backend s':>10s} "
          f"{'in backend s':>12s} {'own s':>6s} {'after s':>8s} {'passes s':>9s}  "
          f"of which: analyze / sources / triton / autotune")


def show(r: dict) -> None:
    def f(key):
        return f"{r[key]:.2f}" if r.get(key) is not None else "-"
    print(f"{r['target']:34s} {r['run']:15s} {r['seconds']:12.2f} {f('backend_seconds'):>10s} "
          f"{f('in_backend'):>12s} {f('own_seconds'):>6s} {f('after_compile'):>8s} "
          f"{f('passes_seconds'):>9s}  {r.get('phases', '')}", flush=True)


def flat_copy(checkout: str, into: str) -> str:
    """``checkout``'s package (fusion_compiler/, passes/, codegen/ at its top, as here) as one
    directory tree under ``into``, importable without installing it; returns ``into``."""
    import shutil
    package = Path(into) / "fusion_compiler"
    shutil.copytree(Path(checkout) / "fusion_compiler", package)
    for sub in ("passes", "codegen"):
        shutil.copytree(Path(checkout) / sub, package / sub)
    return into


def measure(target: str, threads=(None,), inductor=True, profile=0,
            profile_run="warm", autotune=0, sample=False, repeat=1,
            against: str | None = None) -> list[dict]:
    """The rows of one target, each printed as soon as it is measured."""
    rows = []
    if against is not None:
        path, _, name = target.partition(":")
        target = f"{Path(path).resolve()}:{name}"       # the other package's child runs there
    with tempfile.TemporaryDirectory() as tmp:
        other = flat_copy(against, f"{tmp}/against") if against is not None else None
        def env(name):
            e = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/{name}/triton",
                     TORCHINDUCTOR_CACHE_DIR=f"{tmp}/{name}/inductor",
                     FUSION_COMPILER_CACHE_DIR=f"{tmp}/{name}/fusion")
            return e
        aot = first_call(target, "aot_eager", env("aot"))
        base = aot["seconds"]
        rows.append({"target": target, "run": "aot_eager", "seconds": base,
                     "in_backend": aot["in_backend"],
                     "after_compile": aot["seconds"] - aot["dynamo"]})
        show(rows[-1])
        runs = [("inductor", "inductor", {})] if inductor else []
        runs += [("fusion", "fusion" if t is None else f"fusion t={t}",
                  {} if t is None else {"FUSION_COMPILER_COMPILE_THREADS": str(t)})
                 for t in threads]
        if autotune:
            runs.append(("fusion", f"fusion tune={autotune}",
                         {"FUSION_COMPILER_AUTOTUNE": str(autotune)}))
        if other:
            runs.append(("fusion", "against", {}))
        for backend, name, extra in runs:
            for run in ("cold", "warm"):
                r = first_call(target, backend, dict(env(name), **extra),
                               profile if backend == "fusion" and run == profile_run else 0,
                               sample, other if name == "against" else None)
                rows.append({"target": target, "run": f"{name} {run}", "seconds": r["seconds"],
                             "backend_seconds": r["seconds"] - base,
                             "in_backend": r["in_backend"],
                             "own_seconds": r["in_backend"] - aot["in_backend"],
                             "after_compile": r["seconds"] - r["dynamo"],
                             "passes_seconds": r["passes"] if backend == "fusion" else None,
                             "phases": " / ".join(f"{r['phases'].get(k, 0):.2f}" for k in
                                                  ("analyze", "sources", "triton", "autotune"))
                             + (f" (tuned {r['tuned']}, {r['retuned']} off the rule)"
                                if r["tuned"] else "")
                             + (" (workers: {} of {})".format(*r["by_workers"])
                                if r.get("by_workers", [0])[0] else "")
                             if backend == "fusion" else ""})
                show(rows[-1])
        for i in range(1, repeat):
            again = first_call(target, "aot_eager", env(f"aot{i}"))
            rows.append({"target": target, "run": f"aot_eager {i + 1}", "seconds": again["seconds"],
                         "in_backend": again["in_backend"],
                         "after_compile": again["seconds"] - again["dynamo"]})
            show(rows[-1])
            for name, run, cwd in [("fusion", "cold", None)] + (
                    [("against", "cold", other)] if other else []) + [("fusion", "warm", None)]:
                r = first_call(target, "fusion", env(f"{name}{i}"), cwd=cwd)
                rows.append({"target": target, "run": f"{name} {run} {i + 1}",
                             "seconds": r["seconds"], "in_backend": r["in_backend"],
                             "own_seconds": r["in_backend"] - again["in_backend"],
                             "passes_seconds": r["passes"]})
                show(rows[-1])
        if repeat > 1:
            rows.append(medians(target, rows))
            print(f"{target:34s} median of {repeat}: {json.dumps(rows[-1]['medians'])}", flush=True)
    return rows


def medians(target: str, rows: list[dict]) -> dict:
    """The median aot_eager and fusion cold in-backend times of ``rows``, own as their
    difference, and own against Inductor's (one cold process)."""
    def median(run):
        v = sorted(r["in_backend"] for r in rows
                   if r["run"] == run or r["run"].removeprefix(run + " ").isdigit())
        return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    aot, fusion = median("aot_eager"), median("fusion cold")
    out = {"aot_eager in backend": round(aot, 3), "fusion cold in backend": round(fusion, 3),
           "fusion own": round(fusion - aot, 3),
           "fusion warm in backend": round(median("fusion warm"), 3)}
    if any(r["run"].startswith("against cold") for r in rows):
        out["against cold in backend"] = round(median("against cold"), 3)
        out["against own"] = round(median("against cold") - aot, 3)
    inductor = [r["own_seconds"] for r in rows if r["run"] == "inductor cold"]
    if inductor:
        out["inductor own"] = round(inductor[0], 3)
        out["own / inductor own"] = round((fusion - aot) / inductor[0], 3)
    return {"target": target, "run": "medians", "medians": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+")
    parser.add_argument("-o", "--output", help="also write the rows as JSON")
    parser.add_argument("--compile-threads", type=int, nargs="+", default=[None],
                        help="fusion runs with these FUSION_COMPILER_COMPILE_THREADS values "
                             "(default: the configured one)")
    parser.add_argument("--no-inductor", action="store_true",
                        help="skip Inductor's runs (when they were measured in another run)")
    parser.add_argument("--profile-warm", type=int, default=0, metavar="N",
                        help="run fusion's warm first call under cProfile and print its N "
                             "costliest functions (the timing of that row includes cProfile)")
    parser.add_argument("--profile-cold", type=int, default=0, metavar="N",
                        help="the same for fusion's cold first call (instead of the warm one)")
    parser.add_argument("--sample", action="store_true",
                        help="with --profile-cold/--profile-warm: sample the main thread every "
                             "2 ms instead of cProfile, which on Python 3.12+ also records the "
                             "compile threads")
    parser.add_argument("--autotune", type=int, default=0, metavar="K",
                        help="also run fusion with FUSION_COMPILER_AUTOTUNE=K (cold: the tuning "
                             "is timed; warm: its stored choices are loaded)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="N rounds of aot_eager, fusion cold and fusion warm processes in "
                             "all; a last line gives their medians and the ratio from them")
    parser.add_argument("--against", metavar="DIR",
                        help="also time the fusion package of the checkout at DIR, cold, in "
                             "each round (after this code's cold process): an A/B of two "
                             "versions under the same host's noise")
    args = parser.parse_args()
    print(HEADER, flush=True)
    rows = [row for t in args.targets
            for row in measure(t, args.compile_threads, not args.no_inductor,
                               args.profile_cold or args.profile_warm,
                               "cold" if args.profile_cold else "warm", args.autotune,
                               args.sample, args.repeat, args.against)]
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
