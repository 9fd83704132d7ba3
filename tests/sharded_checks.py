"""The sharded checks. tests/test_sharding.py runs each in a process of its own on 4
host CPU devices: jax reads XLA_FLAGS when it first starts a backend, and the suite's
process has one CPU device by then.

  python tests/sharded_checks.py [--devices N] [check ...]   (no check: every check)

prints "ok <check>" per check. N (default 4) devices of jax's default backend: the GPUs
where there are N (the two-GPU run: `python tests/sharded_checks.py --devices 2`), else
N host CPU devices (the flag below; JAX_PLATFORMS=cpu forces them).
"""
import argparse
import dataclasses
import functools
import itertools
import os
import re
import sys
import traceback
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--devices", type=int, default=4)
ARGS.add_argument("checks", nargs="*")
ARGS = ARGS.parse_args() if __name__ == "__main__" else ARGS.parse_args([])
DEVICES = ARGS.devices
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the root: glm5_testing
# Only adds host CPU devices: on a GPU machine jax still picks its GPUs. (Imported, as
# tests/multiprocess_checks.py does for its builders, the importer sets its own count.)
if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={DEVICES}")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax import serving, sharding, synthetic  # noqa: E402
from glm5_jax._primitive import Op  # noqa: E402
from glm5_testing.cases import CASES, tree_bytes  # noqa: E402

AXIS = "data"
CONFIG = glm5_jax.IndexerConfig(max_pools=1024)
# GLM-5.3-Flash's hidden and q_lora sizes: the default routing then runs the projection
# kernel, whose sums per row do not depend on the rows beside it. At hidden 512 no tactic
# tiles K, both programs ran XLA's GEMM, and on the H200 XLA's GEMM of a device's 4 rows
# rounded 1 of 1024 keys differently from its GEMM of all 8 (2026-11-30): XLA's GEMMs are
# not batch-invariant on a GPU (sharding.py).
DIMS = dict(hidden=synthetic.HIDDEN, q_lora=synthetic.Q_LORA)
STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))
# Each device's requests (device d: CONTEXTS[d % 4]): causal-fill rows (<= 512 pools)
# and top-k rows side by side; device 2 has only causal-fill rows (the reference's branch
# differs between devices), device 1 a padding row.
CONTEXTS = [[10, 2500], [3001, 77], [1500, 300], [40, 2999]]
NEXT_N = 2
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|"
                        r"reduce-scatter|collective-broadcast)(-start)?\(")


def mesh(axis_type):
  return jax.make_mesh((DEVICES,), (AXIS,), axis_types=(axis_type,),
                       devices=jax.devices()[:DEVICES])


def differing_leaves(got, want, what):
  """[(leaf index, what differs)] of the leaves whose bytes differ, in tree order."""
  leaves = jax.tree.leaves(want)
  got, want = tree_bytes(got), tree_bytes(want)
  assert len(got) == len(want), what
  return [(i, difference(g, w, leaves[i].dtype) if g.shape == w.shape
           else f"shape {g.shape} vs {w.shape}")
          for i, (g, w) in enumerate(zip(got, want))
          if g.shape != w.shape or not np.array_equal(g, w)]


def assert_bits_equal(got, want, what):
  bad = differing_leaves(got, want, what)
  assert not bad, f"{what}: leaf {bad[0][0]} differs: {bad[0][1]}"


def difference(g, w, dtype):
  """Where two leaves' bytes differ, in the leaf's own elements (for the message)."""
  g, w = g.view(dtype), w.view(dtype)
  off = np.argwhere(g != w)
  text = f"{len(off)} of {g.size} {np.dtype(dtype).name} values, first at {off[:3].tolist()}"
  if np.issubdtype(np.dtype(dtype), np.floating) or dtype == jnp.bfloat16:
    gf, wf = g.astype(np.float64), w.astype(np.float64)
    text += f", max |rel| {np.nanmax(np.abs(gf - wf) / np.maximum(np.abs(wf), 1e-30)):.3g}"
  return text


def assert_step_equal(got, want, what):
  """A whole step under plain jit against the step on one device with all the rows:
  bit for bit, except on a GPU IndexerOutput.w_out. There the stage's q GEMM (XLA's, on
  each device's rows) runs at another row count than on one device, and cuBLAS may sum
  in another order (SPEC D2: a GEMM's summation order is not part of the contract); q's
  fp8 codes come out the same but its per-row scale, which w_out carries, can move by
  an ulp. Everything our primitives compute is bit-equal (check_jit_primitives) and the
  same step against data_parallel_stage (same rows per device) is compared bit for bit."""
  if jax.default_backend() == "cpu":
    return assert_bits_equal(got, want, what)
  (out, cache), (ref_out, ref_cache) = got, want
  np.testing.assert_allclose(np.asarray(out.w_out, np.float64),
                             np.asarray(ref_out.w_out, np.float64), rtol=2.0 ** -7, atol=0,
                             err_msg=f"{what}: w_out")
  assert_bits_equal((out.q_fp8, out.slots, out.counts, cache),
                    (ref_out.q_fp8, ref_out.slots, ref_out.counts, ref_cache), what)


