"""Several devices. Data parallelism over requests (forms 1 and 2): the decode step
with requests and their caches split over one mesh axis, each device computing its own
requests with nothing moved between devices. Context parallelism (form 3): one
request's pools split over the devices of an axis, the selection merged exactly.

Data parallelism, two forms, one layout:

A request's indexer reads only its own K-cache pages, tail block and MLA blocks, so a
data-parallel rank holds whole requests with their caches and the step needs nothing
from another rank. The layout (RequestSpecs, the one place it is written): every
array with a request or row axis is split along it over the mesh axis in contiguous,
equal blocks (x, qr, the DecodeBatch fields, the cache's pages and tail blocks, the
tables' request rows, every output); the weights are replicated.

1. Plain jax.jit (global ids). Put the arguments laid out this way (`put`) and call the
   jitted indexer_stage / serving.indexer_step as on one device: every op declares a
   partitioning rule (glm5_jax._primitive.Split, custom_partitioning with a Shardy
   rule), so XLA runs each op on each device's blocks and gathers nothing (no cache,
   batch or logits all-gather / all-to-all in the compiled step). The ids are global,
   as on one device: page_table holds pages of the whole kv_cache, tslot and loc slots
   of the whole tail and cache, req_ids rows of the whole tables; each op makes them
   local on its device (the id less the start of the device's block). The result
   equals the unsharded step bit for bit when every request's pages, tail block and
   table rows lie in the block of the device that holds its rows (`to_global` builds
   such ids from per-device ones). An id outside its device's block is out of range
   there: the op treats it as the unsharded op treats an out-of-range id (a write is
   dropped, a pool scores -inf, a request has no pages) and never touches another
   device's memory. Two other differences from one device: a completing token with
   tslot < 0 pools its device's first tail block (block 0 of the whole tail on one
   device, SPEC §3), and select_pools' logits of the rows it does not specify (causal
   fill) may differ. block_table's values are not ids into memory the indexer reads:
   they pass through into the slots as they are.

     out, cache = jax.jit(glm5_jax.indexer_stage, static_argnames=("config",
                          "use_reference"), donate_argnames="cache")(*put(mesh, ...))

   use_reference=True composes the reference's jnp functions, which XLA partitions by
   its own rules (it gathers the cache): the plain-jit form is for the primitives.

2. jax.shard_map (device-local ids): data_parallel_stage / data_parallel_step. Each
   device's shard is a complete indexer_stage input on its own, with device-local ids:
   its req_ids index its rows of page_table and block_table, its page_table holds
   pages of its kv_cache shard (0 .. pages/devices - 1), its tslot its tail blocks,
   its block_table its MLA blocks. Build each device's batch as for one device
   (glm5_jax.serving.decode_metadata on its own page table) and concatenate:
   `assemble`.

     step = glm5_jax.sharding.data_parallel_stage(mesh)          # axis "data"
     out, cache = step(weights, cache, x, qr, batch, config=config)

Both compile to steps with no collective (tests/test_sharding.py, 4 host CPU devices;
`python tests/sharded_checks.py --devices 2` on two GPUs).

3. Context parallelism (one request's pools over devices, for long contexts):
   context_parallel_select(mesh, axis) is select_pools with every row's pools split in
   contiguous, equal blocks over the D devices of `axis`: device d holds pools
   [d * max_pools / D, (d + 1) * max_pools / D) of every row, i.e. its columns of the
   page table (split along dim 1) and the K-cache pages they point at (split along dim
   0, global page ids as on one device); the queries, req_ids and positions are
   replicated (context_specs, the one place this layout is written). Each device
   scores its pools and takes their top-k; the devices all-gather the D * k candidates
   (ids and logits, the step's only collective) and take the top-k of those with
   pool_topk itself, so pool_ids equal select_pools' bit for bit (same order, ties by
   ascending pool id, NaN and -0 as pool_topk, -1 padding, the causal fill); the
   logits stay split by pools. context_parallel_topk(mesh, axis) is the same merge for
   logits already split by pools.

     select = glm5_jax.sharding.context_parallel_select(mesh, "context")
     ids, logits = select(*put(mesh, context_specs("context").operands, operands),
                          k=512, max_pools=max_pools)

   context_parallel_stage(mesh, axis) is indexer_stage in that layout
   (context_stage_specs): the update path replicated, each completed pool written by
   the device holding its slot, the selection as above.
"""
import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import checks, serving
from ._checks import fail
from ._primitive import Routing, local_ids
from .logits import candidates_topk, mqa_logits, pool_topk
from .reference.logits import pool_counts
from .stage import (
  DecodeBatch,
  IndexerCache,
  IndexerConfig,
  IndexerOutput,
  IndexerWeights,
  _check_stage_inputs,
  _ops,
  indexer_stage,
  select_path,
  update_path,
)

