"""Synthetic GLM-5.3-Flash-shaped layers, caches, prefill and decode batches for demos,
tests and benchmarks (random weights; valid fp8 cache contents)."""
import math

import numpy as np
import jax.numpy as jnp

from .prefill import PrefillBatch
from .reference.numerics import DIM, POOL
from .serving import token_slots
from .stage import DecodeBatch, IndexerCache, prepare_weights

HIDDEN, Q_LORA = 4096, 1536     # GLM-5.3-Flash (SPEC §9)


def _normal(rng, shape, scale, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def layer(rng, config, hidden=HIDDEN, q_lora=Q_LORA):
  """Random IndexerWeights of one layer."""
  h = config.heads
  return prepare_weights(
      _normal(rng, (h * DIM, q_lora), q_lora ** -0.5),
      _normal(rng, (DIM, hidden), hidden ** -0.5),
      _normal(rng, (h, hidden), hidden ** -0.5),
      _normal(rng, (DIM, hidden), hidden ** -0.5),
      1 + 0.1 * rng.standard_normal(DIM), 0.1 * rng.standard_normal(DIM),
      0.5 * rng.standard_normal((POOL, DIM)))


def inputs(rng, rows, hidden=HIDDEN, q_lora=Q_LORA):
  """(x bf16[rows, hidden], qr bf16[rows, q_lora])."""
  return _normal(rng, (rows, hidden), 1.0), _normal(rng, (rows, q_lora), 1.0)


def layer_inputs(rng, rows, layers, hidden=HIDDEN, q_lora=Q_LORA):
  """([x of layer l], [qr of layer l]) for `layers` layers, each pair from inputs().

  Every layer gets its own x and qr, as in a model (each layer's hidden state): given one
  x and qr for all layers, XLA merged the layers' q GEMMs into one that first copied
  their wq_b together, a cost no model pays (docs/performance.md, Method)."""
  drawn = [inputs(rng, rows, hidden, q_lora) for _ in range(layers)]
  return [x for x, _ in drawn], [qr for _, qr in drawn]


def ring_size(next_n):
  """RING = 4 * next_pow2(ceil((4 + spec) / 4)), spec = next_n - 1 (SPEC §0.2)."""
  return POOL * 2 ** math.ceil(math.log2(math.ceil((POOL + next_n - 1) / POOL)))


def decode_cache(rng, requests, max_context, *, next_n=1, page=64, block_size=128,
                 spare_pages=0):
  """(IndexerCache, page_table i32[B, MP], block_table i32[B, MB]) for
  `requests` requests of up to max_context tokens: pages of valid fp8 entries
  (power-of-two scales), a random tail ring, shuffled page and block tables."""
  pages_per_req = math.ceil((max_context // POOL + 1) / page)
  pages = requests * pages_per_req + spare_pages
  page_table = rng.permutation(pages)[:requests * pages_per_req]
  data = np.clip(rng.standard_normal((pages, page, DIM)) * 64, -448, 448)
  data = np.asarray(jnp.asarray(data, jnp.float8_e4m3fn)).view(np.uint8)
  scales = np.exp2(rng.integers(-12, -4, (pages, page))).astype(np.float32).view(np.uint8)
  kv = np.concatenate([data.reshape(pages, -1), scales.reshape(pages, -1)], 1)
  tail = _normal(rng, (requests, 2, ring_size(next_n), DIM), 1.0)
  blocks_per_req = math.ceil((max_context + 1) / block_size)
  block_table = rng.permutation(requests * blocks_per_req)
  cache = IndexerCache(jnp.asarray(kv.reshape(pages, page, DIM + 4)), tail)
  return (cache, jnp.asarray(page_table.reshape(requests, -1), jnp.int32),
          jnp.asarray(block_table.reshape(requests, -1), jnp.int32))


def _slots(pos, req, cache, page_table):
  """(loc, tslot) of positions `pos` of requests `req` (request r owns tail block r)."""
  return token_slots(pos, req, req, page_table, page=cache.kv_cache.shape[1],
                     ring=cache.tail.shape[2])


def prefill_batch(starts, lengths, cache, page_table, rows=None):
  """PrefillBatch of request r's positions starts[r] .. starts[r] + lengths[r] - 1,
  request-major (request r owns tail block r), padded to `rows` rows (None: no pads).
  Returns (batch, req_ids i32[rows]: each row's request, -1 pads)."""
  req = np.concatenate([np.full(n, r) for r, n in enumerate(lengths)] + [np.zeros(0, int)])
  pos = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)] + [req[:0]])
  pad = (len(pos) if rows is None else rows) - len(pos)
  if pad < 0:
    raise ValueError(f"prefill_batch: rows {rows} < the {len(pos)} tokens")
  req, pos = np.pad(req, (0, pad), constant_values=-1), np.pad(pos, (0, pad), constant_values=-1)
  loc, tslot = _slots(pos, np.maximum(req, 0), cache, page_table)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  return PrefillBatch(i32(pos), i32(loc), i32(tslot)), i32(req)


def decode_batch(positions, cache, page_table, block_table):
  """DecodeBatch of positions i32[B, N] (request b owns tail block b): pool
  slots for the tokens that complete a pool, tail slots for every token."""
  pos = np.asarray(positions)
  b, n = pos.shape
  loc, tslot = _slots(pos, np.arange(b)[:, None], cache, page_table)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  return DecodeBatch(i32(pos), i32(loc), i32(tslot), i32(np.repeat(np.arange(b), n)),
                     page_table, block_table)