def shard(d, tree):
  """Device d's shards of a tree of sharded arrays."""
  return jax.tree.map(lambda a: a.addressable_shards[d].data, tree)


def device_state(d):
  """One device's stage input, as for a single device: device-local page, block and
  tail-block ids (synthetic builds each request's from 0). Every device gets the same
  shapes (the same max context), other contents."""
  rng = np.random.default_rng(100 + d)
  contexts = CONTEXTS[d % len(CONTEXTS)]
  cache, pt, bt = synthetic.decode_cache(rng, len(contexts), 3100 + NEXT_N, next_n=NEXT_N,
                                         page=16, spare_pages=2)
  pos = np.asarray(contexts)[:, None] + np.arange(NEXT_N)
  pos[0, 1] = -1 if d == 1 else pos[0, 1]                    # a padding row
  batch = synthetic.decode_batch(pos, cache, pt, bt)
  x, qr = synthetic.inputs(rng, pos.size, **DIMS)
  return cache, x, qr, batch


def weights():
  return synthetic.layer(np.random.default_rng(7), CONFIG, **DIMS)


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
      mine = tuple(np.asarray(o)[d] for o in got)
      assert_bits_equal(outputs(case, args, mine), outputs(case, args, jax.jit(case.fn)(*args)),
                        f"{name} on device {d}")


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
    args = list(sharding.put(m, (specs.weights, specs.cache, specs.rows, specs.rows,
                                 specs.batch), (w, *host)))
    check_collectives(step.lower(*args, config=CONFIG).compile(), f"stage {axis_type}")
    # A cache put from numpy may alias host memory on the CPU (not XLA's to reuse in
    # place): a copy of its own.
    args[1] = jax.device_put(args[1], sharding.shardings(m, specs.cache), may_alias=False)
    kv_pointer = args[1].kv_cache.addressable_shards[0].data.unsafe_buffer_pointer()
    out, cache = step(*args, config=CONFIG)
    assert args[1].kv_cache.is_deleted(), "the cache is donated"
    assert cache.kv_cache.addressable_shards[0].data.unsafe_buffer_pointer() == kv_pointer
    assert out.slots.sharding.spec == P(AXIS) or out.slots.sharding.spec == P(AXIS, None)
    for d, (want_out, want_cache) in enumerate(want):
      assert_bits_equal(shard(d, (out, cache)), (want_out, want_cache),
                        f"stage {axis_type}, device {d}")
    # The reference composition too, against itself on each device's shard alone (at
    # GLM-5.3 sizes the kernels' GEMM sums in another order than XLA's: SPEC D2).
    args = sharding.put(m, (specs.weights, specs.cache, specs.rows, specs.rows,
                            specs.batch), (w, *host))
    ref = step(*args, config=CONFIG, use_reference=True)
    for d, p in enumerate(parts):
      assert_bits_equal(shard(d, ref), STEP(w, *p, config=CONFIG, use_reference=True),
                        f"use_reference=True {axis_type}, device {d}")


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
  cache, x, qr, batch = device_state(0)       # 2 requests: not DEVICES (> 2) devices' worth
  step = sharding.data_parallel_stage(m, AXIS)
  cache = glm5_jax.IndexerCache(jnp.concatenate([cache.kv_cache] * DEVICES),
                                jnp.concatenate([cache.tail] * DEVICES)[:-1])
  try:
    step(w, cache, x, qr, batch, config=CONFIG)
  except ValueError as e:
    assert str(e).startswith("glm5_jax.data_parallel_stage: cache.tail dim 0 must be a "
                             f"multiple of the {DEVICES} devices of mesh axis 'data'"), e
  else:
    raise AssertionError("no error")
  try:
    sharding.data_parallel_stage(m, "model")
  except ValueError as e:
    assert str(e).startswith("glm5_jax.data_parallel_stage: axis 'model' is not an axis"), e
  else:
    raise AssertionError("no error")


# Plain jax.jit, global ids (module glm5_jax.sharding, form 1) -------------------------