try:
  _shard_map = jax.shard_map
except AttributeError:          # jax without the top-level name
  from jax.experimental.shard_map import shard_map as _shard_map


class RequestSpecs(NamedTuple):
  """PartitionSpec trees of the decode step's arguments and results, requests split over
  one mesh axis: weights (IndexerWeights, replicated), cache (IndexerCache: pages and
  tail blocks), rows (x, qr: rows), batch (DecodeBatch: requests, rows and the tables'
  request rows), packed (DecodeBatch.pack's i32[4, B, N]: requests), output
  (IndexerOutput: rows)."""
  weights: Any
  cache: Any
  rows: P
  batch: Any
  packed: P
  output: Any


def request_specs(axis: str = "data") -> RequestSpecs:
  """The layout of module glm5_jax.sharding over mesh axis `axis`."""
  split = P(axis)
  return RequestSpecs(
      weights=IndexerWeights(*(P(),) * 5), cache=IndexerCache(split, split), rows=split,
      batch=DecodeBatch(*(split,) * 6), packed=P(None, axis),
      output=IndexerOutput(*(split,) * 4))


def _is_spec(x):
  return isinstance(x, P)


def _split_dim(spec):
  """The dim a spec splits (None: replicated)."""
  dims = [d for d, name in enumerate(spec) if name is not None]
  return dims[0] if dims else None


def _check_divides(op, mesh, axis, names, specs, args):
  """Every split dim divides over the devices of the axis (else shard_map's own error
  would not name the argument)."""
  devices = mesh.shape[axis]
  for name, spec, arg in zip(names, specs, args):
    paths, _ = jax.tree_util.tree_flatten_with_path(arg)
    for (path, leaf), s in zip(paths, jax.tree.leaves(spec, is_leaf=_is_spec)):
      dim = _split_dim(s)
      if dim is None:
        continue
      shape = jax.typeof(leaf).shape
      if len(shape) <= dim or shape[dim] % devices:
        fail(op, name + jax.tree_util.keystr(path), f"dim {dim} must be a multiple of the "
             f"{devices} devices of mesh axis {axis!r} (each device holds whole "
             f"requests), got shape {tuple(shape)}")


def _data_parallel(op, fn, mesh, axis, names, in_specs, out_specs):
  _check_axis(op, mesh, axis)

  def step(*args, config=None, use_reference=False):
    _check_divides(op, mesh, axis, names, in_specs, args)
    body = functools.partial(fn, config=config, use_reference=use_reference)
    return _shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)

  step.__name__ = step.__qualname__ = op
  return jax.jit(step, static_argnames=("config", "use_reference"), donate_argnums=1)


def data_parallel_stage(mesh: jax.sharding.Mesh, axis: str = "data"):
  """indexer_stage data-parallel over mesh axis `axis`, jitted with the cache donated:
  step(weights, cache, x, qr, batch, *, config=None, use_reference=False) ->
  (IndexerOutput, IndexerCache), arguments and results laid out as request_specs(axis)
  (module docstring: device-local ids). Each device runs the unsharded stage on its
  shard, so the result equals indexer_stage run on each device's shard alone, bit for
  bit. Place the arguments with `put` (a mesh with Explicit axes wants them placed)."""
  s = request_specs(axis)
  return _data_parallel("data_parallel_stage", indexer_stage, mesh, axis,
                        ("weights", "cache", "x", "qr", "batch"),
                        (s.weights, s.cache, s.rows, s.rows, s.batch), (s.output, s.cache))


