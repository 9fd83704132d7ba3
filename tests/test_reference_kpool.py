"""glm5_jax.reference kpool writers (SPEC §3, §4) against the independent oracle.

K-cache comparison follows SPEC D2: the reference's exp2 is within ~1 ulp of the
oracle's correctly rounded one, so every scale byte must be equal, every fp8 code
equal or one e4m3 code apart, and at most 1% of written entries may differ at all.
One refinement (oracle.compare_cache): in the rare entry where the exp difference
flips a pooled bf16 value, the Hadamard spreads it over all 128 outputs and small
outputs can move by several e4m3 codes (measured: ~1 entry in 2e4 under a 1-ulp exp
model); such entries are bounded by that mechanism and counted. Tail rings, and
every entry not written, must be bit-identical.
"""
import functools
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from glm5_jax import reference as R
from glm5_jax.reference import kpool as RK
from glm5_testing import oracle as O
from glm5_testing.cases import i32

BF16 = O.BF16
STATS = {"multi": 0}     # entries whose fp8 codes differ by > 1 code (see compare_cache)


@functools.cache
def _update_fn(scale_format, round_scale):
  return jax.jit(functools.partial(R.kpool_update, scale_format=scale_format,
                                   round_scale=round_scale))


@functools.cache
def _compress_fn(scale_format, round_scale):
  return jax.jit(functools.partial(R.kpool_compress, scale_format=scale_format,
                                   round_scale=round_scale))


_seed_fn = jax.jit(R.kpool_seed_tail)


def _tail_equal(ref_tail, orc_tail, label=""):
  r = np.asarray(ref_tail)
  assert r.dtype == BF16, r.dtype
  np.testing.assert_array_equal(r.view(np.uint16), np.asarray(orc_tail).view(np.uint16),
                                err_msg=f"{label}: tail differs")


def _check_update(kv, tail, tslot, key, gate, ape, loc, pos, *, scale_format="fp32",
                  round_scale=True, label="", min_written=1):
  written = []
  okv, otail = O.kpool_update(kv, tail, tslot, key, gate, ape, loc, pos,
                              scale_format=scale_format, round_scale=round_scale,
                              written=written)
  rkv, rtail = _update_fn(scale_format, round_scale)(
      jnp.asarray(kv), jnp.asarray(tail), i32(tslot), jnp.asarray(key),
      jnp.asarray(gate), jnp.asarray(ape), i32(loc), i32(pos))
  assert np.asarray(rkv).dtype == np.uint8 and np.asarray(rkv).shape == kv.shape
  bad, n = O.compare_cache(rkv, okv, kv, written, label, STATS)
  _tail_equal(rtail, otail, label)
  assert n >= min_written, (n, min_written)
  return bad, n, okv, otail, written


def _decode_batch(rng, B, N, *, ring, blocks, pages, page, max_start=200, gate_scale=2.0):
  """Consistent random decode inputs: distinct tail blocks, unique pool slots."""
  starts = rng.integers(0, max_start, B)
  pos = starts[:, None] + np.arange(N)[None, :]
  blk = rng.permutation(blocks)[:B]
  tslot = blk[:, None] * ring + pos % ring
  done = pos % 4 == 3
  loc = np.full((B, N), -1, np.int64)
  loc[done] = rng.choice(pages * page, int(done.sum()), replace=False)
  key = O.random_bf16(rng, (B, N, 128))
  gate = O.random_bf16(rng, (B, N, 128), gate_scale)
  return tslot, key, gate, loc, pos


def _state(rng, *, pages, page, blocks, ring):
  ape = (rng.standard_normal((4, 128)) * 0.5).astype(np.float32)
  return O.poison_cache(rng, pages, page), O.poison_tail(rng, blocks, ring), ape


def _report(label, bad, n):
  print(f"\n[{label}] fp8 mismatch: {bad}/{n} pools = {bad / max(n, 1):.4%} "
        f"(entries > 1 code apart so far in this module: {STATS['multi']})")
  assert bad <= max(1, 0.01 * n), (bad, n)


