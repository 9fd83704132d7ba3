"""Small random example inputs for every op, shared by the primitive tests.

CASES[op] = Case(public function with static params bound, make(rng) -> args,
exact, valid): `exact` is False for ops whose float sums may change order with
the row count (GEMMs, the logits einsum); `valid(args, outs)` masks outputs
whose content the op leaves unspecified.
"""
import functools
from typing import Callable, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp

import glm5_jax
from glm5_jax import synthetic

PAGES, PAGE, BLOCKS, RING = 6, 8, 5, 8


def bf16(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def cache(rng):
  return jnp.asarray(rng.integers(0, 256, (PAGES, PAGE, 132)), jnp.uint8)


def tail(rng):
  return bf16(rng, BLOCKS, 2, RING, 128)


def ape(rng):
  return jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)


def i32(values):
  """int32 array; values outside int32 wrap, as in int32 arithmetic."""
  return jnp.asarray(np.asarray(values, np.int64), jnp.int32)


def tree_bytes(tree):
  """Every leaf of a pytree as its bytes (u8), in tree order: bit-for-bit comparison."""
  return [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(tree)]


def stage_state(contexts, next_n=1, seed=0, *, config, hidden, q_lora):
  """(weights, cache, x, qr, batch) of indexer_stage for len(contexts) requests x next_n
  rows: request r's new tokens at positions contexts[r] + 0..next_n-1; 16-entry pages."""
  rng = np.random.default_rng(seed)
  weights = synthetic.layer(rng, config, hidden=hidden, q_lora=q_lora)
  cache, pt, bt = synthetic.decode_cache(rng, len(contexts), max(contexts) + next_n,
                                         next_n=next_n, page=16, spare_pages=2)
  pos = np.asarray(contexts)[:, None] + np.arange(next_n)
  batch = synthetic.decode_batch(pos, cache, pt, bt)
  x, qr = synthetic.inputs(rng, pos.size, hidden=hidden, q_lora=q_lora)
  return weights, cache, x, qr, batch


def update_state(requests, next_n, seed=0, *, heads, hidden):
  """indexer_update's operands (x, w_cat, q, norm_weight, norm_bias, kv_cache, tail,
  tslot, ape, loc, pos) at the stage's shapes: a synthetic layer and decode cache of
  `requests` requests at random contexts (every pool phase), next_n rows each; q random."""
  config = glm5_jax.IndexerConfig(heads=heads, max_pools=1024)
  rng = np.random.default_rng(seed)
  weights, cache, x, _, batch = stage_state(list(rng.integers(3, 900, requests)), next_n,
                                            seed, config=config, hidden=hidden, q_lora=256)
  q = jnp.asarray(rng.standard_normal((requests * next_n, heads, 128)), jnp.bfloat16)
  return (x, weights.w_cat, q, weights.norm_weight, weights.norm_bias, cache.kv_cache,
          cache.tail, batch.tslot, weights.ape, batch.loc, batch.positions)


def _update_args(rng):
  b, n = 3, 2
  start = rng.integers(0, 40, b)
  pos = start[:, None] + np.arange(n)
  pos[1, 1] = -1                                    # a padding token
  blk = rng.permutation(BLOCKS)[:b]
  tslot = np.where(pos >= 0, blk[:, None] * RING + pos % RING, -1)
  loc = np.where(pos % 4 == 3, rng.integers(0, PAGES * PAGE, (b, n)), -1)
  return (cache(rng), tail(rng), i32(tslot), bf16(rng, b, n, 128), bf16(rng, b, n, 128),
          ape(rng), i32(loc), i32(pos))


