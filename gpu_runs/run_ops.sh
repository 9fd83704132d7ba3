#!/usr/bin/env bash
# H200 (BENCHMARKS.json takes H200 rows only): the select ops' rows up to P = 262,144 with the
# reference in the same run (the op rows), then the M=64 131,072 stage row the
# table's run left. Merge with `python gpu_runs/merge.py` here.
# Expected (H100 figures, the H200 lower): pool_topk 10.6 / 17.7 µs at one row of 50,688 /
# 262,144 pools, 17.4 / 31.6 at 16 rows, 28.1 / 74.9 at 64 (chunks).
set -uo pipefail
start=$(date +%s); R=/tmp/ro; mkdir -p $R; trap 'tar -C /tmp -czf $OUT/ops.tgz ro' EXIT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/lib.sh
source gpu_runs/build.sh || exit 1
bench_row ops 330 --groups ops --ops pool_topk,mqa_logits,select_slots --select-pools 50688,262144 --select-rows 1,16,64
bench_row m64 150 --groups stage --stage-contexts 131072 --stage-rows 64