@pytest.mark.slow
@pytest.mark.parametrize("scale_format,round_scale,page", [
    ("fp32", True, 64), ("ue8m0", True, 32), ("fp32", False, 64)])
def test_update_random_many_pools(scale_format, round_scale, page):
  rng = np.random.default_rng(10)
  B, N, ring = 256, 8, 16
  pages = 4096 // page                           # 4096 pool slots
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=B + 7, ring=ring)
  args = _decode_batch(rng, B, N, ring=ring, blocks=B + 7, pages=pages, page=page)
  bad, n, *_ = _check_update(kv, tail, *args[:3], ape, *args[3:], scale_format=scale_format,
                             round_scale=round_scale, label=scale_format,
                             min_written=2 * B)
  _report(f"update {scale_format} round_scale={round_scale}", bad, n)


def test_update_next_n_one_sequence_of_steps():
  """Several decode steps (next_n 1, RING 4) chained, the oracle state fed to both."""
  rng = np.random.default_rng(11)
  B, ring, page, pages, blocks = 64, 4, 64, 8, 70
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=blocks, ring=ring)
  starts = rng.integers(0, 50, B)
  blk = rng.permutation(blocks)[:B]
  total_bad = total = 0
  for step in range(6):
    pos = (starts + step)[:, None]
    pos[rng.random((B, 1)) < 0.1] = -1                      # some padding rows
    tslot = np.where(pos >= 0, blk[:, None] * ring + pos % ring, -1)
    done = (pos % 4 == 3) & (pos >= 0)
    loc = np.full((B, 1), -1)
    loc[done] = rng.choice(pages * page, int(done.sum()), replace=False)
    key = O.random_bf16(rng, (B, 1, 128))
    gate = O.random_bf16(rng, (B, 1, 128), 2.0)
    bad, n, kv, tail, _ = _check_update(kv, tail, tslot, key, gate, ape, loc, pos,
                                        label=f"step {step}", min_written=0)
    total_bad += bad
    total += n
  assert total > 50
  _report("update next_n=1 chained", total_bad, total)


def _edge_batch(rng, ring, blocks, pages, page):
  """Hand-written decode batch (N = 4) covering the §3 edge cases."""
  cap = pages * page
  rows = []   # (pos[4], tslot[4], loc[4])

  def req(blk, pos, loc, tslot=None):
    pos = np.array(pos)
    if tslot is None:
      tslot = np.where(pos >= 0, blk * ring + np.maximum(pos, 0) % ring, -1)
    rows.append((pos, np.array(tslot), np.array(loc)))

  # 1: completion at the last token, slots 0..2 stashed earlier in this call
  req(1, [4, 5, 6, 7], [-1, -1, -1, 3])
  # 2: completion mid-call, a later token of the call stashed after it
  req(2, [9, 10, 11, 12], [-1, -1, 17, -1])
  # 3: trailing padding; pos = -1 and other negative positions
  req(3, [13, 14, -1, -5], [-1, -1, -1, -1])
  # 4: all padding but with tslot and loc pointing at real storage: touches nothing
  req(4, [-1, -1, -1, -1], [5, 6, 7, 8], tslot=[4 * ring, 4 * ring + 1, 4 * ring + 2, 4 * ring + 3])
  # 5: completing slot past the cache (never written), a loc on a non-completing token
  req(5, [15, 16, 17, 18], [cap + 3, 9, -1, -1])
  # 6: negative loc on a completing token: stash but no write
  req(6, [19, 20, 21, 22], [-1, -1, -1, -1])
  # 7: tail block past the ring buffer: the whole token is a no-op
  req(blocks, [20, 21, 22, 23], [-1, -1, -1, 20])
  # 8: slot far past the cache, completing at position 3 (first pool)
  req(7, [0, 1, 2, 3], [-1, -1, -1, 10 ** 6])
  # 9: negative tslot on real tokens: no stash (a completion would read block 0)
  req(8, [24, 25, 26, 27], [-1, -1, -1, -1], tslot=[-1, -3, -1, -1])
  # 10: tslot whose ring row disagrees with pos: the ring row comes from pos
  req(9, [28, 29, 30, 31], [-1, -1, -1, 30], tslot=[9 * ring] * 4)
  # 11: second completion of the call (N = 4 covers pool 8 tokens 32..35)
  req(10, [32, 33, 34, 35], [-1, -1, -1, 31])
  # 12: wrap-around far past the ring size
  req(11, [1001, 1002, 1003, 1004], [-1, -1, 40, -1])
  pos = np.stack([r[0] for r in rows])
  tslot = np.stack([r[1] for r in rows])
  loc = np.stack([r[2] for r in rows])
  return tslot, pos, loc


