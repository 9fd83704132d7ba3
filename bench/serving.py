"""Group "serving": the decode loop of a serving engine, one jitted step of
`stage_layers` (11) layers per decode step (each layer its own weights and caches,
donated and threaded), one dispatch per step. What differs between the variants is
where each step's metadata (positions, loc, tslot, req_ids) comes from:

- "device metadata": already on the device (built once, the same every step): the
  step alone, what the loop can at best reach.
- "host metadata, packed": built fresh with numpy on the host every step
  (glm5_jax.serving.decode_metadata, the positions advancing), one i32[4, B, N] array
  passed to the jitted step (one host->device transfer), unpacked inside
  (glm5_jax.serving.indexer_step); page and block tables stay on the device.
- "host metadata, fields": the same fresh numpy fields passed as a DecodeBatch of four
  numpy arrays (four transfers), the tables on the device.
- "host metadata, pinned": the packed array put in pinned host memory on the host
  (jax.device_put to memory kind "pinned_host": a host copy) and moved to the device
  inside the step, so the transfer is the step's own first command rather than a
  transfer the dispatch waits for (on the H200 the packed variant's dispatch took as
  long as the device's step: host and device time added up). An experiment: kept if
  it measures best.
- "device metadata, advanced": the packed array lives on the device, and each step
  computes the next one from it (glm5_jax.serving.advance: positions + 1, loc and tslot
  from the device page table) and returns it donated with the caches: fresh metadata
  every step with no transfer, the way issue 11 asks a loop to meet 1.15x.
- "arguments only": a jitted function of the same arguments (caches donated) that runs
  no layer and returns the caches and the flag: what jax and the runtime take per
  dispatch of this many arguments, the floor under every variant's host time.

Runs are timed by harness.time_runs: dispatched back to back with one queued, so
the host's work for step k+1 (building metadata, dispatch, transfer) overlaps the
device's step k, as in an engine that knows the next positions before the sampled
token comes back; µs per step = the median interval between step completions, so a
host-bound loop shows its host time. Rows "M=<m>,ctx=<tokens>" (M requests of one
decode token each); device_us is µs per decode step (all layers), not per layer.
Issue 11's target: the packed loop within 1.15x of device metadata."""
import dataclasses
import gc

import numpy as np
import jax
import jax.numpy as jnp

import glm5_jax
from glm5_jax import serving, synthetic

from .harness import compile_fn, time_runs
from .stage import _config, consumed, layers_state, shape_arguments, shapes

NAME = "serving"
DEVICE, PACKED, FIELDS = "device metadata", "host metadata, packed", "host metadata, fields"
PINNED = "host metadata, pinned"
ADVANCED, ARGUMENTS = "device metadata, advanced", "arguments only"
VARIANTS = (DEVICE, ADVANCED, PACKED, FIELDS, PINNED, ARGUMENTS)
# Decode positions the caches have room for past the context: the host variants cycle
# over them; ADVANCED's positions only grow, one per step (warmup + serving_steps < 512).
MARGIN = 512


def add_arguments(parser):
  shape_arguments(parser, NAME)


def _step(config, packed, to_device=None):
  """fn(caches, flag, weights, xs, qrs, meta, page_table, block_table) -> (caches,
  (done, out)): one decode step of every layer (layer l on xs[l], qrs[l]: inputs of
  its own, synthetic.layer_inputs); out is one scalar that reads every layer's counts
  (stage.consumed: a model's step consumes them inside the jit; returned, each would make
  XLA re-trace the FFI call writing it on every step); meta is the packed array or the
  four fields; to_device: a sharding the (pinned host) packed array moves to first."""
  def fn(caches, flag, weights, xs, qrs, meta, page_table, block_table):
    if to_device is not None:
      meta = jax.device_put(meta, to_device)
    if packed:
      batch = glm5_jax.DecodeBatch.unpack(meta, page_table, block_table)
    else:
      batch = glm5_jax.DecodeBatch(*meta, page_table, block_table)
    new, counts = [], []
    for w, c, x, qr in zip(weights, caches, xs, qrs):
      out, c = glm5_jax.indexer_stage(w, c, x, qr, batch, config=config)
      new.append(c)
      counts.append(out.counts)
    return new, (~flag, consumed(counts))
  return fn


def _advancing(config, page, ring):
  """The packed step whose metadata is state: (caches, packed) -> (caches, the next
  step's packed computed on the device) (variant ADVANCED)."""
  inner = _step(config, True)

  def fn(state, flag, weights, xs, qrs, _, page_table, block_table):
    caches, packed = state
    caches, outs = inner(caches, flag, weights, xs, qrs, packed, page_table, block_table)
    return (caches, serving.advance(packed, page_table, page=page, ring=ring)), outs
  return fn


