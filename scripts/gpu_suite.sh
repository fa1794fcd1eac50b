#!/usr/bin/env bash
# The GPU tests, compute-sanitizer runs and benchmarks in one command on the H200 machine
# (docs/development.md describes every stage and the variables that shape them).
#   scripts/gpu_suite.sh [stage ...]   stages: env tests memcheck check bench-norms tune-norms
#   bench-attention-quick bench-attention attention-ab attention-bar bench-decode decode-probe bench-ce ce-jax
#   host-overhead profile-attention profile-decode profile-decode-sass bench-fused-block bench-mla
#   (default: env tests memcheck check bench-norms)
# Results and logs are written to a work folder and packed into $OUT/results.tgz after every stage and every
# 30 s while one runs, so a run cut short still returns what it wrote (the benchmarks save their JSON after
# every row). Without $OUT they stay in ./gpu-out. Wheels the machine lacks (jax-triton, liger-kernel) are
# installed from .whl/ when that folder holds any.
set -uo pipefail
PACK=${OUT:-}
export OUT=${PACK:+/tmp/fb-run}
OUT=${OUT:-$PWD/gpu-out}
# a fresh work folder per packed run (the machine's /tmp can outlive a run): the pack then holds this run's files only
[ -n "$PACK" ] && rm -rf "$OUT"
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests memcheck check bench-norms)
source "$(dirname "$0")/gpu_env.sh"
status=0
MEMCHECK=${MEMCHECK:-}  # NORMS_ARGS (e.g. --no-sweep), DECODE_ARGS (default --splits), ATTN_ARGS (e.g. --tune), CE_ARGS (e.g. --jax-sweep) pass options on
ATTN_DIMS=${ATTN_DIMS:-}
NCU_SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SourceCounters --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
pack() { [ -n "$PACK" ] && tar czf "$PACK/.results.tgz" -C "$OUT" . 2>/dev/null && mv -f "$PACK/.results.tgz" "$PACK/results.tgz"; }
if [ -n "$PACK" ]; then
  ( while sleep 30; do pack; done ) &
  packer=$!
  trap 'kill $packer 2>/dev/null' EXIT
fi
# SM / memory clocks, power and temperature every 500 ms while a timing stage runs (clocks_<stage>.csv), and
# the SM clock's range over the stage: timings differ between machines of the same kind
clocks_start() { sampler=""; case $1 in bench-*|attention-ab|attention-bar)
  command -v nvidia-smi >/dev/null && { nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader,nounits -lms 500 > "$OUT/clocks_$1.csv" 2>/dev/null & sampler=$!; } ;; esac; }