@pytest.mark.slow
@pytest.mark.parametrize("ring", [4, 8])
def test_update_edge_cases(ring):
  rng = np.random.default_rng(12 + ring)
  pages, page, blocks = 2, 32, 12
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=blocks, ring=ring)
  tslot, pos, loc = _edge_batch(rng, ring, blocks, pages, page)
  B, N = pos.shape
  key = O.random_bf16(rng, (B, N, 128))
  gate = O.random_bf16(rng, (B, N, 128), 2.0)
  bad, n, okv, otail, written = _check_update(kv, tail, tslot, key, gate, ape, loc, pos,
                                               label=f"edge ring {ring}")
  # sanity of the oracle itself on the cases named above
  assert sorted(written) == [3, 17, 30, 31, 40]       # not 20 (block past), cap+3, 10**6
  for b in (0, 4, 8):                                  # unused / padding / tslot < 0
    np.testing.assert_array_equal(otail[b].view(np.uint16), tail[b].view(np.uint16))
  # request 10 stashed its rows at pos % ring, not at tslot % ring = 0 only
  for t, p in enumerate([28, 29, 30, 31]):
    np.testing.assert_array_equal(otail[9, 0, p % ring].view(np.uint16),
                                  key[9, t].view(np.uint16))
  # request 1 completion used this call's tokens 4, 5, 6 (recompute independently)
  ks = np.stack([key[0, t].astype(np.float32) for t in range(4)])
  gs = np.stack([gate[0, t].astype(np.float32) for t in range(4)])
  q, sb = O.compress_pool(ks, gs, ape)
  flat = okv.reshape(pages, page * 132)
  np.testing.assert_array_equal(flat[0, 3 * 128:4 * 128], q)
  np.testing.assert_array_equal(flat[0, page * 128 + 12:page * 128 + 16], sb)
  _report(f"update edge ring {ring}", bad, n)


def test_update_completion_with_negative_tslot_reads_block_zero():
  """SPEC §3: blk = max(ts, 0) // RING, so a completing token with tslot -1 pools
  ring rows of block 0 (and stashes nothing). Same shapes as the ring-8 edge case."""
  rng = np.random.default_rng(13)
  ring, pages, page, blocks = 8, 2, 32, 12
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=blocks, ring=ring)
  B, N = 12, 4
  pos = np.full((B, N), -1)
  tslot = np.full((B, N), -1)
  loc = np.full((B, N), -1)
  pos[5, :3] = [9, 10, 11]
  loc[5, 2] = 5
  key = O.random_bf16(rng, (B, N, 128))
  gate = O.random_bf16(rng, (B, N, 128), 2.0)
  _, n, okv, otail, written = _check_update(kv, tail, tslot, key, gate, ape, loc, pos,
                                            label="tslot -1")
  assert written == [5]
  np.testing.assert_array_equal(otail.view(np.uint16), tail.view(np.uint16))
  # the pooled rows 0..2 are block 0's ring rows 8 % 8, 9 % 8, 10 % 8 (poison data)
  ks = np.stack([tail[0, 0, r].astype(np.float32) for r in (0, 1, 2)] +
                [key[5, 2].astype(np.float32)])
  gs = np.stack([tail[0, 1, r].astype(np.float32) for r in (0, 1, 2)] +
                [gate[5, 2].astype(np.float32)])
  q, _ = O.compress_pool(ks, gs, ape)
  np.testing.assert_array_equal(okv.reshape(pages, -1)[0, 5 * 128:6 * 128], q)


