#!/usr/bin/env bash
# Optional call 4 (after run_tail_a/b on the same warm machine). Where CTA 0's tail goes with
# the code and the logits warm in L2, as in the stage: earlier ncu runs flushed every cache
# (--cache-control all), so the tail's instruction fetch came from DRAM. Here the second of
# two launches is profiled with --cache-control none, for async, lean and lean512:
# select_slots at one row of 50,688 pools. Read: Duration, the warp states (No Instruction,
# Barrier, Stall Wait), and the source page's samples after the keys' wait.
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/rp; trap 'tar -C /tmp -czf $OUT/tail_prof.tgz rp' EXIT
mkdir -p /tmp/src && cp gpu_runs/prof2.py /tmp/src/prof2.py; source gpu_runs/tail_trees.sh || exit 1
N="ncu --section SourceCounters --section WarpStateStats --section LaunchStats --section SpeedOfLight --import-source yes --warp-sampling-interval 0 --cache-control none --clock-control none"
for t in async lean lean512; do
  intree $t timeout 100 $N -k regex:'pool_topk_parts' -s 1 -c 1 -o /tmp/rp/$t python3 /tmp/src/prof2.py select_slots 50688 1 > /tmp/rp/$t.log 2>&1; echo "$t rc $? at $(( $(date +%s) - start )) s"
  ncu --import /tmp/rp/$t.ncu-rep --page details > /tmp/rp/${t}_details.txt 2>/dev/null
  ncu --import /tmp/rp/$t.ncu-rep --page source --csv > /tmp/rp/${t}_source.csv 2>/dev/null
  grep -E "Duration|Warp Cycles Per Issued|Issued Instructions  |No Instruction|Barrier" /tmp/rp/${t}_details.txt | head -8
done
