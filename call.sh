# one device call's steps, each under its own time limit (s since start in brackets)
set -u; export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
o=$OUT; t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
step() { local lim=$1 name=$2; shift 2; el "start $name"; timeout "$lim" "$@" > "$o/$name.txt" 2>&1; el "$name rc $?"; }
if [ "${BUILD:-1}" = 1 ]; then
  GLM5_JAX_ENABLE_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . > "$o/build.txt" 2>&1
  el "build rc $?"; python3 -m glm5_jax.info | head -3
fi
for s in "$@"; do eval "$s"; done
tar -czf "$o/logs.tgz" -C "$o" --exclude logs.tgz . 2>/dev/null