# The operands of CASES' ops that hold ids into a split group: {operand: the size of a
# device's block of those ids, of its (device-local) operands}.
IDS = {
    "kpool_update": {2: lambda a: a[1].shape[0] * a[1].shape[2],      # tslot: tail slots
                     6: lambda a: a[0].shape[0] * a[0].shape[1]},     # loc: cache slots
    "kpool_compress": {4: lambda a: a[0].shape[0] * a[0].shape[1]},
    "kpool_seed_tail": {3: lambda a: a[0].shape[0] * a[0].shape[2]},
    "indexer_update": {7: lambda a: a[6].shape[0] * a[6].shape[2],    # tslot: tail slots
                       9: lambda a: a[5].shape[0] * a[5].shape[1]},   # loc: cache slots
    "update_epilogue": {6: lambda a: a[5].shape[0] * a[5].shape[2],   # tslot: tail slots
                        8: lambda a: a[4].shape[0] * a[4].shape[1]},  # loc: cache slots
    "update_epilogue_q": {7: lambda a: a[6].shape[0] * a[6].shape[2],  # tslot: tail slots
                          9: lambda a: a[5].shape[0] * a[5].shape[1]},  # loc: cache slots
    "indexer_update_q": {8: lambda a: a[7].shape[0] * a[7].shape[2],   # tslot: tail slots
                         10: lambda a: a[6].shape[0] * a[6].shape[1]},  # loc: cache slots
    # indexer_update_q's, then the page table's pages and req_ids' requests
    "indexer_update_select": {8: lambda a: a[7].shape[0] * a[7].shape[2],
                              10: lambda a: a[6].shape[0] * a[6].shape[1],
                              12: lambda a: a[6].shape[0], 13: lambda a: a[12].shape[0]},
    "expand_and_remap": {2: lambda a: a[3].shape[0]},                 # req_ids: requests
    "mqa_logits": {3: lambda a: a[2].shape[0]},                       # page ids: pages
    "select_pools": {3: lambda a: a[2].shape[0], 4: lambda a: a[3].shape[0]},
    "select_slots": {3: lambda a: a[2].shape[0], 4: lambda a: a[3].shape[0]},
}


def shift(ids, d, size):
  ids = np.asarray(ids)
  return np.where(ids >= 0, ids + d * size, ids).astype(ids.dtype)


def global_case(name):
  """(host operands, their specs) of op `name` on DEVICES devices: device d's block is
  CASES' operands of seed d with their ids made global; replicated operands device 0's."""
  groups = Op.registry[name].split.operands
  parts = [CASES[name].make(np.random.default_rng(d)) for d in range(DEVICES)]
  args = []
  for i, group in enumerate(groups):
    if group is None:
      args.append(np.asarray(parts[0][i]))
      continue
    size = IDS.get(name, {}).get(i)
    args.append(np.concatenate([np.asarray(p[i]) if size is None else shift(p[i], d, size(p))
                                for d, p in enumerate(parts)]))
  return args, [P() if g is None else P(AXIS) for g in groups], parts


def outputs(case, args, outs):
  outs = outs if isinstance(outs, tuple) else (outs,)
  return case.valid(args, outs) if case.valid else outs


def assert_no_collective(compiled, what):
  text = compiled.as_text()
  found = sorted({m.group(0) for m in COLLECTIVE.finditer(text)})
  assert not found, f"{what}: the compiled program holds collectives {found}"


def check_jit_primitives():
  """Every op under plain jax.jit on operands split over the devices (global ids, each
  device's ids in its block) equals the op on one device bit for bit, holds no
  collective and returns its results split likewise; an id moved into another device's
  block acts as an out-of-range id (SPEC D4)."""
  m = mesh(jax.sharding.AxisType.Auto)
  for name in glm5_jax.OPS:
    case, groups = CASES[name], Op.registry[name].split.results
    args, specs, parts = global_case(name)
    fn = jax.jit(case.fn)
    placed = sharding.put(m, specs, args)
    assert_no_collective(fn.lower(*placed).compile(), name)
    got = fn(*placed)
    for o, g in zip(got if isinstance(got, tuple) else (got,), groups):
      assert o.sharding.spec[:1] == ((AXIS,) if g else ()), (name, o.sharding)
    assert_bits_equal(outputs(case, args, got), outputs(case, args, fn(*args)), name)
    # D4: the last device's first id moved into device 0's block is out of range there;
    # on one device, the same row with an id out of range of the whole array.
    for i, size in IDS.get(name, {}).items():
      start = args[i].size // DEVICES * (DEVICES - 1)       # the last device's block
      at = start + np.flatnonzero(args[i].reshape(-1)[start:] >= 0)[0]
      moved, outside = [a.copy() for a in args], [a.copy() for a in args]
      moved[i].reshape(-1)[at] = 0
      outside[i].reshape(-1)[at] = DEVICES * size(parts[0])
      got = fn(*sharding.put(m, specs, moved))
      assert_bits_equal(outputs(case, moved, got), outputs(case, outside, fn(*outside)),
                        f"{name} operand {i}: an id of another device's block")


