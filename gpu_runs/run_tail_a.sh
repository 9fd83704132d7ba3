#!/usr/bin/env bash
# Next GPU session, call 1 of 2 (checkout: branch topk-lean-tail; carry ["gpu_runs"]).
# Builds main / async / lean (tail_trees.sh), then on lean: the select GPU tests with GPU
# skips as failures (async exchanges, and again with GLM5_EXPERIMENT_TOPK_CLUSTER_SYNC=1:
# the old exchanges, the new tail), memcheck and racecheck (the tail's named barrier and
# the ranked ids written over the gathered keys), tests/test_sass.py.
# Expected: every test passes, both sanitizers report 0 errors / 0 hazards.
set -uo pipefail
start=$(date +%s); mkdir -p /tmp/ra; trap 'tar -C /tmp -czf $OUT/tail_a.tgz ra t/main.log t/async.log t/lean.log t/lean512.log 2>/dev/null' EXIT
nvidia-smi -L
source gpu_runs/tail_trees.sh || exit 1
el() { echo "$(( $(date +%s) - start )) s"; }
intree lean python3 -c "import glm5_jax, glm5_jax._ffi as f; print(glm5_jax.__file__, f.register_targets())"
T="tests/test_wide_gpu.py tests/test_select_gpu.py tests/test_topk_chunks.py tests/test_bounds.py tests/test_sass.py"
intree lean env GLM5_JAX_REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup $T > /tmp/ra/tests.log 2>&1; echo "tests rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests.log | tail -8
intree lean env GLM5_EXPERIMENT_TOPK_CLUSTER_SYNC=1 GLM5_JAX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup tests/test_wide_gpu.py tests/test_select_gpu.py > /tmp/ra/tests_sync.log 2>&1; echo "tests (sync exchanges) rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests_sync.log | tail -5
intree lean512 env GLM5_JAX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 300 -n 15 --dist loadgroup tests/test_wide_gpu.py tests/test_select_gpu.py > /tmp/ra/tests_512.log 2>&1; echo "tests (lean512) rc $? at $(el)"; grep -E "^FAILED|^ERROR| passed| failed" /tmp/ra/tests_512.log | tail -5
for tool in memcheck racecheck; do intree lean timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_kernels.py pool_topk select_pools select_slots > /tmp/ra/$tool.log 2>&1; echo "$tool rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/ra/$tool.log | head -1); $(tail -1 /tmp/ra/$tool.log)) at $(el)"; done
