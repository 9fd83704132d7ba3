"""Packaging: import without the CUDA module, diagnostics, the module's
registrations when it is built."""
import subprocess
import sys

import pytest

import glm5_jax
from glm5_jax import _ffi
from glm5_jax._primitive import Op


def test_diagnostics_list_every_op():
  out = subprocess.run([sys.executable, "-m", "glm5_jax.info"], capture_output=True,
                       text=True, check=True).stdout
  assert f"glm5_jax {glm5_jax.__version__}" in out
  for op in glm5_jax.OPS:
    assert op in out


def test_public_api():
  for name in glm5_jax.__all__:
    assert getattr(glm5_jax, name) is not None
  assert glm5_jax.OPS == tuple(Op.registry)
  assert set(glm5_jax.KERNEL_TARGETS) <= set(glm5_jax.OPS)
  assert all(t == f"glm5_{op}" for op, t in glm5_jax.KERNEL_TARGETS.items())
  assert glm5_jax.KERNEL_TARGETS == {n: op.kernel for n, op in Op.registry.items() if op.kernel}


def test_import_has_no_cycles():
  """Each public module imports on its own in a fresh interpreter (no function-level
  imports are needed to break a cycle)."""
  for module in ("glm5_jax.stage", "glm5_jax._primitive", "glm5_jax.info", "glm5_jax.plan",
                 "glm5_jax.sharding", "glm5_jax.reference"):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)


@pytest.mark.gpu
def test_cuda_module_registers_every_kernel():
  assert _ffi.register_targets(), "the CUDA module is not built"
  assert set(_ffi._glm5_cuda.registrations()) == set(glm5_jax.KERNEL_TARGETS.values())
  assert _ffi.ffi_api_version()[0] == 0
