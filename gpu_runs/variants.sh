#!/usr/bin/env bash
# The patches run_ab.sh applies: bash gpu_runs/variants.sh BRANCH... writes
# gpu_runs/variants/BRANCH.patch (its cc/ and tests/ against main; the folder stays untracked
# so that it travels to the device). Where main changed cc/ or tests/ after the branch left
# it, the diff would also revert those changes: such a branch is named and left out (merge
# main into it first).
set -uo pipefail
cd "$(git rev-parse --show-toplevel)" && mkdir -p gpu_runs/variants
for v in "$@"; do
  if ! git diff --quiet "$(git merge-base main "$v")" main -- cc tests; then
    echo "$v: main changed cc/ or tests/ since it left (git checkout $v && git merge main); left out"
    continue
  fi
  git diff main "$v" -- cc tests > "gpu_runs/variants/$v.patch"
  echo "$v: $(git diff --shortstat main "$v" -- cc tests)"
done
