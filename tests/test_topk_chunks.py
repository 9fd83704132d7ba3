"""Rows wider than the top-k kernel takes (limits.TOPK_MAX_POOLS): plan.topk_chunks cuts
them into chunks, pool_topk runs over the chunks then over their candidates, and
select_pools / select_slots compose mqa_logits with that top-k. On the CPU the parts run
their references, so these tests check the composition itself against the numpy oracle
(glm5_testing.oracle, written from SPEC §5c) bit for bit, at the limit of 32,768 pools
(`small_limit`: the composition does not depend on it, and the oracle walks rows of that
size in seconds); tests/test_wide_gpu.py runs the kernels at the real one."""
import functools
import json
import pathlib

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from test_select_gpu import SMALL_CODES

import glm5_jax
from glm5_jax import plan
from glm5_jax import reference as ref
from glm5_jax.limits import LOGITS_ITEM_POOLS, TOPK_CTA_POOLS, TOPK_MAX_POOLS
from glm5_testing import oracle as O

I32 = np.int32


@pytest.mark.parametrize("width,k,rows,want", [
    (TOPK_MAX_POOLS, 512, 1, (1, TOPK_MAX_POOLS)),      # one call holds it: 1M tokens
    (202752 // 4, 512, 16, (1, 50688)),                 # GLM-5's window, clusters in one wave
    (202752 // 4, 512, 17, (1, 202752 // 4)),           # a pair of CTAs a row
    (2 * TOPK_CTA_POOLS, 512, 64, (1, 2 * TOPK_CTA_POOLS)),
    (2 * TOPK_CTA_POOLS + 1, 512, 17, (2, 32832)),      # past a pair's width: chunks
    (202752 // 4, 512, 65, (2, 25344)),                 # more rows: chunks of one CTA's width
    (TOPK_CTA_POOLS, 512, 4096, (1, TOPK_CTA_POOLS)),   # one CTA a row at any rows
    (TOPK_CTA_POOLS + 1, 512, 65, (2, 16448)),
    (TOPK_MAX_POOLS + 1, 512, 1, (2, 131136)),          # the first width cut
    (4 * TOPK_MAX_POOLS, 512, 2, (4, TOPK_MAX_POOLS)),  # 4M tokens
    (300000, TOPK_MAX_POOLS // 2, 1, (1, 300000)),      # k too large: chunks would not shrink
    (300000, TOPK_MAX_POOLS // 2 - 1, 1, (2, 150016)),
    (300000, TOPK_CTA_POOLS // 2, 65, (1, 300000)),
    (300000, TOPK_CTA_POOLS // 2 - 1, 65, (10, 30016))])
def test_chunks(width, k, rows, want):
  chunks = plan.topk_chunks(width, k, rows)
  assert tuple(chunks) == want
  limit = (TOPK_MAX_POOLS if rows <= 16 else 2 * TOPK_CTA_POOLS if rows <= 64 else
           TOPK_CTA_POOLS)
  if chunks.chunks > 1:
    assert chunks.pools <= limit and chunks.pools % LOGITS_ITEM_POOLS == 0
    assert chunks.padded >= width and chunks.padded - width < chunks.chunks * LOGITS_ITEM_POOLS
    assert chunks.pools > k          # every chunk but a row's last full is wider than k


@pytest.fixture
def small_limit(monkeypatch):
  """TOPK_MAX_POOLS at 32,768 (one CTA's row) where the routing and the chunks read it."""
  monkeypatch.setattr(plan, "TOPK_ROW_TIERS", ((None, TOPK_CTA_POOLS),))
  monkeypatch.setattr(glm5_jax.logits, "TOPK_MAX_POOLS", TOPK_CTA_POOLS)


def _rows(rng, rows, width, kind, bound):
  """f32[rows, width] logits of one kind; `bound`: a chunk boundary where equal values
  straddle it (the ties must go to the lower ids, across chunks)."""
  if kind == "normal":
    x = rng.standard_normal((rows, width)) * 10
  elif kind == "ties":
    x = np.round(rng.standard_normal((rows, width)) * 2)
  elif kind == "rising":
    x = np.tile(np.arange(width, dtype=np.float64), (rows, 1))
  elif kind == "equal":
    x = np.full((rows, width), 3.0)
  elif kind == "special":
    vals = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0], np.float32)
    x = rng.choice(vals, (rows, width))
  else:
    raise ValueError(kind)
  x = x.astype(np.float32)
  if kind in ("normal", "ties") and bound < width:
    x[:, max(0, bound - 300):bound + 300] = 50.0     # the best straddle the boundary
  return x


@pytest.mark.parametrize("rows,width", [(1, 262144), (3, 50688), (2, 32769), (4, 70001)])
@pytest.mark.parametrize("kind", ["normal", "ties", "rising", "equal", "special"])
@pytest.mark.usefixtures("small_limit")
def test_chunked_topk_equals_oracle(rows, width, kind):
  rng = np.random.default_rng(rows * 31 + width)
  chunks = plan.topk_chunks(width, 512, rows)
  logits = _rows(rng, rows, width, kind, chunks.pools)
  lens = rng.integers(0, width + 10, rows).astype(I32)
  edge = [width, chunks.pools + 5, 511, -3]          # full, just past a chunk, fits k, none
  lens[:min(rows, len(edge))] = edge[:rows]
  for k in (512, 1, 37):
    fn = jax.jit(functools.partial(glm5_jax.pool_topk, k=k))
    # two pool_topk calls a row (the chunks', then the candidates'), no single wide one
    calls = [e for e in jax.make_jaxpr(fn)(logits, lens).jaxpr.eqns[0].params["jaxpr"].eqns
             if e.primitive.name == "glm5_pool_topk"]
    assert [c.invars[0].aval.shape for c in calls] == [
        (rows * chunks.chunks, chunks.pools), (rows, chunks.chunks * k)]
    got = np.asarray(fn(jnp.asarray(logits), jnp.asarray(lens)))
    np.testing.assert_array_equal(got, O.pool_topk(logits, lens, k=k), err_msg=f"k={k}")


@pytest.mark.usefixtures("small_limit")
def test_chunked_topk_k_above_a_row():
  """k larger than every row (and than a chunk's share): each row lists all its pools."""
  logits = np.zeros((2, 40000), np.float32)
  lens = np.array([700, 40000], I32)
  got = np.asarray(glm5_jax.pool_topk(logits, lens, k=1024))
  np.testing.assert_array_equal(got, O.pool_topk(logits, lens, k=1024))
  assert got[0].tolist() == list(range(700)) + [-1] * 324


def test_reordered_candidates_fail_the_check():
  """Negative control: candidates merged with the chunks in the wrong order (the ties then
  go to the higher ids) differ from the oracle where equal values straddle a boundary."""
  logits = np.full((1, 40000), 1.0, np.float32)
  lens = np.array([40000], I32)
  want = O.pool_topk(logits, lens, k=512)
  halves = logits.reshape(2, 20000)
  local = np.asarray(ref.pool_topk(halves, np.array([20000, 20000], I32), k=512))
  wrong = np.sort(local[1] + 20000)                  # the second chunk's candidates first
  assert not np.array_equal(wrong, want[0])
  assert np.array_equal(local[0], want[0])


def _exact_cache(rng, pages, page, scale):
  """A K cache u8[pages, page, 132] (SPEC §0.1: a page's page x 128 codes, then its page
  fp32 scales) of codes 0, 0.5, 1, 1.5 or 2 and one scale: with the tests' small integer
  queries and weights in eighths every logit is exact in fp32 (the tensor cores' and the
  reference's sums alike), so the kernels' logits equal the reference's bit for bit and
  ties are common."""
  codes = SMALL_CODES[rng.integers(0, len(SMALL_CODES), (pages, page * 128))]
  scales = np.full((pages, page), scale, np.float32).view(np.uint8).reshape(pages, -1)
  return np.concatenate([codes, scales], axis=1).reshape(pages, page, 132)


@pytest.mark.usefixtures("small_limit")
def test_select_pools_by_chunks_equals_reference():
  """select_pools past the select kernel's width: mqa_logits, then the chunked top-k; the
  ids equal the reference select_pools' (CPU: the parts' references), a row that fits k
  selecting 0..n-1, and its logits are the reference's on the rows with more than k pools
  (over their n pools: the rest are unspecified)."""
  rng = np.random.default_rng(5)
  max_pools, k, page = 40000, 64, 64
  pages = -(-max_pools // page)
  kv = _exact_cache(rng, 2 * pages, page, 0.5)
  table = rng.permutation(2 * pages)[: 2 * pages].reshape(2, pages).astype(I32)
  positions = np.array([4 * max_pools - 1, 100, 4 * 20000 + 2], I32)
  req_ids = np.array([0, 1, 1], I32)
  q = jnp.asarray(rng.integers(-2, 3, (3, 32, 128)).astype(np.float32), jnp.float8_e4m3fn)
  w = jnp.asarray((rng.integers(-4, 5, (3, 32)) / 8).astype(np.float32))
  args = (q, w, jnp.asarray(kv), jnp.asarray(table), jnp.asarray(req_ids),
          jnp.asarray(positions))
  params = dict(k=k, max_pools=max_pools)
  assert glm5_jax.logits.select_chunks(args, dict(params, scale_format="fp32"),
                                       glm5_jax.Routing()) == plan.topk_chunks(max_pools, k, 3)
  ids, logits = jax.jit(functools.partial(glm5_jax.select_pools, **params))(*args)
  want_ids, want_logits = ref.select_pools(*args, **params)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  assert np.asarray(ids)[1].tolist() == list(range(25)) + [-1] * (k - 25)
  n = np.asarray(ref.pool_counts(positions)).clip(0, max_pools)
  for r in (0, 2):                                   # the rows of more than k pools
    np.testing.assert_array_equal(np.asarray(logits)[r, :n[r]],
                                  np.asarray(want_logits)[r, :n[r]])
  assert logits.shape == (3, max_pools)
  block_table = jnp.asarray(rng.integers(0, 9000, (2, 2000)).astype(I32))
  remap = dict(block_size=64, width=4 * k + 3)
  slots = jax.jit(functools.partial(glm5_jax.select_slots, **params, **remap))(
      *args, block_table)
  want = ref.select_slots(*args, block_table, **params, **remap)
  for got, expected in zip(slots, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_next_n_is_a_hint_that_changes_no_result():
  """select_pools' next_n (how its kernel shares a request's K reads) leaves the ids of every
  row and its logits over its pools as they are (the rest are unspecified), and the
  stage's CUDA lowering passes it to select_slots' kernel (alone or in indexer_update_select's call)
  as the batch's next_n."""
  rng = np.random.default_rng(9)
  pages, page = 40, 64
  kv = _exact_cache(rng, pages, page, 0.25)
  table = rng.permutation(pages)[:32].reshape(2, 16).astype(I32)
  positions = np.array([900, 901, 902, 903, 400, 401, 402, 403], I32)
  req_ids = np.repeat(np.arange(2), 4).astype(I32)
  q = jnp.asarray(rng.integers(-2, 3, (8, 32, 128)).astype(np.float32), jnp.float8_e4m3fn)
  w = jnp.asarray((rng.integers(-4, 5, (8, 32)) / 8).astype(np.float32))
  args = (q, w, jnp.asarray(kv), jnp.asarray(table), jnp.asarray(req_ids),
          jnp.asarray(positions))
  one = glm5_jax.select_pools(*args, k=64, max_pools=1024)
  four = glm5_jax.select_pools(*args, k=64, max_pools=1024, next_n=4)
  np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(four[0]))
  n = np.asarray(ref.pool_counts(positions))
  for r in range(len(n)):
    np.testing.assert_array_equal(np.asarray(one[1])[r, :n[r]], np.asarray(four[1])[r, :n[r]])
  golden = json.loads((pathlib.Path(__file__).parent / "golden" /
                       "stage_lowering.json").read_text())
  for case, next_n in (("M16-n4-ctx32768", 4), ("M16-n2-ctx8192", 2), ("M16-n1-ctx8192", 1)):
    # select_slots' kernel, alone or in indexer_update_select's call
    calls = dict(golden[case]["calls"])
    select = calls.get("glm5_select_slots") or calls["glm5_indexer_update_select"]
    assert select["next_n"] == f"{next_n} : i64"