@pytest.mark.slow
@pytest.mark.parametrize("ring,N", [(8, 5), (8, 8)])
def test_update_next_n_completions_mid_call(ring, N):
  rng = np.random.default_rng(14 + N)
  B, pages, page = 48, 4, 64
  blocks = B + 2
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=blocks, ring=ring)
  tslot, key, gate, loc, pos = _decode_batch(rng, B, N, ring=ring, blocks=blocks,
                                              pages=pages, page=page, max_start=3 * ring)
  # pad the last token of a few requests (non-uniform batch)
  pad = rng.random(B) < 0.2
  pos[pad, -1] = -1
  tslot[pad, -1] = -1
  loc[pad, -1] = -1
  key[pad, -1] = 0
  gate[pad, -1] = 0
  bad, n, *_ = _check_update(kv, tail, tslot, key, gate, ape, loc, pos,
                             label=f"ring {ring} N {N}", min_written=B)
  _report(f"update ring {ring} next_n {N}", bad, n)


@pytest.mark.parametrize("B,N", [(0, 4), (3, 0), (0, 0)])
def test_update_empty(B, N):
  rng = np.random.default_rng(15)
  kv, tail, ape = _state(rng, pages=2, page=32, blocks=3, ring=8)
  tslot = np.zeros((B, N), np.int64)
  key = O.random_bf16(rng, (B, N, 128))
  rkv, rtail = _update_fn("fp32", True)(
      jnp.asarray(kv), jnp.asarray(tail), i32(tslot), jnp.asarray(key), jnp.asarray(key),
      jnp.asarray(ape), i32(tslot), i32(tslot))
  np.testing.assert_array_equal(np.asarray(rkv), kv)
  np.testing.assert_array_equal(np.asarray(rtail).view(np.uint16), tail.view(np.uint16))


def test_update_graph_does_not_grow_with_next_n():
  """At most RK.UNROLL_TOKENS tokens a loop trip: a call's compiled graph, and so the GPU
  compiler's time (which grows with the traced tokens times the batch: minutes for next_n
  16 x 32,768 requests traced straight), stays that of next_n 4 however long the call;
  next_n <= RK.UNROLL_TOKENS (MTP) runs every token straight, no loop (three scatters a
  token: the entry's data and scales, the tail row)."""
  def compiled(N):
    rng = np.random.default_rng(17)
    kv, tail, ape = _state(rng, pages=2, page=32, blocks=3, ring=8)
    z = i32(np.zeros((3, N)))
    key = jnp.asarray(O.random_bf16(rng, (3, N, 128)))
    hlo = _update_fn("fp32", True).lower(jnp.asarray(kv), jnp.asarray(tail), z, key, key,
                                         jnp.asarray(ape), z, z).compile().as_text()
    return len(re.findall(r" scatter\(", hlo)), len(re.findall(r" while\(", hlo))

  assert RK.UNROLL_TOKENS == 4               # next_n of MTP with 3 draft tokens
  for N in (1, 2, RK.UNROLL_TOKENS):
    assert compiled(N) == (3 * N, 0), N
  for N in (16, 64):
    assert compiled(N) == (3 * RK.UNROLL_TOKENS, 1), N


def test_update_runs_eagerly_on_numpy_inputs():
  """Called outside jit with numpy arrays (as a test or a script would) at next_n 6, looped
  with a remainder trip: the same bits as the jitted call on jax arrays (the straight
  graph's eager call is test_primitives.py's test_reference_runs_eagerly_on_numpy)."""
  N = 6
  rng = np.random.default_rng(23)
  kv, tail, ape = _state(rng, pages=2, page=32, blocks=6, ring=8)
  tslot, key, gate, loc, pos = _decode_batch(rng, 4, N, ring=8, blocks=6, pages=2, page=32)
  tslot, loc, pos = (np.asarray(a, np.int32) for a in (tslot, loc, pos))
  args = (kv, tail, tslot, key, gate, ape, loc, pos)
  eager = R.kpool_update(*args)
  jitted = _update_fn("fp32", True)(*map(jnp.asarray, args))
  assert (loc >= 0).sum() > 0
  np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(jitted[0]))
  np.testing.assert_array_equal(np.asarray(eager[1]).view(np.uint16),
                                np.asarray(jitted[1]).view(np.uint16))
  assert not np.array_equal(np.asarray(eager[0]), kv)   # pools were written


