#!/usr/bin/env bash
# Variants against main on one machine: bash gpu_runs/run_ab.sh main NAME... Each variant
# (the cc/, glm5_jax/, tests/ and bench/ parts of gpu_runs/variants/NAME.patch over main's
# files: gpu_runs/variants.sh; main: the tree) is built and timed (stage, kernels only: MTP
# 16x4 at 32K, M 1/16/64 at 32K and 202,752); TESTS="NAME.." also runs those variants' GPU
# tests (GPU_TESTS, default those of the select path, holes in select_slots' block tables
# included) with GPU skips as failures and the sanitizer's cases (TOOLS, default memcheck
# racecheck; OPS, default mqa_logits select_pools pool_topk); BENCH=0 skips the timing;
# CONTEXTS (default 32768,202752) and ROWS (default 1,16,64) the stage rows' shapes.
# Every variant's sources are extracted with fresh times, so each is rebuilt. Results:
# $OUT/ab.tgz.
# Expected: tests pass, 0 errors / 0 hazards; main on an H100: MTP ~37.4, M=1 / 16 / 64 at
# 32K: 22.9-23.0 / 30.6-30.7 / 53.2-53.4, at 202,752: 27.0-27.4 / 67.4-67.6 / 200-201 µs per
# layer.
set -uo pipefail
start=$(date +%s); R=/tmp/ab; mkdir -p $R; trap 'tar -C /tmp -czf $OUT/ab.tgz ab' EXIT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/lib.sh
tar -czf /tmp/main_src.tgz --exclude=bench/.jax_cache --exclude=__pycache__ cc glm5_jax tests bench
for v in "$@"; do
  tar -mxzf /tmp/main_src.tgz
  if [ "$v" != main ]; then
    git apply --include='cc/*' --include='glm5_jax/*' --include='tests/*' --include='bench/*' \
      gpu_runs/variants/$v.patch || { echo "$v: the patch does not apply"; continue; }
  fi
  source gpu_runs/build.sh > $R/build_$v.log 2>&1 || { echo "$v build failed"; tail -20 $R/build_$v.log; continue; }
  echo "== $v built at $(el)"
  if [[ " ${TESTS:-} " == *" $v "* ]]; then
    gpu_pytest $R/tests_$v.log 200 ${GPU_TESTS:-tests/test_select_gpu.py \
      tests/test_stage_gpu.py tests/test_wide_gpu.py tests/test_topk_chunks.py \
      tests/test_values.py::test_select_slots_kernel_closes_holes}
    echo "tests rc $? at $(el)"
    sanitize $v 170 ${OPS:-mqa_logits select_pools pool_topk}
  fi
  [ "${BENCH:-1}" = 0 ] && continue
  bench_row ${v}_mtp 50 --skip-variants reference --groups stage --stage-contexts 32768 --stage-rows 64 --stage-next-n 4
  bench_row ${v}_rows 95 --skip-variants reference --groups stage --stage-contexts ${CONTEXTS:-32768,202752} --stage-rows ${ROWS:-1,16,64}
done
tar -mxzf /tmp/main_src.tgz
