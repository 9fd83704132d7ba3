#!/usr/bin/env bash
# Where the missed targets' time goes, each kernel alone (ncu's node mode: no PDL overlap,
# which the --timeline figures in docs/performance.md §5 include), then the logits kernel's
# and the top-k's ncu sections (bandwidth, occupancy, stall reasons) at those shapes.
# `source`: the same kernels' stall samples per SASS instruction (scripts/ncu_source.py maps
# them to source lines).
# bash gpu_runs/run_profile.sh [node] [sections] [wide] [source]  (default the first two); SOURCES
# names the source pages.
# Results: $OUT/prof.tgz.
# Expected (H100): MTP 16x4's logits kernel alone ~15.1 µs a layer, the top-k ~9.9 (node mode;
# the top-k's sections and source at that shape too: one CTA a row of 8,192 pools).
set -uo pipefail
start=$(date +%s); R=/tmp/prof; mkdir -p $R; trap 'tar -C /tmp -czf $OUT/prof.tgz prof' EXIT
nvidia-smi -L | tee $R/gpu.txt
source gpu_runs/build.sh > $R/build.log 2>&1 || { tail -20 $R/build.log; exit 1; }
source gpu_runs/lib.sh
parts=${*:-node sections}
ST="python3 -m bench.step_times --runs 1 --variants kernel"
# One launch of the kernel (its third step), caches flushed: the sections' and sources' runs.
ONE="--cache-control all --clock-control none --launch-skip 22 --launch-count 1"
fill() { timeout 150 $ST "${@:2}" > $R/$1.fill.log 2>&1; }  # the compilation cache
node() {  # name, then step_times' shape flags
  n=$1; shift
  fill $n "$@"
  timeout 200 ncu --csv --metrics gpu__time_duration.sum --cache-control none \
    --clock-control none $ST "$@" > $R/$n.csv 2> $R/$n.err
  $ST --parse $R/$n.csv "$@" > $R/$n.txt 2>&1
  echo "== $n at $(el)"; grep -vE "^\s*$" $R/$n.txt | tail -12
}
sections() {  # name, kernel regex, then step_times' shape flags (the cache is filled)
  n=$1 k=$2; shift 2
  timeout 200 ncu $ONE -k "regex:$k" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats $ST "$@" > $R/$n.ncu.txt 2> $R/$n.ncu.err
  echo "== $n sections at $(el)"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occ|Registers Per|Grid Size|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall" $R/$n.ncu.txt | head -24
}
source_page() {  # name, kernel regex, then step_times' shape flags
  n=$1 k=$2; shift 2
  fill $n "$@"
  timeout 200 ncu $ONE -k "regex:$k" --warp-sampling-interval 0 --section WarpStateStats \
    --section SourceCounters -f -o $R/$n $ST "$@" > $R/$n.src.log 2>&1
  ncu -i $R/$n.ncu-rep --page source --csv --print-source sass > $R/$n.sass.csv 2>&1
  ncu -i $R/$n.ncu-rep --page details --print-details all > $R/$n.details.txt 2>&1
  rm -f $R/$n.ncu-rep; echo "== $n source at $(el)"; wc -c $R/$n.sass.csv
  grep -iE "stall|samples" $R/$n.details.txt | head -20
}
if [[ " $parts " == *" node "* ]]; then
  node mtp --contexts 32768 --rows 64 --next-n 4
  node rows64 --contexts 32768 --rows 64
  node wide --contexts 202752 --rows 1,16
fi
if [[ " $parts " == *" sections "* ]]; then
  sections mtp_logits mqa_logits --contexts 32768 --rows 64 --next-n 4
  sections rows64_logits mqa_logits --contexts 32768 --rows 64
  sections wide1_topk pool_topk --contexts 202752 --rows 1
  sections mtp_topk pool_topk --contexts 32768 --rows 64 --next-n 4
fi
# SOURCES: which source pages (default all but small_topk_src).
# wide: the logits kernel's sections at 16 and 64 rows of GLM-5's window, where its bytes are
# most of the step (how near the copy bandwidth it streams, and what its warps wait on).
if [[ " $parts " == *" wide "* ]]; then
  for m in 16 64; do
    fill wide$m --contexts 202752 --rows $m
    sections wide${m}_logits mqa_logits --contexts 202752 --rows $m
  done
fi
src() { [[ " ${SOURCES:-wide1_topk_src mtp_src rows64_src mtp_topk_src} " == *" $1 "* ]] && source_page "$@"; }
if [[ " $parts " == *" source "* ]]; then
  src wide1_topk_src pool_topk --contexts 202752 --rows 1
  src mtp_src mqa_logits --contexts 32768 --rows 64 --next-n 4
  src rows64_src mqa_logits --contexts 32768 --rows 64
  src mtp_topk_src pool_topk --contexts 32768 --rows 64 --next-n 4
  src small_topk_src pool_topk --contexts 8192 --rows 1  # one row of 2,048 pools
fi
