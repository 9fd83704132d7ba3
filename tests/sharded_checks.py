"""The sharded checks, each run by tests/test_sharding.py in a process of its own:
jax reads XLA_FLAGS when it first starts a backend, and the suite's process has one CPU
device by then. Here the host platform has DEVICES devices.

  python tests/sharded_checks.py <check>      (prints "ok <check>")
"""
import os
import re
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax import serving, sharding, synthetic  # noqa: E402
from glm5_jax.testing.cases import CASES, tree_bytes  # noqa: E402

AXIS = "data"
CONFIG = glm5_jax.IndexerConfig(max_pools=1024)
STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))
# Each device's requests: causal-fill rows (<= 512 pools) and top-k rows side by side;
# device 2 has only causal-fill rows (the reference's branch differs between devices).
CONTEXTS = [[10, 2500], [3001, 77], [1500, 300], [40, 2999]]
NEXT_N = 2
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|"
                        r"reduce-scatter|collective-broadcast)(-start)?\(")


def mesh(axis_type):
  return jax.make_mesh((DEVICES,), (AXIS,), axis_types=(axis_type,))


def assert_bits_equal(got, want, what):
  got, want = tree_bytes(got), tree_bytes(want)
  assert len(got) == len(want), what
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.shape == w.shape and np.array_equal(g, w), f"{what}: leaf {i} differs"


def shard(d, tree):
  """Device d's shards of a tree of sharded arrays."""
  return jax.tree.map(lambda a: a.addressable_shards[d].data, tree)


def device_state(d):
  """One device's stage input, as for a single device: device-local page, block and
  tail-block ids (synthetic builds each request's from 0). Every device gets the same
  shapes (the same max context), other contents."""
  rng = np.random.default_rng(100 + d)
  contexts = CONTEXTS[d]
  cache, pt, bt = synthetic.decode_cache(rng, len(contexts), 3100 + NEXT_N, next_n=NEXT_N,
                                         page=16, spare_pages=2)
  pos = np.asarray(contexts)[:, None] + np.arange(NEXT_N)
  pos[0, 1] = -1 if d == 1 else pos[0, 1]                    # a padding row
  batch = synthetic.decode_batch(pos, cache, pt, bt)
  x, qr = synthetic.inputs(rng, pos.size, hidden=512, q_lora=256)
  return cache, x, qr, batch


def weights():
  return synthetic.layer(np.random.default_rng(7), CONFIG, hidden=512, q_lora=256)


def check_primitives():
  """Every op under jax.shard_map, each device with its own operands (caches
  included), equals the op run on each device's operands alone, bit for bit."""
  m = mesh(jax.sharding.AxisType.Explicit)
  for name in glm5_jax.OPS:
    case = CASES[name]
    parts = [case.make(np.random.default_rng(d)) for d in range(DEVICES)]
    stacked = [np.stack([np.asarray(p[i]) for p in parts]) for i in range(len(parts[0]))]
    stacked = sharding.put(m, [P(AXIS)] * len(stacked), stacked)

    def body(*args, case=case):
      outs = case.fn(*(a[0] for a in args))
      outs = outs if isinstance(outs, tuple) else (outs,)
      return tuple(o[None] for o in outs)

    got = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(AXIS), out_specs=P(AXIS)))(*stacked)
    for d, args in enumerate(parts):
      want = jax.jit(case.fn)(*args)
      want = want if isinstance(want, tuple) else (want,)
      assert_bits_equal([np.asarray(o)[d] for o in got], want, f"{name} on device {d}")


def sharded_inputs():
  parts = [device_state(d) for d in range(DEVICES)]
  specs = sharding.request_specs(AXIS)
  host = sharding.assemble((specs.cache, specs.rows, specs.rows, specs.batch), parts)
  return parts, host


def check_collectives(compiled, what):
  text = compiled.as_text()
  found = sorted({m.group(0) for m in COLLECTIVE.finditer(text)})
  assert not found, f"{what}: the compiled step holds collectives {found}"
  # The donated caches stay in place: both are aliased to outputs.
  assert re.search(r"input_output_alias=\{[^\n]*\{4\}: \(5, \{\}, may-alias\)", text), what


