#!/usr/bin/env bash
# Branch topk-wide-parts (the landing of topk-parts16's winners, no env switch): one row of
# 262,144 pools on a cluster of 16, 9-16 rows of <= 65,536 pools on 4 a row.
# Expected: tests pass (GPU skips as failures); memcheck/racecheck clean on pool_topk's
# cases; stage (H100) M=1 202,752 ~29.0, 1M ~45.5, M=16 202,752 ~70.1 µs/layer (H200 ~8% less).
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/rl; trap 'tar -C /tmp -czf $OUT/land.tgz rl' EXIT
nvidia-smi -L | tee /tmp/rl/gpu.txt
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
D=${DEADLINE:-400}
lim() { l=$(( D - ($(date +%s) - start) )); [ $l -gt $1 ] && l=$1; echo $l; }
GLM5_JAX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 140 -n 15 --dist loadgroup tests/test_wide_gpu.py tests/test_select_gpu.py tests/test_topk_chunks.py tests/test_bounds.py > /tmp/rl/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/rl/tests.log | tail -8
for tool in memcheck racecheck; do timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk > /tmp/rl/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/rl/$tool.log | head -1); $(tail -1 /tmp/rl/$tool.log)) at $(el)"; done
b() { l=$(lim $2); [ $l -lt 30 ] && { echo "$1 skipped"; return; }; n=$1; timeout $l python3 -m bench --out /tmp/rl/$n.json --md /tmp/rl/$n.md --plot '' --budget-s $(( l * 2 / 3 )) "${@:3}" > /tmp/rl/$n.log 2>&1; echo "$n rc $? at $(el)"; grep -E "^\| (M=|[0-9])" /tmp/rl/$n.md | head -6; }
b wide1 70 --groups stage --stage-contexts 202752,1048576 --stage-rows 1
b wide16 90 --groups stage --stage-contexts 202752 --stage-rows 16,64
b mtp 60 --groups stage --stage-contexts 32768 --stage-rows 64 --stage-next-n 4