def data_parallel_step(mesh: jax.sharding.Mesh, axis: str = "data"):
  """glm5_jax.serving.indexer_step data-parallel over mesh axis `axis` (as
  data_parallel_stage): step(weights, cache, x, qr, packed, page_table, block_table, *,
  config=None, use_reference=False), packed split along its requests (dim 1)."""
  s = request_specs(axis)
  return _data_parallel("data_parallel_step", serving.indexer_step, mesh, axis,
                        ("weights", "cache", "x", "qr", "packed", "page_table",
                         "block_table"),
                        (s.weights, s.cache, s.rows, s.rows, s.packed, s.batch.page_table,
                         s.batch.block_table), (s.output, s.cache))


def data_parallel_advance(mesh: jax.sharding.Mesh, axis: str = "data"):
  """glm5_jax.serving.advance on data_parallel_step's layout: advance(packed, page_table,
  *, page, ring, accepted=1) -> the next step's packed metadata, packed split along its
  requests (request_specs(axis).packed), page_table by request rows with device-local
  ids, accepted an int or i32[B] split likewise. Each device advances its own requests
  from its own page-table rows, so nothing moves between devices. Call it inside the
  jitted decode step, the result donated with the caches (serving's pattern)."""
  op = "data_parallel_advance"
  _check_axis(op, mesh, axis)
  s = request_specs(axis)

  def advance(packed, page_table, *, page, ring, accepted=1):
    _check_divides(op, mesh, axis, ("packed", "page_table"), (s.packed, s.batch.page_table),
                   (packed, page_table))
    fn = functools.partial(serving.advance, page=page, ring=ring)
    if jnp.ndim(accepted) == 0:
      return _shard_map(lambda p, t: fn(p, t, accepted=accepted), mesh=mesh,
                        in_specs=(s.packed, s.batch.page_table), out_specs=s.packed)(
                            packed, page_table)
    return _shard_map(lambda p, t, a: fn(p, t, accepted=a), mesh=mesh,
                      in_specs=(s.packed, s.batch.page_table, P(axis)),
                      out_specs=s.packed)(packed, page_table, accepted)

  advance.__name__ = advance.__qualname__ = op
  return advance


def to_global(index: int, cache: IndexerCache, batch: DecodeBatch) -> DecodeBatch:
  """Device `index`'s batch with device-local ids (data_parallel_stage's form, built
  with device `index`'s cache shard `cache`) -> the same batch with global ids (plain
  jit's form): loc, tslot, req_ids and page_table shifted by the start of the device's
  block of K-cache slots, tail slots, table rows and pages; negative ids kept.
  block_table is kept as it is (its values are not ids the indexer reads). Host numpy;
  join the devices' results with `assemble`."""
  pages, page = cache.kv_cache.shape[:2]
  blocks, ring = cache.tail.shape[0], cache.tail.shape[2]

  def shift(ids, size):
    ids = np.asarray(ids)
    return np.where(ids >= 0, ids + index * size, ids).astype(np.int32)
  return DecodeBatch(np.asarray(batch.positions), shift(batch.loc, pages * page),
                     shift(batch.tslot, blocks * ring),
                     shift(batch.req_ids, batch.page_table.shape[0]),
                     shift(batch.page_table, pages), np.asarray(batch.block_table))


