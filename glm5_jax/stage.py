"""The indexer of one DSA layer for a decode step, composed of the ops
(seed `IndexerStage`; SPEC data flow: §1 -> §2 -> §3 -> §5 -> §6 + §7)."""
import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp

from . import reference
from .reference.numerics import DIM, POOL

MQA_MIN_HEADS = 32


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  """Static configuration; defaults are GLM-5.3-Flash's (SPEC §9).

  max_pools: width of the logits (max_model_len // 4); block_size: MLA tokens
  per block (block_table); fused: indexer_projection_fused instead of
  indexer_projection + indexer_query (off: on the H200 the two kernels are faster at
  every measured token count, BENCHMARKS.md; the outputs agree within SPEC D2);
  rope_dim: the indexer's RoPE head dim, which must be 0 (a NoPE indexer, SPEC §9).
  """
  heads: int = 32
  topk_tokens: int = 2048
  softmax_scale: float = DIM ** -0.5
  eps: float = 1e-6
  max_pools: int = 32768
  block_size: int = 128
  scale_format: str = "fp32"
  weights_dtype: str = "float32"
  fused: bool = False
  rope_dim: int = 0

  def __post_init__(self):
    if self.rope_dim != 0:
      raise ValueError(f"glm5_jax.IndexerConfig: rope_dim must be 0 (the kpool indexer is "
                       f"NoPE only, SPEC §9), got {self.rope_dim}")

  @property
  def padded(self):
    return max(self.heads, MQA_MIN_HEADS)

  @property
  def scale(self):
    return float(np.float32(self.softmax_scale * self.heads ** -0.5))

  @property
  def width(self):
    """Logical top-k width: roundup(topk + 3, 128) (2176)."""
    return math.ceil((self.topk_tokens + POOL - 1) / 128) * 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexerWeights:
  """One layer's indexer parameters, prepared once (prepare_weights).

  wq_b bf16[heads*128, q_lora]; w_cat bf16[256 + heads, hidden] = [wk;
  weights_proj; gate]; norm_weight, norm_bias f32[128]; ape f32[4, 128].
  """
  wq_b: jax.Array
  w_cat: jax.Array
  norm_weight: jax.Array
  norm_bias: jax.Array
  ape: jax.Array


def prepare_weights(wq_b, wk, weights_proj, gate, norm_weight, norm_bias, ape):
  """Concatenates [wk; weights_proj; gate] once per layer (never per step)."""
  w_cat = jnp.concatenate([wk, weights_proj, gate]).astype(jnp.bfloat16)
  return IndexerWeights(jnp.asarray(wq_b, jnp.bfloat16), w_cat,
                        jnp.asarray(norm_weight, jnp.float32),
                        jnp.asarray(norm_bias, jnp.float32),
                        jnp.asarray(ape, jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexerCache:
  """kv_cache u8[pages, PAGE, 132] and tail bf16[blocks, 2, RING, 128] (SPEC §0)."""
  kv_cache: jax.Array
  tail: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeBatch:
  """Decode metadata, B requests x N tokens (rows = B*N, request-major).

  positions, loc, tslot i32[B, N] (-1 pads); req_ids i32[B*N];
  page_table i32[R, MP] (indexer K-cache pages per request);
  block_table i32[R, MB] (MLA blocks per request).
  """
  positions: jax.Array
  loc: jax.Array
  tslot: jax.Array
  req_ids: jax.Array
  page_table: jax.Array
  block_table: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexerOutput:
  """q_fp8 e4m3[rows, padded, 128], weights [rows, padded], slots
  i32[rows, width] (physical sparse-MLA slots, valid prefix), counts i32[rows]."""
  q_fp8: jax.Array
  weights: jax.Array
  slots: jax.Array
  counts: jax.Array


def indexer_stage(weights, cache, x, qr, batch, *, config=IndexerConfig(),
                  use_reference=False):
  """One layer's indexer for a decode step; returns (IndexerOutput, cache).

  x bf16[rows, hidden]; qr bf16[rows, q_lora]. Jit with the cache donated:
  jax.jit(indexer_stage, static_argnames=("config", "use_reference"),
  donate_argnames="cache"). Rows whose pools all fit in topk_tokens // 4 select
  every pool (causal fill); others the top-k of their MQA logits over the pooled
  cache (select_pools, per row, pool ids ascending). use_reference=True composes
  glm5_jax.reference directly.
  """
  import glm5_jax        # the package namespace: the ops as primitives
  ops = reference if use_reference else glm5_jax
  rows = x.shape[0]
  b, n = batch.positions.shape
  q = jnp.dot(qr, weights.wq_b.T, preferred_element_type=jnp.float32)
  q = q.astype(jnp.bfloat16).reshape(rows, config.heads, DIM)
  query = dict(scale=config.scale, eps=config.eps, padded=config.padded,
               weights_dtype=np.dtype(config.weights_dtype))
  if config.fused:
    q_fp8, w_out, key, gate = ops.indexer_projection_fused(
        x, weights.w_cat, q, weights.norm_weight, weights.norm_bias,
        heads=config.heads, **query)
  else:
    key_raw, head_w, gate = ops.indexer_projection(x, weights.w_cat, heads=config.heads)
    q_fp8, w_out, key = ops.indexer_query(q, key_raw, head_w, weights.norm_weight,
                                      weights.norm_bias, **query)
  kv_cache, tail = ops.kpool_update(
      cache.kv_cache, cache.tail, batch.tslot, key.reshape(b, n, DIM),
      gate.reshape(b, n, DIM), weights.ape, batch.loc, batch.positions,
      scale_format=config.scale_format)
  positions = batch.positions.reshape(rows)
  # Rows whose pools all fit in the top-k select every pool (the causal fill), others
  # the top-k of their logits; decided per row inside select_pools: no branch here.
  pool_ids, _ = ops.select_pools(q_fp8, w_out.astype(jnp.float32), kv_cache, batch.page_table,
                                 batch.req_ids, positions, k=config.topk_tokens // POOL,
                                 max_pools=config.max_pools, scale_format=config.scale_format)
  slots, counts = ops.expand_and_remap(pool_ids, positions, batch.req_ids,
                                   batch.block_table, block_size=config.block_size,
                                   width=config.width)
  return IndexerOutput(q_fp8, w_out, slots, counts), IndexerCache(kv_cache, tail)
