# Sourced by the gpu_runs scripts: build the CUDA module against the machine's jax.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
GLM5_JAX_ENABLE_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; return 1; }
python3 -m glm5_jax.info | tail -4
