"""Prefill into the caches: prefill then decode == one longer prefill (bit-exact on
CPU), chunked prefill == one prefill, the stock pool-aligned formulation (SPEC §4a),
the ops (kpool_compress's kernel on a GPU) against the reference composition, in-place
caches under donation, trace-time errors."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import synthetic
from glm5_jax.reference.numerics import POOL
from glm5_testing import oracle, tiers
from glm5_testing.cases import tree_bytes

from graphs import copied_shapes, gemm_pinned

PREFILL = jax.jit(glm5_jax.indexer_prefill, static_argnames=("config", "use_reference"),
                  donate_argnames="cache")
STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"),
               donate_argnames="cache")
CONFIG = glm5_jax.IndexerConfig(max_pools=256)
HIDDEN, Q_LORA = 512, 256


class Requests:
  """Requests of up to `max_context` tokens each: one layer, a random cache (random fp8
  pages, random tail ring), the layer input of every token of every request."""

  def __init__(self, requests, max_context, seed=0, next_n=1):
    rng = np.random.default_rng(seed)
    self.weights = synthetic.layer(rng, CONFIG, hidden=HIDDEN, q_lora=Q_LORA)
    self.cache, self.pt, self.bt = synthetic.decode_cache(rng, requests, max_context,
                                                          next_n=next_n, page=16,
                                                          spare_pages=2)
    self.x = synthetic.inputs(rng, requests * max_context, hidden=HIDDEN,
                              q_lora=Q_LORA)[0].reshape(requests, max_context, HIDDEN)
    self.qr = synthetic.inputs(rng, requests * max_context, hidden=HIDDEN,
                               q_lora=Q_LORA)[1].reshape(requests, max_context, Q_LORA)

  def fresh(self):
    return jax.tree.map(jnp.copy, self.cache)

  def inputs(self, cache, starts, lengths, rows=None):
    """(x, batch) of a prefill of request r's positions starts[r] .. + lengths[r] - 1."""
    batch, req = synthetic.prefill_batch(starts, lengths, cache, self.pt, rows=rows)
    pos = np.asarray(batch.positions)
    return self.x[np.maximum(np.asarray(req), 0), np.maximum(pos, 0)], batch

  def prefill(self, cache, starts, lengths, rows=None, **kw):
    x, batch = self.inputs(cache, starts, lengths, rows)
    return PREFILL(self.weights, cache, x, batch, config=CONFIG, **kw)

  def decode(self, cache, positions, next_n=1):
    """One decode step of every request at positions starts i32[B] + 0 .. next_n - 1."""
    pos = np.asarray(positions)[:, None] + np.arange(next_n)
    batch = synthetic.decode_batch(pos, cache, self.pt, self.bt)
    b = np.arange(len(pos))[:, None]
    x, qr = self.x[b, pos].reshape(pos.size, -1), self.qr[b, pos].reshape(pos.size, -1)
    _, cache = STEP(self.weights, cache, x, qr, batch, config=CONFIG)
    return cache


def assert_same(got, want):
  for g, w, name in zip(tree_bytes(got), tree_bytes(want), ("kv_cache", "tail")):
    np.testing.assert_array_equal(g, w, err_msg=name)


def assert_equivalent(got, want):
  """Caches written by two different compositions (prefill vs decode steps, one prefill
  vs chunks): bit-exact on the CPU. On a GPU the keys come out of GEMMs of other shapes
  (the decode step's projection kernel, XLA's GEMM for a prefill's rows), whose summation
  order is not part of the contract (SPEC D2): there a key may differ by one bf16 rounding,
  so a tail value by one bf16 ulp and a pooled entry by one fp8 code (and its scale by the
  amax's rounding), in a handful of places."""
  if jax.default_backend() == "cpu":
    return assert_same(got, want)
  g_kv, g_tail = tree_bytes(got)
  w_kv, w_tail = tree_bytes(want)
  assert (g_kv != w_kv).mean() <= 1e-2 and (g_tail != w_tail).mean() <= 1e-2
  # Only where the bytes differ (unwritten cache pages hold random bytes, NaN codes too).
  f32 = lambda a: np.asarray(a).view(jnp.bfloat16).astype(np.float32)  # noqa: E731
  gt, wt = f32(got.tail), f32(want.tail)
  off = gt != wt
  np.testing.assert_array_less(np.abs(gt - wt)[off], 2.0 ** -6 * np.abs(wt)[off], err_msg="tail")
  entry = (g_kv != w_kv).any(-1)            # differing entries: written by both, finite
  def dequant(kv):  # u8[n, 132] -> f32[n, 128]: the fp8 codes times the entry's scale
    codes = kv[:, :128].copy().view(jnp.float8_e4m3fn).astype(np.float32)
    return codes * kv[:, 128:].copy().view(np.float32)
  gv, wv = dequant(g_kv[entry]), dequant(w_kv[entry])
  step = np.abs(wv).max(axis=-1, keepdims=True) * 2.0 ** -9
  np.testing.assert_array_less(np.abs(gv - wv), 2.0 ** -2 * np.abs(wv) + step + 1e-30,
                               err_msg="kv_cache")