def global_inputs():
  """(cache, x, qr, batch) host trees of the whole step, global ids (sharding.to_global
  of each device's device_state), and the per-device states."""
  parts = [device_state(d) for d in range(DEVICES)]
  specs = sharding.request_specs(AXIS)
  glob = [(c, x, qr, sharding.to_global(d, c, b)) for d, (c, x, qr, b) in enumerate(parts)]
  return sharding.assemble((specs.cache, specs.rows, specs.rows, specs.batch), glob), parts


def check_jit_stage():
  """indexer_stage under plain jax.jit (cache donated) on arguments laid out as
  request_specs, global ids: bit-equal to the stage on one device, outputs split by
  request, no collective, the donated caches in place; and, split back per device,
  equal to data_parallel_stage on the device-local ids. Control: the reference
  composition (jnp, no partitioning rule) under the same jit gathers, and the check
  sees it."""
  w = weights()
  host, parts = global_inputs()
  want = STEP(w, *host, config=CONFIG)
  step = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"),
                 donate_argnames="cache")
  specs = sharding.request_specs(AXIS)
  arg_specs = (specs.weights, specs.cache, specs.rows, specs.rows, specs.batch)
  for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    m = mesh(axis_type)
    args = sharding.put(m, arg_specs, (w, *host))
    check_collectives(step.lower(*args, config=CONFIG).compile(), f"jit stage {axis_type}")
    got = step(*args, config=CONFIG)
    assert args[1].kv_cache.is_deleted(), "the cache is donated"
    for leaf in jax.tree.leaves(got):
      assert leaf.sharding.spec[:1] == (AXIS,), leaf.sharding
    try:
      assert_step_equal(got, want, f"jit stage {axis_type}")
    except AssertionError as e:
      raise AssertionError(f"{e}\n{explain_update(m, arg_specs, (w, *host))}") from None
    local = sharding.assemble(arg_specs, [(w, *p) for p in parts])
    shard_map = sharding.data_parallel_stage(m, AXIS)(*sharding.put(m, arg_specs, local),
                                                     config=CONFIG)
    # (slots hold the block_table's values, the same in both forms)
    assert_bits_equal(got, shard_map, f"jit stage == data_parallel_stage {axis_type}")
  # (an Explicit mesh refuses the reference's gathers of sharded operands at trace time)
  control = STEP.lower(*sharding.put(m, arg_specs, (w, *host)), config=CONFIG,
                       use_reference=True).compile().as_text()
  assert COLLECTIVE.search(control), "the reference under plain jit was expected to gather"


def explain_update(m, arg_specs, args):
  """Which op of the update path (stage.update_path's own composition, each op call
  recorded) first gives other bytes under plain jit on `m` than on one device: a
  diagnosis for a failed jit_stage check."""
  from glm5_jax import stage
  names = []

  def recorded(w, cache, x, qr, batch):
    ops, seen = stage._ops(CONFIG, False), []
    names.clear()

    class Recorder:
      def __getattr__(self, name):
        if not callable(getattr(ops, name)):    # (ops.kernels)
          return getattr(ops, name)

        def call(*a, **k):
          out = getattr(ops, name)(*a, **k)
          names.append(name)
          seen.append((a, out))
          return out
        return call
    b, n = batch.positions.shape
    stage.update_path(Recorder(), CONFIG, w, cache, x, qr, batch, b * n)
    return seen

  sharded = sharding.put(m, arg_specs, args)
  got = jax.jit(recorded)(*sharded)
  want = jax.jit(recorded)(*args)
  lines = [f"  {name} {what}[{i}]: {text}"
           for name, (g_in, g_out), (w_in, w_out) in zip(names, got, want)
           for what, g, w in (("inputs", g_in, w_in), ("outputs", g_out, w_out))
           for i, text in differing_leaves(g, w, name)] or ["  equal"]
  # What each program runs: its FFI calls with their attributes, and its other GEMMs.
  for what, a in (("plain jit", sharded), ("one device", args)):
    text = jax.jit(recorded).lower(*a).compile().as_text()
    calls = [f"{t} {c}" for t, c in re.findall(
        r'custom_call_target="(glm5_\w+)".*?backend_config=(\{[^}]*\})', text)]
    gemms = len(re.findall(r'custom_call_target="__cublas', text))
    lines.append(f"  {what} runs: {'; '.join(calls) or 'no FFI call'}; {gemms} cuBLAS calls")
  return "update path under plain jit vs one device:\n" + "\n".join(lines)


