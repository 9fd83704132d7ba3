#!/usr/bin/env bash
# topk-parts16, second call: the rule's edges. M=1 at 524,288 tokens (131,072 pools) and
# M=8 at 1M, 8 vs 16 CTAs; M=1, 8 and 16 at 202,752, 2 vs 4 vs 8; parts 2's tests.
# Expected: 16 wins where 8 CTAs hold > 8 keys a thread (past 65,536 pools), up to 8 rows
# (14 clusters of 16 resident on an H100); 2 or 4 CTAs win at 16 rows of 50,688 pools.
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/rp; trap 'tar -C /tmp -czf $OUT/p16b.tgz rp' EXIT
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
D=${DEADLINE:-400}
lim() { l=$(( D - ($(date +%s) - start) )); [ $l -gt $1 ] && l=$1; echo $l; }
t() { l=$(lim $1); [ $l -lt 20 ] && { echo "$2 skipped"; return; }; GLM5_EXPERIMENT_TOPK_WIDE_PARTS=$3 GLM5_JAX_REQUIRE_GPU=1 timeout $l python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 200 -n 8 tests/test_wide_gpu.py "${@:4}" > /tmp/rp/$2.log 2>&1; echo "$2 rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/rp/$2.log | tail -6; }
b() { l=$(lim $1); [ $l -lt 25 ] && { echo "$2 skipped"; return; }; echo "== $2 parts=$3"; GLM5_EXPERIMENT_TOPK_WIDE_PARTS=$3 timeout $l python3 -m bench --out /tmp/rp/$2.json --md /tmp/rp/$2.md --plot '' --budget-s 30 --skip-variants reference "kernel, PDL off" "${@:4}" > /tmp/rp/$2.log 2>&1; grep -E "^\| (M=|rows=)" /tmp/rp/$2.md | head -6; }
i=0
for v in 8 16 8 16; do i=$((i+1)); b 50 a$i $v --groups stage --stage-contexts 524288,1048576 --stage-rows 1,8; done
for v in 8 4 2 8 4 2; do i=$((i+1)); b 50 b$i $v --groups stage --stage-contexts 202752 --stage-rows 1,8,16; done
t 100 t2 2 -k "16-65536 or 2-50688 or 3-32769 or 64-50688"
echo "done at $(el)"
