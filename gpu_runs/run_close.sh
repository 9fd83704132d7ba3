#!/usr/bin/env bash
# Issue 42's closing run on the H200, in calls of under 10 minutes (PART=1/2/3; 0: short; 4:
# timelines), results under $OUT as each step ends (a call can die with nothing back):
#   1: build, the GPU-marked tests of one GPU with GPU skips as failures,
#      -v so a cut run still names each result; SAN=1 then runs the sanitizer over the
#      select kernels' cases (about 2 minutes) in the time DEADLINE leaves.
#   2: the stage rows with the reference at 202,752 (M 1/16/64), 1M (M=1) and MTP (MTP=0
#      skips it), then the select ops' rows at P 50,688 / 262,144 (about 580 s in all on an
#      H100 with the build kept from PART=1).
#   3: the 1K-131K stage table with the reference.
#   0: short (about 5 minutes with the build): the MTP row, then M=1 at 202,752, with the
#      reference.
#   4: where a step's time goes (bench.step_times --timeline, kernels only) at the MTP rows
#      and at 202,752 (M 1/16/64), for docs/performance.md §5.
#   5: one call for a short lease: the MTP row, 202,752 (M 1/16/64) and 1M with the
#      reference, then the select path's GPU tests (GPU skips as failures) in the time left.
# Expected (H200): all tests pass, 0 errors / 0 hazards; MTP 16x4 32K ~34-36 (47.6 before
# the MTP logits changes; 37.2 on an H100), 202,752 ~25 / ~56 / ~149 (M=64 ~157 before the
# pair of CTAs a row; 26.2 / 66.5 / 188.9 on an H100 with the stage's one FFI call), 1M ~39;
# the 1K-131K rows ~1 below BENCHMARKS (the one call; 32K M=1/16 ~1.3 lower again after the
# one-CTA top-k).
# Then here: python gpu_runs/merge.py the JSONs; re-render BENCHMARKS.md; readme_ops --write.
# After it, the changes that wait for a GPU: gpu_runs/variants/*.patch, each by the Run line
# of its note (run_ab.sh main NAME).
set -uo pipefail
PART=${PART:-1}; start=$(date +%s); R=/tmp/close$PART; mkdir -p $R
snap() { tar -C /tmp -czf $OUT/close$PART.tgz close$PART; }
trap snap EXIT
nvidia-smi -L | tee $R/gpu.txt
DEADLINE=${DEADLINE:-580}
source gpu_runs/lib.sh
source gpu_runs/build.sh > $R/build.log 2>&1 || { tail -20 $R/build.log; exit 1; }
echo "built at $(el)"
stage() { bench_row "$1" "$2" --groups stage "${@:3}"; snap; }
mtp() { stage mtp 100 --stage-contexts 32768 --stage-rows 64 --stage-next-n 4; }
wide() { stage wide 190 --stage-contexts 202752 --stage-rows 1,16,64; }
mil() { stage mil 110 --stage-contexts 1048576 --stage-rows 1; }
# gpu_tests NAME S [pytest args]: gpu_pytest into $R/pytest_NAME.log, then a snapshot.
gpu_tests() {
  local n=$1 s=$2 rc; shift 2
  gpu_pytest $R/pytest_$n.log $s "$@"; rc=$?
  echo "$n rc $rc at $(el)"; snap
}
case $PART in
1)
  # The GPU-marked tests alone (with the CPU tests beside them the suite outran one call):
  # the kpool edge chains and million-pool batches are its longest tests (each up to about
  # two minutes beside the others; the whole about 5.5 minutes on an H100, the sanitizer
  # about 2 more); the build's ~50 s come first (DEADLINE 580 leaves the tests ~530). The
  # two-GPU test belongs to the two-GPU run (one GPU here: it would skip). -rP: the passed
  # tests' prints (the D2 rates, the million-pool batches' phase times).
  gpu_tests gpu_all 540 -rP -m "(gpu or cuda_build) and not two_gpus" tests
  # An if, not &&: the call's last command, its status the script's (SAN unset is no error).
  if [ "${SAN:-0}" = 1 ]; then
    sanitize sel 200 pool_topk mqa_logits select_pools indexer_update_select; snap
  fi ;;
2)
  wide; mil
  [ "${MTP:-1}" = 1 ] && mtp
  # Without the PDL-off rows (within noise of PDL on at these shapes on an H100): all
  # three ops with the reference took ~350 s with them, ~290 without.
  bench_row ops 300 --groups ops --ops pool_topk,mqa_logits,select_slots \
    --select-pools 50688,262144 --select-rows 1,16,64 --skip-variants "kernel, PDL off" ;;
0)
  mtp; stage wide1 100 --stage-contexts 202752 --stage-rows 1 ;;
3)
  stage table 540 --stage-contexts 1024,8192,32768,131072 --stage-rows 1,16,64 ;;
4)
  # A first run fills the compilation cache, so the traced one times warm steps.
  tl() {
    local n=$1 l; l=$(lim $2); [ $l -lt 30 ] && { echo "$n skipped"; return; }
    local st="python3 -m bench.step_times --runs 3 --steps 4 --variants kernel"
    timeout $l $st "${@:3}" > $R/$n.fill.log 2>&1 &&
      timeout $(lim $2) $st --timeline /tmp/tl_$n --json $R/$n.json "${@:3}" > $R/$n.log 2>&1
    echo "timeline $n rc $? at $(el)"; snap
    grep -vE "^\s*$|WARNING|^I0|^E0|^W0" $R/$n.log | tail -14
  }
  tl tl_mtp 120 --contexts 32768 --rows 64 --next-n 4
  tl tl_wide 200 --contexts 202752 --rows 1,16,64 ;;
5)
  mtp; wide; mil
  gpu_tests select_tests 300 tests/test_select_gpu.py tests/test_wide_gpu.py \
    tests/test_stage_gpu.py tests/test_topk_chunks.py ;;
esac
