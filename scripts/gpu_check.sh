#!/usr/bin/env bash
# The H200 workflow (no package registry there): build with CUDA against the
# installed jax, run the whole test suite on the GPU with GPU skips turned into
# failures, then the benchmarks. Logs and BENCHMARKS.* go to $OUT (or ./gpu_out).
#   scripts/gpu_check.sh [--no-build] [--no-tests] [--tests "PYTEST TARGETS"] [--no-bench]
#                        [--sanitize] [--ncu] [-- bench args]
# --tests runs those targets instead of the whole suite (a branch's own tests); --ncu times
# the select-path kernels under Nsight Compute (bench/kernel_times.py) into ncu.txt;
# --no-build reuses the install of an earlier call on the same (warm) machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
# pytest-xdist workers share the GPU: without this each one takes 75% of its memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
build=1 tests=1 bench=1 sanitize=0 ncu=0 targets=tests
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;; --no-tests) tests=0 ;; --no-bench) bench=0 ;;
    --sanitize) sanitize=1 ;; --ncu) ncu=1 ;;
    --tests) shift; targets="$1" ;;
    --) shift; break ;; *) echo "unknown option $1"; exit 2 ;;
  esac
  shift
done
status=0
# gpu_pytest and sanitize; R: where sanitize writes its logs.
start=$(date +%s) R="$out"
source gpu_runs/lib.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$build" = 1 ]; then
  GLM5_JAX_ENABLE_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
fi
python3 -m glm5_jax.info || exit 1
if [ "$tests" = 1 ]; then
  gpu_pytest "$out/pytest.log" "${GLM5_JAX_TEST_SECONDS:-560}" $targets || status=1
fi
if [ "$sanitize" = 1 ]; then
  # scripts/sanitize_kernels.py, not the test suite: compute-sanitizer crashes
  # (segfault) inside pytest runs that execute XLA's reference programs. Every kernel's
  # cases, no time limit, into $out/{memcheck,racecheck}_all.log (gpu_runs/lib.sh).
  sanitize all 1000000 || status=1
fi
if [ "$ncu" = 1 ]; then
  ncu --csv --metrics gpu__time_duration.sum --cache-control all --clock-control none \
    -k regex:'mqa_logits.*kernel|pool_topk.*kernel' python3 -m bench.kernel_times \
    > "$out/ncu.csv" 2> "$out/ncu.err"
  python3 -m bench.kernel_times --parse "$out/ncu.csv" | tee "$out/ncu.txt"
fi
if [ "$bench" = 1 ]; then
  python3 -m bench --out BENCHMARKS.json --md BENCHMARKS.md "$@" 2>&1 \
    | tee "$out/bench.log" | tail -60
  cp BENCHMARKS.json BENCHMARKS.md bench/benchmarks.png "$out"/ 2>/dev/null
fi
# The device tool returns at most 8 files from $OUT: one archive of the logs as well.
tar -czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
exit $status