def test_update_wide_inputs():
  """k * 8, gates * 6 (SPEC §11.2 'wide inputs'); same shapes as the next_n 8 case."""
  rng = np.random.default_rng(16)
  B, N, ring, page, pages = 48, 8, 8, 64, 4
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=B + 2, ring=ring)
  tslot, key, gate, loc, pos = _decode_batch(rng, B, N, ring=ring, blocks=B + 2,
                                              pages=pages, page=page, gate_scale=12.0)
  key = O.to_bf16(key.astype(np.float32) * 8)
  bad, n, *_ = _check_update(kv, tail, tslot, key, gate, ape, loc, pos, label="wide",
                             min_written=B)
  _report("update wide", bad, n)


# --------------------------------------------------------------------------- §4a

def _check_compress(kv, sk, ss, ape, loc, mask, scale_format="fp32", round_scale=True,
                    label=""):
  written = []
  okv = O.kpool_compress(kv, sk, ss, ape, loc, mask, scale_format=scale_format,
                         round_scale=round_scale, written=written)
  rkv = _compress_fn(scale_format, round_scale)(
      jnp.asarray(kv), jnp.asarray(sk), jnp.asarray(ss), jnp.asarray(ape), i32(loc),
      jnp.asarray(mask))
  bad, n = O.compare_cache(rkv, okv, kv, written, label, STATS)
  return bad, n


@pytest.mark.slow
@pytest.mark.parametrize("scale_format,round_scale,page", [
    ("fp32", True, 64), ("ue8m0", True, 64), ("fp32", False, 32)])
def test_compress_thousands_of_pools(scale_format, round_scale, page):
  rng = np.random.default_rng(20)
  n = 4096
  pages = 5120 // page
  kv = O.poison_cache(rng, pages, page)
  sk = O.random_bf16(rng, (n, 4, 128))
  ss = O.random_bf16(rng, (n, 4, 128), 2.0)
  ape = (rng.standard_normal((4, 128)) * 0.5).astype(np.float32)
  loc = rng.permutation(pages * page)[:n].astype(np.int64)
  loc[rng.random(n) < 0.03] = -1
  past = rng.random(n) < 0.03
  loc[past] = pages * page + rng.integers(0, 1000, int(past.sum()))   # past the cache
  mask = rng.random(n) < 0.9
  bad, w = _check_compress(kv, sk, ss, ape, loc, mask, scale_format, round_scale,
                           scale_format)
  assert w > 3000
  _report(f"compress {scale_format} round_scale={round_scale} page {page}", bad, w)


def test_compress_wide_inputs_and_empty():
  rng = np.random.default_rng(21)
  n, pages, page = 1024, 16, 64
  kv = O.poison_cache(rng, pages, page)
  sk = O.random_bf16(rng, (n, 4, 128), 8.0)
  ss = O.random_bf16(rng, (n, 4, 128), 12.0)
  ape = rng.standard_normal((4, 128)).astype(np.float32)
  loc = rng.permutation(pages * page)[:n].astype(np.int64)
  mask = np.ones(n, bool)
  mask[::7] = False
  bad, w = _check_compress(kv, sk, ss, ape, loc, mask, label="wide")
  assert w == n - len(range(0, n, 7))
  _report("compress wide", bad, w)
  # empty batch: unchanged cache
  e = np.zeros((0,), np.int64)
  rkv = _compress_fn("fp32", True)(jnp.asarray(kv), jnp.asarray(sk[:0]), jnp.asarray(ss[:0]),
                                   jnp.asarray(ape), i32(e), jnp.asarray(np.zeros(0, bool)))
  np.testing.assert_array_equal(np.asarray(rkv), kv)


