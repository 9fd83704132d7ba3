#!/usr/bin/env bash
# Branch logits-unit-batch: an MTP unit's rows' wgmma chains issued together (score_unit).
# 1. the branch: its tests (MTP cases, select/stage GPU tests) with GPU skips as failures, the
#    sanitizer's select_pools cases (MTP units included); the MTP stage row and the op rows;
#    a timeline of the MTP step;
# 2. main's select_logits.cuh (gpu_runs/base/) rebuilt: the same rows, same machine.
# Expected: tests pass, 0 errors / 0 hazards; MTP 16x4 at 32K: main ~47.6 (H200) / ~50.5
# (H100) µs per layer, the branch lower (logits kernel 24.7 -> ~10 µs a layer on the H100).
set -uo pipefail
start=$(date +%s); R=/tmp/rm; mkdir -p $R; trap 'tar -C /tmp -czf $OUT/mtp.tgz rm' EXIT
nvidia-smi -L | tee $R/gpu.txt
el() { echo "$(( $(date +%s) - start )) s"; }
source gpu_runs/build.sh || exit 1
GLM5_JAX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 140 -n 15 --dist loadgroup tests/test_select_gpu.py tests/test_stage_gpu.py > $R/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" $R/tests.log | tail -8
for tool in memcheck racecheck; do timeout 80 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py select_pools > $R/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool.log | head -1); $(grep -c 'True' $R/$tool.log) cases ok) at $(el)"; done
b() { n=$1; timeout $2 python3 -m bench --out $R/$n.json --md $R/$n.md --plot '' --budget-s $(( $2 - 20 )) "${@:3}" > $R/$n.log 2>&1; echo "$n rc $? at $(el)"; grep -E "^\[" $R/$n.log | grep -v "^\[   0" | sed 's/(step.*//' ; }
rows() { b $1_stage 60 --groups stage --stage-contexts 32768 --stage-rows 64 --stage-next-n 4 --skip-variants reference; b $1_m64 40 --groups stage --stage-contexts 32768 --stage-rows 64 --skip-variants reference; }
rows branch
timeout 60 python3 -m bench.step_times --runs 3 --steps 4 --variants kernel --contexts 32768 --rows 64 --next-n 4 > /dev/null 2>&1; timeout 60 python3 -m bench.step_times --runs 3 --steps 4 --variants kernel --contexts 32768 --rows 64 --next-n 4 --timeline /tmp/tl --json $R/tl_branch.json > $R/tl_branch.log 2>&1; echo "timeline rc $? at $(el)"; grep -A3 "launches" $R/tl_branch.log | head -4
cp gpu_runs/base/select_logits.cuh cc/select_logits.cuh && source gpu_runs/build.sh > /dev/null || exit 1
rows main
