"""Reference MQA logits over the pooled fp8 cache, pool top-k, the select path with
and without its slots, and the bf16 -> fp32 logits upcast (SPEC §5b, §5c, §6, §7, §8)."""
import numpy as np
import jax.numpy as jnp
from jax import lax

from .expand import expand_and_remap
from .numerics import DIM, POOL, e4m3_to_f32


def upcast_logits(logits, row_ends):
  """bf16 logits -> fp32 below each row end (SPEC §8).

  logits bf16[rows, width]; row_ends i32[rows]. Returns f32[rows, width]:
  out[r, c] = logits[r, c] for c < row_ends[r]. Columns from the row end on
  are unspecified (the kernel leaves them unwritten; this reference writes -inf).
  """
  cols = jnp.arange(logits.shape[1])
  return jnp.where(cols < row_ends[:, None], logits.astype(jnp.float32), -jnp.inf)


def read_cache(kv_cache, loc, scale_format="fp32"):
  """Entries at flat slots loc (in range): (f32[..., 128] fp8 values, f32[...] scales)."""
  pages, page = kv_cache.shape[:2]
  flat = kv_cache.reshape(pages, page * (DIM + 4))
  pg, entry = loc // page, loc % page
  data = flat[pg[..., None], entry[..., None] * DIM + jnp.arange(DIM)]
  raw = flat[pg[..., None], page * DIM + entry[..., None] * 4 + jnp.arange(4)]
  if scale_format == "fp32":
    scale = lax.bitcast_convert_type(raw, jnp.float32)
  else:
    scale = lax.bitcast_convert_type((raw[..., 0].astype(jnp.int32)) << 23, jnp.float32)
  return e4m3_to_f32(data), scale


