#!/usr/bin/env bash
# topk-wide-parts, short lease: test_wide_gpu, memcheck and racecheck of pool_topk's cases
# (the 16-CTA and 4-CTA clusters among them). Expected: all pass; 0 errors, 0 hazards.
set -uo pipefail
start=$(date +%s); R=$OUT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
GLM5_JAX_REQUIRE_GPU=1 timeout 50 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 45 -n 15 tests/test_wide_gpu.py > $R/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" $R/tests.log | tail -8
for tool in memcheck racecheck; do timeout 65 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk > $R/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool.log | head -1); $(tail -1 $R/$tool.log)) at $(el)"; done