def check_jit_step():
  """serving.indexer_step under plain jax.jit, packed metadata of the whole batch
  (decode_metadata on the global page table) split along its requests: bit-equal to
  the step on one device, no collective."""
  w = weights()
  host, _ = global_inputs()
  cache, x, qr, batch = host
  packed = serving.decode_metadata(batch.positions, batch.page_table,
                                   page=cache.kv_cache.shape[1], ring=cache.tail.shape[2])
  assert np.array_equal(packed, glm5_jax.DecodeBatch.pack(
      batch.positions, batch.loc, batch.tslot, batch.req_ids)), "to_global's ids"
  step = jax.jit(serving.indexer_step, static_argnames=("config", "use_reference"),
                 donate_argnames="cache")
  one = (cache, x, qr, packed, batch.page_table, batch.block_table)
  want = step(w, *jax.tree.map(jnp.asarray, one), config=CONFIG)
  specs = sharding.request_specs(AXIS)
  m = mesh(jax.sharding.AxisType.Auto)
  args = sharding.put(m, (specs.weights, specs.cache, specs.rows, specs.rows, specs.packed,
                          specs.batch.page_table, specs.batch.block_table), (w, *one))
  check_collectives(step.lower(*args, config=CONFIG).compile(), "jit serving step")
  assert_step_equal(step(*args, config=CONFIG), want, "jit serving step")



# Context parallelism (sharding.context_parallel_select) -------------------------------

CONTEXT_AXIS = "context"
CONTEXT_PAGE = 16
# (seed, pools per device, ks): small shares with k below, near and above a device's
# share, and one long context at the stage's k
CONTEXT_CASES = [(0, 48, (5, 20, 60)), (1, 48, (5, 20, 60)), (2, 48, (5, 20, 60)),
                 (3, 2048, (512,))]