@pytest.mark.parametrize("lengths,n", tiers.first(
    ([8, 13, 3, 30], 3), ([8, 13, 3, 30], 1), ([16, 1, 6, 21], 6), ([0, 4, 9, 2], 5),
    ([5, 5, 5, 5], 9)))
def test_prefill_then_decode_is_a_longer_prefill(lengths, n):
  """Prefill of L tokens then n decode steps (indexer_stage, next_n 1: RING 4, every
  row live) leaves every byte of both caches as one prefill of L + n tokens, for
  pool-aligned and unaligned L; L 0 is decode from scratch."""
  reqs = Requests(len(lengths), max(lengths) + n + 1)
  starts = [0] * len(lengths)
  cache = reqs.fresh()
  if sum(lengths):
    cache = reqs.prefill(cache, starts, lengths)
  for t in range(n):
    cache = reqs.decode(cache, np.asarray(lengths) + t)
  want = reqs.prefill(reqs.fresh(), starts, [n_ + n for n_ in lengths])
  assert_equivalent(cache, want)


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[8, 13, 3, 30], [0, 6, 1, 17]])
def test_prefill_then_next_n_decode(lengths):
  """With next_n 2 (RING 8) the ring holds more than the seed writes: the K cache is
  byte-equal to the longer prefill's, and so are the ring rows of each request's last
  four tokens (the rows a later pool reads)."""
  steps, next_n = 3, 2
  reqs = Requests(len(lengths), max(lengths) + steps * next_n + 1, next_n=next_n)
  cache = reqs.prefill(reqs.fresh(), [0] * len(lengths), lengths)
  for t in range(steps):
    cache = reqs.decode(cache, np.asarray(lengths) + t * next_n, next_n)
  total = [n + steps * next_n for n in lengths]
  want = reqs.prefill(reqs.fresh(), [0] * len(lengths), total)
  ring = cache.tail.shape[2]
  live = np.zeros(cache.tail.shape, bool)   # the ring rows of each request's last pool
  for b, n in enumerate(total):
    live[b][:, np.arange(n - POOL, n) % ring] = True
  assert_equivalent(glm5_jax.IndexerCache(cache.kv_cache, jnp.where(live, cache.tail, 0)),
                    glm5_jax.IndexerCache(want.kv_cache, jnp.where(live, want.tail, 0)))


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [
    ([8, 12, 4], [4, 9, 16]), ([5, 2, 13], [7, 1, 3]), ([1, 3, 6], [2, 2, 11]),
    ([0, 9, 14], [10, 0, 1])])
def test_chunked_prefill_is_one_prefill(first, second):
  """A chunk continues its request, starting at any position (the first pool of an
  unaligned chunk takes its earlier tokens from the tail ring); padded rows too."""
  reqs = Requests(len(first), max(a + b for a, b in zip(first, second)) + 1, seed=1)
  cache = reqs.prefill(reqs.fresh(), [0] * len(first), first, rows=sum(first) + 3)
  cache = reqs.prefill(cache, first, second, rows=sum(second) + 5)
  want = reqs.prefill(reqs.fresh(), [0] * len(first), [a + b for a, b in zip(first, second)])
  assert_equivalent(cache, want)