def mqa_logits(q_fp8, w_out, kv_cache, page_table, pool_lens, *, max_pools,
               scale_format="fp32"):
  """Per-row pool scores over the paged fp8 K cache (SPEC §5b).

  q_fp8 e4m3[rows, H, 128]; w_out f32[rows, H] (head weights); kv_cache u8[pages, PAGE, 132];
  page_table i32[rows, MP] (page of pool p is page_table[r, p // PAGE]);
  pool_lens i32[rows] (n_r). Returns f32[rows, max_pools]:
  sum_h w[r,h] * relu(q[r,h] . k[p]) * kscale[p] for p < n_r; -inf from n_r on
  and for pools whose page id is outside the cache.
  """
  pages, page = kv_cache.shape[:2]
  p = jnp.arange(max_pools)
  pg = page_table[:, jnp.minimum(p // page, page_table.shape[1] - 1)]   # [rows, P]
  ok = (p < pool_lens[:, None]) & (p // page < page_table.shape[1]) & (pg >= 0) & (pg < pages)
  loc = jnp.where(ok, pg * page + p % page, 0)
  k, kscale = read_cache(kv_cache, loc, scale_format)                   # [rows, P, 128]
  q = e4m3_to_f32(lax.bitcast_convert_type(q_fp8, jnp.uint8))
  dots = jnp.einsum("rhd,rpd->rhp", q, k,
                    precision=lax.Precision.HIGHEST)
  score = jnp.einsum("rh,rhp->rp", w_out.astype(jnp.float32), jnp.maximum(dots, 0),
                     precision=lax.Precision.HIGHEST) * kscale
  return jnp.where(ok, score, -jnp.inf)


def pool_topk(logits, pool_lens, *, k):
  """The k best pools of each row (SPEC §5c), listed in ascending pool id.

  logits f32[rows, P]; pool_lens i32[rows]. Returns i32[rows, k]: the set of the
  k largest logits among p < pool_lens[r] (a NaN logit ranks as -inf; -0 and
  subnormals tie with +0; ties at the k-th value go to the lower ids), listed in
  ascending pool id, then -1. A row with at most k eligible pools lists all of them,
  0, 1, .. -- the causal fill of SPEC §5a.

  The order is a project decision (stock top-k leaves it implementation-defined and
  the remap keeps whatever order it gets): ascending ids make a row's result
  independent of how the selection was computed and equal to the causal fill.
  """
  rows, width = logits.shape
  cols = jnp.arange(width)
  eligible = cols < pool_lens[:, None]
  masked = jnp.where(eligible & ~jnp.isnan(logits), logits, -jnp.inf)
  # -0 and subnormals tie with +0 on every platform (XLA's CPU flushes them).
  masked = jnp.where(jnp.abs(masked) < np.float32(2.0 ** -126), 0.0, masked)
  if width < k:
    masked = jnp.pad(masked, ((0, 0), (0, k - width)), constant_values=-jnp.inf)
  _, ids = lax.top_k(masked, k)   # stable: equal values by ascending id
  valid = ids < jnp.minimum(pool_lens, width)[:, None]
  ids = jnp.sort(jnp.where(valid, ids, jnp.iinfo(jnp.int32).max), axis=1)
  return jnp.where(ids < jnp.iinfo(jnp.int32).max, ids, -1).astype(jnp.int32)


def pool_counts(positions):
  """i32[rows] pools of each decode row: (pos + 1) // 4, 0 for pads (pos < 0).

  Written as pos // 4 + (pos % 4 == 3) so that pos = 2^31 - 1 does not overflow.
  """
  pos = jnp.maximum(positions, 0)
  return jnp.where(positions >= 0, pos // POOL + (pos % POOL == POOL - 1), 0).astype(jnp.int32)


def row_pages(page_table, req_ids, positions, max_pools):
  """Each select row's K-cache pages and pool count: (i32[rows, MP] its request's row of
  page_table i32[R, MP], all -1 for a req_id outside [0, R); i32[rows] n =
  min(pool_counts(positions), max_pools)) for req_ids, positions i32[rows]."""
  requests = page_table.shape[0]
  ok = (req_ids >= 0) & (req_ids < requests)
  table = jnp.where(ok[:, None], page_table[jnp.clip(req_ids, 0, requests - 1)], -1)
  return table, jnp.minimum(pool_counts(positions), max_pools)


def select_pools(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, k, max_pools,
                 scale_format="fp32"):
  """The select path of a decode step: MQA logits, then the k best pools (SPEC §5).

  q_fp8 e4m3[rows, H, 128]; w_out f32[rows, H]; kv_cache u8[pages, PAGE, 132];
  page_table i32[R, MP] (K-cache pages of each request); req_ids i32[rows];
  positions i32[rows]. Row r has n = min(pool_counts(positions)[r], max_pools) pools.
  Returns (pool_ids i32[rows, k], logits f32[rows, max_pools]):
  pool_ids = pool_topk(logits, n, k=k): a row with n <= k selects 0..n-1 (the
  causal fill) and needs no logits; logits = mqa_logits over the request's pages,
  specified only for rows with n > k and columns p < n (elsewhere unspecified: the
  kernel does not write them; this reference writes -inf or skips the logits
  altogether when every row fits). A req_id outside [0, R) has no pages: its pools
  score -inf (still eligible, so they are selected by ascending id).
  """
  # Arrays, not numpy: the branches close over them (the op also runs eagerly).
  q_fp8, w_out, kv_cache = map(jnp.asarray, (q_fp8, w_out, kv_cache))
  table, n = row_pages(page_table, req_ids, positions, max_pools)

  def fill(_):
    g = jnp.arange(k)
    ids = jnp.where(g < n[:, None], g, -1).astype(jnp.int32)
    # -inf everywhere, but computed from n rather than a constant: under jax.shard_map
    # both branches must vary over the same mesh axes as their operands.
    none = jnp.where(n[:, None] >= 0, -jnp.inf, 0).astype(jnp.float32)
    return ids, jnp.broadcast_to(none, (q_fp8.shape[0], max_pools))

  def top(_):
    logits = mqa_logits(q_fp8, w_out, kv_cache, table, n, max_pools=max_pools,
                        scale_format=scale_format)
    return pool_topk(logits, n, k=k), logits

  # A branch only here, in the reference: the kernel decides per row.
  return lax.cond(jnp.max(n, initial=0) <= k, fill, top, None)


def select_slots(q_fp8, w_out, kv_cache, page_table, req_ids, positions, block_table, *, k,
                 max_pools, block_size, width, stride_rows=None, scale_format="fp32"):
  """The select path to its sparse-MLA slots: select_pools, then expand_and_remap of its
  pool ids (seq_offset 1: a decode row at position p holds p + 1 tokens; compact).

  q_fp8, w_out, kv_cache, page_table, req_ids, positions, k, max_pools, scale_format: as
  select_pools; block_table i32[R, MB], block_size (a positive multiple of 4), width
  (>= 4k + 3), stride_rows (None: block_size): as expand_and_remap, the same req_ids
  naming both tables' rows. Returns (slots i32[rows, width], counts i32[rows], logits
  f32[rows, max_pools]); the logits are select_pools' (specified where it says).
  """
  ids, logits = select_pools(q_fp8, w_out, kv_cache, page_table, req_ids, positions, k=k,
                             max_pools=max_pools, scale_format=scale_format)
  slots, counts = expand_and_remap(ids, positions, req_ids, block_table,
                                   block_size=block_size, width=width,
                                   stride_rows=stride_rows)
  return slots, counts, logits