def check_stage():
  """data_parallel_stage on 4 devices equals indexer_stage on each device's shard alone,
  bit for bit, with no collective in the compiled step (both mesh axis types)."""
  w = weights()
  parts, host = sharded_inputs()
  want = [STEP(w, *p, config=CONFIG) for p in parts]
  for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    m = mesh(axis_type)
    specs = sharding.request_specs(AXIS)
    step = sharding.data_parallel_stage(m, AXIS)
    args = sharding.put(m, (specs.weights, specs.cache, specs.rows, specs.rows,
                            specs.batch), (w, *host))
    check_collectives(step.lower(*args, config=CONFIG).compile(), f"stage {axis_type}")
    kv_pointer = args[1].kv_cache.addressable_shards[0].data.unsafe_buffer_pointer()
    out, cache = step(*args, config=CONFIG)
    assert args[1].kv_cache.is_deleted(), "the cache is donated"
    assert cache.kv_cache.addressable_shards[0].data.unsafe_buffer_pointer() == kv_pointer
    assert out.slots.sharding.spec == P(AXIS) or out.slots.sharding.spec == P(AXIS, None)
    for d, (want_out, want_cache) in enumerate(want):
      assert_bits_equal(shard(d, (out, cache)), (want_out, want_cache),
                        f"stage {axis_type}, device {d}")
    if axis_type == jax.sharding.AxisType.Auto:
      # The check sees collectives where they are: plain jit of the same sharded
      # arguments (global ids, no locality known) gathers.
      plain = STEP.lower(*args, config=CONFIG).compile().as_text()
      assert COLLECTIVE.search(plain), "plain jit was expected to gather"
    # the reference composition too
    args = sharding.put(m, (specs.weights, specs.cache, specs.rows, specs.rows,
                            specs.batch), (w, *host))
    ref = step(*args, config=CONFIG, use_reference=True)
    assert_bits_equal(ref, (out, cache), f"use_reference=True {axis_type}")


def check_serving_step():
  """data_parallel_step (packed metadata split along its requests) equals the serving
  step on each device's shard alone, bit for bit, with no collective."""
  w = weights()
  m = mesh(jax.sharding.AxisType.Explicit)
  specs = sharding.request_specs(AXIS)
  parts = []
  for d in range(DEVICES):
    cache, x, qr, batch = device_state(d)
    ring = cache.tail.shape[2]
    packed = serving.decode_metadata(np.asarray(batch.positions),
                                     np.asarray(batch.page_table), page=16, ring=ring)
    parts.append((cache, x, qr, packed, batch.page_table, batch.block_table))
  step_specs = (specs.cache, specs.rows, specs.rows, specs.packed, specs.batch.page_table,
                specs.batch.block_table)
  host = sharding.assemble(step_specs, parts)
  one = jax.jit(serving.indexer_step, static_argnames=("config", "use_reference"))
  want = [one(w, *p, config=CONFIG) for p in parts]
  step = sharding.data_parallel_step(m, AXIS)
  args = sharding.put(m, (specs.weights,) + step_specs, (w, *host))
  check_collectives(step.lower(*args, config=CONFIG).compile(), "serving step")
  out = step(*args, config=CONFIG)
  for d, wanted in enumerate(want):
    assert_bits_equal(shard(d, out), wanted, f"serving step, device {d}")


def check_errors():
  """Arguments that do not divide over the devices are named at trace time."""
  m = mesh(jax.sharding.AxisType.Auto)
  w = weights()
  cache, x, qr, batch = device_state(0)                  # 2 requests: not 4 devices' worth
  step = sharding.data_parallel_stage(m, AXIS)
  cache = glm5_jax.IndexerCache(jnp.concatenate([cache.kv_cache] * 4), cache.tail)
  try:
    step(w, cache, x, qr, batch, config=CONFIG)
  except ValueError as e:
    assert str(e).startswith("glm5_jax.data_parallel_stage: cache.tail dim 0 must be a "
                             "multiple of the 4 devices of mesh axis 'data'"), e
  else:
    raise AssertionError("no error")
  try:
    sharding.data_parallel_stage(m, "model")
  except ValueError as e:
    assert str(e).startswith("glm5_jax.data_parallel_stage: axis 'model' is not an axis"), e
  else:
    raise AssertionError("no error")


if __name__ == "__main__":
  assert len(jax.devices()) == DEVICES, jax.devices()
  globals()[f"check_{sys.argv[1]}"]()
  print(f"ok {sys.argv[1]}")
