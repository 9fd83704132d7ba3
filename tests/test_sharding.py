"""Data parallelism over requests and context parallelism over a request's pools
(glm5_jax.sharding) on 4 host CPU devices: each check runs tests/sharded_checks.py in a
process of its own (XLA_FLAGS is read when jax first starts a backend, and this process
has one CPU device by then). On GPUs, all of them at once:
`python tests/sharded_checks.py --devices 2`."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import jax
import pytest

from glm5_jax._primitive import SPLIT_GROUPS, Op, local_ids

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


@pytest.mark.slow
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


def test_every_primitive_under_plain_jit():
  """Each op of OPS under plain jax.jit on operands split over 4 devices (global ids,
  each device's in its block) equals the op on one device bit for bit, its compiled
  program holds no collective and its results are split likewise; an id moved into
  another device's block acts as an out-of-range id (SPEC D4)."""
  run_check("jit_primitives")


@pytest.mark.slow
def test_plain_jit_stage_equals_unsharded_stage():
  """indexer_stage under plain jax.jit (cache donated) on arguments laid out as
  request_specs with global ids equals the stage on one device and data_parallel_stage
  bit for bit, with outputs split by request and no collective (all-gather,
  all-to-all, collective-permute, ...) in the compiled step; the same check sees the
  gathers of the reference composition (the control)."""
  run_check("jit_stage")


@pytest.mark.slow
def test_plain_jit_serving_step_equals_unsharded_step():
  """serving.indexer_step under plain jax.jit, packed metadata of the whole batch split
  along its requests, equals the step on one device bit for bit, with no collective."""
  run_check("jit_step")


@pytest.mark.slow
def test_context_parallel_select_equals_one_device():
  """context_parallel_select (each request's pools split over 2 and 4 devices, a local
  top-k per device and an exact merge of the gathered candidates) equals select_pools on
  one device and the reference top-k of the whole logits bit for bit, on ties, NaN,
  +-inf and -0 logits, rows with <= k pools, rows on one device, max_pools not a multiple
  of k; the only collective compiled is the all-gather of the D * k candidates;
  context_parallel_topk equals pool_topk; bad layouts are named at trace time."""
  run_check("context")


@pytest.mark.slow
def test_context_parallel_stage_equals_one_device():
  """context_parallel_stage (each request's pools and their pages split over 2 and 4
  devices; the update path replicated, each completed pool written by the device that
  holds its slot; the selection merged from the gathered candidates) equals
  indexer_stage on one device bit for bit, outputs and cache, over two donated steps,
  with the update part as three ops, as XLA's GEMM + update_epilogue and as indexer_update's
  one call (IndexerConfig(update="ops"), "auto", "fused");
  the candidates' all-gather is its only collective."""
  run_check("context_stage")


def test_data_parallel_errors_name_the_argument():
  run_check("errors")


@pytest.mark.slow
def test_decode_loop_demo_on_two_devices():
  """`examples/decode_loop.py --devices 2`, small: 3 requests in blocks over 2 host CPU
  devices (one pad request), the script forcing the device count itself; each device's
  shard equals its single-device reference run bit for bit."""
  root = str(SCRIPT.parent.parent)
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  # The script sets the count itself only where XLA_FLAGS does not force one already.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  done = subprocess.run([sys.executable, "examples/decode_loop.py", "--devices", "2",
                         "--steps", "3", "--layers", "1", "--contexts", "30,2100,700"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "data-parallel over 2 devices (2 requests each, 1 pad request(s))" in done.stdout
  for d in range(2):
    assert f"device {d}: check: every step's selected slots" in done.stdout, done.stdout
  assert done.stdout.rstrip().endswith("ok")


def test_every_op_declares_a_split():
  """Plain jit partitions every op (an op without a Split would be gathered)."""
  for name, op in Op.registry.items():
    assert op.split is not None, name
    assert set(op.split.operands + op.split.results) <= {*SPLIT_GROUPS, None}


def test_local_ids():
  """Ids in the device's block lose its start; negative ids stay; others are `size`."""
  ids = np.asarray([-1, 0, 9, 10, 14, 15, 40], np.int32)
  assert local_ids(ids, 2, 5).tolist() == [-1, 5, 5, 0, 4, 5, 5]


def test_put_keeps_an_array_already_laid_out():
  """sharding.put returns a jax.Array whose sharding is already equivalent to the target
  (a step's returned cache, its spec written in full rank) as it is: a second Array over
  the same buffers would block the next step's donation. Other leaves are put."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from glm5_jax import sharding
  m = Mesh(np.asarray(jax.devices()[:1]), ("r",))
  a = jax.device_put(np.arange(12, dtype=np.int32).reshape(4, 3), NamedSharding(m, P("r", None)))
  kept, moved = sharding.put(m, (P("r"), P()), (a, np.ones(3, np.float32)))
  assert kept is a
  assert isinstance(moved, jax.Array) and moved.sharding.is_equivalent_to(NamedSharding(m, P()), 1)
