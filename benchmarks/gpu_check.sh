#!/usr/bin/env bash
# One device run: install, the whole test suite on the GPU, then the pattern benchmark.
#   bash benchmarks/gpu_check.sh   (writes logs and JSON under $OUT)
# The suite runs on 8 workers (pytest-xdist, on the device image) with a per-test timeout, and
# `-rfE` so the failures are named even if the run is cut: a log without its summary tells
# nothing (the 2026-11-29 final run lost its failures that way).
set -o pipefail
OUT=${OUT:-/tmp/fc-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation --no-index -q -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -n ${WORKERS:-8} -q -p no:cacheprovider tests -rfE \
    --timeout=${PER_TEST_TIMEOUT:-120} --tb=short ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed" | tail -60
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/patterns.py --out "$OUT/patterns.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v Warning
# the same through the CLI, with launches, compile times, memory and errors
[ -n "${CLI_BENCH:-}" ] && timeout ${BENCH_TIMEOUT:-240} fusion-compiler bench $CLI_BENCH -o "$OUT/cli_bench.json" 2>&1 | tee "$OUT/cli_bench.log" | tail -30
