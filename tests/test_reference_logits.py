"""glm5_jax.reference logits ops (SPEC §5b, §5c, §8) against the independent oracle."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from glm5_jax import reference as R
from glm5_testing import oracle as O
from glm5_testing.cases import i32

F32 = np.float32


_upcast = jax.jit(R.upcast_logits)


# --------------------------------------------------------------------------- §8

@pytest.mark.parametrize("rows,width", [(7, 40), (16, 2048)])
def test_upcast_logits(rows, width):
  rng = np.random.default_rng(50)
  logits = O.random_bf16(rng, (rows, width), 30.0)
  ends = rng.integers(-3, width + 5, rows)
  ends[0], ends[1] = 0, width
  want, valid = O.upcast_logits(logits, ends)
  got = np.asarray(_upcast(jnp.asarray(logits), i32(ends)))
  assert got.dtype == np.float32 and got.shape == (rows, width)
  np.testing.assert_array_equal(got[valid].view(np.uint32), want[valid].view(np.uint32))
  assert valid.sum() > rows * width // 4


def test_upcast_logits_empty():
  assert _upcast(jnp.zeros((0, 16), jnp.bfloat16), i32(np.zeros(0))).shape == (0, 16)
  got = _upcast(jnp.zeros((3, 0), jnp.bfloat16), i32([0, 1, 2]))
  assert got.shape == (3, 0) and got.dtype == jnp.float32


# --------------------------------------------------------------------------- §5b

def _cache_with_entries(rng, pages, page, scale_format):
  """A K cache with valid entries everywhere: fp8 codes (no NaN) and sane scales."""
  kv = np.zeros((pages, page, 132), np.uint8)
  flat = kv.reshape(pages, page * 132)
  codes = rng.integers(0, 256, (pages, page * 128)).astype(np.uint8)
  codes[(codes & 0x7F) == 0x7F] ^= 0x01                     # no NaN codes
  flat[:, :page * 128] = codes
  E = rng.integers(-20, -2, (pages, page))
  if scale_format == "fp32":
    s = (2.0 ** E).astype("<f4")
    flat[:, page * 128:] = s.view(np.uint8).reshape(pages, page * 4)
  else:
    flat[:, page * 128:] = np.repeat((E + 127).astype(np.uint8), 4, axis=1)
  return kv


@functools.cache
def _mqa_fn(max_pools, scale_format):
  return jax.jit(functools.partial(R.mqa_logits, max_pools=max_pools,
                                   scale_format=scale_format))


@pytest.mark.parametrize("scale_format,H,page", [("fp32", 32, 64), ("ue8m0", 32, 32),
                                                 ("fp32", 4, 32)])
def test_mqa_logits(scale_format, H, page):
  rng = np.random.default_rng(51)
  rows, pages, MP = 8, 12, 6
  max_pools = MP * page
  kv = _cache_with_entries(rng, pages, page, scale_format)
  qc = rng.integers(0, 256, (rows, H, 128)).astype(np.uint8)
  qc[(qc & 0x7F) == 0x7F] ^= 0x01
  q = qc.view(O.E4M3)
  w = (rng.standard_normal((rows, H)) * 2.0 ** -6).astype(F32)      # sign mixes
  table = rng.integers(0, pages, (rows, MP))
  table[1, 2] = -1                                                  # page ids outside
  table[2, 0] = pages
  table[3, 1] = pages + 100
  lens = rng.integers(1, max_pools + 1, rows)
  lens[[0, 4, 5, 6]] = [0, -3, max_pools + 7, max_pools]
  want, bound = O.mqa_logits(q, w, kv, table, lens, max_pools=max_pools,
                             scale_format=scale_format)
  got = np.asarray(_mqa_fn(max_pools, scale_format)(
      jnp.asarray(q), jnp.asarray(w), jnp.asarray(kv), i32(table), i32(lens)))
  assert got.dtype == np.float32 and got.shape == (rows, max_pools)
  none = np.isneginf(want)
  np.testing.assert_array_equal(np.isneginf(got), none)
  tol = (128 + H + 8) * 2.0 ** -24 * bound[~none] + 1e-30
  err = np.abs(got[~none].astype(np.float64) - want[~none])
  assert np.all(err <= tol), float(np.max(err / tol))
  assert (~none).sum() > rows * max_pools // 4
  assert np.any(want[~none] < 0) and np.any(want[~none] > 0)
  worst = float(np.max(err / bound[~none].clip(1e-300)))
  print(f"\nmqa {scale_format} H={H}: max err/bound {worst:.2e}")


def test_mqa_logits_empty():
  rng = np.random.default_rng(52)
  kv = _cache_with_entries(rng, 2, 32, "fp32")
  got = _mqa_fn(64, "fp32")(jnp.zeros((0, 32, 128), jnp.float8_e4m3fn),
                            jnp.zeros((0, 32), jnp.float32), jnp.asarray(kv),
                            i32(np.zeros((0, 2))), i32(np.zeros(0)))
  assert got.shape == (0, 64)


# --------------------------------------------------------------------------- §5c

@functools.cache
def _topk_fn(k):
  return jax.jit(functools.partial(R.pool_topk, k=k))


def _check_topk(logits, lens, k):
  want = O.pool_topk(logits, lens, k=k)
  got = np.asarray(_topk_fn(k)(jnp.asarray(logits, jnp.float32), i32(lens)))
  assert got.dtype == np.int32 and got.shape == want.shape
  np.testing.assert_array_equal(got, want)
  return want


def test_pool_topk_random():
  rng = np.random.default_rng(53)
  rows, P, k = 16, 2048, 512
  logits = (rng.standard_normal((rows, P)) * 10).astype(F32)
  logits[:4] = np.round(logits[:4] / 10) + F32(0)   # many ties (no -0.0: see below)
  lens = rng.integers(0, P + 1, rows)
  lens[:8] = [P, 511, 512, 513, 0, -5, P + 100, 1]
  want = _check_topk(logits, lens, k)
  for r in range(rows):
    n = max(0, min(int(lens[r]), P))
    assert np.sum(want[r] >= 0) == min(n, k)


def test_pool_topk_special_values():
  k = 8
  nan, inf = np.nan, np.inf
  logits = np.array([
      [1, 2, 2, 1, 3, 3, 3, 0, 0, 5, 5, 5],                 # ties: ascending id
      [nan, -inf, 1, nan, -inf, 0, inf, 2, nan, 1, 0, -1],  # NaN ranks as -inf
      [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],               # ineligible past len
      [5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6],           # len 0
      [1e30, -1e30, 3e38, -3e38, 1e-40, -1e-40, 0, 0, 1, 1, 1, 1],
  ], F32)
  lens = np.array([12, 12, 5, 0, 12])
  want = _check_topk(logits, lens, k)
  assert want[0].tolist() == [1, 2, 4, 5, 6, 9, 10, 11]   # the set {5s, 3s, 2s}
  assert want[1].tolist() == [0, 2, 5, 6, 7, 9, 10, 11]   # -inf/NaN tie: id 0
  assert want[2].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
  assert want[3].tolist() == [-1] * k


def test_pool_topk_signed_zeros_tie_by_id():
  """-0.0 and +0.0 are equal logits (they arise as sum_h w*relu(..) with w < 0), so
  the documented tie rule orders them by ascending id."""
  logits = np.array([[-0.0, 0.0, -0.0, 0.0, -1.0, 1.0]], F32)
  want = _check_topk(logits, np.array([6]), 4)
  assert want[0].tolist() == [0, 1, 2, 5]


def test_pool_topk_empty():
  assert _topk_fn(4)(jnp.zeros((0, 10), jnp.float32), i32(np.zeros(0))).shape == (0, 4)


def test_pool_topk_fewer_pools_is_the_causal_fill():
  """A row with at most k pools lists 0..n-1 whatever its logits: the causal fill
  (SPEC §5a) and the top-k agree, so the stage needs no branch between them."""
  rng = np.random.default_rng(7)
  logits = rng.standard_normal((3, 40)).astype(F32)
  lens = np.array([40, 17, 0])
  want = _check_topk(logits, lens, 40)
  for r, n in enumerate(lens):
    assert want[r].tolist() == list(range(n)) + [-1] * (40 - n)


# ----------------------------------------------------------------- select_pools

def _cache_of(rng, data, scale_format):
  """u8[pages, PAGE, 132]: the values data[pages, PAGE, 128] as fp8, each entry's scale a
  random power of two (2^-8 .. 2^-3) in `scale_format`."""
  pages, page = data.shape[:2]
  codes = np.asarray(jnp.asarray(data, jnp.float8_e4m3fn)).view(np.uint8).reshape(pages, -1)
  exps = rng.integers(-8, -2, (pages, page))
  if scale_format == "fp32":
    scales = np.exp2(exps).astype(F32).view(np.uint8).reshape(pages, page * 4)
  else:
    scales = np.repeat((exps + 127).astype(np.uint8), 4, axis=1)
  return np.concatenate([codes, scales], 1).reshape(pages, page, 132)


def _select_case(rng, positions, req_ids, *, heads=32, page=16, requests=3, mp=4,
                 scale_format="fp32"):
  rows = len(positions)
  pages = requests * mp + 2
  q = rng.integers(0, 256, (rows, heads, 128)).astype(np.uint8)
  q[(q & 0x7F) == 0x7F] = 0            # no NaN codes
  w = rng.standard_normal((rows, heads)).astype(F32)
  kv = _cache_of(rng, rng.standard_normal((pages, page, 128)) * 8, scale_format)
  table = rng.permutation(pages)[:requests * mp].reshape(requests, mp).astype(np.int32)
  table[-1, -1] = pages + 5            # out of range: never read (D4)
  return (jnp.asarray(q).view(jnp.float8_e4m3fn), jnp.asarray(w), jnp.asarray(kv),
          i32(table), i32(np.asarray(req_ids)), i32(np.asarray(positions)))


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_select_pools_against_oracle(scale_format):
  rng = np.random.default_rng(11)
  k, max_pools = 8, 60
  positions = [-1, 5, 31, 32, 120, 250, 255, 2 ** 31 - 1, 60]
  req_ids = [0, 1, 2, 0, 1, 2, 0, 1, 7]   # 7: no such request
  args = _select_case(rng, positions, req_ids, scale_format=scale_format)
  ids, logits = jax.jit(functools.partial(R.select_pools, k=k, max_pools=max_pools,
                                          scale_format=scale_format))(*args)
  want_ids, want_logits, bound, n = O.select_pools(*args, k=k, max_pools=max_pools,
                                                   scale_format=scale_format)
  ids, logits = np.asarray(ids), np.asarray(logits)
  assert n.tolist() == [0, 1, 8, 8, 30, 60, 60, 60, 15]
  for r in range(len(positions)):
    if n[r] <= k:   # causal fill; logits unspecified
      assert ids[r].tolist() == list(range(n[r])) + [-1] * (k - n[r])
      continue
    got, want = logits[r, :n[r]], want_logits[r, :n[r]]
    none = np.isneginf(want)                       # no page: exactly -inf
    np.testing.assert_array_equal(np.isneginf(got), none, err_msg=f"row {r}")
    np.testing.assert_array_less(np.abs(got[~none] - want[~none]),
                                 1e-5 * bound[r, :n[r]][~none] + 1e-30, err_msg=f"row {r}")
  # The selection is exactly the top-k of the logits the op computed.
  np.testing.assert_array_equal(ids, O.pool_topk(logits, n, k=k))
  assert np.all(np.isneginf(logits[8, :15]))     # unknown request: no pages
  assert np.isneginf(logits[5, 56:60]).all()     # page id past the cache


def test_select_pools_all_rows_fit_skips_logits():
  rng = np.random.default_rng(3)
  args = _select_case(rng, [3, 7, -1], [0, 1, 2])
  ids, _ = R.select_pools(*args, k=4, max_pools=32)
  assert np.asarray(ids).tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [-1] * 4]


def test_vectorized_oracle_equals_loop_oracle():
  """The GPU tests use the vectorised float64 logits; it must equal the loop."""
  rng = np.random.default_rng(5)
  args = _select_case(rng, [40, 60, 7], [0, 2, 1])
  q, w, kv, table, req, pos = args
  lens = np.array([11, 16, 3])
  rows = np.asarray(table)[[0, 2, 1]]
  rows[1, 1] = -1
  want = O.mqa_logits(q, w, kv, rows, lens, max_pools=20)
  got = O.mqa_logits_vectorized(q, w, kv, rows, lens, max_pools=20)
  for g, x in zip(got, want):
    np.testing.assert_allclose(g, x, rtol=1e-12)


# ----------------------------------------------------------------- select_slots

def _exact_select_case(rng, contexts, next_n, *, requests, heads=32, page=16, mp=4,
                       scale_format="fp32"):
  """select_slots' operands whose logits are exact in fp32 (small-integer fp8 values,
  weights in eighths, power-of-two scales: every sum of products is exact in any order),
  so the float64 oracle's selection is the reference's bit for bit; few distinct values,
  so the top-k ties at its threshold. Rows = len(contexts) requests x next_n,
  request-major, request r's rows at positions contexts[r] + 0..next_n-1."""
  positions = (np.asarray(contexts)[:, None] + np.arange(next_n)).reshape(-1)
  req_ids = np.repeat(np.arange(len(contexts)), next_n)
  rows, pages = positions.size, requests * mp + 2
  q = jnp.asarray(rng.integers(-2, 3, (rows, heads, 128)), jnp.float8_e4m3fn)
  w = (rng.integers(-4, 5, (rows, heads)) / 8).astype(F32)
  kv = _cache_of(rng, rng.integers(-3, 4, (pages, page, 128)), scale_format)
  table = rng.permutation(pages)[:requests * mp].reshape(requests, mp)
  return [q, jnp.asarray(w), jnp.asarray(kv), i32(table), req_ids, positions]


