"""glm5_jax.reference pool expansion and sparse-MLA remap (SPEC §6, §7) against the
independent oracle. Integer ops: exact equality everywhere."""
import functools

import numpy as np
import jax
import pytest

from glm5_jax import reference as R
from glm5_testing import oracle as O
from glm5_testing.cases import i32


@functools.cache
def _expand_fn(seq_offset, width):
  return jax.jit(functools.partial(R.expand_pools, seq_offset=seq_offset, width=width))


@functools.cache
def _remap_fn(block_size, width, stride_rows, seq_offset, compact):
  return jax.jit(functools.partial(R.expand_and_remap, block_size=block_size, width=width,
                                   stride_rows=stride_rows, seq_offset=seq_offset,
                                   compact=compact))


def _pool_ids(rng, rows, G, pools, p_unused=0.2):
  ids = rng.integers(0, pools, (rows, G))
  ids[rng.random((rows, G)) < p_unused] = -1
  ids[rng.random((rows, G)) < 0.02] = rng.integers(-1000, -1)   # other negative ids
  return ids


def _check_expand(pool_ids, seq_lens, seq_offset, width):
  want = O.expand_pools(pool_ids, seq_lens, seq_offset=seq_offset, width=width)
  got = np.asarray(_expand_fn(seq_offset, width)(i32(pool_ids), i32(seq_lens)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)
  return want


@pytest.mark.parametrize("seq_offset,width", [(0, None), (1, 2176)])
def test_expand_pools_random(seq_offset, width):
  rng = np.random.default_rng(40)
  rows, G = 64, 512
  ids = _pool_ids(rng, rows, G, 5000)
  seq = rng.integers(-3, 20000, rows)
  out = _check_expand(ids, seq, seq_offset, width)
  assert out.shape == (rows, 2051 if width is None else width)
  if width is not None:
    assert np.all(out[:, 2051:] == -1)


def test_expand_pools_tail_counts_and_negative_lengths():
  rng = np.random.default_rng(41)
  G = 32
  seq = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 401, 402, 403, 404, -1, -2, -4, -5, -400])
  rows = len(seq)
  ids = _pool_ids(rng, rows, G, 200)
  ids[0] = -1                                   # a row with no pools at all
  ids[1, :4] = [0, (1 << 28) + 5, 7, -1]        # large ids: no upper-bound check
  for seq_offset in (0, 1):
    want = _check_expand(ids, seq, seq_offset, None)
    n = seq + seq_offset
    tc = want[:, 4 * G:]
    for r in range(rows):
      cnt = int(np.sum(tc[r] >= 0))
      assert cnt == (n[r] % 4 if n[r] >= 0 else 0)
  assert want[1, 4] == ((1 << 28) + 5) * 4


def test_expand_pools_empty():
  got = _expand_fn(0, None)(i32(np.zeros((0, 8))), i32(np.zeros(0)))
  assert got.shape == (0, 35)
  got = _expand_fn(1, 64)(i32(np.zeros((0, 8))), i32(np.zeros(0)))
  assert got.shape == (0, 64)