def compress_args(rng, n=6, out_of_range=(-1, 10 ** 6)):
  """kpool_compress's operands: n rows, the first at distinct slots of the cache (every
  third of them masked off), the last ones with their mask set but their slot
  `out_of_range` (SPEC D4: never written; far past the cache, so that the ids made global
  for a split stay out of every device's block)."""
  inside = n - len(out_of_range)
  loc = np.concatenate([rng.permutation(PAGES * PAGE)[:inside], out_of_range])
  mask = (np.arange(n) % 3 != 1) | (np.arange(n) >= inside)
  return (cache(rng), bf16(rng, n, 4, 128), bf16(rng, n, 4, 128), ape(rng),
          i32(loc.astype(np.int64)), jnp.asarray(mask))


def _seed_args(rng):
  n = 6
  tslot = np.concatenate([1 * RING + np.arange(3), 3 * RING + np.arange(3)])
  return tail(rng), bf16(rng, n, 128), bf16(rng, n, 128), i32(tslot)


def _pool_ids(rng, rows, groups, pools=40):
  ids = rng.integers(0, pools, (rows, groups))
  return i32(np.where(rng.random((rows, groups)) < 0.2, -1, ids))


def _expand_args(rng):
  return _pool_ids(rng, 3, 8), i32(rng.integers(-1, 160, 3))


def _remap_args(rng):
  return (_pool_ids(rng, 3, 32), i32(rng.integers(-1, 160, 3)), i32([0, 2, 1]),
          i32(rng.integers(0, 50, (3, 4))))


def _upcast_args(rng):
  return bf16(rng, 3, 20), i32(rng.integers(-2, 23, 3))


def _q_fp8(rng, rows, heads):
  return jnp.asarray(rng.standard_normal((rows, heads, 128)) * 8, jnp.float8_e4m3fn)


LOGITS_HEADS, LOGITS_PAGE = 32, 16    # a shape the logits kernel takes (cc/select.cu)


def _logits_cache(rng):
  """Valid entries (no NaN codes, power-of-two fp32 scales): the logits are finite."""
  data = rng.integers(0, 256, (PAGES, LOGITS_PAGE * 128)).astype(np.uint8)
  data[(data & 0x7F) == 0x7F] = 0
  scales = np.exp2(rng.integers(-10, -2, (PAGES, LOGITS_PAGE))).astype(np.float32)
  kv = np.concatenate([data, scales.view(np.uint8).reshape(PAGES, -1)], 1)
  return jnp.asarray(kv.reshape(PAGES, LOGITS_PAGE, 132))


def mqa_args(rng, lens=(5, 40, 0), slots=3, holes=False):
  """mqa_logits arguments: a row per pool count in `lens`, `slots` random pages per row's
  table (with `holes`, row 0's second page missing and the last row's last one past the
  cache: SPEC D4)."""
  rows, heads = len(lens), LOGITS_HEADS
  table = rng.integers(0, PAGES, (rows, slots))
  if holes:
    table[0, 1], table[-1, -1] = -1, PAGES + 3
  return (_q_fp8(rng, rows, heads), jnp.asarray(rng.random((rows, heads)), jnp.float32),
          _logits_cache(rng), i32(table), i32(lens))


def _select_args(rng):
  rows, heads = 4, LOGITS_HEADS
  return (_q_fp8(rng, rows, heads), jnp.asarray(rng.random((rows, heads)), jnp.float32),
          _logits_cache(rng), i32(rng.integers(0, PAGES, (3, 3))), i32([0, 2, 1, 2]),
          i32([7, 150, -1, 60]))


def _select_valid(args, outs):
  """Logits are specified only for rows with more than k pools, below their count."""
  positions, (ids, logits) = args[5], outs
  n = np.asarray(glm5_jax.reference.pool_counts(np.asarray(positions)))
  n = np.minimum(n, logits.shape[-1])
  keep = (np.arange(logits.shape[-1]) < n[..., None]) & (n[..., None] > ids.shape[-1])
  return np.asarray(ids), np.where(keep, np.asarray(logits), 0)


def _slots_args(rng):
  """select_pools' case (the same draws: the same pools selected) and a block table of
  its 3 requests: 8 blocks of 16 tokens, so position 150's tokens past 128 are dropped."""
  return _select_args(rng) + (i32(rng.integers(0, 50, (3, 8))),)