def _slots_fn(**static):
  return jax.jit(functools.partial(R.select_slots, **static))


# (contexts, next_n, k, block_size, MB, stride_rows, width past 4k + 3, scale_format):
# contexts of up to 4 * max_pools (64 pools) tokens; MB * block_size below the longest
# contexts (their tokens from there on dropped).
SLOTS_CASES = [
    ([3, 20, 40, 150, 255, 100], 1, 8, 16, 10, None, 0, "fp32"),
    ([3, 20, 40, 150, 255, 100], 1, 8, 16, 10, 48, 5, "ue8m0"),
    ([30, 130, 200], 2, 12, 32, 3, 40, 1, "fp32"),
    ([7, 90, 240], 4, 5, 8, 8, 12, 9, "fp32"),
    ([60, 250, 30], 4, 16, 64, 3, None, 2, "ue8m0"),
]


@pytest.mark.parametrize("contexts,next_n,k,block_size,mb,stride_rows,extra,scale_format",
                         SLOTS_CASES)
def test_select_slots_against_oracle(contexts, next_n, k, block_size, mb, stride_rows, extra,
                                     scale_format):
  """select_slots' reference equals the oracle's select_pools then expand_and_remap (seq
  offset 1, compact) bit for bit: rows that fit (causal fill) and rows that select, pads,
  a request outside the tables, tokens past the block table (dropped: fewer slots)."""
  rng = np.random.default_rng(sum(contexts) + k)
  requests = len(contexts) - 1       # the last request's rows name no table row
  args = _exact_select_case(rng, contexts, next_n, requests=requests,
                            scale_format=scale_format)
  req_ids, positions = args[4], args[5]
  req_ids[-next_n:] = requests + 3
  positions[1] = -1                  # a pad
  if next_n > 1:
    req_ids[next_n] = -1             # an unknown request among known ones' rows
  block_table = rng.integers(0, 100, (requests, mb))
  max_pools, width = 64, 4 * k + 3 + extra
  static = dict(k=k, max_pools=max_pools, block_size=block_size, width=width,
                stride_rows=stride_rows, scale_format=scale_format)
  args = args[:4] + [i32(req_ids), i32(positions), i32(block_table)]
  slots, counts, _ = (np.asarray(a) for a in _slots_fn(**static)(*args))
  ids, _, _, n = O.select_pools(*args[:6], k=k, max_pools=max_pools, scale_format=scale_format)
  want_slots, want_counts = O.expand_and_remap(ids, positions, req_ids, block_table,
                                               block_size=block_size, width=width,
                                               stride_rows=stride_rows)
  np.testing.assert_array_equal(slots, want_slots)
  np.testing.assert_array_equal(counts, want_counts)
  # The cases cover what they claim: both kinds of rows, and dropped tokens.
  known = (req_ids >= 0) & (req_ids < requests)
  assert np.any(known & (n > 0) & (n <= k)) and np.any(known & (n > k))
  tokens = np.minimum(4 * np.minimum(n, k) + np.where(positions >= 0, (positions + 1) % 4, 0),
                      4 * k + 3)
  assert np.any(known & (counts < tokens)), "no row lost tokens past the block table"
  assert np.all(counts[~known] == 0) and np.all(slots[~known] == -1)


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_select_slots_is_the_two_references(scale_format):
  """On logits that round (random fp8 and weights): select_slots' reference is
  select_pools' then expand_and_remap's, all three results bit for bit."""
  rng = np.random.default_rng(12)
  positions = [-1, 5, 31, 32, 120, 250, 255, 2 ** 31 - 1, 60, 61]
  req_ids = [0, 1, 2, 0, 1, 2, 0, 1, 7, 2]
  args = _select_case(rng, positions, req_ids, scale_format=scale_format)
  block_table = i32(rng.integers(0, 1000, (3, 12)))
  select = dict(k=8, max_pools=60, scale_format=scale_format)
  remap = dict(block_size=16, width=40, stride_rows=20)
  got = _slots_fn(**select, **remap)(*args, block_table)
  ids, logits = jax.jit(functools.partial(R.select_pools, **select))(*args)
  want = jax.jit(functools.partial(R.expand_and_remap, **remap))(ids, args[5], args[4],
                                                                 block_table)
  for g, w in zip(got, (*want, logits)):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
