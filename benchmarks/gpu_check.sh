#!/usr/bin/env bash
# One device run: install, the GPU suite, the patterns (small sizes first), the models, and
# optionally compile time. Everything it prints goes to one log, $OUT/all.log, and each step's
# JSON beside it: a device call returns at most 8 files (session 13 lost two logs to that).
#   bash benchmarks/gpu_check.sh
#   STEPS="suite small patterns models compile costmodel" \
#       COMPILE_TARGETS="examples/bert.py:bench_16x256" bash benchmarks/gpu_check.sh
# Steps:
#   suite      the GPU test suite
#   small      every pattern at 1, 64 and 512 rows (softmax: 1, 4096 and 32768 rows of 1024, the
#              last two patterns.py's 64 and 512) by benchmarks/time_split.py: do_bench medians, the
#              kernels' own time and the time per call back to back (do_bench alone cannot rank
#              cases this small: its event timer moves in steps of about 0.5 us, BENCHMARKS.md)
#   patterns   patterns at 16384 rows
#   variants   benchmarks/variants.py with $VARIANTS_ARGS (time limit $VARIANTS_LIMIT s, 150)
#   models     `bench` on $MODELS, with $BENCH_ARGS (e.g. "--rounds 15"; time limit $MODELS_LIMIT s,
#              240)
#   zoo        `bench` on $ZOO (benchmarks/hf_zoo.py's architectures; about 70 s each)
#   tiles      `bench $TILES_TARGET --mode training` (Mamba2 8 x 1024 at 4 x 1024) with pointwise
#              tiles and with FUSION_COMPILER_TILES=0, each in its own cache (about 60 s each)
#   ab         `bench $AB_TARGETS` (with $AB_ARGS) at this tree and at $AB_TAR (a `git archive REV`
#              of an earlier commit, in the tree), each in its own cache; then each cache's
#              kernels of at least $AB_MIN_MB MB (100) timed alone (benchmarks/kernel_files.py),
#              and those files in $OUT/ab_kernels.tgz
#   rowtiles   benchmarks/row_tiles.py (tiles of rows and warps for Mamba2's segment sums)
#   strided    benchmarks/strided_rows.py (strided-row settings at ConvNeXt-T's stages)
#   memory     benchmarks/peak_memory.py on each of $MEMORY_TARGETS: static peaks and measured
#              max_memory_allocated for eager, fusion and Inductor (about 60 s each)
#   compile    compile_time.py on $COMPILE_TARGETS, with $COMPILE_ARGS (time limit $COMPILE_LIMIT s
#              a target, 150)
#   profile    where fusion's cold compile of $PROFILE_TARGET spends its main thread's time
#   costmodel  `calibrate`, then `dump --measure` of each of $MODELS (the measured tables in the
#              log; the GPU's clock and a host-speed probe in $OUT/probe.log)
# Each step has its own time limit. Output reaches the log line by line (python -u, grep
# --line-buffered), so a step cut by its limit still shows what it printed (session 13 lost a
# compile-time table that sat in a pipe's buffer). The suite runs on 12 workers with a per-test
# timeout and `-rfE`, so failures are named even if the run is cut; its whole output goes to
# $OUT/suite.log (on 8 workers and a 240 s limit it was cut with nothing printed, session 45:
# 12 workers took 180 s).
# Small sizes run before anything else: timed after the 16384-row cases in the same process,
# their rounds disagreed by up to 8x for every backend (session 13, calls 1 and 3).
# Compile time runs with the site-packages compiled to .pyc first (PYTHONPYCACHEPREFIX): a
# normal install has them, the device image does not, and compiling modules from source
# during a cold compile (0.48 s for Llama 1 x 128, session 12) is not the backend's cost.
set -o pipefail
OUT=${OUT:-/tmp/fc-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/all.log"
STEPS=${STEPS:-"suite small patterns models"}
MODELS=${MODELS:-"examples/llama.py:bench_1x128 examples/llama.py:bench_4x1024 examples/gpt2.py:bench_8x512 examples/bert.py:bench_16x256"}
COMPILE_TARGETS=${COMPILE_TARGETS:-"examples/llama.py:bench_1x128"}
PROFILE_TARGET=${PROFILE_TARGET:-"examples/bert.py:bench_16x256"}
Z=benchmarks/hf_zoo.py
MEMORY_TARGETS=${MEMORY_TARGETS:-"$Z:convnext_tiny_32 $Z:t5_base_16x256 $Z:bloom_8x512"}
TILES_TARGET=${TILES_TARGET:-"$Z:mamba2_4x1024"}
AB_TARGETS=${AB_TARGETS:-$TILES_TARGET}
AB_ARGS=${AB_ARGS:-"--mode training --compare fusion --rounds 3"}
ZOO=${ZOO:-"$Z:qwen3_4x1024 $Z:bart_base_16x256 $Z:gemma2_4x512 $Z:convnext_tiny_32 $Z:swin_tiny_32"}

step() {    # step NAME SECONDS COMMAND: the command's output into the log, with its rc and time
    local name=$1 limit=$2; shift 2
    local start=$(date +%s)
    echo "===== $name: $*" >> "$LOG"
    timeout "$limit" bash -c "$*" >> "$LOG" 2>&1
    echo "===== $name rc=$? $(( $(date +%s) - start ))s" >> "$LOG"
}
quiet="grep --line-buffered -v -e Warning -e 'warn(' -e 'warner('"

[ -n "$NO_INSTALL" ] || python3 -m pip install --no-deps --no-build-isolation --no-index -q -e . >> "$LOG" 2>&1
{ git log --oneline -1; git status --short;
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; } >> "$LOG" 2>&1
for s in $STEPS; do
    case $s in
    suite) step suite ${SUITE_LIMIT:-420} "python3 -m pytest -n ${WORKERS:-12} -q -p no:cacheprovider \
        tests -rfE --timeout=120 --tb=short -p no:warnings --durations=15 ${PYTEST_ARGS:-} 2>&1 \
        | $quiet > $OUT/suite.log; tail -60 $OUT/suite.log" ;;
    small) cases=""
        for p in add_rmsnorm add_layernorm rmsnorm_fp8 rmsnorm_dynamic_fp8 dequant_add; do
            for r in 1 64 512; do cases="$cases $p:$r:4096"; done; done
        for p in swiglu bias_gelu; do for r in 1 64 512; do cases="$cases $p:$r:11008"; done; done
        cases="$cases softmax_scale:1:1024 softmax_scale:4096:1024 softmax_scale:32768:1024"
        step small 330 "python3 benchmarks/time_split.py --rounds 5 --cases $cases \
        --out $OUT/split_small.json 2>&1 | $quiet" ;;
    patterns) step patterns 120 "python3 benchmarks/patterns.py --rows 16384 \
        --out $OUT/patterns.json 2>&1 | $quiet" ;;
    variants) step variants ${VARIANTS_LIMIT:-150} "python3 benchmarks/variants.py --rounds 3 --out /tmp/variants \
        ${VARIANTS_ARGS:-} 2>&1 | $quiet" ;;
    models) step models ${MODELS_LIMIT:-240} "fusion-compiler bench $MODELS --compare eager,inductor,fusion \
        ${BENCH_ARGS:-} -o $OUT/models.json 2>&1 | $quiet" ;;
    zoo) step zoo $(( 90 * $(echo $ZOO | wc -w) )) "fusion-compiler bench $ZOO \
        --compare eager,inductor,fusion -o $OUT/zoo.json 2>&1 | $quiet" ;;
    memory) for t in $MEMORY_TARGETS; do
            step memory 120 "python3 benchmarks/peak_memory.py $t 2>&1 | $quiet"; done ;;
    tiles) for v in 1 0; do     # $TILES_TARGET's step with 2-d tiles (1) and without (0)
            step "tiles=$v" 200 "FUSION_COMPILER_TILES=$v FUSION_COMPILER_CACHE_DIR=/tmp/fc-tiles$v \
                fusion-compiler bench $TILES_TARGET --mode training --compare fusion --rounds 3 \
                -o $OUT/tiles$v.json 2>&1 | $quiet"; done ;;
    ab) # the earlier commit's package in /tmp/ab-old, with codegen/ and passes/ linked inside
        # it: the editable install maps fusion_compiler.codegen and .passes to this tree's
        # folders, and would serve them to the earlier fusion_compiler (sessions 66-67's
        # comparisons so ran this tree's code twice)
        rm -rf /tmp/ab-old && mkdir -p /tmp/ab-old && tar -xf "$AB_TAR" -C /tmp/ab-old
        ln -s ../codegen /tmp/ab-old/fusion_compiler/codegen
        ln -s ../passes /tmp/ab-old/fusion_compiler/passes
        here=$PWD
        step "ab old" 300 "cd /tmp/ab-old && PYTHONPATH=/tmp/ab-old python3 -c \"import \
            fusion_compiler.codegen as c, fusion_compiler.passes as p; \
            assert c.__file__.startswith('/tmp/ab-old') and p.__file__.startswith('/tmp/ab-old')\" \
            && PYTHONPATH=/tmp/ab-old FUSION_COMPILER_CACHE_DIR=/tmp/fc-ab-old fusion-compiler \
            bench $AB_TARGETS $AB_ARGS -o $OUT/ab_old.json 2>&1 | $quiet"
        step "ab new" 300 "cd $here && FUSION_COMPILER_CACHE_DIR=/tmp/fc-ab-new fusion-compiler \
            bench $AB_TARGETS $AB_ARGS -o $OUT/ab_new.json 2>&1 | $quiet"
        # each cache's big kernels alone (both through this tree's launch helpers), so that a
        # change of the step's time is found in its kernels without another call
        for side in old new; do
            step "ab kernels $side" 150 "python3 benchmarks/kernel_files.py /tmp/fc-ab-$side \
                --min-mb ${AB_MIN_MB:-100} --out $OUT/ab_kernels_$side.json 2>&1 | $quiet"
        done
        # and those kernel files themselves, to edit and time again (kernel_files.py
        # --reference): the CPU's dump of a model need not make the GPU run's kernels
        python3 -c "import json, tarfile