def _slots_valid(args, outs):
  """The slots and counts: the reference's third result (select_pools' logits) is
  workspace that the public op drops."""
  return outs[:2]


def _topk_args(rng):
  return jnp.asarray(rng.standard_normal((3, 12)), jnp.float32), i32([12, 3, 0])


HEADS = 4


def _norm(rng):
  return (jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32),
          jnp.asarray(0.1 * rng.standard_normal(128), jnp.float32))


PROJECTION_HEADS, PROJECTION_K = 16, 1024    # a shape the projection kernel takes


def _projection_args(rng, heads=PROJECTION_HEADS, k=PROJECTION_K):
  return bf16(rng, 3, k), bf16(rng, 256 + heads, k)


def _q_args(rng):
  # K = 1536 (GLM-5.3-Flash's q_lora), N = 2 heads of 128: a shape the kernel takes.
  return bf16(rng, 3, 1536), bf16(rng, 256, 1536)


def _query_args(rng):
  return (bf16(rng, 3, HEADS, 128), bf16(rng, 3, 128),
          jnp.asarray(rng.standard_normal((3, HEADS)), jnp.float32)) + _norm(rng)


def _fused_args(rng):
  return _projection_args(rng) + (bf16(rng, 3, PROJECTION_HEADS, 128),) + _norm(rng)


def _exact_bf16(rng, *shape):
  """bf16 multiples of 2^-5 in [-3/32, 3/32]: GEMM sums of up to 2^14 of their products
  are exact in fp32 (multiples of 2^-10 below 2^4), so any summation order gives the
  same bits (the projection's kernel, XLA's GEMM and the reference agree exactly)."""
  return jnp.asarray(rng.integers(-3, 4, shape) / 32, jnp.bfloat16)


def _indexer_update_args(rng):
  kv, tail, tslot, _, _, ape, loc, pos = _update_args(rng)
  rows, heads = tslot.size, PROJECTION_HEADS
  return ((_exact_bf16(rng, rows, PROJECTION_K), _exact_bf16(rng, 256 + heads, PROJECTION_K),
           bf16(rng, rows, heads, 128)) + _norm(rng) + (kv, tail, tslot, ape, loc, pos))


def _epilogue_args(rng):
  """update_epilogue's operands: indexer_update's, with f32 projection sums for x and w_cat
  (any values: the kernel rounds them to bf16 as the reference does)."""
  (_, _, q, norm_weight, norm_bias, kv, tail, tslot, ape, loc, pos) = _indexer_update_args(rng)
  rows, heads = q.shape[:2]
  raw = jnp.asarray(rng.standard_normal((rows, 256 + heads)), jnp.float32)
  return (raw, q, norm_weight, norm_bias, kv, tail, tslot, ape, loc, pos)


def _epilogue_q_args(rng):
  """update_epilogue_q's operands: update_epilogue's with qr and wq_b for q (K = 256, which
  both indexer_q tactics tile; exact GEMM inputs, so any summation order gives q's bits)."""
  raw, q, *rest = _epilogue_args(rng)
  rows, heads = q.shape[:2]
  return (raw, _exact_bf16(rng, rows, 256), _exact_bf16(rng, heads * 128, 256), *rest)


def _update_q_args(rng):
  """indexer_update_q's operands: indexer_update's with qr and wq_b for q (K = 256, exact GEMM
  inputs as in _epilogue_q_args)."""
  x, w_cat, q, *rest = _indexer_update_args(rng)
  rows, heads = q.shape[:2]
  return (x, w_cat, _exact_bf16(rng, rows, 256), _exact_bf16(rng, heads * 128, 256), *rest)


