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


# The kernels' tiling (cc/projection.cuh): 16 weight rows per CTA; (warps, split) = warps
# per CTA and CTAs per cluster splitting K; a warp's span of K is 1..MAX_BLOCKS blocks of
# 32 held in registers, or whole stages of MAX_BLOCKS blocks.
TILE_ROWS, BLOCK_K, MAX_BLOCKS, MAX_WARPS, MAX_SPLIT = 16, 32, 8, 8, 8
AUTO_K = 1024           # K % AUTO_K == 0, K <= 8 * AUTO_K: the built-in tactic table tiles K
FUSED_WARPS = 8         # the fused kernel's warps without a tactic (split is always 1)
# M where the projection kernel beat XLA's GEMM on the H200 (BENCHMARKS.md, K 4096, H 32):
# its default; XLA's GEMM elsewhere.
PROJECTION_KERNEL_ROWS = (2, 16)


def _tiles(k, warps, split):
  """Whether (warps, split) tiles K (cc/projection.cuh tile_k)."""
  blocks, rest = divmod(k, BLOCK_K * warps * split)
  return not rest and (1 <= blocks <= MAX_BLOCKS or blocks % MAX_BLOCKS == 0 < blocks)


def _check_tactic(op, tactic, k, max_split=MAX_SPLIT):
  """An explicit (warps, split) must tile K."""
  if tactic is None:
    return
  warps, split = tactic
  if not (1 <= warps <= MAX_WARPS and 1 <= split <= max_split):
    fail(op, "tactic", f"must be (warps 1..{MAX_WARPS}, split 1..{max_split}), got {tactic}")
  if not _tiles(k, warps, split):
    fail(op, "tactic", f"{tactic} does not tile K = {k}: K must be 32 * warps * split * "
         f"blocks with blocks in 1..{MAX_BLOCKS} or a multiple of {MAX_BLOCKS}")


def _projection_op_shapes(x, w_cat, *, heads, tactic):
  op = "indexer_projection"
  out = _projection_shapes(op, x, w_cat, heads)
  _check_tactic(op, tactic, x.shape[1])
  return out


def _projection_kernel_supports(x, w_cat, *, heads, tactic):
  """Whole 16-row tiles (H % 16 == 0) and a K the tactic tiles (checked at trace time
  for an explicit tactic)."""
  k = x.shape[1]
  return heads % TILE_ROWS == 0 and (
      tactic is not None or (k % AUTO_K == 0 and AUTO_K <= k <= MAX_BLOCKS * AUTO_K))


def _projection_attributes(*, heads, tactic):
  """The kernel's Attr<int32_t> warps and split (0, 0 = its built-in table); heads
  comes from the result shapes."""
  warps, split = tactic or (0, 0)
  return dict(warps=np.int32(warps), split=np.int32(split))


_projection = Op(
    "indexer_projection",
    lambda x, w_cat, *, heads, tactic: ref.indexer_projection(x, w_cat, heads=heads),
    _projection_op_shapes, rows=((0, None), (0, 0, 0)), attributes=_projection_attributes,
    kernel_supports=_projection_kernel_supports,
    kernel_limits="heads % 16 == 0, K % 1024 == 0, K <= 8192",
    kernel_default=lambda x, w_cat, **params: (
        PROJECTION_KERNEL_ROWS[0] <= x.shape[0] <= PROJECTION_KERNEL_ROWS[1]),
    kernel_default_note="M {} to {}, where it beats XLA's GEMM".format(*PROJECTION_KERNEL_ROWS))


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
                  weights_dtype, tactic):
  op = "indexer_projection_fused"
  key, _, gate = _projection_shapes(op, x, w_cat, heads)
  q_fp8, w_out, _ = _query_shapes(op, q, None, norm_weight, norm_bias, x.shape[0],
                                  heads, scale, eps, padded, weights_dtype)
  _check_tactic(op, tactic, x.shape[1], max_split=1)
  return [q_fp8, w_out, key, gate]


def _fused_kernel_supports(x, w_cat, q, norm_weight, norm_bias, *, heads, tactic, **params):
  """Whole 16-row tiles (H % 16 == 0) and a K that (FUSED_WARPS, 1) tiles (an explicit
  tactic is checked at trace time)."""
  return heads % TILE_ROWS == 0 and (tactic is not None or _tiles(x.shape[1], FUSED_WARPS, 1))


def _fused_attributes(*, heads, tactic, **query_params):
  """indexer_query's attributes and the kernel's Attr<int32_t> warps (0 = FUSED_WARPS);
  heads comes from q's shape."""
  return dict(_query_attributes(**query_params),
              warps=np.int32(0 if tactic is None else tactic[0]))


_fused = Op(
    "indexer_projection_fused",
    lambda *args, tactic, **params: ref.indexer_projection_fused(*args, **params),
    _fused_shapes, rows=((0, None, 0, None, None), (0, 0, 0, 0)),
    attributes=_fused_attributes, kernel_supports=_fused_kernel_supports,
    kernel_limits="heads % 16 == 0, K = 256 * blocks with blocks in 1..8 or a multiple of 8")


def indexer_projection(x, w_cat, *, heads, tactic=None):
  """(key bf16[M, 128], head weights f32[M, heads], gate bf16[M, 128]) of
  x bf16[M, K] against w_cat = [wk; weights_proj; gate] bf16[256 + heads, K].

  The CUDA kernel takes heads % 16 == 0, K % 1024 == 0, K <= 8192 (other shapes
  run the reference) and reads w_cat before the preceding kernel has finished
  (PDL): pass the weights in as model parameters, not as the output of the op
  just before. tactic: None (the kernel's table by M) or (warps, split), warps
  per CTA and CTAs per cluster splitting K, for benchmark sweeps; it changes
  the fp32 summation order, not the result's tolerance; the reference ignores it.
  """
  tactic = None if tactic is None else tuple(int(v) for v in tactic)
  return tuple(_projection(x, w_cat, heads=int(heads), tactic=tactic))


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
                             eps=1e-6, padded=None, weights_dtype=jnp.float32, tactic=None):
  """indexer_projection + indexer_query in one op: (q_fp8 e4m3[M, padded, 128],
  w_out[M, padded], key bf16[M, 128], gate bf16[M, 128]).

  The CUDA kernel takes heads % 16 == 0 and K = 256 * blocks (blocks 1..8 or a
  multiple of 8; other shapes run the reference) and splits K over the warps of a
  CTA only. tactic: None (8 warps) or (warps, 1); its outputs are bit-identical to
  indexer_projection(tactic=(warps, 1)) followed by indexer_query's kernel. As for
  indexer_projection, w_cat is read before the preceding kernel has finished (PDL).
  """
  params = _query_params(scale, eps, padded, heads, weights_dtype)
  tactic = None if tactic is None else tuple(int(v) for v in tactic)
  return tuple(_fused(x, w_cat, q, norm_weight, norm_bias, heads=int(heads), tactic=tactic,
                      **params))