with tarfile.open('$OUT/ab_kernels.tgz', 'w:gz') as t:
    for side in ('old', 'new'):
        for k in json.load(open(f'$OUT/ab_kernels_{side}.json'))['kernels']:
            t.add(k['file'])" >> "$LOG" 2>&1 ;;
    rowtiles) step rowtiles 300 "python3 benchmarks/row_tiles.py --out $OUT/row_tiles.json 2>&1 \
        | $quiet" ;;
    strided) step strided 200 "python3 benchmarks/strided_rows.py --out $OUT/strided.json 2>&1 \
        | $quiet" ;;
    compile|profile)
        if [ -z "$PYTHONPYCACHEPREFIX" ]; then
            export PYTHONPYCACHEPREFIX=/tmp/pyc
            sp=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
            std=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
            # the whole site-packages: with only torch, triton, transformers, sympy and networkx
            # compiled, a GPT-2 training process compiled 1570 modules from source (sessions
            # 33-34); with all of it, a warm GPT-2 inference compile still compiled 25 files
            # (0.10-0.15 s, session 35; which ones was not recorded there). The same setup on
            # the CPU compiled 6 kernel modules and two standard library modules, whose .pyc
            # files are not under the prefix; so the standard library is compiled too
            step pyc 120 "python3 -m compileall -q -j 16 $sp $std . > /dev/null; du -sh /tmp/pyc"
        fi
        if [ $s = compile ]; then
            # 150 s a target; --repeat N adds about 35 s a target for each further round
            step compile $(( ${COMPILE_LIMIT:-150} * $(echo $COMPILE_TARGETS | wc -w) )) "python3 \
                benchmarks/compile_time.py $COMPILE_TARGETS ${COMPILE_ARGS:-} \
                -o $OUT/compile.json 2>&1 | $quiet"
        else
            step profile 120 "python3 benchmarks/compile_time.py $PROFILE_TARGET --no-inductor \
                --profile-cold 50 --sample 2>&1 | $quiet"
        fi ;;
    costmodel)
        # beside it, once a second: the GPU's SM clock and how long a fixed piece of pure
        # Python takes on this host (both into $OUT/probe.log), to tell a drift of either from
        # an error of the cost model
        nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu --format=csv,noheader \
            -lms 1000 >> "$OUT/probe.log" 2>&1 &
        smi=$!
        python3 -c "
import time
while True:
    t = time.perf_counter(); sum(i * i for i in range(200000))
    print(time.strftime('%H:%M:%S'), 'python probe ms', round(1e3 * (time.perf_counter() - t), 2), flush=True)
    time.sleep(1)" >> "$OUT/probe.log" 2>&1 &
        probe=$!
        step calibrate 60 "fusion-compiler calibrate 2>&1 | $quiet"
        for m in $MODELS; do
            name=$(echo "$m" | sed 's|.*/||; s|\.py:|_|')
            step "measure $name" 150 "date +%H:%M:%S; fusion-compiler dump $m --device cuda \
                --measure -o /tmp/measure_$name.txt 2>&1 | $quiet; sed -n '/^measured vs/,\$p' \
                /tmp/measure_$name.txt; date +%H:%M:%S"
        done
        kill $smi $probe ;;
    esac
done
grep "^=====" "$LOG"
