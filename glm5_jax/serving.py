"""A serving loop's decode step: per-step metadata as one packed int32 array, the
tables resident on the device.

The pattern (examples/decode_loop.py runs it on 11 layers):

  step = jax.jit(glm5_jax.serving.indexer_step, static_argnames=("config", "use_reference"),
                 donate_argnames="cache")
  page_table_np = ...           # the engine's host copy; page_table = its device copy
  for each decode step:
    packed = glm5_jax.serving.decode_metadata(positions, page_table_np, page=PAGE, ring=RING)
    out, cache = step(weights, cache, x, qr, packed, page_table, block_table, config=config)

`packed` is a numpy array passed straight to the jitted step: jax copies it to the
device as one argument (16 bytes per row). Building a DecodeBatch of device arrays
every step (jnp.asarray or jax.device_put per field) costs one transfer per field,
several times the device time of an 11-layer step (docs/serving.md).

Cheaper still, and what the bench measures fastest: keep `packed` on the device and
compute the next step's from it inside the jitted step with `advance` (positions + the
tokens each request accepted, loc and tslot from the device page table), returning it
donated like the caches. Steps then move no metadata at all; the host sends a new
packed array (decode_metadata) only when the batch changes: a request admitted or
finished. A host-built packed array per step costs more than the whole device-resident
step; advancing on the device costs nothing measurable (BENCHMARKS.json, op "serving").

page_table and block_table change only when a request is admitted, finishes or grows
a page/block: keep them as device arrays and pass them unchanged; when they change,
update the device copy (e.g. `table.at[rows].set(values)` in a jitted function with
the table donated, an in-place scatter) rather than transferring the whole table.
A request that will reach a new K-cache page within a step needs that page in the
device table before the step: allocate pages ahead (a page holds PAGE pools).
"""
import numpy as np
import jax
import jax.numpy as jnp

from .reference.numerics import POOL
from .stage import (
  DecodeBatch,
  IndexerCache,
  IndexerConfig,
  IndexerOutput,
  IndexerWeights,
  indexer_stage,
)


def indexer_step(weights: IndexerWeights, cache: IndexerCache, x: jax.Array, qr: jax.Array,
                 packed: jax.Array, page_table: jax.Array, block_table: jax.Array, *,
                 config: IndexerConfig | None = None,
                 use_reference: bool = False) -> tuple[IndexerOutput, IndexerCache]:
  """indexer_stage on DecodeBatch.unpack(packed, page_table, block_table).

  packed i32[4, B, N] (DecodeBatch.pack / decode_metadata; a numpy array is fine);
  page_table i32[R, MP]; block_table i32[R, MB]; the rest as indexer_stage. Jit it with
  the cache donated: jax.jit(indexer_step, static_argnames=("config", "use_reference"),
  donate_argnames="cache"). Inside a model's own jitted step, call it once per layer
  with that layer's weights and cache and the same packed metadata and tables.
  """
  batch = DecodeBatch.unpack(packed, page_table, block_table)
  return indexer_stage(weights, cache, x, qr, batch, config=config,
                       use_reference=use_reference)


def decode_metadata(positions, page_table, *, page: int, ring: int, requests=None,
                    tail_blocks=None) -> np.ndarray:
  """The packed metadata (DecodeBatch.pack) of one decode step, with numpy on the host.

  positions i32[B, N]: each row's token position (-1 pads); page_table i32[R, MP]: the
  host copy of the K-cache page table; page: entries per K-cache page
  (kv_cache.shape[1]); ring: tail-ring rows (tail.shape[2]); requests i32[B]: each
  request's page_table row (default 0..B-1); tail_blocks i32[B]: each request's tail
  block (default: requests). loc is the K-cache slot of the pool a token completes
  (-1 if it completes none), tslot its tail-ring slot (SPEC §0).
  """
  pos = np.asarray(positions)
  if pos.ndim != 2:
    raise ValueError(f"glm5_jax.serving.decode_metadata: positions must have shape (B, N), "
                     f"got {pos.shape}")
  b, n = pos.shape
  req = np.arange(b) if requests is None else np.asarray(requests)
  tail = req if tail_blocks is None else np.asarray(tail_blocks)
  for name, value in (("requests", req), ("tail_blocks", tail)):
    if value.shape != (b,):
      raise ValueError(f"glm5_jax.serving.decode_metadata: {name} must have shape ({b},), "
                       f"got {value.shape}")
  loc, tslot = token_slots(pos, req[:, None], tail[:, None], page_table, page=page, ring=ring)
  return DecodeBatch.pack(pos, loc, tslot, np.repeat(req, n))


