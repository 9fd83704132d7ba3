"""Reference indexer projection and query epilogue (SPEC §1, §2)."""
import numpy as np
import jax.numpy as jnp
from jax import lax

from .checks import fail
from .numerics import DIM, rotate_quant

LN_GROUPS = 16      # the key LayerNorm's (mean, M2) groups of 8 dims (seed order)


def indexer_q(qr, wq_b):
  """q = qr wq_b^T (SPEC §1, step 1): the query heads before the epilogue.

  qr bf16[M, K] (the q-lora latent); wq_b bf16[N = heads * 128, K]. Returns q bf16[M, N]:
  fp32 sums of exact products, one RNE rounding to bf16.

  wq_b's dim 1 is contracted where it lies (as indexer_projection contracts w_cat), not
  `wq_b.T`: run eagerly, the .T is its own transpose and the dot then XLA CPU's bf16
  GEMM, while under jit the transpose folds into the dot, which the CPU backend then
  computes as an f32 GEMM of upcast operands: another summation order, so eager and
  jitted q differed in a few bf16 roundings. One dot_general is the same HLO both ways.
  """
  acc = lax.dot_general(qr, wq_b, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
  return acc.astype(jnp.bfloat16)


def projection_sums(x, w_cat):
  """The projection's GEMM (SPEC §1): x bf16[M, K] against w_cat bf16[256 + heads, K],
  f32[M, 256 + heads] fp32 sums of exact products (columns: key, head weights, gate)."""
  return lax.dot_general(x, w_cat, (((1,), (1,)), ((), ())),
                         precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def split_projection(acc, heads):
  """projection_sums' f32[M, 256 + heads] as indexer_projection's results: (key bf16[M,
  128], head_w f32[M, heads], gate bf16[M, 128]), the bf16 ones rounded to nearest even."""
  key, head_w, gate = acc[:, :DIM], acc[:, DIM:DIM + heads], acc[:, DIM + heads:]
  return key.astype(jnp.bfloat16), head_w, gate.astype(jnp.bfloat16)


def indexer_projection(x, w_cat, *, heads):
  """One GEMM against [wk; weights_proj; gate] (SPEC §1).

  x bf16[M, K]; w_cat bf16[128 + heads + 128, K]. Returns (key bf16[M, 128],
  head_w f32[M, heads] (per-token head weights), gate bf16[M, 128]); fp32 sums of
  exact products.
  """
  return split_projection(projection_sums(x, w_cat), heads)


def _sum_in_order(x):
  """Sequential fp32 sum over the last axis, left to right."""
  total = x[..., 0]
  for i in range(1, x.shape[-1]):
    total = total + x[..., i]
  return total


def key_layernorm(key_raw, weight, bias, eps):
  """LayerNorm of bf16[M, 128] keys with the seed's grouped (mean, M2) order.

  16 groups of 8: mean_g = sum8 * 1/8, M2_g = sum (x - mean_g)^2;
  mean = sum_g mean_g * 1/16, M2 = sum_g (M2_g + 8 (mean_g - mean)^2);
  y = bf16((x - mean) * rsqrt(M2 / 128 + eps) * weight + bias).
  """
  x = key_raw.astype(jnp.float32)
  groups = x.reshape(x.shape[0], LN_GROUPS, DIM // LN_GROUPS)
  mean_g = _sum_in_order(groups) * np.float32(LN_GROUPS / DIM)
  m2_g = _sum_in_order(jnp.square(groups - mean_g[..., None]))
  mean = _sum_in_order(mean_g) * np.float32(1 / LN_GROUPS)
  m2 = _sum_in_order(m2_g + np.float32(DIM // LN_GROUPS) * jnp.square(mean_g - mean[:, None]))
  rstd = lax.rsqrt(m2 * np.float32(1 / DIM) + np.float32(eps))
  y = (x - mean[:, None]) * rstd[:, None] * weight + bias
  return y.astype(jnp.bfloat16)


def padded_heads(op, heads, padded):
  """The head count w_out and q_fp8 are padded to: `padded` (>= heads), heads where None."""
  if padded is None:
    return heads
  if padded < heads:
    fail(op, "padded", f"must be >= the head count {heads}, got {padded}")
  return padded


def indexer_query(q, key_raw, head_w, norm_weight, norm_bias, *, scale, eps=1e-6,
                  padded=None, w_out_dtype=jnp.float32):
  """Key LayerNorm, q Hadamard + FP8, head-weight scaling, head padding (SPEC §2).

  q bf16[M, H, 128]; key_raw bf16[M, 128]; head_w f32[M, H];
  norm_weight, norm_bias f32[128]; scale = softmax_scale * H**-0.5;
  padded >= H (None: H). Returns (q_fp8 e4m3[M, padded, 128],
  w_out w_out_dtype[M, padded] = head_w * q_scale * scale, key bf16[M, 128]);
  heads >= H are zero.
  """
  m, heads, _ = q.shape
  padded = padded_heads("indexer_query", heads, padded)
  q_fp8, q_scale, _ = rotate_quant(q.astype(jnp.float32))
  w_out = (head_w * q_scale) * np.float32(scale)
  pad = ((0, 0), (0, padded - heads))
  q_fp8 = jnp.pad(q_fp8, pad + ((0, 0),))
  w_out = jnp.pad(w_out, pad).astype(w_out_dtype)
  return q_fp8, w_out, key_layernorm(key_raw, norm_weight, norm_bias, eps)


def indexer_projection_fused(x, w_cat, q, norm_weight, norm_bias, *, heads, scale,
                             eps=1e-6, padded=None, w_out_dtype=jnp.float32):
  """indexer_projection then indexer_query, as one op (seed `fused`).

  Returns (q_fp8 e4m3[M, padded, 128], w_out[M, padded], key bf16[M, 128],
  gate bf16[M, 128]).
  """
  key_raw, head_w, gate = indexer_projection(x, w_cat, heads=heads)
  q_fp8, w_out, key = indexer_query(q, key_raw, head_w, norm_weight, norm_bias,
                                    scale=scale, eps=eps, padded=padded,
                                    w_out_dtype=w_out_dtype)
  return q_fp8, w_out, key, gate
