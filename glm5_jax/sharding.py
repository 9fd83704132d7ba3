"""Data parallelism over requests: the decode step on several devices, each running the
unsharded stage on its own requests and caches (jax.shard_map), with no collective.

A request's indexer reads only its own K-cache pages, tail block and MLA blocks, so a
data-parallel rank holds whole requests with their caches and the step needs nothing
from another rank. The layout (RequestSpecs, the one place it is written): every
array with a request or row axis is split along it over the mesh axis (x, qr, the
DecodeBatch fields, the cache's pages and tail blocks, the tables' request rows, every
output); the weights are replicated. Each device's shard is a complete indexer_stage
input on its own, with device-local ids: its req_ids index its rows of page_table and
block_table, its page_table holds pages of its kv_cache shard (0 .. pages/devices - 1),
its tslot its tail blocks, its block_table its MLA blocks (so its slots are slots of
its own MLA cache). Build each device's batch as for one device
(glm5_jax.serving.decode_metadata on its own page table) and concatenate: `assemble`.

  step = glm5_jax.sharding.data_parallel_stage(mesh)          # axis "data"
  out, cache = step(weights, cache, x, qr, batch, config=config)

Under plain jax.jit, arguments sharded this way would not do: the ops' page, block and
request ids are global there, and XLA cannot know that a row reads only its own
device's pages, so it all-gathers the cache (CPU reference) or every operand of an FFI
call (no sharding rule). The shard_map states that locality; the compiled step holds no
collective (tests/test_sharding.py).
"""
import functools
from typing import Any, NamedTuple

import numpy as np
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import serving
from ._checks import fail
from .stage import DecodeBatch, IndexerCache, IndexerOutput, IndexerWeights, indexer_stage

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
  if axis not in mesh.shape:
    fail(op, "axis", f"{axis!r} is not an axis of the mesh {dict(mesh.shape)}")

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


def shardings(mesh: jax.sharding.Mesh, specs):
  """NamedShardings of a spec tree (e.g. request_specs().cache) on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def put(mesh: jax.sharding.Mesh, specs, tree):
  """jax.device_put of `tree` laid out as the spec tree `specs` on `mesh`."""
  return jax.device_put(tree, shardings(mesh, specs))


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
