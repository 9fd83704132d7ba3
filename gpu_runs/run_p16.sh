#!/usr/bin/env bash
# Branch topk-parts16: the wide top-k's cluster of 16 CTAs (non-portable) at M=1, of 4 at
# M=16 (GLM5_EXPERIMENT_TOPK_WIDE_PARTS), against today's 8, same build, same machine.
# Expected: max active 8-CTA clusters < 16 would explain M=16's top-k taking ~2x one row's;
# tests pass under each variant; 16 CTAs: stage M=1 1M -2..-4 µs/layer, 202,752 -0..-1;
# 4 CTAs at M=16, 202,752: faster if 8-CTA clusters take two waves.
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/rp; trap 'tar -C /tmp -czf $OUT/p16.tgz rp' EXIT
nvidia-smi -L
source gpu_runs/build.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
nvcc -arch=sm_90a -o /tmp/clusters gpu_runs/clusters.cu && /tmp/clusters | tee /tmp/rp/clusters.txt
D=${DEADLINE:-560}
lim() { l=$(( D - ($(date +%s) - start) )); [ $l -gt $1 ] && l=$1; echo $l; }
t() { l=$(lim $1); [ $l -lt 20 ] && { echo "$2 skipped"; return; }; GLM5_EXPERIMENT_TOPK_WIDE_PARTS=$3 GLM5_JAX_REQUIRE_GPU=1 timeout $l python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 200 -n 8 tests/test_wide_gpu.py "${@:4}" > /tmp/rp/$2.log 2>&1; echo "$2 rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/rp/$2.log | tail -6; }
b() { l=$(lim $1); [ $l -lt 25 ] && { echo "$2 skipped"; return; }; GLM5_EXPERIMENT_TOPK_WIDE_PARTS=$3 timeout $l python3 -m bench --out /tmp/rp/$2.json --md /tmp/rp/$2.md --plot '' --budget-s $(( l * 2 / 3 )) --skip-variants reference "kernel, PDL off" "${@:4}" > /tmp/rp/$2.log 2>&1; echo "$2 rc $? at $(el)"; grep -E "^\| (M=|rows=)" /tmp/rp/$2.md | head -6; }
for v in 8 16 8 16; do b s1_$v$RANDOM 50 $v --groups stage --stage-contexts 202752,1048576 --stage-rows 1; done
for v in 8 4 8 4; do b s16_$v$RANDOM 50 $v --groups stage --stage-contexts 202752 --stage-rows 16; done
t t16 150 16
t t4 120 4 -k "16-65536 or 2-50688 or 5-131072 or 3-32769"
