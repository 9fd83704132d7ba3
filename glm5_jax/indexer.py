"""Indexer projection and query epilogue (SPEC §1, §2), separate or fused.
Shapes and dtypes: see glm5_jax.reference.indexer."""
import numpy as np
import jax.numpy as jnp

from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op
from .reference.numerics import DIM

I32, F32, BF16 = np.int32, np.float32, jnp.bfloat16
WEIGHTS_DTYPES = (np.dtype(F32), np.dtype(BF16))


def _projection_shapes(op, x, w_cat, heads):
  expect(op, "x", x, BF16, (None, None))
  m, k = x.shape
  if heads <= 0:
    fail(op, "heads", f"must be > 0, got {heads}")
  expect(op, "w_cat", w_cat, BF16, (2 * DIM + heads, k))
  return [((m, DIM), BF16), ((m, heads), F32), ((m, DIM), BF16)]


def _query_shapes(op, q, weights, norm_weight, norm_bias, m, heads, scale, eps,
                  padded, weights_dtype):
  expect(op, "q", q, BF16, (m, heads, DIM))
  if weights is not None:
    expect(op, "weights", weights, F32, (m, heads))
  expect(op, "norm_weight", norm_weight, F32, (DIM,))
  expect(op, "norm_bias", norm_bias, F32, (DIM,))
  if padded < heads:
    fail(op, "padded", f"must be >= the head count {heads}, got {padded}")
  if np.dtype(weights_dtype) not in WEIGHTS_DTYPES:
    fail(op, "weights_dtype", f"must be float32 or bfloat16, got {weights_dtype}", TypeError)
  if not (np.isfinite(scale) and np.isfinite(eps) and eps >= 0):
    fail(op, "scale/eps", f"must be finite (eps >= 0), got {scale}, {eps}")
  return [((m, padded, DIM), jnp.float8_e4m3fn), ((m, padded), weights_dtype),
          ((m, DIM), BF16)]


_projection = Op(
    "indexer_projection", ref.indexer_projection,
    lambda x, w_cat, *, heads: _projection_shapes("indexer_projection", x, w_cat, heads),
    rows=((0, None), (0, 0, 0)))


def _query_op_shapes(q, key_raw, weights, norm_weight, norm_bias, *, scale, eps,
                     padded, weights_dtype):
  op = "indexer_query"
  expect(op, "key_raw", key_raw, BF16, (None, DIM))
  m = key_raw.shape[0]
  if q.ndim != 3:
    fail(op, "q", f"must have shape (M, H, 128), got {tuple(q.shape)}")
  return _query_shapes(op, q, weights, norm_weight, norm_bias, m, q.shape[1],
                       scale, eps, padded, weights_dtype)


def _query_attributes(*, scale, eps, padded, weights_dtype):
  """The kernel's Attr<float> scale and eps; padded and the weights dtype come
  from its result buffers."""
  return dict(scale=np.float32(scale), eps=np.float32(eps))


_query = Op("indexer_query", ref.indexer_query, _query_op_shapes,
            rows=((0, 0, 0, None, None), (0, 0, 0)), attributes=_query_attributes)


def _fused_shapes(x, w_cat, q, norm_weight, norm_bias, *, heads, scale, eps, padded,
                  weights_dtype):
  op = "indexer_projection_fused"
  key, _, gate = _projection_shapes(op, x, w_cat, heads)
  q_fp8, w_out, _ = _query_shapes(op, q, None, norm_weight, norm_bias, x.shape[0],
                                  heads, scale, eps, padded, weights_dtype)
  return [q_fp8, w_out, key, gate]


_fused = Op("indexer_projection_fused", ref.indexer_projection_fused, _fused_shapes,
            rows=((0, None, 0, None, None), (0, 0, 0, 0)))


def indexer_projection(x, w_cat, *, heads):
  """(key bf16[M, 128], head weights f32[M, heads], gate bf16[M, 128]) of
  x bf16[M, K] against w_cat = [wk; weights_proj; gate] bf16[256 + heads, K]."""
  return tuple(_projection(x, w_cat, heads=int(heads)))


def _query_params(scale, eps, padded, heads, weights_dtype):
  return dict(scale=float(scale), eps=float(eps),
              padded=int(heads if padded is None else padded),
              weights_dtype=np.dtype(weights_dtype))


def indexer_query(q, key_raw, weights, norm_weight, norm_bias, *, scale, eps=1e-6,
                  padded=None, weights_dtype=jnp.float32):
  """(q_fp8 e4m3[M, padded, 128], w_out[M, padded], key bf16[M, 128]): key
  LayerNorm, q Hadamard + FP8, head-weight scaling and padding (SPEC §2)."""
  params = _query_params(scale, eps, padded, q.shape[1], weights_dtype)
  return tuple(_query(q, key_raw, weights, norm_weight, norm_bias, **params))


def indexer_projection_fused(x, w_cat, q, norm_weight, norm_bias, *, heads, scale,
                             eps=1e-6, padded=None, weights_dtype=jnp.float32):
  """indexer_projection + indexer_query in one op: (q_fp8, w_out, key, gate)."""
  params = _query_params(scale, eps, padded, heads, weights_dtype)
  return tuple(_fused(x, w_cat, q, norm_weight, norm_bias, heads=int(heads), **params))