def test_compress_equals_update_pooling():
  """The §4a pool of (t0..t3) equals the §3 pool completed at t3 (oracle-level
  consistency), and the reference agrees with both on the same slot."""
  rng = np.random.default_rng(22)
  ring, page = 4, 32
  kv = O.poison_cache(rng, 1, page)
  tail = O.poison_tail(rng, 1, ring)
  ape = rng.standard_normal((4, 128)).astype(np.float32)
  key = O.random_bf16(rng, (1, 4, 128))
  gate = O.random_bf16(rng, (1, 4, 128), 2.0)
  pos = np.array([[8, 9, 10, 11]])
  okv, _ = O.kpool_update(kv, tail, pos % ring, key, gate, ape, np.array([[-1, -1, -1, 7]]), pos)
  okv2 = O.kpool_compress(kv, key, gate, ape, np.array([7]), np.array([True]))
  np.testing.assert_array_equal(okv, okv2)
  bad, w = _check_compress(kv, key, gate, ape, np.array([7]), np.array([True]), label="one")
  assert w == 1 and bad == 0


# --------------------------------------------------------------------------- §4b

@pytest.mark.parametrize("ring", [4, 8])
def test_seed_tail(ring):
  rng = np.random.default_rng(30 + ring)
  blocks = 10
  tail = O.poison_tail(rng, blocks, ring)
  lens = [7, 1, 4, 3, 0, 9, 2, 5]
  blks = [0, 2, 3, 5, 6, 7, blocks, 9]          # request 6 has a block past the buffer
  tslot = []
  for L, b in zip(lens, blks):
    tslot += [b * ring + i % ring for i in range(L)]
  tslot += [-1, -1, -1]                          # trailing padding
  tslot = np.array(tslot)
  n = len(tslot)
  key = O.random_bf16(rng, (n, 128))
  gate = O.random_bf16(rng, (n, 128), 2.0)
  want = O.kpool_seed_tail(tail, key, gate, tslot)
  got = _seed_fn(jnp.asarray(tail), jnp.asarray(key), jnp.asarray(gate), i32(tslot))
  _tail_equal(got, want, "seed")
  # oracle sanity: request 0 (7 tokens) stashed exactly its last 4 tokens 3..6
  changed = np.any(want[0].view(np.uint16) != tail[0].view(np.uint16), axis=(0, 2))
  assert sorted(np.nonzero(changed)[0].tolist()) == sorted({i % ring for i in range(3, 7)})
  for b in (1, 4, 6, 8):                          # no tokens seeded there
    np.testing.assert_array_equal(want[b].view(np.uint16), tail[b].view(np.uint16))
  # empty
  got0 = _seed_fn(jnp.asarray(tail), jnp.asarray(key[:0]), jnp.asarray(gate[:0]),
                  i32(tslot[:0]))
  _tail_equal(got0, tail, "seed empty")


def test_seed_tail_then_decode():
  """Prefill seeding followed by decode completions that read the seeded rows."""
  rng = np.random.default_rng(33)
  ring, blocks, pages, page = 8, 6, 2, 64
  kv, tail, ape = _state(rng, pages=pages, page=page, blocks=blocks, ring=ring)
  lens = [6, 9, 14, 3, 11]
  tslot = np.concatenate([b * ring + np.arange(L) % ring for b, L in enumerate(lens)])
  n = len(tslot)
  pk = O.random_bf16(rng, (n, 128))
  ps = O.random_bf16(rng, (n, 128), 2.0)
  tail2 = O.kpool_seed_tail(tail, pk, ps, tslot)
  _tail_equal(_seed_fn(jnp.asarray(tail), jnp.asarray(pk), jnp.asarray(ps), i32(tslot)),
              tail2, "seed")
  B, N = len(lens), 2
  pos = np.array(lens)[:, None] + np.arange(N)
  ts = np.arange(B)[:, None] * ring + pos % ring
  loc = np.where(pos % 4 == 3, np.arange(B)[:, None] * 2 + np.arange(N), -1)
  key = O.random_bf16(rng, (B, N, 128))
  gate = O.random_bf16(rng, (B, N, 128), 2.0)
  bad, w, *_ = _check_update(kv, tail2, ts, key, gate, ape, loc, pos, label="seeded")
  assert w == int(np.sum(pos % 4 == 3))


