"""Reference MQA logits over the pooled fp8 cache, pool top-k and the bf16 ->
fp32 logits upcast (SPEC §5b, §5c, §8)."""
import numpy as np
import jax.numpy as jnp
from jax import lax

from .numerics import DIM, e4m3_to_f32


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
  """The k best pools of each row (SPEC §5c).

  logits f32[rows, P]; pool_lens i32[rows]. Returns i32[rows, k]: pool ids by
  descending logit, ties by ascending id (-0, subnormals and +0 tie); only
  p < pool_lens[r] are eligible (a NaN logit ranks as -inf); missing entries are -1.
  """
  rows, width = logits.shape
  cols = jnp.arange(width)
  eligible = cols < pool_lens[:, None]
  masked = jnp.where(eligible & ~jnp.isnan(logits), logits, -jnp.inf)
  # -0 and subnormals tie with +0 on every platform (XLA's CPU flushes them).
  masked = jnp.where(jnp.abs(masked) < np.float32(2.0 ** -126), 0.0, masked)
  if width < k:
    masked = jnp.pad(masked, ((0, 0), (0, k - width)), constant_values=-jnp.inf)
  _, ids = lax.top_k(masked, k)
  return jnp.where(ids < jnp.minimum(pool_lens, width)[:, None], ids, -1).astype(jnp.int32)