def _check_remap(ids, positions, req_ids, table, *, block_size, width, stride_rows=None,
                 seq_offset=1, compact=True):
  want, wcnt = O.expand_and_remap(ids, positions, req_ids, table, block_size=block_size,
                                  width=width, stride_rows=stride_rows,
                                  seq_offset=seq_offset, compact=compact)
  out, cnt = _remap_fn(block_size, width, stride_rows, seq_offset, compact)(
      i32(ids), i32(positions), i32(req_ids), i32(table))
  out, cnt = np.asarray(out), np.asarray(cnt)
  assert out.dtype == np.int32 and cnt.dtype == np.int32
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(cnt, wcnt)
  return want, wcnt


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("block_size,stride_rows", [(64, None), (128, 192)])
def test_expand_and_remap_random(compact, block_size, stride_rows):
  rng = np.random.default_rng(42)
  expanded, rows, G, W = 24, 32, 512, 2176   # rows past `expanded`
  R_, MB = 6, 40                              # blocks cover tokens < 40 * block_size
  max_tok = MB * block_size
  ids = _pool_ids(rng, expanded, G, (max_tok + 600) // 4)   # some pools past the table
  positions = rng.integers(-2, max_tok + 50, expanded)
  positions[:3] = [-1, 3, 6]                  # padding, tail count 0, causal-like
  req_ids = rng.integers(0, R_, rows)
  req_ids[[2, 5, 9]] = [-1, R_, R_ + 100]     # requests outside the block table
  table = rng.integers(0, 5000, (R_, MB))
  want, cnt = _check_remap(ids, positions, req_ids, table, block_size=block_size,
                           width=W, stride_rows=stride_rows, compact=compact)
  assert np.all(want[expanded:] == -1) and np.all(cnt[expanded:] == 0)
  assert np.all(want[[2, 5, 9]] == -1) and np.all(cnt[[2, 5, 9]] == 0)
  assert np.all(cnt[:expanded] == np.sum(want[:expanded] >= 0, axis=1))
  assert 0 < cnt.max() <= 2051


def test_compact_and_column_layouts_differ_on_gaps():
  """Rows with interior gaps: compact = valid prefix in column order, column-preserving
  keeps positions; both have the same counts and the same multiset of slots."""
  rng = np.random.default_rng(43)
  G, W, bs, MB = 32, 132, 16, 8
  ids = np.array([[0, -1, 3, 40, 1] + [-1] * (G - 5),         # pool 40 -> block 10 >= MB
                  list(range(G)),                               # 32 pools: blocks 0..7
                  [-1] * G])
  positions = np.array([13, 130, 17])
  table = rng.integers(0, 100, (2, MB))
  req = np.array([1, 0, 1, 0])                                  # 4 rows > 3 expanded
  a, ca = _check_remap(ids, positions, req, table, block_size=bs, width=W, compact=True)
  b, cb = _check_remap(ids, positions, req, table, block_size=bs, width=W, compact=False)
  np.testing.assert_array_equal(ca, cb)
  assert ca.tolist() == [12 + 2, 4 * 32, 2, 0]    # row 1: tail tokens 128.. are block 8
  assert not np.array_equal(a[0], b[0])
  for r in range(3):
    np.testing.assert_array_equal(np.sort(a[r][a[r] >= 0]), np.sort(b[r][b[r] >= 0]))
    np.testing.assert_array_equal(a[r][:ca[r]], b[r][b[r] >= 0])
  # row 0, column preserving: pool 0 -> tokens 0..3 -> block 0
  assert b[0, :4].tolist() == [table[1, 0] * bs + o for o in range(4)]
  assert np.all(b[0, 4:8] == -1)


def test_remap_tail_blocks_and_seq_offset():
  """Tail tokens past the block table are dropped; seq_offset 0 vs 1."""
  rng = np.random.default_rng(44)
  G, W, bs, MB = 32, 160, 16, 4
  ids = _pool_ids(rng, 6, G, 20)
  positions = np.array([62, 63, 64, 65, 66, -1])   # n = 63..67: tail crosses token 64
  table = rng.integers(0, 50, (1, MB))
  req = np.zeros(6)
  for off in (0, 1):
    for compact in (True, False):
      _check_remap(ids, positions, req, table, block_size=bs, width=W, seq_offset=off,
                   compact=compact)


def test_remap_empty():
  table = np.arange(8).reshape(2, 4)
  out, cnt = _remap_fn(16, 132, None, 1, True)(i32(np.zeros((0, 32))), i32(np.zeros(0)),
                                               i32(np.zeros(0)), i32(table))
  assert out.shape == (0, 132) and cnt.shape == (0,)
  # rows but nothing expanded: all -1, counts 0
  _check_remap(np.zeros((0, 32)), np.zeros(0), np.array([0, 1, 1]), table, block_size=16,
               width=132)
  out, cnt = _remap_fn(16, 132, None, 1, True)(i32(np.zeros((0, 32))), i32(np.zeros(0)),
                                               i32([0, 1, 1]), i32(table))
  assert np.all(np.asarray(out) == -1) and np.all(np.asarray(cnt) == 0)


def test_int32_wraparound():
  """SPEC §6 `int32(pid*4 + o)` and §7 'int32 arithmetic' (block-table entries are not
  validated): large ids and table entries wrap like int32."""
  G, W, bs = 32, 132, 16
  ids = np.full((2, G), -1)
  ids[0, :3] = [(1 << 29) + 1, (1 << 30) - 1, 2]
  positions = np.array([5, 9])
  _check_expand(ids, positions, 1, W)
  table = np.array([[(1 << 31) - 20, 1 << 27, 3, 4]])
  for compact in (True, False):
    _check_remap(ids, positions, np.array([0, 0]), table, block_size=bs, width=W,
                 stride_rows=32, compact=compact)