def _arguments_only(caches, flag, weights, xs, qrs, meta, page_table, block_table):
  """The step's signature and donation without its layers (variant ARGUMENTS)."""
  return caches, (~flag, [])


class _Metadata:
  """Each call: the next step's packed metadata, built with numpy (positions
  ctx - 1 + i, cycling over MARGIN steps)."""

  def __init__(self, m, ctx, page_table, page, ring):
    self.start, self.i = np.full((m, 1), ctx - 1), 0
    self.pages, self.page, self.ring = np.asarray(page_table), page, ring

  def __call__(self):
    pos = self.start + self.i % MARGIN
    self.i += 1
    return serving.decode_metadata(pos, self.pages, page=self.page, ring=self.ring)


def _variants(config, host):
  """(variant, step fn, metadata source) of each variant; host: a _Metadata."""
  on_device = jnp.asarray(host())

  def unpacked():                              # the same numpy fields, not packed
    positions, loc, tslot, req_ids = host()
    return positions, loc, tslot, req_ids.reshape(-1)
  device = jax.devices()[0]
  pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  resident = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  page, ring = host.page, host.ring
  return ((DEVICE, _step(config, True), lambda: on_device),
          (ADVANCED, _advancing(config, page, ring), lambda: on_device),
          (PACKED, _step(config, True), host),
          (FIELDS, _step(config, False), unpacked),
          (PINNED, _step(config, True, resident), lambda: jax.device_put(host(), pinned)),
          (ARGUMENTS, _arguments_only, lambda: on_device))


def _state(m, ctx, layers, seed):
  rng = np.random.default_rng(seed)
  weights, caches, pt, bt = layers_state(rng, m, ctx + MARGIN, layers)
  return (weights, caches, *synthetic.layer_inputs(rng, m, layers), pt, bt)


def _measure(bench, shape, variant, fn, caches, fixed, meta_of, sizes, layers):
  """Compiles fn, times runs whose metadata comes from meta_of() (called on the host
  before every dispatch), adds the row; returns (caches, row). caches: the donated
  state fn threads (the caches, or (caches, packed) for ADVANCED)."""
  flag = jnp.zeros((), jnp.bool_)
  weights, xs, qrs, pt, bt = fixed
  compiled, _, compile_s = compile_fn(fn, caches, flag, weights, xs, qrs, meta_of(), pt, bt,
                                      options=sizes.compiler_options)
  run = lambda state, flag: compiled(state, flag, weights, xs, qrs, meta_of(), pt, bt)
  caches, sec, dispatch = time_runs(run, caches, (flag,), sizes)
  us = sec * 1e6
  row = bench.row(NAME, shape, variant, us, None, None, layers=layers, reps=sizes.reps,
                  dispatch_us=dispatch * 1e6, compile_s=round(compile_s, 2),
                  notes=f"{layers} layers per decode step, µs per step, one dispatch "
                        "per step")
  bench.log(f"serving {shape} {variant}: {us:.1f} us per step "
            f"(host dispatch {dispatch * 1e6:.0f} us)")
  return caches, row


def run(bench):
  s = bench.s
  layers = s.stage_layers
  sizes = dataclasses.replace(s, reps=s.serving_steps)
  build = lambda ctx, m: _state(m, ctx, layers, seed=m * 11 + ctx)  # noqa: E731
  for shape, (ctx, m), state in bench.states(NAME, shapes(bench, NAME), VARIANTS, build):
    weights, caches, xs, qrs, pt, bt = state
    del state
    config = _config(ctx + MARGIN, glm5_jax.Routing())
    fixed = (weights, xs, qrs, pt, bt)
    page, ring = caches[0].kv_cache.shape[1], caches[0].tail.shape[2]
    measured = {}
    for variant, fn, meta_of in _variants(config, _Metadata(m, ctx, pt, page, ring)):
      # ADVANCED threads its packed metadata (from the first step's) with the caches.
      state = (caches, jnp.array(meta_of())) if variant == ADVANCED else caches
      try:
        state, measured[variant] = _measure(bench, shape, variant, fn, state, fixed,
                                            meta_of, sizes, layers)
      except Exception as e:                             # noqa: BLE001
        bench.error_row(NAME, shape, variant, e)
      caches = state[0] if variant == ADVANCED else state
      if any(a.is_deleted() for a in jax.tree.leaves(caches)):
        break                                            # the caches were donated away
      bench.write_json()
    for host_variant in (ADVANCED, PACKED, PINNED):
      if DEVICE in measured and host_variant in measured:
        ratio = measured[host_variant]["device_us"] / measured[DEVICE]["device_us"]
        measured[host_variant]["notes"] += (f"; {ratio:.2f}x the device-metadata step "
                                            "(target <= 1.15x)")
        bench.log(f"serving {shape}: {host_variant} {ratio:.2f}x the device step")
    del weights, caches, xs, qrs, pt, bt
    gc.collect()
