"""Logits ops: MQA logits over the pooled cache, pool top-k, bf16 -> fp32 upcast
(SPEC §5b, §5c, §8). Shapes and dtypes: see glm5_jax.reference.logits."""
import numpy as np
import jax
import jax.numpy as jnp

from . import reference as ref
from ._checks import check_cache, check_scale_format, expect, fail
from ._primitive import Op, Routing
from .reference.numerics import DIM

I32, F32 = np.int32, np.float32


def _upcast_shapes(logits, row_ends):
  expect("upcast_logits", "logits", logits, jnp.bfloat16, (None, None))
  expect("upcast_logits", "row_ends", row_ends, I32, (logits.shape[0],))
  return [(logits.shape, F32)]


_upcast = Op("upcast_logits", ref.upcast_logits, _upcast_shapes, rows=((0, 0), (0,)),
             kernel="glm5_upcast_logits",
             kernel_off="XLA's fused convert is faster at most measured shapes")


def upcast_logits(logits: jax.Array, row_ends: jax.Array, *,
                  routing: Routing | None = None) -> jax.Array:
  """bf16[rows, width] logits -> f32 below row_ends i32[rows] (SPEC §8).

  Columns at or past a row's end are unspecified. fp32 logits are returned
  unchanged. routing: None = Routing.from_env().
  """
  if jnp.result_type(logits) == jnp.float32:
    return logits
  return _upcast(logits, row_ends, routing=routing)[0]


def _mqa_shapes(q_fp8, w_out, kv_cache, page_table, pool_lens, *, max_pools,
                scale_format):
  op = "mqa_logits"
  expect(op, "q_fp8", q_fp8, jnp.float8_e4m3fn, (None, None, DIM))
  rows, heads = q_fp8.shape[:2]
  expect(op, "w_out", w_out, F32, (rows, heads))
  check_cache(op, kv_cache)
  expect(op, "page_table", page_table, I32, (rows, None))
  expect(op, "pool_lens", pool_lens, I32, (rows,))
  if max_pools < 0:
    fail(op, "max_pools", f"must be >= 0, got {max_pools}")
  check_scale_format(op, scale_format)
  return [((rows, max_pools), F32)]


_mqa = Op("mqa_logits", ref.mqa_logits, _mqa_shapes,
          rows=((0, 0, None, 0, 0), (0,)))


def mqa_logits(q_fp8: jax.Array, w_out: jax.Array, kv_cache: jax.Array,
               page_table: jax.Array, pool_lens: jax.Array, *, max_pools: int,
               scale_format: str = "fp32", routing: Routing | None = None) -> jax.Array:
  """Pool scores f32[rows, max_pools] of fp8 queries against the paged K cache
  (SPEC §5b); see glm5_jax.reference.mqa_logits for shapes."""
  return _mqa(q_fp8, w_out, kv_cache, page_table, pool_lens,
              max_pools=int(max_pools), scale_format=scale_format, routing=routing)[0]


def _topk_shapes(logits, pool_lens, *, k):
  expect("pool_topk", "logits", logits, F32, (None, None))
  expect("pool_topk", "pool_lens", pool_lens, I32, (logits.shape[0],))
  if k <= 0:
    fail("pool_topk", "k", f"must be > 0, got {k}")
  return [((logits.shape[0], k), I32)]


_topk = Op("pool_topk", ref.pool_topk, _topk_shapes, rows=((0, 0), (0,)))


def pool_topk(logits: jax.Array, pool_lens: jax.Array, *, k: int,
              routing: Routing | None = None) -> jax.Array:
  """The k best pool ids i32[rows, k] of f32[rows, P] logits below pool_lens
  (SPEC §5c): descending logit, ties by ascending id, -1 where fewer."""
  return _topk(logits, pool_lens, k=int(k), routing=routing)[0]
