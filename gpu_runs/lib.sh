# Sourced by the gpu_runs scripts, after they set start=$(date +%s) and R (results folder).
# el: seconds since start. lim S: at most S, and no later than DEADLINE s after start where
# DEADLINE is set. bench_row NAME S [bench args]: one bench run into $R/NAME.{json,md,log}
# within lim S, its rows printed (skipped under 30 s). sanitize NAME S OPS...: each of
# TOOLS (default memcheck racecheck) over scripts/sanitize_kernels.py's cases of OPS into
# $R/TOOL_NAME.log within lim S, its summary, case count and verdict printed; it fails
# where any tool did. gpu_pytest LOG S [pytest args]: the tests with GPU skips as failures
# into LOG within lim S, its status returned, its totals printed.
el() { echo "$(( $(date +%s) - start )) s"; }
lim() {
  local l=$1 left
  if [ -n "${DEADLINE:-}" ]; then
    left=$(( DEADLINE - ($(date +%s) - start) )); [ $left -lt $l ] && l=$left
  fi
  echo $l
}
bench_row() {
  local n=$1 l; l=$(lim $2)
  [ $l -lt 30 ] && { echo "$n skipped"; return; }
  timeout $l python3 -m bench --out $R/$n.json --md $R/$n.md --plot '' --budget-s $(( l - 25 )) \
    "${@:3}" > $R/$n.log 2>&1
  echo "$n rc $? at $(el)"
  grep -E "^\[" $R/$n.log | grep -v "^\[   0" | sed 's/(step.*//;s/^\[ *[0-9.]*s\] stage //' \
    | tail -30
}
sanitize() {
  local n=$1 s=$2 tool log rc failed=0; shift 2
  for tool in ${TOOLS:-memcheck racecheck}; do
    log=$R/${tool}_$n.log
    timeout $(lim $s) compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 scripts/sanitize_kernels.py "$@" > $log 2>&1
    rc=$?; [ $rc = 0 ] || failed=1
    echo "$tool rc $rc ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $log | head -1);" \
      "$(grep -c 'the CPU reference' $log) cases; $(tail -1 $log)) at $(el)"
  done
  return $failed
}
# -v: a run cut by its limit still names each result (-q names them only in its summary).
# --timeout names a hung test, above what the million-pool batches take while the workers
# share the GPU and CPUs. --dist loadgroup hands out one test at a time (each ungrouped test
# its own group), in the order tests/conftest.py gives: the default scheduler sent each
# worker a run of consecutive tests, which put all the long ones on one worker.
gpu_pytest() {
  local log=$1 s=$2 rc; shift 2
  GLM5_JAX_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(lim $s) python3 -m \
    pytest -v -p no:cacheprovider -p no:benchmark --timeout ${GLM5_JAX_TEST_TIMEOUT:-540} \
    --durations 15 -n ${GLM5_JAX_TEST_WORKERS:-15} --dist loadgroup "$@" > $log 2>&1
  rc=$?
  grep -E "^FAILED|^ERROR| passed| failed|skipped" $log | tail -12
  return $rc
}
