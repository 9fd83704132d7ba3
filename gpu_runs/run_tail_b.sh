#!/usr/bin/env bash
# Next GPU session, calls 2-5 (after run_tail_a.sh on the same warm machine; rebuilds if
# it is fresh): `bash gpu_runs/run_tail_b.sh stage`, then `... stage2`, `... ops`, `... parts`.
# The A/B/C, twice, alternating: main (verified), async (st.async exchanges), lean (async + the
# gathered select on 8 warps), lean512 (16 warps). main -> async is the exchanges' effect,
# async -> lean / lean512 the tail's; lean with GLM5_EXPERIMENT_TOPK_NO_LOOKUP=1 (the slots
# looked up after the select, as before) the idle warps' lookups'.
# Expected (H100, µs per layer, M=1): stage 202,752 main ~31.8 -> async ~30.5; the tail
# (lean, lean512) 0 to 1.5 µs less again: its warps issue and wait less, but its code (run
# cold, once a launch) grows 1.4x / 1.15x (static reach after the keys' wait, SASS), and
# ncu put half of the tail on instruction fetch, so this A/B decides. Ops: pool_topk at
# 8192 / 32768 pools, select_slots at 50,688: lean <= main; nothing slower than noise. The
# lookups beside the select: 0.2-0.4 µs a layer (one L2 round trip less after the select).
# Rows 64 against 65 at 8,192 and 32,768 pools: 2-CTA clusters (topk_parts) against one CTA
# a row, both one wave: if one CTA a row is faster per row, topk_parts should not split there;
# and lean with GLM5_EXPERIMENT_TOPK_ONE_CTA=1 (one CTA a row at any rows up to 32,768
# pools) against lean as is, at 1 / 16 / 64 rows of 8,192 / 16,384 / 32,768 pools.
set -uo pipefail
what=${1:-stage}
start=$(date +%s); mkdir -p /tmp/rb; trap 'tar -C /tmp -czf $OUT/tail_$what.tgz rb' EXIT
source gpu_runs/tail_trees.sh || exit 1
D=${DEADLINE:-560}
el() { echo "$(( $(date +%s) - start )) s"; }
b() { t=$1; n=$2; shift 2; l=$(( D - ($(date +%s) - start) )); [ $l -gt 65 ] && l=65; [ $l -lt 30 ] && { echo "$t $n skipped"; return; }
  intree $t timeout $l python3 -m bench --out /tmp/rb/${n}_$t.json --md /tmp/rb/${n}_$t.md --plot '' --budget-s $(( l - 30 )) --skip-variants reference "kernel, PDL off" "$@" > /tmp/rb/${n}_$t.log 2>&1
  echo "$t $n rc $? at $(el)"; grep -E "^\| (M=|rows=)" /tmp/rb/${n}_$t.md | head -9; }
S="--groups stage --stage-contexts 202752,1048576 --stage-rows 1"
for rep in 1 2; do
  case $what in
    stage) for t in main async lean; do b $t stage_r$rep $S; done;;
    stage2) b lean stage2_r$rep $S; GLM5_EXPERIMENT_TOPK_NO_LOOKUP=1 b lean nolookup_r$rep $S
            b lean512 stage2_r$rep $S;;
    ops) for t in main async lean lean512; do
           b $t ops_r$rep --groups ops --ops pool_topk,select_slots --select-pools 8192,32768,50688 --select-rows 1,64,65
         done;;
    parts) GLM5_EXPERIMENT_TOPK_ONE_CTA=1 b lean one_r$rep --groups ops --ops pool_topk --select-pools 8192,16384,32768 --select-rows 1,16,64
           b lean split_r$rep --groups ops --ops pool_topk --select-pools 8192,16384,32768 --select-rows 1,16,64;;
  esac
done