def shardings(mesh: jax.sharding.Mesh, specs):
  """NamedShardings of a spec tree (e.g. request_specs().cache) on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def put(mesh: jax.sharding.Mesh, specs, tree):
  """jax.device_put of `tree` laid out as the spec tree `specs` on `mesh`. A jax.Array
  already laid out so (e.g. a step's returned cache, whose spec jax writes out in full
  rank) is returned as it is: a second Array over the same buffers would keep a
  reference that stops the next step's donation (jax 0.11 then copies the cache,
  silently)."""
  def one(sharding, sub):   # sub: a leaf, or the subtree under a prefix spec
    if isinstance(sub, jax.Array) and sub.sharding.is_equivalent_to(sharding, sub.ndim):
      return sub
    return jax.device_put(sub, sharding)
  return jax.tree.map(one, shardings(mesh, specs), tree,
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def assemble(specs, parts):
  """One tree of host arrays from per-device trees `parts` (device order), each
  device's arrays concatenated along the dim its spec splits; replicated leaves must be
  equal and are taken once. Pass the result to `put`."""
  def join(spec, *leaves):
    dim = _split_dim(spec)
    if dim is None:
      first = np.asarray(leaves[0])
      if any(not np.array_equal(np.asarray(a), first) for a in leaves[1:]):
        raise ValueError("glm5_jax.sharding.assemble: a replicated leaf differs between "
                         "devices")
      return first
    return np.concatenate([np.asarray(a) for a in leaves], axis=dim)
  return jax.tree.map(join, specs, *parts, is_leaf=_is_spec)


# Context parallelism: one request's pools over the devices of a mesh axis ------------

class ContextSpecs(NamedTuple):
  """PartitionSpec trees of context_parallel_select over one mesh axis: operands
  (select_pools' six: kv_cache split by pages, page_table by columns, the rest
  replicated), results (pool_ids replicated, logits split by pools)."""
  operands: tuple
  results: tuple


def context_specs(axis: str = "context") -> ContextSpecs:
  """The layout of context_parallel_select over mesh axis `axis`."""
  return ContextSpecs(operands=(P(), P(), P(axis), P(None, axis), P(), P()),
                      results=(P(), P(None, axis)))


_NO_ID = np.iinfo(np.int32).max


def _merge_topk(local, logits, *, k, axis, routing):
  """The exact global top-k of pools split over mesh axis `axis` (inside its
  shard_map): local i32[rows, k], this device's pool_topk (ascending local ids, -1
  padding) of its f32[rows, P_local] logits (device d holds pools [d * P_local,
  (d + 1) * P_local)) -> i32[rows, k] global ids, the same on every device.

  Exact: a pool of the global top-k is among its device's k best (fewer than k of the
  device's pools precede it in the order), so the top-k of the D * k candidates under
  the same order (pool_topk: value, then ascending id) is the global top-k. The only
  collective is the all-gather of the candidates (ids and logit bits, one array)."""
  d = lax.axis_index(axis)
  width = logits.shape[1]
  gid = jnp.where(local >= 0, local + d * width, _NO_ID).astype(jnp.int32)
  value = jnp.take_along_axis(logits, jnp.maximum(local, 0), axis=1)
  both = jnp.stack([gid, lax.bitcast_convert_type(value, jnp.int32)], axis=-1)
  both = lax.all_gather(both, axis, axis=1, tiled=True)          # [rows, D * k, 2]
  gid, value = both[..., 0], lax.bitcast_convert_type(both[..., 1], jnp.float32)
  # Device-major, the candidates are in ascending global id except for each device's
  # padding (a device with fewer than k pools in a row): sorting by id moves the padding
  # last and keeps that order, so pool_topk's ties by index are ties by global id and
  # the valid candidates are a prefix of the row.
  gid, value = lax.sort((gid, value), dimension=1, num_keys=1)
  # Every device now holds the same candidates and computes the same result from them
  # (hence check_vma=False in the shard_maps: jax types an all-gather's result as
  # varying over the axis, but a replicated out_spec is exact here).
  count = jnp.sum(gid != _NO_ID, axis=1, dtype=jnp.int32)
  return candidates_topk(gid, value, count, k=k, routing=routing)


def _check_axis(op, mesh, axis):
  if axis not in mesh.shape:
    fail(op, "axis", f"{axis!r} is not an axis of the mesh {dict(mesh.shape)}")
  return mesh.shape[axis]


def context_parallel_topk(mesh: jax.sharding.Mesh, axis: str = "context"):
  """glm5_jax.pool_topk of logits split by pools over mesh axis `axis`, jitted:
  topk(logits f32[rows, P], pool_lens i32[rows], *, k, routing=None) -> i32[rows, k],
  logits split along dim 1 (P(None, axis): device d holds pools [d * P / D,
  (d + 1) * P / D)), pool_lens and the result replicated. Each device takes the top-k
  of its pools, then all devices merge the gathered D * k candidates (_merge_topk):
  bit-equal to pool_topk on the whole logits, its order and tie rule included."""
  op = "context_parallel_topk"
  devices = _check_axis(op, mesh, axis)

  @functools.partial(jax.jit, static_argnames=("k", "routing"))
  def run(logits, pool_lens, *, k, routing):
    def body(logits, pool_lens):
      width = logits.shape[1]
      lens = jnp.clip(pool_lens - lax.axis_index(axis) * width, 0, width)
      local = pool_topk(logits, lens, k=k, routing=routing)
      return _merge_topk(local, logits, k=k, axis=axis, routing=routing)
    return _shard_map(body, mesh=mesh, in_specs=(P(None, axis), P()), out_specs=P(),
                      check_vma=False)(logits, pool_lens)

  def topk(logits, pool_lens, *, k, routing=None):
    shape = jax.typeof(logits).shape
    if len(shape) != 2 or shape[1] % devices:
      fail(op, "logits", f"dim 1 must be a multiple of the {devices} devices of mesh axis "
           f"{axis!r}, got shape {tuple(shape)}")
    return run(logits, pool_lens, k=int(k), routing=Routing.resolve(routing, op))

  topk.__name__ = topk.__qualname__ = op
  return topk


def _select_shard(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, k, max_pools,
                  scale_format, routing, axis):
  """One device's part of context_parallel_select inside its shard_map (its pages and
  page-table columns, everything else whole): (pool_ids, its logits)."""
  d = lax.axis_index(axis)
  requests, width = page_table.shape[0], page_table.shape[1] * kv_cache.shape[1]
  ok = (req_ids >= 0) & (req_ids < requests)
  table = local_ids(page_table[jnp.clip(req_ids, 0, requests - 1)], d, kv_cache.shape[0])
  table = jnp.where(ok[:, None], table, -1)
  n = jnp.minimum(pool_counts(positions), max_pools)    # the spec's count, as select_pools
  lens = jnp.clip(n - d * width, 0, width).astype(jnp.int32)
  # Rows whose pools all fit in k select them all (the causal fill) and need no logits,
  # as in select_pools: their logits are skipped (pool_lens 0).
  logits = mqa_logits(q_fp8, w_out, kv_cache, table, jnp.where(n > k, lens, 0),
                      max_pools=width, scale_format=scale_format, routing=routing)
  local = pool_topk(logits, lens, k=k, routing=routing)
  return _merge_topk(local, logits, k=k, axis=axis, routing=routing), logits


def _check_context_layout(op, devices, axis, kv_cache, page_table, max_pools):
  """Each device holds a block of pages and whole pages of every row's pools."""
  pages, page = jax.typeof(kv_cache).shape[:2]
  if pages % devices:
    fail(op, "kv_cache", f"dim 0 must be a multiple of the {devices} devices of mesh "
         f"axis {axis!r} (each device holds a block of pages), got {pages}")
  if max_pools <= 0 or max_pools % (devices * page):
    fail(op, "max_pools", f"must be a positive multiple of {devices} devices x PAGE "
         f"{page} (each device holds whole pages of every row), got {max_pools}")
  columns = jax.typeof(page_table).shape[1]
  if columns * page != max_pools:
    fail(op, "page_table", f"dim 1 must be max_pools / PAGE = {max_pools // page} (device "
         f"d holds the columns of pools [d * max_pools / {devices}, ...)), got {columns}")


