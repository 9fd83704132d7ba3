"""The update part of a decode step after the q GEMM: indexer_projection,
indexer_query and kpool_update composed, as indexer_stage composes them; update_epilogue
the last two on the projection's GEMM sums (indexer_update = the GEMM, its split, then
update_epilogue); update_epilogue_q the q GEMM (indexer_q) then update_epilogue;
indexer_update_q the q GEMM then indexer_update; indexer_update_select indexer_update_q then
the select path (select_slots) on its results."""
import jax.numpy as jnp

from .indexer import indexer_q, indexer_query, projection_sums, split_projection
from .kpool import kpool_update
from .logits import select_slots
from .numerics import DIM


def indexer_update(x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                   positions, *, heads, scale, eps=1e-6, padded=None, w_out_dtype=jnp.float32,
                   scale_format="fp32", round_scale=True):
  """indexer_projection -> indexer_query -> kpool_update (SPEC §1, §2, §3).

  x bf16[M, K]; w_cat bf16[256 + heads, K]; q bf16[M, heads, 128]; norm_weight,
  norm_bias f32[128]; kv_cache u8[pages, PAGE, 132]; tail bf16[blocks, 2, RING, 128];
  tslot, loc, positions i32[B, N] with M = B * N (rows request-major); ape f32[4, 128].
  Returns the three ops' results in order: (key_raw bf16[M, 128], head_w f32[M, heads],
  gate bf16[M, 128], q_fp8 e4m3[M, padded, 128], w_out w_out_dtype[M, padded],
  key bf16[M, 128], kv_cache, tail); kpool_update sees key and gate as [B, N, 128].
  """
  raw = projection_sums(x, w_cat)
  return split_projection(raw, heads) + update_epilogue(
      raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, positions, scale=scale,
      eps=eps, padded=padded, w_out_dtype=w_out_dtype, scale_format=scale_format,
      round_scale=round_scale)


def update_epilogue(raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, positions, *,
                    scale, eps=1e-6, padded=None, w_out_dtype=jnp.float32,
                    scale_format="fp32", round_scale=True):
  """indexer_query -> kpool_update on the projection's f32 sums (SPEC §1 rounding, §2, §3):
  indexer_update after its GEMM.

  raw f32[M, 256 + heads] (projection_sums: key, head-weight and gate columns); q bf16[M,
  heads, 128]; the rest as indexer_update. Returns (q_fp8 e4m3[M, padded, 128],
  w_out w_out_dtype[M, padded], key bf16[M, 128], kv_cache, tail).
  """
  key_raw, head_w, gate = split_projection(raw, q.shape[1])
  q_fp8, w_out, key = indexer_query(q, key_raw, head_w, norm_weight, norm_bias, scale=scale,
                                    eps=eps, padded=padded, w_out_dtype=w_out_dtype)
  grid = tslot.shape + (DIM,)
  kv_cache, tail = kpool_update(kv_cache, tail, tslot, key.reshape(grid), gate.reshape(grid),
                                ape, loc, positions, scale_format=scale_format,
                                round_scale=round_scale)
  return q_fp8, w_out, key, kv_cache, tail


def update_epilogue_q(raw, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                      positions, *, scale, eps=1e-6, padded=None, w_out_dtype=jnp.float32,
                      scale_format="fp32", round_scale=True):
  """indexer_q -> update_epilogue (SPEC §1, §2, §3): the update part after the projection's
  GEMM, q's GEMM included.

  raw f32[M, 256 + heads] (projection_sums); qr bf16[M, K]; wq_b bf16[heads * 128, K]; the
  rest as update_epilogue. Returns (q bf16[M, heads * 128], q_fp8 e4m3[M, padded, 128],
  w_out w_out_dtype[M, padded], key bf16[M, 128], kv_cache, tail): indexer_q's result, then
  update_epilogue's on q seen as [M, heads, 128].
  """
  q = indexer_q(qr, wq_b)
  q3 = q.reshape(q.shape[0], wq_b.shape[0] // DIM, DIM)
  return (q,) + update_epilogue(
      raw, q3, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, positions,
      scale=scale, eps=eps, padded=padded, w_out_dtype=w_out_dtype,
      scale_format=scale_format, round_scale=round_scale)


def indexer_update_q(x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape,
                     loc, positions, *, scale, eps=1e-6, padded=None, w_out_dtype=jnp.float32,
                     scale_format="fp32", round_scale=True):
  """indexer_q -> indexer_update (SPEC §1, §2, §3): the whole update part of a decode step.

  x bf16[M, K]; w_cat bf16[256 + heads, K]; qr bf16[M, Kq]; wq_b bf16[heads * 128, Kq];
  the rest as indexer_update. Returns (key_raw bf16[M, 128], head_w f32[M, heads],
  gate bf16[M, 128], q bf16[M, heads * 128], q_fp8 e4m3[M, padded, 128],
  w_out w_out_dtype[M, padded], key bf16[M, 128], kv_cache, tail): indexer_update's results
  with indexer_q's q after the projection's three.
  """
  q = indexer_q(qr, wq_b)
  heads = wq_b.shape[0] // DIM
  out = indexer_update(x, w_cat, q.reshape(q.shape[0], heads, DIM), norm_weight, norm_bias,
                       kv_cache, tail, tslot, ape, loc, positions, heads=heads, scale=scale,
                       eps=eps, padded=padded, w_out_dtype=w_out_dtype, scale_format=scale_format,
                       round_scale=round_scale)
  return out[:3] + (q,) + out[3:]


def indexer_update_select(x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot,
                          ape, loc, positions, page_table, req_ids, block_table, *, scale, k,
                          max_pools, block_size, width, eps=1e-6, padded=None,
                          scale_format="fp32", round_scale=True, stride_rows=None):
  """indexer_update_q (w_out float32), then select_slots on its q_fp8, w_out and cache
  (SPEC §1-§7): a decode step's update part and select path.

  x .. positions as indexer_update_q (positions i32[B, N], M = B * N rows); page_table
  i32[T, W], req_ids i32[M], block_table i32[R, MB] and k, max_pools, block_size, width,
  stride_rows as select_slots, whose positions are positions.reshape(M). Returns
  indexer_update_q's nine results, then select_slots' (slots i32[M, width], counts i32[M],
  logits f32[M, max_pools]).
  """
  out = indexer_update_q(x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot,
                         ape, loc, positions, scale=scale, eps=eps, padded=padded,
                         w_out_dtype=jnp.float32, scale_format=scale_format,
                         round_scale=round_scale)
  q_fp8, w_out, kv_cache = out[4], out[5], out[7]
  select = select_slots(q_fp8, w_out, kv_cache, page_table, req_ids, positions.reshape(-1),
                        block_table, k=k, max_pools=max_pools, block_size=block_size,
                        width=width, stride_rows=stride_rows, scale_format=scale_format)
  return tuple(out) + tuple(select)