clocks_stop() { [ -n "$sampler" ] || return 0; kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  awk -F', ' '$2 > 0 { n++; s += $2; if (!lo || $2 < lo) lo = $2; if ($2 > hi) hi = $2 }
    END { if (n) printf "clocks during %s: SM %d-%d MHz (mean %.0f, %d samples)\n", stage, lo, hi, s / n, n }' \
    stage="$1" "$OUT/clocks_$1.csv"; }
for stage in "${stages[@]}"; do
  echo "=== $stage ($(date +%T))"
  clocks_start "$stage"
  case $stage in
    env) { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
           python3 -c 'import torch, triton, jax; print(torch.__version__, triton.__version__, jax.__version__, jax.devices())'; } 2>&1 | tee "$OUT/env.txt" ;;
    # PYTEST_EXTRA is split like a shell line: PYTEST_EXTRA="-k 'attention or cross'"
    tests) eval "extra=(${PYTEST_EXTRA:-})"
           python3 -m pytest tests -m gpu -q -p no:cacheprovider -n 4 --timeout 120 "${extra[@]}" 2>&1 | tee "$OUT/tests_gpu.log" | tail -40; status=$((status | PIPESTATUS[0])) ;;
    # MEMCHECK="norms decode" limits the families (default: all, and attention); MEMCHECK=attention runs
    # attention alone (tests/memcheck.py with no family named would run all of its own)
    memcheck) families=$(echo ${MEMCHECK//attention/})
              if [ -z "${MEMCHECK:-}" ] || [ -n "$families" ]; then
                compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/memcheck.py $families 2>&1 | tee "$OUT/memcheck.log" | tail -15; status=$((status | PIPESTATUS[0]))
              fi
              if [ -z "${MEMCHECK:-}" ] || [[ " $MEMCHECK " == *" attention "* ]]; then
                compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/test_attention_gpu.py 2>&1 | tee "$OUT/memcheck_attention.log" | tail -15; status=$((status | PIPESTATUS[0]))
              fi ;;
    check) python3 -m flashbridge check --json "$OUT/check.json" 2>&1 | tee "$OUT/check.log" | tail -60 ;;
    bench-norms) python3 benchmarks/bench_norms.py ${NORMS_ARGS:-} 2>&1 | tee "$OUT/bench_norms.log" | tail -80 ;;
    # FUSED_ARGS: e.g. --quick, --tune
    bench-fused-block) python3 benchmarks/bench_fused_block.py ${FUSED_ARGS:-} 2>&1 | tee "$OUT/bench_fused_block.log" | tail -60 ;;
    bench-decode) python3 benchmarks/bench_decode.py ${DECODE_ARGS---splits} 2>&1 | tee "$OUT/bench_decode.log" | tail -60 ;;
    bench-mla) python3 benchmarks/bench_mla.py ${MLA_ARGS:-} 2>&1 | tee "$OUT/bench_mla.log" | tail -60 ;;
    # the torch-only B=1 S=16k probe beside the library's decode step (PROBE_ARGS=--attribution: pointer variants only)
    decode-probe) python3 benchmarks/decode_tma_probe.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/decode_probe.log" | grep -v '^check' | tail -40 ;;
    bench-ce) python3 benchmarks/bench_cross_entropy.py ${CE_ARGS:-} 2>&1 | tee "$OUT/bench_cross_entropy.log" | tail -40 ;;
    # the JAX linear CE rows alone (and torch's default beside them), with XLA's optimized HLO of each
    ce-jax) python3 benchmarks/bench_cross_entropy.py --jax-only --jax-hlo "$OUT/hlo" ${CE_ARGS:-} 2>&1 | tee "$OUT/ce_jax.log" | tail -20 ;;
    # ATTN_DIMS=64,128 splits the full matrix across runs (one results file per split)
    bench-attention) python3 benchmarks/bench_attention.py ${ATTN_DIMS:+--dims $ATTN_DIMS} ${ATTN_ARGS:-} 2>&1 | tee "$OUT/bench_attention.log" | tail -60 ;;
    host-overhead) python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.log" | tail -30 ;;
    # defaults against one AttentionConfig setting, alternating in one process: ATTN_AB_CONFIG='{"dkdv_block_m": 32}',
    # ATTN_AB_DIMS=256 for other head dims (default 128,64 and GQA 32/8 at 128)
    attention-ab) python3 benchmarks/bench_attention.py --ab ${ATTN_AB:-4} ${ATTN_AB_CONFIG:+--ab-config "$ATTN_AB_CONFIG"} ${ATTN_AB_DIMS:+--ab-dims $ATTN_AB_DIMS} 2>&1 | tee "$OUT/attention_ab.log" | tail -30 ;;
    # the target rows (D=128, S=4096 / 16384, full and causal): ours / Flex / SDPA flash alternating
    # ATTN_BAR_REPS times in one process (~3 min at 5)
    attention-bar) python3 benchmarks/bench_attention.py --bar-rows ${ATTN_BAR_REPS:-5} 2>&1 | tee "$OUT/attention_bar.log" | tail -12 ;;
    bench-attention-quick) python3 benchmarks/bench_attention.py --quick 2>&1 | tee "$OUT/bench_attention.log" | tail -40 ;;
    # Nsight Compute on one backward of ours and of FlexAttention (PROFILE_ARGS, e.g. "--causal --d 64"), side by side
    profile-attention) for which in ours flex; do
                         ncu --clock-control none --profile-from-start off $NCU_SECTIONS --csv --page details \
                           python3 benchmarks/profile_attention_bwd.py --which $which ${PROFILE_ARGS:-} > "$OUT/ncu_bwd_$which.csv" 2> "$OUT/ncu_bwd_$which.err"
                         tail -3 "$OUT/ncu_bwd_$which.err"
                       done
                       python3 benchmarks/ncu_summary.py "$OUT/ncu_bwd_ours.csv" "$OUT/ncu_bwd_flex.csv" > "$OUT/ncu_bwd_summary.txt" 2>&1; tail -5 "$OUT/ncu_bwd_summary.txt" ;;
    # Nsight Compute on one decode step (bf16 S=16k, FP8 S=128k) and on the bare read of the S=16k bytes, side by side
    profile-decode) for case in ${PROFILE_DECODE:-bf16-s16k floor-s16k fp8-s128k}; do
                      ncu --clock-control none --profile-from-start off $NCU_SECTIONS --csv --page details \
                        python3 benchmarks/profile_decode.py --case $case > "$OUT/ncu_decode_$case.csv" 2> "$OUT/ncu_decode_$case.err"
                      tail -3 "$OUT/ncu_decode_$case.err"
                    done
                    python3 benchmarks/ncu_summary.py "$OUT"/ncu_decode_*.csv > "$OUT/ncu_decode_summary.txt" 2>&1; tail -5 "$OUT/ncu_decode_summary.txt" ;;
    # per-SASS-instruction counters (stall samples, executed instructions) of the split kernel: where a step's
    # cycles go, instruction by instruction (line info is on by default, so the source column is filled)
    profile-decode-sass) for case in ${PROFILE_DECODE:-fp8-s128k bf16-s16k}; do
                           ncu --clock-control none --profile-from-start off -k regex:decode_fwd --section SourceCounters \
                             --section WarpStateStats --import-source yes --page source --print-source sass --csv \
                             python3 benchmarks/profile_decode.py --case $case > "$OUT/ncu_sass_$case.csv" 2> "$OUT/ncu_sass_$case.err"
                           tail -3 "$OUT/ncu_sass_$case.err"
                         done
                         (cd "$OUT" && python3 "$OLDPWD/benchmarks/ncu_sass_summary.py" ncu_sass_*.csv > ncu_sass_summary.txt 2>&1)
                         head -40 "$OUT/ncu_sass_summary.txt" ;;
    tune-norms) python3 benchmarks/bench_norms.py --tune --no-sweep 2>&1 | tee "$OUT/tune_norms.log" | tail -120 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
  clocks_stop "$stage"
  pack
done
exit $status
