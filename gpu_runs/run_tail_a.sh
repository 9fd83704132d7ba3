#!/usr/bin/env bash
# Next GPU session, calls 1 and 2 (checkout: branch topk-lean-tail; carry ["gpu_runs"]):
# `bash gpu_runs/run_tail_a.sh 1`, then `... 2` (each within one call's limit).
# Builds main / async / lean / lean512 (tail_trees.sh); 1: on lean, the select GPU tests with GPU
# skips as failures (async exchanges, and again with GLM5_EXPERIMENT_TOPK_CLUSTER_SYNC=1:
# the old exchanges, the new tail) and tests/test_sass.py; 2: the select GPU tests on
# lean512, the slots tests with GLM5_EXPERIMENT_TOPK_NO_LOOKUP=1, then memcheck and racecheck
# on lean (the tail's named barriers, the ranked ids written over the gathered keys).
# Expected: every test passes, both sanitizers report 0 errors / 0 hazards.
set -uo pipefail
part=${1:-1}
start=$(date +%s); mkdir -p /tmp/ra; trap 'tar -C /tmp -czf $OUT/tail_a$part.tgz ra t/main.log t/async.log t/lean.log t/lean512.log 2>/dev/null' EXIT
nvidia-smi -L
source gpu_runs/tail_trees.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
intree lean python3 -c "import glm5_jax, glm5_jax._ffi as f; print(glm5_jax.__file__, f.register_targets())"
H=tests/test_values.py::test_select_slots_kernel_closes_holes  # drops inside the selection
T="tests/test_wide_gpu.py tests/test_select_gpu.py tests/test_topk_chunks.py tests/test_bounds.py tests/test_sass.py $H"
[ $part = 1 ] && { intree lean env GLM5_JAX_REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup $T > /tmp/ra/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests.log | tail -8; }
[ $part = 1 ] && { intree lean env GLM5_EXPERIMENT_TOPK_CLUSTER_SYNC=1 GLM5_JAX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup tests/test_wide_gpu.py tests/test_select_gpu.py $H > /tmp/ra/tests_sync.log 2>&1; echo "tests (sync exchanges) rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests_sync.log | tail -5; }
[ $part = 2 ] && { intree lean512 env GLM5_JAX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup tests/test_wide_gpu.py tests/test_select_gpu.py $H > /tmp/ra/tests_512.log 2>&1; echo "tests (lean512) rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests_512.log | tail -5; }
[ $part = 2 ] && { intree lean env GLM5_EXPERIMENT_TOPK_NO_LOOKUP=1 GLM5_JAX_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup tests/test_wide_gpu.py::test_wide_select_equals_reference tests/test_select_gpu.py::test_slots_kernel_equals_reference $H > /tmp/ra/tests_nolookup.log 2>&1; echo "tests (no lookup) rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests_nolookup.log | tail -5; }
[ $part = 2 ] && for tool in memcheck racecheck; do intree lean timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk select_pools select_slots > /tmp/ra/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/ra/$tool.log | head -1); $(tail -1 /tmp/ra/$tool.log)) at $(el)"; done