def token_slots(positions, requests, tail_blocks, page_table, *, page: int, ring: int,
                xp=np):
  """(loc, tslot) of tokens at `positions` (-1 pads) of `requests` (their page_table
  rows) owning tail blocks `tail_blocks`, both broadcast against positions (SPEC §0):
  loc the K-cache slot of the pool a token completes (-1: it completes none), tslot its
  tail-ring slot (-1 for pads). xp: numpy on the host (decode_metadata), jax.numpy
  inside a jitted step (advance); the one place this rule is written."""
  pos = xp.asarray(positions)
  pid = pos // POOL
  completes = (pos >= 0) & ((pos + 1) % POOL == 0)
  page_of = xp.asarray(page_table)[requests, xp.where(completes, pid // page, 0)]
  loc = xp.where(completes, page_of * page + pid % page, -1)
  return loc, xp.where(pos >= 0, tail_blocks * ring + pos % ring, -1)


def advance(packed: jax.Array, page_table: jax.Array, *, page: int, ring: int,
            accepted=1) -> jax.Array:
  """The packed metadata of the decode step after `packed`, computed on the device.

  packed i32[4, B, N] (DecodeBatch.pack: this step's positions, loc, tslot, req_ids);
  page_table i32[R, MP] (the device copy, already holding the pages the new positions
  reach); accepted: int or i32[B], the tokens each request advances by (1 for plain
  decode; an MTP engine passes its per-request accepted counts, a device array). Each
  live row's position grows by its request's `accepted`, pads stay pads, requests and
  tail blocks stay; loc and tslot follow from token_slots. Call it inside the jitted step
  and keep the result on the device (donated, as the caches): a decode loop then moves
  no metadata at all between steps, and sends a new packed array (decode_metadata) only
  when its batch changes (a request admitted or finished). Each row needs only its own
  request's page-table row: with requests split over devices, call it where each device
  holds its requests' rows with device-local ids (inside the shard_map of
  glm5_jax.sharding.data_parallel_step's form), not on global ids under plain jit.
  """
  if packed.ndim != 3 or packed.shape[0] != len(DecodeBatch.PACKED_FIELDS):
    raise ValueError(f"glm5_jax.serving.advance: packed must have shape (4, B, N) "
                     f"(DecodeBatch.pack), got {tuple(packed.shape)}")
  positions, _, tslot, req_ids = (packed[i] for i in range(len(DecodeBatch.PACKED_FIELDS)))
  b = positions.shape[0]
  accepted = jnp.asarray(accepted)
  if accepted.shape not in ((), (b,)) or not jnp.issubdtype(accepted.dtype, jnp.integer):
    raise ValueError(f"glm5_jax.serving.advance: accepted must be an int or an integer "
                     f"array of shape ({b},), got {accepted.dtype}{list(accepted.shape)}")
  step = jnp.broadcast_to(accepted.astype(jnp.int32).reshape(-1, 1), (b, 1))
  live = positions >= 0
  tail_blocks = (tslot - positions % ring) // ring      # tslot = block * ring + pos % ring
  positions = jnp.where(live, positions + step, -1)
  loc, tslot = token_slots(positions, req_ids, tail_blocks, page_table, page=page,
                           ring=ring, xp=jnp)
  return jnp.stack([positions, loc, tslot, req_ids]).astype(jnp.int32)