def _update_select_args(rng):
  """indexer_update_select's operands: indexer_update_q's with a cache of 16-entry pages (the
  select kernel's page multiple; valid entries: finite logits), then the select path's page
  table (3 pages a request), req_ids (each request's rows) and block table (8 blocks of 16
  tokens: position 150's tokens past 128 are dropped)."""
  *update, _, tail, tslot, ape, loc, pos = _update_q_args(rng)
  b, n = tslot.shape
  return (*update, _logits_cache(rng), tail, tslot, ape, loc, pos,
          i32(rng.integers(0, PAGES, (b, 3))), i32(np.repeat(np.arange(b), n)),
          i32(rng.integers(0, 50, (b, 8))))


def _update_select_valid(args, outs):
  """Every result but the select path's logits (workspace the stage drops)."""
  return outs[:11]


# Tolerance of the non-exact cases against the reference (the GEMM and einsum sum in
# another order than XLA: SPEC D2).
TOLERANCE = dict(rtol=2e-2, atol=1e-3)


class Case(NamedTuple):
  fn: Callable
  make: Callable
  exact: bool = True
  valid: Callable | None = None


def _upcast_valid(args, outs):
  """Columns at or past a row end are unspecified."""
  (logits, row_ends), (out,) = args, outs
  keep = np.arange(logits.shape[-1]) < np.asarray(row_ends)[..., None]
  return (np.where(keep, np.asarray(out), 0),)


_query = dict(scale=2.0 ** -6, padded=8)
P = functools.partial
CASES = {
    "kpool_update": Case(glm5_jax.kpool_update, _update_args),
    "kpool_compress": Case(glm5_jax.kpool_compress, compress_args),
    "kpool_seed_tail": Case(glm5_jax.kpool_seed_tail, _seed_args),
    "expand_pools": Case(P(glm5_jax.expand_pools, seq_offset=1, width=40), _expand_args),
    "expand_and_remap": Case(P(glm5_jax.expand_and_remap, block_size=16, width=132),
                             _remap_args),
    "upcast_logits": Case(glm5_jax.upcast_logits, _upcast_args, valid=_upcast_valid),
    "mqa_logits": Case(P(glm5_jax.mqa_logits, max_pools=24), mqa_args, exact=False),
    "pool_topk": Case(P(glm5_jax.pool_topk, k=5), _topk_args),
    "select_pools": Case(P(glm5_jax.select_pools, k=5, max_pools=48), _select_args,
                         exact=False, valid=_select_valid),
    # width 24 > 4k + 3 = 23: a column past the tail's (compact: -1).
    "select_slots": Case(P(glm5_jax.select_slots, k=5, max_pools=48, block_size=16, width=24),
                         _slots_args, valid=_slots_valid),
    "indexer_projection": Case(P(glm5_jax.indexer_projection, heads=PROJECTION_HEADS),
                               _projection_args, exact=False),
    "indexer_q": Case(glm5_jax.indexer_q, _q_args, exact=False),
    "indexer_query": Case(P(glm5_jax.indexer_query, **_query), _query_args),
    # Exact: its GEMM's inputs make every summation order give the same sums.
    "indexer_update": Case(P(glm5_jax.indexer_update, heads=PROJECTION_HEADS, scale=2.0 ** -6,
                             padded=32), _indexer_update_args),
    "update_epilogue": Case(P(glm5_jax.update_epilogue, scale=2.0 ** -6, padded=32),
                            _epilogue_args),
    "update_epilogue_q": Case(P(glm5_jax.update_epilogue_q, scale=2.0 ** -6, padded=32),
                              _epilogue_q_args),
    "indexer_update_q": Case(P(glm5_jax.indexer_update_q, scale=2.0 ** -6, padded=32),
                             _update_q_args),
    "indexer_update_select": Case(
        P(glm5_jax.indexer_update_select, scale=2.0 ** -6, padded=32, k=5, max_pools=48,
          block_size=16, width=24), _update_select_args, valid=_update_select_valid),
    "indexer_projection_fused": Case(
        P(glm5_jax.indexer_projection_fused, heads=PROJECTION_HEADS, scale=2.0 ** -6,
          padded=32), _fused_args,
        exact=False),
}
