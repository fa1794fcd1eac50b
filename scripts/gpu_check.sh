#!/usr/bin/env bash
# A bounded GPU pass over what a change touched: the GPU tests of the named files, then named benchmarks,
# each under its own time limit, logs and JSON under $OUT (or ./gpu-out).
#   scripts/gpu_check.sh "tests/test_a_gpu.py tests/test_b_gpu.py" "host_overhead.py:150 bench_mla.py:200"
# (benchmark arguments after the limit: "bench_fused_block.py:90:--only rope"); everything lands in
# $OUT/results.tgz
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; export OUT; mkdir -p "$OUT"
# the device tool returns at most 8 files: everything written under $OUT travels back as one archive
trap 'tar czf /tmp/gpu-results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu-results.tgz "$OUT/results.tgz"' EXIT
source "$(dirname "$0")/gpu_env.sh"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/env.txt"
if [ -n "${1:-}" ]; then
  echo "=== tests ($(date +%T))"
  timeout "${TEST_LIMIT:-240}" python3 -m pytest -m gpu -v -rfE -n "${TEST_WORKERS:-4}" -p no:cacheprovider --timeout 120 $1 \
    > "$OUT/tests_gpu.log" 2>&1; rc=$?; tail -25 "$OUT/tests_gpu.log"; status=$((status | rc))
fi
for item in ${2:-}; do
  IFS=: read -r script limit args <<< "$item"
  echo "=== $script ($(date +%T), limit ${limit}s)"
  timeout "$limit" python3 "benchmarks/$script" ${args//,/ } > "$OUT/${script%.py}.log" 2>&1; rc=$?
  tail -30 "$OUT/${script%.py}.log"; [ $rc -ne 0 ] && echo "exit $rc" && status=$((status | 1))
done
exit $status
