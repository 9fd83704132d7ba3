# Sourced by run_tail_*.sh: builds the CUDA module of three trees side by side, without an
# editable install (which would shadow PYTHONPATH): main (verified), async (branch
# topk-async-exchange: st.async exchanges), lean (this checkout, branch topk-lean-tail:
# async + the gathered select on 8 warps), lean512 (lean with kGatheredThreads = 512: 16
# warps, 4 keys a thread, a smaller tail code). Each lands in /tmp/t/<tree>/glm5_jax/.
# Before the call, here: git archive --format=tar -o gpu_runs/trees/main.tar main; likewise
# gpu_runs/trees/async.tar from topk-async-exchange (gpu_runs is git-ignored; carry it).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CMAKE_BUILD_PARALLEL_LEVEL=8
grep -q "^constexpr int kGatheredThreads" cc/select_topk.cuh || { echo "tail_trees: check out topk-lean-tail first"; return 1; }
python3 -m pip uninstall -y -q glm5_jax > /dev/null 2>&1
mkdir -p /tmp/t
build_tree() {  # name source-dir
  [ -n "$(ls /tmp/t/$1/glm5_jax/_glm5_cuda*.so 2>/dev/null)" ] && return 0
  rm -rf /tmp/t/$1 && mkdir -p /tmp/t/$1 && cp -r $2/. /tmp/t/$1/
  (cd /tmp/t/$1 && GLM5_JAX_ENABLE_CUDA=ON python3 -m pip wheel -q --no-build-isolation --no-deps . -w /tmp/t/$1.whl > /tmp/t/$1.log 2>&1 \
    && python3 -c "import zipfile,glob,sys; z=zipfile.ZipFile(glob.glob('/tmp/t/$1.whl/*.whl')[0]); n=[x for x in z.namelist() if '_glm5_cuda' in x][0]; open('/tmp/t/$1/glm5_jax/'+n.split('/')[-1],'wb').write(z.read(n))") \
    || { echo "build $1 failed"; tail -20 /tmp/t/$1.log; return 1; }
}
if [ ! -d /tmp/src/main ]; then
  mkdir -p /tmp/src/main /tmp/src/async
  tar -xf gpu_runs/trees/main.tar -C /tmp/src/main && tar -xf gpu_runs/trees/async.tar -C /tmp/src/async
fi
if [ ! -d /tmp/src/lean512 ]; then
  mkdir -p /tmp/src/lean512 && cp -r cc glm5_jax tests glm5_testing bench scripts CMakeLists.txt pyproject.toml README.md /tmp/src/lean512/
  sed -i 's|^constexpr int kGatheredThreads = kTopkCandidates / 8;|constexpr int kGatheredThreads = 512;|' /tmp/src/lean512/cc/select_topk.cuh
  grep -q "^constexpr int kGatheredThreads = 512;" /tmp/src/lean512/cc/select_topk.cuh || { echo "lean512: sed failed"; return 1; }
fi
s=$(date +%s)
build_tree main /tmp/src/main & build_tree async /tmp/src/async & build_tree lean . &
build_tree lean512 /tmp/src/lean512 & wait
echo "builds $(( $(date +%s) - s )) s: $(ls /tmp/t/*/glm5_jax/_glm5_cuda*.so | wc -l) modules"
# intree <tree> CMD...: runs CMD in that tree with its module (prints the module it imports)
intree() { t=$1; shift; (cd /tmp/t/$t && PYTHONPATH=/tmp/t/$t:/tmp/t/$t/tests "$@"); }