def context_meshes():
  """Meshes of 2 and DEVICES devices on the context axis (each size once)."""
  return [jax.make_mesh((n,), (CONTEXT_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                        devices=jax.devices()[:n]) for n in sorted({2, DEVICES})]


def context_case(rng, devices, local):
  """select_pools operands whose pools split over `devices` devices (global page ids,
  each device's columns pointing into its own block of pages), with ties (3 distinct
  keys x 2 scales), NaN, +-inf and -0 logits, missing and out-of-range pages, unknown
  requests and pads; -> (operands, max_pools)."""
  requests, local_pages = 4, local // CONTEXT_PAGE + 5
  pages, max_pools = devices * local_pages, devices * local
  columns = max_pools // CONTEXT_PAGE
  keys = rng.standard_normal((3, 128)) * 32
  keys = np.asarray(jnp.asarray(keys, jnp.float8_e4m3fn)).view(np.uint8)
  data = keys[rng.integers(0, 3, (pages, CONTEXT_PAGE))]
  scales = np.float32([2.0 ** -4, 2.0 ** -5])[rng.integers(0, 2, (pages, CONTEXT_PAGE))]
  special = rng.random((pages, CONTEXT_PAGE))
  scales[special < 0.03] = np.nan
  scales[(special >= 0.03) & (special < 0.06)] = -0.0
  scales[(special >= 0.06) & (special < 0.08)] = 0.0
  scales[(special >= 0.08) & (special < 0.09)] = np.inf
  scales[(special >= 0.09) & (special < 0.10)] = 2.0 ** -140    # a subnormal logit
  kv = np.concatenate([data.reshape(pages, -1), scales.view(np.uint8).reshape(pages, -1)], 1)
  kv = kv.reshape(pages, CONTEXT_PAGE, 132)
  device = np.arange(columns) // (columns // devices)
  table = (device * local_pages + rng.integers(0, local_pages, (requests, columns)))
  table[1, 1] = -1                                  # a missing page
  table[2, -1] = pages + 3                          # past the cache: scores -inf
  # Pools of each row: a few (the causal fill), within device 0's share (twice), just
  # past it, all but a few, all, past max_pools (clamped), none (a pad), all of an
  # unknown request (every logit -inf), 60 (= k at k 60).
  pools = [3, 40, local - 1, local + 7, max_pools - 5, max_pools, 10 ** 6, 0, max_pools, 60]
  positions = np.asarray([4 * n - 1 if n else -1 for n in pools], np.int64)
  positions = np.minimum(positions, 2 ** 31 - 1).astype(np.int32)
  req_ids = np.asarray([0, 1, 3, 2, 3, 0, 1, 2, 7, 3], np.int32)
  q = _q(rng, len(pools))
  w = rng.random((len(pools), 32)).astype(np.float32)
  return (q, w, kv, table.astype(np.int32), req_ids, positions), max_pools


def _q(rng, rows):
  return jnp.asarray(rng.standard_normal((rows, 32, 128)) * 8, jnp.float8_e4m3fn)


def assert_gathers_only_candidates(compiled, rows, candidates, what):
  """The compiled program's only collective is the all-gather of the candidates:
  rows x candidates x 2 s32 values (global ids and logit bits), never the cache or the
  logits. (By element count: XLA may move the gathered dim to the front.)"""
  text = compiled.as_text()
  kinds = sorted({m.group(1) for m in COLLECTIVE.finditer(text)})
  assert kinds == ["all-gather"], f"{what}: collectives {kinds}"
  for line in text.splitlines():
    found = COLLECTIVE.search(line)
    if found:    # the result's shape(s) precede the op's name
      shapes = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", line[:found.start()])
      sizes = {(dtype, int(np.prod([int(d) for d in dims.split(",") if d])))
               for dtype, dims in shapes}
      assert ("s32", rows * candidates * 2) in sizes and all(
          dtype == "s32" and size <= rows * candidates * 2 for dtype, size in sizes), \
          f"{what}: gathers other than the {rows} x {candidates} candidates: {line}"


def check_context():
  """context_parallel_select on 2 and DEVICES devices equals select_pools on one device
  bit for bit (pool ids; logits where specified) and the reference top-k of the whole
  logits, on data with ties, NaN, +-inf, -0 and subnormal logits, missing pages, rows
  with <= k pools, rows on one device, max_pools not a multiple of k; the only
  collective is the all-gather of the D * k candidates. context_parallel_topk on the
  same kinds of logits equals pool_topk."""
  for m in context_meshes():
    devices = m.shape[CONTEXT_AXIS]
    specs = sharding.context_specs(CONTEXT_AXIS)
    select = sharding.context_parallel_select(m, CONTEXT_AXIS)
    for seed, local, ks in CONTEXT_CASES:
      args, max_pools = context_case(np.random.default_rng(seed), devices, local)
      placed = sharding.put(m, specs.operands, args)
      n = np.minimum(np.asarray(glm5_jax.reference.pool_counts(args[5])), max_pools)
      requests = args[3].shape[0]
      known = (args[4] >= 0) & (args[4] < requests)
      table = np.where(known[:, None], args[3][np.clip(args[4], 0, requests - 1)], -1)
      full = jax.jit(functools.partial(glm5_jax.mqa_logits, max_pools=max_pools))(
          *args[:3], table, jnp.asarray(n, jnp.int32))
      for k in ks:
        what = f"context {devices} devices, seed {seed}, k {k}"
        one = jax.jit(functools.partial(glm5_jax.select_pools, k=k, max_pools=max_pools))
        got = select(*placed, k=k, max_pools=max_pools)
        assert got[1].sharding.spec == specs.results[1], what
        case = CASES["select_pools"]
        assert_bits_equal(case.valid(args, got), case.valid(args, one(*args)), what)
        want = glm5_jax.reference.pool_topk(full, jnp.asarray(n, jnp.int32), k=k)
        assert_bits_equal(got[0], want, f"{what}: the reference top-k of the logits")
        if seed == 0:
          compiled = jax.jit(functools.partial(select, k=k, max_pools=max_pools)).lower(
              *placed).compile()
          assert_gathers_only_candidates(compiled, len(n), devices * k, what)
    assert_context_topk(m, devices)
  assert_context_errors(context_meshes()[-1])


def context_stage_inputs(devices, seed=0):
  """indexer_stage's arguments (one device's form, global ids) for 3 requests at
  contexts of 300, 3000 and 4000 tokens (the causal fill, and the top-k of 750 and
  1000 pools), next_n 2, CONFIG.max_pools = 1024 pools over 64 page-table columns of
  16-entry pages: each device's columns point into its own block of pages."""
  rng = np.random.default_rng(seed)
  contexts, page = [300, 3000, 4000], CONTEXT_PAGE
  cache, table, blocks = synthetic.decode_cache(rng, len(contexts), 4095, next_n=NEXT_N,
                                                page=page)
  columns = np.asarray(table).shape[1]
  assert columns * page == CONFIG.max_pools and columns % devices == 0
  share = columns // devices
  # request r's column c -> page (c // share) * (R * share) + r * share + c % share
  c = np.arange(columns)
  placed = ((c // share) * len(contexts) * share + np.arange(len(contexts))[:, None] * share
            + c % share)
  kv = np.zeros_like(np.asarray(cache.kv_cache))
  kv[placed] = np.asarray(cache.kv_cache)[np.asarray(table)]
  cache = glm5_jax.IndexerCache(jnp.asarray(kv), cache.tail)
  table = jnp.asarray(placed, jnp.int32)
  pos = np.asarray(contexts)[:, None] + np.arange(NEXT_N)
  batch = synthetic.decode_batch(pos, cache, table, blocks)
  x, qr = synthetic.inputs(rng, pos.size, **DIMS)
  return cache, x, qr, batch


def check_context_stage():
  """context_parallel_stage on 2 and DEVICES devices equals indexer_stage on one device
  bit for bit (outputs and every byte of the cache, over two steps with the cache
  donated), with the candidates' all-gather its only collective; with the update part as
  three ops, as XLA's GEMM + update_epilogue and as indexer_update's one call
  (IndexerConfig(update="ops"), "auto", and "fused" with indexer_update routed on: its
  update_path runs each) and as indexer_update_q's (the default "auto" at these rows), each
  against indexer_stage with the same config."""
  w = weights()
  # (config, the update primitive its update_path traces)
  fused = glm5_jax.Routing(ops={"indexer_update": True})
  assert 3 * NEXT_N in glm5_jax.plan.KERNEL_ROWS["indexer_update_q"].rows
  modes = {dataclasses.replace(CONFIG, update="ops"): None,
           # M = 3 requests x NEXT_N: indexer_update_q's kernel rows (plan.KERNEL_ROWS)
           dataclasses.replace(CONFIG, update="auto"): "glm5_indexer_update_q",
           dataclasses.replace(CONFIG, update="auto", routing=glm5_jax.Routing(
               ops={"indexer_update_q": False})): "glm5_indexer_update",
           dataclasses.replace(CONFIG, update="auto", routing=glm5_jax.Routing(
               ops={"indexer_update": False, "indexer_update_q": False})):
               "glm5_update_epilogue",
           dataclasses.replace(CONFIG, update="fused", routing=fused): "glm5_indexer_update"}
  for m, config in itertools.product(context_meshes(), modes):
    devices = m.shape[CONTEXT_AXIS]
    what = f"context stage, {devices} devices, update {config.update!r}"
    cache, x, qr, batch = context_stage_inputs(devices)
    step = sharding.context_parallel_stage(m, CONTEXT_AXIS)
    specs = sharding.context_stage_specs(CONTEXT_AXIS)
    arg_specs = (specs.weights, specs.cache, specs.rows, specs.rows, specs.batch)
    # A cache made from numpy may alias host memory on the CPU (jax 0.11: then it is not
    # donated, silently): a copy of its own, as in check_stage.
    want_cache = cache
    got_cache = jax.device_put(cache, sharding.shardings(m, specs.cache), may_alias=False)
    for t in range(2):           # the second step reads the first one's pools
      pos = batch.positions + t * NEXT_N
      b = synthetic.decode_batch(np.asarray(pos), cache, batch.page_table, batch.block_table)
      want, want_cache = STEP(w, want_cache, x, qr, b, config=config)
      args = sharding.put(m, arg_specs, (w, got_cache, x, qr, b))
      if t == 0:
        traced = step.trace(*args, config=config)
        # The switch reaches update_path inside the shard_map: its update op is traced.
        jaxpr = str(traced.jaxpr)
        for name in ("glm5_update_epilogue", "glm5_indexer_update", "glm5_indexer_update_q"):
          traced_name = re.search(rf"\b{name}\b", jaxpr) is not None
          assert traced_name == (name == modes[config]), f"{what}: {name} traced"
        compiled = traced.lower().compile()
        assert_gathers_only_candidates(compiled, x.shape[0],
                                       devices * (CONFIG.topk_tokens // 4), what)
      got, got_cache = step(*args, config=config)
      # Compared through device copies: on the CPU, np.asarray of an Array can be a
      # zero-copy view that the Array keeps cached, an outside reference to the buffer
      # that makes the next step's donation fall back to a copy (jax 0.11.2).
      assert_bits_equal(jax.tree.map(jnp.copy, (got, got_cache)), (want, want_cache),
                        f"{what}, step {t}")
      if not args[1].kv_cache.is_deleted():
        aliased = "input_output_alias" in compiled.as_text()
        raise AssertionError(
            f"{what}, step {t}: bit-equal, but the cache is not donated (jax "
            f"{jax.__version__}; the compiled step {'has' if aliased else 'has no'} "
            "input_output_alias; cache in "
            f"{args[1].kv_cache.sharding}, out {got_cache.kv_cache.sharding})")
  print("  (context stage: outputs and caches bit-equal to one device)")
  m = context_meshes()[-1]
  cache, x, qr, batch = context_stage_inputs(m.shape[CONTEXT_AXIS])
  step = sharding.context_parallel_stage(m, CONTEXT_AXIS)
  narrow = glm5_jax.IndexerConfig(max_pools=CONFIG.max_pools // 2)
  try:
    step(w, cache, x, qr, batch, config=narrow)
  except ValueError as e:
    assert "context_parallel_stage: page_table" in str(e), e
  else:
    raise AssertionError("context_parallel_stage accepted page-table columns != max_pools / PAGE")


def assert_context_topk(m, devices):
  rng = np.random.default_rng(devices)
  rows, width = 7, devices * 40
  logits = rng.integers(-2, 3, (rows, width)).astype(np.float32)     # few values: ties
  special = rng.random((rows, width))
  logits[special < 0.05] = np.nan
  logits[(special >= 0.05) & (special < 0.1)] = -0.0
  logits[(special >= 0.1) & (special < 0.15)] = -np.inf
  logits[(special >= 0.15) & (special < 0.17)] = np.inf
  logits[(special >= 0.17) & (special < 0.2)] = 1e-40               # subnormal: ties +0
  logits[3] = -np.inf
  lens = np.asarray([width, 0, 7, width - 3, 45, 10 ** 6, -2], np.int32)
  topk = sharding.context_parallel_topk(m, CONTEXT_AXIS)
  placed = sharding.put(m, (P(None, CONTEXT_AXIS), P()), (logits, lens))
  for k in (1, 6, 40, 41, width + 3):
    got = topk(*placed, k=k)
    assert_bits_equal(got, glm5_jax.reference.pool_topk(logits, lens, k=k),
                      f"context_parallel_topk {devices} devices, k {k}")
    assert_bits_equal(got, jax.jit(functools.partial(glm5_jax.pool_topk, k=k))(logits, lens),
                      f"context_parallel_topk {devices} devices, k {k}: pool_topk")
    compiled = jax.jit(functools.partial(topk, k=k)).lower(*placed).compile()
    assert_gathers_only_candidates(compiled, rows, devices * k, f"topk k {k}")


def assert_context_errors(m):
  devices = m.shape[CONTEXT_AXIS]
  args, max_pools = context_case(np.random.default_rng(0), devices, 48)
  select = sharding.context_parallel_select(m, CONTEXT_AXIS)
  bad = [({}, dict(max_pools=max_pools + CONTEXT_PAGE), "max_pools must be a positive "
          f"multiple of {devices} devices x PAGE {CONTEXT_PAGE}"),
         (dict(page_table=args[3][:, :-devices]), {}, "page_table dim 1 must be max_pools "
          "/ PAGE"),
         (dict(kv_cache=args[2][:-1]), {}, "kv_cache dim 0 must be a multiple of the")]
  names = ("q_fp8", "w_out", "kv_cache", "page_table", "req_ids", "positions")
  for operands, params, message in bad:
    call = [operands.get(name, a) for name, a in zip(names, args)]
    try:
      select(*call, **{"k": 5, "max_pools": max_pools, **params})
    except ValueError as e:
      assert str(e).startswith(f"glm5_jax.context_parallel_select: {message}"), e
    else:
      raise AssertionError(f"no error: {message}")
  for make in (sharding.context_parallel_select, sharding.context_parallel_topk):
    try:
      make(m, "data")
    except ValueError as e:
      assert "axis 'data' is not an axis" in str(e), e
    else:
      raise AssertionError("no error")


if __name__ == "__main__":
  assert len(jax.devices()) >= DEVICES, f"--devices {DEVICES}: jax has {jax.devices()}"
  checks = ARGS.checks or [n[len("check_"):] for n in list(globals())
                           if n.startswith("check_") and n != "check_collectives"]
  print(f"{DEVICES} {jax.devices()[0].platform} devices: {', '.join(checks)}", flush=True)
  # Every check runs (a failure is printed and does not hide the later ones); the exit
  # status says whether all passed.
  failed = []
  for name in checks:
    try:
      globals()[f"check_{name}"]()
    except Exception:                                    # noqa: BLE001
      traceback.print_exc()
      failed.append(name)
      print(f"FAILED {name}", flush=True)
    else:
      print(f"ok {name}", flush=True)
  sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