def context_parallel_select(mesh: jax.sharding.Mesh, axis: str = "context"):
  """glm5_jax.select_pools with each request's pools split over mesh axis `axis`
  (module docstring, form 3), jitted: select(q_fp8, w_out, kv_cache, page_table,
  req_ids, positions, *, k, max_pools, scale_format="fp32", routing=None) ->
  (pool_ids i32[rows, k], logits f32[rows, max_pools]), laid out as
  context_specs(axis); page_table.shape[1] * PAGE == max_pools, a multiple of D * PAGE
  (each device holds whole pages of every row).

  Page ids are global, as on one device; a page outside the block of the device that
  holds its column is out of range there and its pools score -inf (docs/semantics.md
  D4). pool_ids equal select_pools' bit for bit where the logits are equal (on the GPU
  both run the same logits kernel, whose per-pool sum does not depend on the row's
  length); the logits are mqa_logits' over each device's pools, specified where
  select_pools specifies them. Only each device's share (max_pools / D) and the D * k
  candidates meet the one-device kernels' limits (logits.TOPK_MAX_POOLS), so a
  context too long for one device's top-k kernel still runs its kernels."""
  op = "context_parallel_select"
  devices = _check_axis(op, mesh, axis)
  specs = context_specs(axis)

  @functools.partial(jax.jit, static_argnames=("k", "max_pools", "scale_format",
                                               "routing"))
  def run(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, k, max_pools,
          scale_format, routing):
    body = functools.partial(_select_shard, k=k, max_pools=max_pools,
                             scale_format=scale_format, routing=routing, axis=axis)
    return _shard_map(body, mesh=mesh, in_specs=specs.operands, out_specs=specs.results,
                      check_vma=False)(q_fp8, w_out, kv_cache, page_table, req_ids,
                                       positions)

  def select(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, k, max_pools,
             scale_format="fp32", routing=None):
    _check_context_layout(op, devices, axis, kv_cache, page_table, max_pools)
    return run(q_fp8, w_out, kv_cache, page_table, req_ids, positions, k=int(k),
               max_pools=int(max_pools), scale_format=scale_format,
               routing=Routing.resolve(routing, op))

  select.__name__ = select.__qualname__ = op
  return select


