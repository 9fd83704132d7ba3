#!/usr/bin/env bash
# Branch topk-cluster-fits: cluster_fits' query (once a device, relaxed capture mode) keeps
# the 16-CTA top-k on an H100/H200. Expected: tests pass; memcheck/racecheck clean; the M=1
# 1M stage (command buffers) at the 16-CTA figure (H100 ~45.5 µs/layer, not 8 CTAs' ~50.2).
set -uo pipefail
start=$(date +%s); R=$OUT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
timeout 40 python3 -m bench --out $R/s1.json --md $R/s1.md --plot '' --budget-s 25 --skip-variants reference "kernel, PDL off" --groups stage --stage-contexts 202752,1048576 --stage-rows 1 > $R/s1.log 2>&1; echo "s1 rc $? at $(el)"; grep -E "^\| M=" $R/s1.md | head -3
GLM5_JAX_REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 55 -n 15 tests/test_wide_gpu.py > $R/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" $R/tests.log | tail -8
for tool in memcheck racecheck; do timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk > $R/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$tool.log | head -1); $(tail -1 $R/$tool.log)) at $(el)"; done
