#!/usr/bin/env bash
# One call (a short lease): lean's select GPU tests with GPU skips as failures, then the
# stage A/B once (main, async, lean; M=1 at 202,752 and 1M tokens).
# Expected: tests pass; stage 202,752 main ~31.8 (H100) -> async ~30.5 -> lean 29-30.5.
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/rn; trap 'tar -C /tmp -czf $OUT/tail_now.tgz rn' EXIT
nvidia-smi -L
source gpu_runs/tail_trees.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
H=tests/test_values.py::test_select_slots_kernel_closes_holes
intree lean env GLM5_JAX_REQUIRE_GPU=1 timeout 170 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup tests/test_wide_gpu.py tests/test_select_gpu.py tests/test_topk_chunks.py tests/test_sass.py $H > /tmp/rn/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/rn/tests.log | tail -8
D=575
b() { t=$1; n=$2; shift 2; l=$(( D - ($(date +%s) - start) )); [ $l -gt 65 ] && l=65; [ $l -lt 35 ] && { echo "$t $n skipped"; return; }
  intree $t timeout $l python3 -m bench --out /tmp/rn/${n}_$t.json --md /tmp/rn/${n}_$t.md --plot '' --budget-s $(( l - 30 )) --skip-variants reference "kernel, PDL off" "$@" > /tmp/rn/${n}_$t.log 2>&1
  echo "$t $n rc $? at $(el)"; grep -E "^\| (M=|rows=)" /tmp/rn/${n}_$t.md | head -4; }
for t in main async lean; do b $t stage_r1 --groups stage --stage-contexts 202752,1048576 --stage-rows 1; done
