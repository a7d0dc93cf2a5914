#!/usr/bin/env bash
# One device run: install, the whole test suite on the GPU, then the pattern benchmark.
#   bash benchmarks/gpu_check.sh   (writes logs and JSON under $OUT)
set -o pipefail
OUT=${OUT:-/tmp/fc-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation --no-index -q -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/patterns.py --out "$OUT/patterns.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v Warning
# the same through the CLI, with launches, compile times, memory and errors
[ -n "${CLI_BENCH:-}" ] && timeout ${BENCH_TIMEOUT:-240} fusion-compiler bench $CLI_BENCH -o "$OUT/cli_bench.json" 2>&1 | tee "$OUT/cli_bench.log" | tail -30
