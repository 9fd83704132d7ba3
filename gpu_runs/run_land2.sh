#!/usr/bin/env bash
# topk-wide-parts, short lease: test_wide_gpu, memcheck and racecheck of pool_topk's cases
# (the 16-CTA and 4-CTA clusters among them), then the M=1 stage (kernel only).
# Expected: all pass; 0 errors, 0 hazards; H100 M=1 ~29.0 / ~45.5 µs per layer.
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/rl; trap 'tar -C /tmp -czf $OUT/land2.tgz rl' EXIT
nvidia-smi -L | tee /tmp/rl/gpu.txt
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
GLM5_JAX_REQUIRE_GPU=1 timeout 70 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 60 -n 15 tests/test_wide_gpu.py > /tmp/rl/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/rl/tests.log | tail -8
for tool in memcheck racecheck; do timeout 45 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk > /tmp/rl/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/rl/$tool.log | head -1); $(tail -1 /tmp/rl/$tool.log)) at $(el)"; done
timeout 30 python3 -m bench --out /tmp/rl/s1.json --md /tmp/rl/s1.md --plot '' --budget-s 20 --skip-variants reference "kernel, PDL off" --groups stage --stage-contexts 202752,1048576 --stage-rows 1 > /tmp/rl/s1.log 2>&1; echo "s1 rc $? at $(el)"; grep -E "^\| M=" /tmp/rl/s1.md | head -3
