#!/usr/bin/env bash
# Variants: changes that wait for a GPU, one patch each against main, tracked in git as
# gpu_runs/variants/NAME.patch (a branch does not outlive a session's checkout; main does).
# The text before a patch's first diff says what it is for, how the next GPU session runs
# it, what to expect and what to do on merging; git apply skips that text. run_ab.sh applies
# a patch's cc/, glm5_jax/, tests/ and bench/ parts over main's. tests/golden is left out
# (regenerate it on merging: python tests/test_stage_routing.py --regen). A merged or
# dropped variant's patch is deleted; git log keeps it.
#   bash gpu_runs/variants.sh write BRANCH NOTE  NAME.patch (NAME = BRANCH) from BRANCH's
#                                                changes since it left main, headed by the
#                                                file NOTE
#   bash gpu_runs/variants.sh check              every patch applies to this tree
#   bash gpu_runs/variants.sh branch NAME        branch NAME off HEAD with the patch
#                                                committed (to refresh, rebase or merge it)
# A patch that main has moved under: variants.sh branch NAME (git apply -3 takes the
# patch's own base blobs), resolve, regenerate, then write it again.
set -uo pipefail
cd "$(git rev-parse --show-toplevel)" || exit 1
dir=gpu_runs/variants
case "${1:-}" in
  write)
    [ $# = 3 ] || { echo "usage: variants.sh write BRANCH NOTE"; exit 2; }
    # main...BRANCH: the branch's own changes since it left main (check: they still apply).
    mkdir -p $dir
    { cat "$3"; echo; git diff main..."$2" -- . ':(exclude)tests/golden'; } > "$dir/$2.patch"
    echo "$dir/$2.patch: $(git diff --shortstat main..."$2" -- . ':(exclude)tests/golden')" ;;
  check)
    status=0
    for p in $dir/*.patch; do
      [ -e "$p" ] || continue
      if git apply --check "$p" 2> /dev/null; then echo "$p: applies"
      else echo "$p: does not apply (variants.sh branch $(basename "$p" .patch))"; status=1; fi
    done
    exit $status ;;
  branch)
    [ $# = 2 ] || { echo "usage: variants.sh branch NAME"; exit 2; }
    git checkout -b "$2" && git apply -3 "$dir/$2.patch" && git add -A &&
      git commit -q -m "$2 (from $dir/$2.patch)" && echo "on $2" ;;
  *)
    sed -n '2,16p' "$0"; exit 2 ;;
esac
