"""Data parallelism over requests (glm5_jax.sharding) on 4 host CPU devices: each check
runs tests/sharded_checks.py in a process of its own (XLA_FLAGS is read when jax first
starts a backend, and this process has one CPU device by then)."""
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("sharded_checks.py")


def run_check(name):
  root = str(SCRIPT.parent.parent)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [root, os.environ.get("PYTHONPATH")])))
  # The 4 devices are host CPU devices (the flag): on a GPU machine jax would otherwise
  # use its GPUs.
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run([sys.executable, str(SCRIPT), name], env=env, capture_output=True,
                        text=True)
  assert done.returncode == 0, done.stdout + done.stderr[-4000:]
  assert f"ok {name}" in done.stdout


def test_every_primitive_under_shard_map():
  """Each op of OPS inside jax.shard_map over 4 devices, each with its own operands
  (caches included), equals the op on each device's operands alone, bit for bit."""
  run_check("primitives")


@pytest.mark.slow
def test_data_parallel_stage_equals_per_device_stage():
  """data_parallel_stage over 4 devices (device-local page, block and tail-block ids)
  equals indexer_stage on each device's shard alone, bit for bit (kernel routing and
  reference composition), on meshes with Explicit and Auto axes; the compiled step holds
  no collective (all-gather, all-to-all, collective-permute, ...) and keeps the donated
  caches in place."""
  run_check("stage")


@pytest.mark.slow
def test_data_parallel_serving_step_equals_per_device_step():
  """data_parallel_step (packed metadata split along its requests) equals
  serving.indexer_step on each device's shard, bit for bit, with no collective."""
  run_check("serving_step")


def test_data_parallel_errors_name_the_argument():
  run_check("errors")
