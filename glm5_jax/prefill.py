"""The indexer of one DSA layer for prompt tokens: their keys into the caches
(docs/semantics.md §1 -> §2a -> §4c), so that decode steps (indexer_stage) continue
the requests."""
import dataclasses
import functools
import types

import numpy as np
import jax
import jax.numpy as jnp
from jax import export, lax

from . import reference
from ._checks import expect, fail
from .indexer import indexer_projection
from .kpool import kpool_compress, kpool_seed_tail
from .reference.numerics import DIM, POOL
from .stage import IndexerCache, IndexerConfig, IndexerWeights

OP = "indexer_prefill"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillBatch:
  """Prefill metadata of `rows` prompt tokens of one or more requests, flat.

  positions i32[rows]: each token's position in its request (-1 pads); a request's
  rows are contiguous and consecutive in position (a chunk may start anywhere: it
  continues what earlier chunks or decode steps left in the caches).
  loc i32[rows]: the K-cache slot of the pool a token completes ((pos + 1) % 4 == 0),
  -1 for the others (SPEC §0.1).
  tslot i32[rows]: tail block * RING + pos % RING, -1 pads; each request owns one
  tail block, the same its decode steps use (SPEC §0.2).
  """
  positions: jax.Array
  loc: jax.Array
  tslot: jax.Array


export.register_pytree_node_serialization(
    PrefillBatch, serialized_name="glm5_jax.PrefillBatch",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


def _check(weights, cache, x, batch, config):
  """Trace-time checks of what the ops below would only blame on their own
  arguments."""
  expect(OP, "x", x, jnp.bfloat16, (None, None))
  rows, hidden = x.shape
  for name in ("positions", "loc", "tslot"):
    expect(OP, f"batch.{name}", getattr(batch, name), np.int32, (rows,))
  w_rows = 2 * DIM + config.heads
  if weights.w_cat.shape != (w_rows, hidden):
    fail(OP, "weights.w_cat", f"must have shape ({w_rows}, {hidden}) (256 + config.heads "
         f"{config.heads} rows, x's width), got {tuple(weights.w_cat.shape)}")


def _ops(config, use_reference):
  fns = (indexer_projection, kpool_compress, kpool_seed_tail)
  if use_reference:
    return types.SimpleNamespace(**{f.__name__: getattr(reference, f.__name__) for f in fns})
  return types.SimpleNamespace(**{f.__name__: functools.partial(f, routing=config.routing)
                                  for f in fns})


def indexer_prefill(weights: IndexerWeights, cache: IndexerCache, x: jax.Array,
                    batch: PrefillBatch, *, config: IndexerConfig | None = None,
                    use_reference: bool = False) -> IndexerCache:
  """One layer's indexer for prompt tokens: writes their pools and tail rows and
  returns the new IndexerCache (docs/semantics.md §4c).

  weights IndexerWeights (prepare_weights); cache IndexerCache (kv_cache
  u8[pages, PAGE, 132], tail bf16[blocks, 2, RING, 128]); x bf16[rows, hidden], the
  layer input of the batch's rows; batch PrefillBatch (positions, loc, tslot
  i32[rows]). Every pool a row completes is compressed into kv_cache at its loc
  (kpool_compress; a pool begun before this call takes its earlier tokens from the
  tail ring), and each request's last (up to 4) tokens are stashed in its tail ring
  (kpool_seed_tail). The queries are not computed: prefill attention is not the
  indexer's (no qr). Prefill of L tokens then decode steps leaves the caches a
  prefill of the same tokens leaves (tests/test_prefill.py). config None:
  IndexerConfig() (heads, eps, scale_format and routing are used).
  use_reference=True composes glm5_jax.reference directly.

  Jit with the cache donated (updated in place):
  jax.jit(indexer_prefill, static_argnames=("config", "use_reference"),
  donate_argnames="cache").
  """
  config = IndexerConfig() if config is None else config
  _check(weights, cache, x, batch, config)
  ops = _ops(config, use_reference)
  key_raw, _, gate = ops.indexer_projection(x, weights.w_cat, heads=config.heads)
  # The key LayerNorm of indexer_query's epilogue, without its query half: prefill has
  # no q. (Decode's query kernel agrees with it within 1 bf16 ulp, SPEC D2.)
  key = reference.key_layernorm(key_raw, weights.norm_weight, weights.norm_bias, config.eps)
  slot_key, slot_gate = reference.prefill_windows(cache.tail, key, gate, batch.positions,
                                                  batch.tslot)
  # The seed below overwrites ring rows the windows read: it must follow the read, and
  # saying so lets XLA update a donated tail in place instead of copying it first.
  slot_key, slot_gate, tail = lax.optimization_barrier((slot_key, slot_gate, cache.tail))
  blocks, _, ring, _ = tail.shape
  pos = batch.positions
  # The completion rule of a decode step (SPEC §3), tail block included: a token whose
  # tail block is past the ring is a no-op there too.
  write = ((batch.loc >= 0) & (pos >= 0) & (pos % POOL == POOL - 1)
           & (jnp.maximum(batch.tslot, 0) // ring < blocks))
  kv_cache = ops.kpool_compress(cache.kv_cache, slot_key, slot_gate, weights.ape, batch.loc,
                                write, scale_format=config.scale_format)
  tail = ops.kpool_seed_tail(tail, key, gate, batch.tslot)
  return IndexerCache(kv_cache, tail)
