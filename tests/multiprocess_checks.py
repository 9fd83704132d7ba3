"""The decode step over several processes (glm5_jax.distributed): each process of one
multi-process jax program runs this script; tests/test_multiprocess.py starts 2 of them
with 2 host CPU devices each (glm5_jax.distributed.launch), the GPU variant one per GPU.

  GLM5_JAX_PROCESSES=N GLM5_JAX_PROCESS_ID=i GLM5_JAX_COORDINATOR=host:port \\
      python tests/multiprocess_checks.py [--devices K] [check ...]

or, on one host, `python -c "from glm5_jax import distributed; distributed.launch([...])"`
(the test does). K host CPU devices per process (default 2; on a GPU machine jax picks
the GPUs instead, JAX_LOCAL_DEVICE_IDS choosing each process's). Every check builds the
requests of the devices this process holds, runs the sharded steps on the global mesh and
gathers their outputs and caches whole; then one process (OWNER) compares them with the
same requests run on one device (its first), bit for bit, and prints "ok <check>" (a
failure is printed and the later checks still run; the exit status says whether all
passed). Checks (default: data and context): data (the decode loop data-parallel:
data_parallel_step with the caches and the packed metadata donated, serving.advance on
the device through data_parallel_advance),
jit (serving.indexer_step under plain jax.jit on global ids: the ops' partitioning
rules), context (context_parallel_stage: each request's pools over every process's
devices, the candidates gathered across processes), and die (not run by default: the
last process exits mid-run; the others must be terminated by the coordination service,
never left waiting in a collective).
"""
import argparse
import functools
import os
import sys
import time
import traceback

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--devices", type=int, default=2, help="host CPU devices per process")
ARGS.add_argument("--timeout", type=int, default=60, help="initialize's timeout_s")
ARGS.add_argument("--heartbeat", type=int, default=30, help="initialize's heartbeat_s")
ARGS.add_argument("checks", nargs="*")
ARGS = ARGS.parse_args()
# This process's count, whatever XLA_FLAGS held (only host CPU devices: GPUs stay GPUs).
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if "xla_force_host_platform_device_count" not in f]
    + [f"--xla_force_host_platform_device_count={ARGS.devices}"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax import distributed, serving, sharding, synthetic  # noqa: E402

# Before any computation: jax starts its backends with the distributed client.
distributed.initialize(timeout_s=ARGS.timeout, heartbeat_s=ARGS.heartbeat)

import sharded_checks as sc  # noqa: E402  (the one-process checks' builders)

if jax.default_backend() == "cpu":
  # The hidden and q_lora sizes of the other CPU tests: the CPU runs the reference's
  # GEMMs, whose sums are batch-invariant there (sc.DIMS's GLM-5.3 sizes are for GPUs).
  sc.DIMS = dict(hidden=512, q_lora=256)

AXIS, CONTEXT_AXIS = sc.AXIS, sc.CONTEXT_AXIS
STEPS = 3
PAGE = 16                       # sc.device_state's pages
ONE = jax.local_devices()[0]    # the one-device runs


# The process that runs each check's one-device program (they alternate, so each
# compiles once in all): the sharded results are gathered whole to it.
OWNER = {"data": 0, "context": 1, "jit": 0, "die": 0}


def on_one(tree):
  return jax.device_put(tree, ONE)


def owns(check):
  return OWNER[check] % jax.process_count() == jax.process_index()


def donated_copy(mesh, specs, tree):
  """A copy of placed arrays that XLA may update in place (an array made from numpy may
  alias host memory on the CPU, and is then copied rather than donated)."""
  return jax.device_put(tree, sharding.shardings(mesh, specs), may_alias=False)


def my_block(spec, a, devices, mine):
  """This process's block (its devices `mine` of `devices`) of a whole host array laid
  out as `spec` (replicated: the whole array)."""
  dim, a = sharding._split_dim(spec), np.asarray(a)
  return a if dim is None else np.concatenate(
      np.split(a, devices, axis=dim)[mine[0]:mine[-1] + 1], axis=dim)


def check_data():
  """The decode loop data-parallel over every process's devices (device-local ids): each
  process feeds its devices' requests, caches and tables; STEPS steps of
  data_parallel_step, the next packed metadata computed on the device
  (data_parallel_advance), caches and metadata donated, the caches updated in place.
  Every step's outputs, the final caches and metadata equal each device's requests run
  alone on one device (the same loop with serving.indexer_step and serving.advance) bit
  for bit."""
  m = distributed.global_mesh((AXIS,))
  mine, devices = distributed.local_indexes(m), m.devices.size
  specs = sharding.request_specs(AXIS)
  arg_specs = (specs.cache, specs.rows, specs.rows, specs.packed, specs.batch.page_table,
               specs.batch.block_table, specs.rows)

  def device_args(d):
    cache, x, qr, batch = sc.device_state(d)
    accepted = np.full(batch.positions.shape[0], sc.NEXT_N, np.int32)
    return (cache, x, qr, batch.packed(), batch.page_table, batch.block_table, accepted)
  w = sc.weights()
  local = sharding.assemble(arg_specs, [device_args(d) for d in mine])
  args = distributed.from_local(m, arg_specs, local)
  sc.assert_bits_equal(distributed.to_local(args), local, "to_local(from_local(...))")
  ring = local[0].tail.shape[2]
  cache = donated_copy(m, specs.cache, args[0])
  layer = sharding.data_parallel_step(m, AXIS)
  advance = sharding.data_parallel_advance(m, AXIS)

  @functools.partial(jax.jit, donate_argnums=(1, 4))
  def step(w, cache, x, qr, packed, page_table, block_table, accepted):
    out, cache = layer(w, cache, x, qr, packed, page_table, block_table, config=sc.CONFIG)
    return out, cache, advance(packed, page_table, page=PAGE, ring=ring, accepted=accepted)

  _, x, qr, packed, page_table, block_table, accepted = args
  weights = distributed.from_local(m, specs.weights, w)
  pointer = cache.kv_cache.addressable_shards[0].data.unsafe_buffer_pointer()
  got = []
  for _ in range(STEPS):
    before = cache
    out, cache, packed = step(weights, cache, x, qr, packed, page_table, block_table,
                              accepted)
    assert before.kv_cache.is_deleted(), "the cache is donated"
    got.append(out)
  assert cache.kv_cache.addressable_shards[0].data.unsafe_buffer_pointer() == pointer, \
      "the cache stays in place"
  whole = distributed.gather(m, (got, cache, packed))

  @functools.partial(jax.jit, donate_argnums=(1, 4))
  def alone(w, cache, x, qr, packed, page_table, block_table, accepted):
    out, cache = serving.indexer_step(w, cache, x, qr, packed, page_table, block_table,
                                      config=sc.CONFIG)
    return out, cache, serving.advance(packed, page_table, page=PAGE, ring=ring,
                                       accepted=accepted)

  def compare():
    for d in range(devices):
      c, x, qr, p, pt, bt, a = on_one(device_args(d))
      want = []
      for _ in range(STEPS):
        out, c, p = alone(on_one(w), jax.tree.map(jnp.copy, c), x, qr, p, pt, bt, a)
        want.append(out)
      got_d = jax.tree.map(lambda spec, a, d=d: my_block(spec, a, devices, [d]),
                           ([specs.output] * STEPS, specs.cache, specs.packed), whole,
                           is_leaf=sharding._is_spec)
      sc.assert_bits_equal(got_d, (want, c, p), f"data-parallel loop, device {d}")
  return compare


def check_jit():
  """serving.indexer_step under plain jax.jit on global ids (each device's requests'
  pages, tail blocks and table rows in its block, sharding.to_global), arguments laid
  out as request_specs over every process's devices, each process feeding its block,
  the cache donated, two steps with host-built metadata: equal to the whole batch's
  steps on one device bit for bit. Only the ops' partitioning rules split the step."""
  m = distributed.global_mesh((AXIS,))
  mine, devices = distributed.local_indexes(m), m.devices.size
  specs = sharding.request_specs(AXIS)
  arg_specs = (specs.cache, specs.rows, specs.rows, specs.packed, specs.batch.page_table,
               specs.batch.block_table)
  w = sc.weights()

  def global_args(d, t):
    cache, x, qr, batch = sc.device_state(d)
    batch = synthetic.decode_batch(np.asarray(batch.positions) + t * sc.NEXT_N, cache,
                                   batch.page_table, batch.block_table)
    batch = sharding.to_global(d, cache, batch)
    return (cache, x, qr, glm5_jax.DecodeBatch.pack(batch.positions, batch.loc,
                                                    batch.tslot, batch.req_ids),
            batch.page_table, batch.block_table)

  step = jax.jit(serving.indexer_step, static_argnames=("config", "use_reference"),
                 donate_argnames="cache")
  weights, cache, got = distributed.from_local(m, specs.weights, w), None, []
  for t in range(2):
    args = distributed.from_local(m, arg_specs, sharding.assemble(
        arg_specs, [global_args(d, t) for d in mine]))
    cache = donated_copy(m, specs.cache, args[0]) if cache is None else cache
    out, cache = step(weights, cache, *args[1:], config=sc.CONFIG)
    got.append(out)
  whole = distributed.gather(m, (got, cache))

  def compare():
    want_cache, want = None, []
    for t in range(2):
      one = on_one(sharding.assemble(arg_specs, [global_args(d, t) for d in range(devices)]))
      out, want_cache = step(on_one(w), one[0] if want_cache is None else want_cache,
                             *one[1:], config=sc.CONFIG)
      want.append(out)
    got, got_cache = whole
    for t in range(2):      # (on a GPU, w_out within an ulp: sc.assert_step_equal)
      last = t == len(got) - 1
      sc.assert_step_equal((got[t], got_cache if last else None),
                           (want[t], want_cache if last else None), f"plain jit, step {t}")
  return compare


def check_context():
  """context_parallel_stage with each request's pools over every process's devices (the
  K cache split by pages, each process feeding its block; the page table by columns;
  the rest replicated), two steps with the cache donated: outputs and caches equal
  indexer_stage on one device bit for bit; the D * k candidates' all-gather crosses the
  processes."""
  m = distributed.global_mesh((CONTEXT_AXIS,))
  mine, devices = distributed.local_indexes(m), m.devices.size
  specs = sharding.context_stage_specs(CONTEXT_AXIS)
  arg_specs = (specs.weights, specs.cache, specs.rows, specs.rows, specs.batch)
  w = sc.weights()
  cache, x, qr, batch = sc.context_stage_inputs(devices)
  step = sharding.context_parallel_stage(m, CONTEXT_AXIS)
  batches = [synthetic.decode_batch(np.asarray(batch.positions) + t * sc.NEXT_N, cache,
                                    batch.page_table, batch.block_table) for t in range(2)]
  got_cache, got = None, []
  for b in batches:
    args = distributed.from_local(m, arg_specs, jax.tree.map(
        lambda spec, a: my_block(spec, a, devices, mine), arg_specs, (w, cache, x, qr, b),
        is_leaf=sharding._is_spec))
    got_cache = donated_copy(m, specs.cache, args[1]) if got_cache is None else got_cache
    before = got_cache
    out, got_cache = step(args[0], got_cache, *args[2:], config=sc.CONFIG)
    assert before.kv_cache.is_deleted(), "the cache is donated"
    got.append(out)
  whole = distributed.gather(m, (got, got_cache))

  def compare():
    want_cache, want = on_one(cache), []
    for b in batches:
      out, want_cache = sc.STEP(*on_one((w, want_cache, x, qr, b)), config=sc.CONFIG)
      want.append(out)
    sc.assert_bits_equal(whole, (want, want_cache), "context stage, two steps")
  return compare


def check_die():
  """The last process exits after a first collective; the others go on into collectives
  and must be ended by the coordination service (heartbeat_s), not wait."""
  m = distributed.global_mesh((AXIS,))
  ones = distributed.from_local(m, jax.sharding.PartitionSpec(AXIS),
                                np.ones(len(jax.local_devices()), np.int32))
  total = jax.jit(lambda a: a.sum())
  print(f"collective: {int(total(ones))}", flush=True)
  if jax.process_index() == jax.process_count() - 1:
    print("exiting", flush=True)
    os._exit(3)
  end = time.monotonic() + 10 * ARGS.heartbeat
  while time.monotonic() < end:
    total(ones).block_until_ready()
    time.sleep(0.05)
  raise AssertionError(f"still running {10 * ARGS.heartbeat} s after a process died")


def run(name, part):
  """Runs one part of check `name`; returns its result, or None after printing the
  failure (recorded in FAILED)."""
  try:
    return part()
  except Exception:                                    # noqa: BLE001
    traceback.print_exc()
    FAILED.append(name)
    print(f"FAILED {name}", flush=True)


FAILED = []

if __name__ == "__main__":
  checks = ARGS.checks or ["data", "context"]
  print(f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} of {jax.device_count()} {jax.devices()[0].platform} "
        f"devices: {', '.join(checks)}", flush=True)
  # Every process runs every check's sharded steps (they are collective), then the
  # one-device runs it owns, alongside the other processes' own.
  t0 = time.perf_counter()
  compares = {name: run(name, globals()[f"check_{name}"]) for name in checks}
  print(f"sharded steps done ({time.perf_counter() - t0:.1f} s)", flush=True)
  for name, compare in compares.items():
    if name in FAILED or compare is None or not owns(name):
      continue
    t0 = time.perf_counter()
    if run(name, compare) is None and name not in FAILED:
      print(f"ok {name} (compared with one device here, {time.perf_counter() - t0:.1f} s)",
            flush=True)
  sys.exit(f"failed: {', '.join(FAILED)}" if FAILED else 0)
