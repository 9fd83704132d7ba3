#!/usr/bin/env bash
# One call for the next lease, from main: the checks topk-wide-parts still owes (test_wide_gpu,
# memcheck and racecheck of pool_topk's cases incl. the 16- and 4-CTA clusters), then the
# stage rows with the reference (BENCHMARKS.json when on an H200: gpu_runs/merge.py).
# Expected: all pass, 0 errors / 0 hazards; H100: M=1 29.0 / 45.5, M=16 ~70, M=64 ~207,
# MTP 16x4 ~50.6 µs per layer (the H200 lower).
set -uo pipefail
start=$(date +%s); R=/tmp/rs; mkdir -p $R/r; trap 'tar -C /tmp -czf $OUT/session.tgz rs' EXIT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
D=${DEADLINE:-560}
lim() { l=$(( D - ($(date +%s) - start) )); [ $l -gt $1 ] && l=$1; echo $l; }
GLM5_JAX_REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 55 -n 15 tests/test_wide_gpu.py > $R/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" $R/tests.log | tail -8
for tool in memcheck racecheck; do timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk > $R/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool.log | head -1); $(tail -1 $R/$tool.log)) at $(el)"; done
b() { l=$(lim $2); [ $l -lt 30 ] && { echo "$1 skipped"; return; }; n=$1; timeout $l python3 -m bench --out $R/r/$n.json --md $R/r/$n.md --plot '' --budget-s $(( l * 2 / 3 )) "${@:3}" > $R/r/$n.log 2>&1; echo "$n rc $? at $(el)"; grep -E "^\| (M=|[0-9])" $R/r/$n.md | head -6; }
b wide1 70 --groups stage --stage-contexts 202752,1048576 --stage-rows 1
b wide16 90 --groups stage --stage-contexts 202752 --stage-rows 16,64
b mtp 60 --groups stage --stage-contexts 32768 --stage-rows 64 --stage-next-n 4
b m64 40 --groups stage --stage-contexts 32768 --stage-rows 64
