"""Prefill into the caches: prefill then decode == one longer prefill (bit-exact on
CPU), chunked prefill == one prefill, the stock pool-aligned formulation (SPEC §4a),
the ops (kpool_compress's kernel on a GPU) against the reference composition, in-place
caches under donation, trace-time errors."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from bounds import GEMM_TAIL_FLOOR, check_equivalent

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
  order is not part of the contract (SPEC D2): check_equivalent."""
  if jax.default_backend() == "cpu":
    return assert_same(got, want)
  check_equivalent(np.asarray(got.kv_cache), np.asarray(got.tail), np.asarray(want.kv_cache),
                   np.asarray(want.tail))


def _written_caches():
  """(kv u8[pages, 16, 132], tail bf16[2, 2, 4, 128], written slots) of a CPU prefill of two
  requests: what check_equivalent compares on a GPU."""
  reqs = Requests(2, 24, seed=6)
  cache = reqs.prefill(reqs.fresh(), [0, 0], [22, 13])
  _, batch = reqs.inputs(reqs.fresh(), [0, 0], [22, 13])
  pos, loc = np.asarray(batch.positions), np.asarray(batch.loc)
  written = loc[(loc >= 0) & (pos % POOL == POOL - 1)]
  assert len(written) == 8
  return np.array(cache.kv_cache), np.array(cache.tail), written


def _fault(kind, kv, tail, written):
  """A wrong result, made from right caches by the fault `kind` (numpy, in place)."""
  page = kv.shape[1]
  flat = kv.reshape(kv.shape[0], -1)
  pg, e = divmod(int(written[3]), page)
  scale = flat[pg, page * 128 + 4 * e:page * 128 + 4 * e + 4]
  codes = flat[pg, e * 128:(e + 1) * 128]
  u16 = tail.view(np.uint16)
  if kind == "scale doubled":             # what the row-wise reading did not see
    scale[:] = (scale.view(np.float32) * 2).view(np.uint8)
  elif kind == "entries row-wise":        # codes then scale in each 132-byte row
    for slot in written:
      p_, e_ = divmod(int(slot), page)
      entry = np.concatenate([flat[p_, e_ * 128:(e_ + 1) * 128],
                              flat[p_, page * 128 + 4 * e_:page * 128 + 4 * e_ + 4]])
      kv[p_, e_] = entry
  elif kind == "code 3 apart":            # all of an entry's codes moved three codes
    nonzero = (codes & 0x7F) > 3
    codes[nonzero] -= 3
  elif kind == "tail 2 ulp":
    u16[1, 0, 2, 5] += 2
  elif kind == "tail 1 ulp, too many":    # a whole key of each request one ulp off
    u16[:, 0, 1, :] += 1
  elif kind == "code 1 apart":            # allowed: one fp8 code
    codes[7] = codes[7] + 1 if (codes[7] & 0x7F) < 0x7E else codes[7] - 1
  elif kind == "tail 1 ulp":              # allowed: one bf16 ulp in one value
    u16[0, 1, 3, 9] += 1
  else:
    raise ValueError(kind)


@pytest.mark.parametrize("kind,reason", [
    ("scale doubled", "scale bytes differ"), ("entries row-wise", "pooled bf16 flip"),
    ("code 3 apart", "pooled bf16 flip"), ("tail 2 ulp", "2 bf16 ulp off"),
    ("tail 1 ulp, too many", "256 of 2048 values differ")])
def test_equivalence_check_rejects_a_wrong_cache(kind, reason):
  """check_equivalent (assert_equivalent's GPU branch) on the CPU: each fault fails it."""
  kv, tail, written = _written_caches()
  got_kv, got_tail = kv.copy(), tail.copy()
  _fault(kind, got_kv, got_tail, written)
  assert oracle.bits(got_kv).tobytes() != kv.tobytes() or (
      oracle.bits(got_tail).tobytes() != oracle.bits(tail).tobytes())
  with pytest.raises(AssertionError, match=reason):
    check_equivalent(got_kv, got_tail, kv, tail)


@pytest.mark.parametrize("kind", ["code 1 apart", "tail 1 ulp"])
def test_equivalence_check_passes_what_d2_allows(kind):
  kv, tail, written = _written_caches()
  got_kv, got_tail = kv.copy(), tail.copy()
  _fault(kind, got_kv, got_tail, written)
  check_equivalent(got_kv, got_tail, kv, tail)
  check_equivalent(kv, tail, kv, tail)


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


def test_gemm_floor_passes_a_value_near_0_and_nothing_else():
  """check_equivalent's gemm_floor (the stage against the reference: GEMMs in other orders)
  passes a value at 2^-14 of its row's rms off by 8 of its ulps, which fails without it,
  and still rejects a value near 0 off by twice the floor of its row's largest magnitude,
  2 ulps on the row's largest value and a token's key in another's slot."""
  kv, tail, _ = _written_caches()
  rms = np.sqrt(np.mean(tail.astype(np.float64) ** 2, axis=-1))
  b, plane, slot = np.unravel_index(np.argmax(rms), rms.shape)
  want = tail.copy()
  want[b, plane, slot, 4] = rms[b, plane, slot] * 2.0 ** -14
  got = want.copy()
  got.view(np.uint16)[b, plane, slot, 4] += 8
  check_equivalent(kv, got, kv, want, GEMM_TAIL_FLOOR)
  with pytest.raises(AssertionError, match="8 bf16 ulp off"):
    check_equivalent(kv, got, kv, want)
  peak = np.max(np.abs(want[b, plane, slot].astype(np.float64)))
  got = want.copy()
  got[b, plane, slot, 4] = 2 * GEMM_TAIL_FLOOR * peak
  with pytest.raises(AssertionError, match="largest magnitude"):
    check_equivalent(kv, got, kv, want, GEMM_TAIL_FLOOR)
  big = np.argmax(np.abs(want[b, plane, slot].astype(np.float64)))
  got = want.copy()
  got.view(np.uint16)[b, plane, slot, big] += 2
  with pytest.raises(AssertionError, match="2 bf16 ulp off"):
    check_equivalent(kv, got, kv, want, GEMM_TAIL_FLOOR)
  got = want.copy()
  got[b, plane, slot] = want[b, plane, (slot + 1) % want.shape[2]]
  with pytest.raises(AssertionError):
    check_equivalent(kv, got, kv, want, GEMM_TAIL_FLOOR)
