#!/usr/bin/env bash
# H200: pool_topk's sanitizer cases (the 16- and 4-CTA clusters included); the stage rows
# still without their reference (MTP 16x4 at 32K, M=64 at 202,752), where a step's time goes
# (timeline) at those and M=16 202,752; then the 1K-128K table with the reference.
# Expected: 0 errors / 0 hazards, every case identical; MTP under 47.6 (37.4 on an H100),
# M=64 202,752 ~158 µs/layer.
set -uo pipefail
start=$(date +%s); R=/tmp/rh; mkdir -p $R; trap 'tar -C /tmp -czf $OUT/h200.tgz rh' EXIT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/build.sh || exit 1
DEADLINE=${DEADLINE:-575}
source gpu_runs/lib.sh
sanitize h200 100 pool_topk
bench_row mtp 90 --groups stage --stage-contexts 32768 --stage-rows 64 --stage-next-n 4
bench_row wide 150 --groups stage --stage-contexts 202752 --stage-rows 64
t() { l=$(lim $2); [ $l -lt 30 ] && { echo "$1 skipped"; return; }; n=$1; timeout $l python3 -m bench.step_times --runs 3 --steps 4 --variants kernel "${@:3}" > $R/$n.fill.log 2>&1 && timeout $(lim $2) python3 -m bench.step_times --runs 3 --steps 4 --variants kernel --timeline /tmp/tl_$n --json $R/$n.json "${@:3}" > $R/$n.log 2>&1; echo "timeline $n rc $? at $(el)"; grep -vE "^\s*$|WARNING|^I0|^E0|^W0" $R/$n.log | tail -14; }
t tl_mtp 90 --contexts 32768 --rows 64 --next-n 4
t tl_wide 100 --contexts 202752 --rows 1,16,64
bench_row table 400 --groups stage --stage-contexts 1024,8192,32768,131072 --stage-rows 1,16,64