def context_stage_specs(axis: str = "context") -> RequestSpecs:
  """The layout of context_parallel_stage over mesh axis `axis` (RequestSpecs' fields):
  the K cache split by pages (each device a block of pages) and the page table by
  columns (device d: pools [d * max_pools / D, ...) of every row), as context_specs;
  everything else replicated (the tail ring, x, qr, the other batch fields, the packed
  metadata, the outputs)."""
  whole, pages, columns = P(), P(axis), P(None, axis)
  return RequestSpecs(
      weights=IndexerWeights(*(whole,) * 5), cache=IndexerCache(pages, whole), rows=whole,
      batch=DecodeBatch(whole, whole, whole, whole, columns, whole), packed=whole,
      output=IndexerOutput(*(whole,) * 4))


def context_parallel_stage(mesh: jax.sharding.Mesh, axis: str = "context"):
  """indexer_stage with each request's pools split over mesh axis `axis` (long
  contexts), jitted with the cache donated: step(weights, cache, x, qr, batch, *,
  config=None, use_reference=False) -> (IndexerOutput, IndexerCache), laid out as
  context_stage_specs(axis); global ids (loc, page_table) as on one device, the page
  table's columns of device d pointing into its block of pages; config.max_pools ==
  page_table.shape[1] * PAGE, a multiple of D * PAGE.

  Every device runs the update path on the whole batch (the projection, the query
  epilogue and the tail ring are small and replicated); kpool_update writes a completed
  pool only on the device whose block holds its slot (elsewhere the slot is out of
  range: no write). The selection is context_parallel_select's (local logits and top-k,
  one all-gather of the D * k candidates, the exact merge), expand_and_remap runs on the
  merged pool ids everywhere. So the result equals indexer_stage on one device bit for
  bit, cache included, with one collective per layer."""
  op = "context_parallel_stage"
  devices = _check_axis(op, mesh, axis)
  s = context_stage_specs(axis)

  def body(weights, cache, x, qr, batch, *, config, use_reference):
    d = lax.axis_index(axis)
    b, n = batch.positions.shape
    ops = _ops(config, use_reference)
    capacity = cache.kv_cache.shape[0] * cache.kv_cache.shape[1]   # this device's slots
    mine = dataclasses.replace(batch, loc=local_ids(batch.loc, d, capacity))
    q_fp8, w_out, cache = update_path(ops, config, weights, cache, x, qr, mine, b * n)
    routing = Routing(kernels=False) if use_reference else config.routing
    select = functools.partial(_select_shard, routing=routing, axis=axis)
    slots, counts = select_path(ops, config, q_fp8, w_out, cache.kv_cache, batch, b * n,
                                select_pools=select)
    return IndexerOutput(q_fp8, w_out, slots, counts), cache

  def step(weights, cache, x, qr, batch, *, config=None, use_reference=False):
    config = IndexerConfig() if config is None else config
    _check_stage_inputs(weights, cache, x, qr, batch, config)
    _check_context_layout(op, devices, axis, cache.kv_cache, batch.page_table,
                          config.max_pools)
    # Rows past capacity are pads, as in indexer_stage (SPEC §12).
    batch = checks.pad_past_capacity(cache, batch, config)
    fn = functools.partial(body, config=config, use_reference=use_reference)
    return _shard_map(fn, mesh=mesh, in_specs=(s.weights, s.cache, s.rows, s.rows, s.batch),
                      out_specs=(s.output, s.cache), check_vma=False)(
                          weights, cache, x, qr, batch)

  step.__name__ = step.__qualname__ = op
  return jax.jit(step, static_argnames=("config", "use_reference"), donate_argnums=1)
