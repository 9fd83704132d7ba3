"""Markers and GPU policy.

Tests marked `gpu` need a CUDA device; they skip without one unless
GLM5_JAX_REQUIRE_GPU=1, which turns those skips into failures (the H200 run).
Tests marked `two_gpus` also need a second device; they skip on one GPU unless
GLM5_JAX_REQUIRE_GPUS=2 (the two-GPU run).
Tests marked `cuda_build` need the built CUDA module and the toolkit's cuobjdump, not a
device (the SASS tests): they skip without them unless GLM5_JAX_REQUIRE_CUDA_BUILD=1 or
GLM5_JAX_REQUIRE_GPU=1 (CI's CUDA step, the H200 run).
"""
import os

import jax
import pytest

from glm5_jax import _ffi
from glm5_jax._ffi import local_cuda, register_targets


@pytest.fixture
def all_kernels(monkeypatch):
  """Every built kernel on (GLM5_JAX_KERNELS=1, also those off by default), with
  jit caches cleared around the test: the switch is read (Routing.from_env) when an op
  is traced.
  Fails without the CUDA module: the ops would silently run the reference."""
  if not register_targets():
    pytest.fail("glm5_jax._glm5_cuda is not built (GLM5_JAX_ENABLE_CUDA=ON) on a GPU machine")
  monkeypatch.setenv("GLM5_JAX_KERNELS", "1")
  jax.clear_caches()
  yield
  jax.clear_caches()


def pytest_report_header(config):
  from glm5_jax.info import report
  return report()


def missing(what):
  """Skip the test for lack of `what`, or fail it where the run requires the CUDA build."""
  if "1" in (os.environ.get("GLM5_JAX_REQUIRE_CUDA_BUILD"), os.environ.get("GLM5_JAX_REQUIRE_GPU")):
    pytest.fail(f"{what} (GLM5_JAX_REQUIRE_CUDA_BUILD / GLM5_JAX_REQUIRE_GPU is set)")
  pytest.skip(what)


def pytest_runtest_setup(item):
  if "gpu" in item.keywords and not local_cuda():
    if os.environ.get("GLM5_JAX_REQUIRE_GPU") == "1":
      pytest.fail("GLM5_JAX_REQUIRE_GPU=1 but this machine has no CUDA device")
    pytest.skip("needs a CUDA GPU (GLM5_JAX_REQUIRE_GPU=1 makes this a failure)")
  if "two_gpus" in item.keywords and local_cuda() and len(jax.devices("cuda")) < 2:
    if os.environ.get("GLM5_JAX_REQUIRE_GPUS") == "2":
      pytest.fail("GLM5_JAX_REQUIRE_GPUS=2 but this machine has fewer than 2 CUDA devices")
    pytest.skip("needs 2 CUDA GPUs (GLM5_JAX_REQUIRE_GPUS=2 makes this a failure)")
  if "cuda_build" in item.keywords and _ffi._glm5_cuda is None:
    missing("glm5_jax._glm5_cuda is not built (GLM5_JAX_ENABLE_CUDA=ON)")


@pytest.hookimpl(trylast=True)  # after -m and -k deselect: the order of what runs
def pytest_collection_modifyitems(session, config, items):
  """Tests marked `long` first, one on each worker, then as many short ones, then the other
  long ones (stable otherwise). Under `--dist loadgroup` (gpu_runs/lib.sh's gpu_pytest)
  pytest-xdist hands out tests in this order one at a time, but keeps a second one queued
  on each worker behind the one it runs: the first `workers` tests start at once and the
  next `workers` wait behind them. A long test queued there waited out a million-pool
  batch and ran past the call's limit, so short ones take those places, and the long ones
  left go to whichever workers free up first."""
  workers = getattr(config, "workerinput", {}).get("workercount", 1)
  long = [item for item in items if "long" in item.keywords]
  short = [item for item in items if "long" not in item.keywords]
  items[:] = long[:workers] + short[:workers] + long[workers:] + short[workers:]


def pytest_sessionfinish(session, exitstatus):
  """A run that collected no test fails (never a green 'no tests ran')."""
  if session.testscollected == 0:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