def special_pools(rng, n=12):
  """Keys and gates bf16[n, 4, 128] with SPEC §3's special values, pool i: 0 NaN key, 1 +Inf
  key, 2 -Inf key, 3 NaN gate, 4 +Inf gate, 5 a -Inf gate slot (its weight 0), 6 -Inf gates
  in one dim of every slot (-Inf - -Inf: NaN there), 7 a -Inf gate dim in three slots,
  8 +Inf keys in two slots of one dim (Inf - Inf in the Hadamard), 9 huge finite keys
  (3e38: the fp32 sum overflows), 10-11 finite; the APE f32[4, 128]."""
  keys = O.random_bf16(rng, (n, 4, 128))
  gates = O.random_bf16(rng, (n, 4, 128), 2.0)
  keys[0, 1, 5] = np.nan
  keys[1, 3, 7] = np.inf
  keys[2, 0, 64] = -np.inf
  gates[3, 2, 9] = np.nan
  gates[4, 0, 11] = np.inf
  gates[5, 1, :] = -np.inf
  gates[6, :, 3] = -np.inf
  gates[7, :3, 100] = -np.inf
  keys[8, 1:3, 20] = np.inf
  keys[9, :, :8] = 3e38
  ape = (rng.standard_normal((4, 128)) * 0.5).astype(np.float32)
  return keys, gates, ape


@pytest.mark.parametrize("scale_format,round_scale", [("fp32", True), ("ue8m0", True),
                                                      ("fp32", False)])
def test_special_values_match_the_oracle(scale_format, round_scale):
  """NaN and +-Inf keys and gates (SPEC §3: fmax ignores NaN, Inf/NaN propagate, the clamp
  sends NaN to -448): the reference's entries are the oracle's, byte for byte, through
  kpool_compress and through kpool_update's ring (the tail rows copied bit for bit)."""
  rng = np.random.default_rng(47)
  keys, gates, ape = special_pools(rng)
  n = len(keys)
  kv0 = O.poison_cache(rng, 4, 16)
  loc = rng.permutation(64)[:n].astype(np.int64)
  written = []
  okv = O.kpool_compress(kv0, keys, gates, ape, loc, np.ones(n, bool),
                         scale_format=scale_format, round_scale=round_scale, written=written)
  rkv = _compress_fn(scale_format, round_scale)(
      jnp.asarray(kv0), jnp.asarray(keys), jnp.asarray(gates), jnp.asarray(ape), i32(loc),
      jnp.ones(n, bool))
  assert O.differing_entries(rkv, okv).size == 0
  flat = np.asarray(rkv).reshape(4, -1)
  pg, e = np.divmod(loc[0], 16)
  assert np.all(flat[pg, e * 128:(e + 1) * 128] == 0xFE), "NaN pooled values -> -448"
  # kpool_update: each pool's slots 0-2 stashed in the ring by three tokens, then the
  # completing token (positions 4i .. 4i + 3 of request i).
  ring = 4
  tail0 = np.zeros((n, 2, ring, 128), BF16)
  pos = np.arange(4)[None, :] + 4 * np.arange(n)[:, None]
  tslot = np.arange(n)[:, None] * ring + pos % ring
  upd_loc = np.where(pos % 4 == 3, loc[:, None], -1)
  _, _, okv2, otail, _ = _check_update(kv0, tail0, tslot, keys, gates, ape, upd_loc, pos,
                                       scale_format=scale_format, round_scale=round_scale,
                                       label="special values", min_written=n)
  np.testing.assert_array_equal(O.differing_entries(okv2, okv), [])
  np.testing.assert_array_equal(np.asarray(otail).view(np.uint16)[:, 0],
                                keys.view(np.uint16)[:, pos[0] % ring])