def test_prefill_writes_the_stock_pool_aligned_form():
  """One request from position 0: the stock caller's windows [i-3, i] of every token
  with write_mask loc >= 0 and i >= 3 (SPEC §4a) and the seed of §4b; the keys from
  indexer_projection + indexer_query's key LayerNorm."""
  reqs = Requests(1, 23, seed=2)
  length = 22
  got = reqs.prefill(reqs.fresh(), [0], [length], use_reference=True)
  batch, _ = synthetic.prefill_batch([0], [length], reqs.cache, reqs.pt)
  w = reqs.weights
  key_raw, head_w, gate = glm5_jax.reference.indexer_projection(
      reqs.x[0, :length], w.w_cat, heads=CONFIG.heads)
  q = jnp.zeros((length, CONFIG.heads, 128), jnp.bfloat16)
  _, _, key = glm5_jax.reference.indexer_query(q, key_raw, head_w, w.norm_weight,
                                               w.norm_bias, scale=CONFIG.scale)
  window = np.maximum(np.arange(length)[:, None] - 3 + np.arange(POOL), 0)
  loc = batch.loc
  kv = glm5_jax.reference.kpool_compress(reqs.cache.kv_cache, key[window], gate[window], w.ape,
                                         loc, (loc >= 0) & (jnp.arange(length) >= 3))
  tail = glm5_jax.reference.kpool_seed_tail(reqs.cache.tail, key, gate, batch.tslot)
  assert_same(got, glm5_jax.IndexerCache(kv, tail))


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_prefill_matches_reference_composition(scale_format):
  """The ops' composition with kpool_compress's kernel named by the routing against
  use_reference=True, from the same caches: a first chunk, then an unaligned second one
  with pad rows. Every tail byte equal; the K cache bit-equal on the CPU (both run the
  reference) and, on a GPU, within SPEC D2 (the kernel follows the stock exp and
  division; oracle.compare_cache), every entry no row completes unchanged. XLA's GEMM is
  pinned (gemm_pinned), so that both programs get the same keys."""
  reqs = Requests(3, 48, seed=3)
  config = glm5_jax.IndexerConfig(max_pools=256, scale_format=scale_format,
                                  routing=glm5_jax.Routing(ops={"kpool_compress": True}))
  cache = reqs.fresh()
  for starts, lengths, rows in (([0, 0, 0], [19, 6, 11], None),
                                ([19, 6, 11], [22, 13, 30], 70)):
    x, batch = reqs.inputs(cache, starts, lengths, rows)
    if jax.default_backend() == "gpu":
      text = PREFILL.lower(reqs.weights, cache, x, batch, config=config).as_text()
      assert "glm5_kpool_compress" in text
    got, want = (gemm_pinned(PREFILL, reqs.weights, cache, x, batch, config=config,
                             use_reference=use_reference) for use_reference in (False, True))
    np.testing.assert_array_equal(*tree_bytes((got.tail, want.tail)), err_msg="tail")
    pos, loc = np.asarray(batch.positions), np.asarray(batch.loc)
    written = loc[(loc >= 0) & (pos >= 0) & (pos % POOL == POOL - 1)]
    bad, total = oracle.compare_cache(got.kv_cache, want.kv_cache, cache.kv_cache, written,
                                      f"prefill {starts} {scale_format}")
    assert total == len(written) >= 7
    if jax.default_backend() == "cpu":
      assert_same(got, want)
    assert bad <= 1, (bad, total)
    cache = want


def test_donated_prefill_is_in_place():
  """No copy of the paged K cache (nor, off CPU, of the tail ring: the CPU backend
  materialises the tail's bf16 <-> u16 bitcasts), and the donated buffer is reused."""
  reqs = Requests(2, 40, seed=4)
  batch, req = synthetic.prefill_batch([0, 3], [30, 17], reqs.cache, reqs.pt)
  x = reqs.x[np.asarray(req), np.asarray(batch.positions)]
  cache = reqs.fresh()
  shapes = [cache.kv_cache.shape, cache.tail.shape]
  text = PREFILL.lower(reqs.weights, cache, x, batch, config=CONFIG).compile().as_text()
  copies = copied_shapes(text, shapes)
  if jax.default_backend() == "cpu":
    copies.discard(tuple(cache.tail.shape))
  assert copies == set()
  undonated = jax.jit(glm5_jax.indexer_prefill, static_argnames=("config", "use_reference"))
  text = undonated.lower(reqs.weights, cache, x, batch, config=CONFIG).compile().as_text()
  assert copied_shapes(text, shapes), "the check must see copies without donation"
  before = cache.kv_cache.unsafe_buffer_pointer()
  new = PREFILL(reqs.weights, cache, x, batch, config=CONFIG)
  assert cache.kv_cache.is_deleted()
  assert new.kv_cache.unsafe_buffer_pointer() == before


def test_prefill_rejects_bad_input():
  reqs = Requests(1, 8, seed=5)
  batch, _ = synthetic.prefill_batch([0], [8], reqs.cache, reqs.pt)
  x = reqs.x[0]
  run = lambda **kw: glm5_jax.indexer_prefill(
      **{**dict(weights=reqs.weights, cache=reqs.fresh(), x=x, batch=batch,
                config=CONFIG), **kw})
  with pytest.raises(ValueError, match=r"glm5_jax.indexer_prefill: batch.positions must "
                     r"have shape \(7,\)"):
    run(x=x[:7])
  with pytest.raises(TypeError, match="glm5_jax.indexer_prefill: x must be bfloat16"):
    run(x=x.astype(jnp.float32))
  with pytest.raises(TypeError, match="glm5_jax.indexer_prefill: batch.loc must be int32"):
    run(batch=glm5_jax.PrefillBatch(batch.positions, batch.loc.astype(jnp.int16),
                                    batch.tslot))
  with pytest.raises(ValueError, match="glm5_jax.indexer_prefill: weights.w_cat"):
    run(config=glm5_jax.IndexerConfig(heads=16))
