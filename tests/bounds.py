"""The tolerances the GPU tests hold the kernels to, each one a function the CPU negative
tests (tests/test_bounds.py) feed deliberately wrong results through: a bound that lets a
plausible wrong kernel pass is a bound that tests nothing.

Where a figure was measured (the H200, bench/NOTES.md at 9b858ca, README, SPEC §11.2) the
bound keeps a stated margin over it; where none was, the bound comes from an error analysis
named next to it and is to be confirmed on the GPU (the functions return the measured
figure so the GPU tests can assert it, never print it only)."""
import math

import numpy as np

from glm5_testing import oracle as O

# K-cache pools that may differ (in some fp8 byte) between a kpool kernel (the stock
# ex2.approx / div.full arithmetic) and the reference (IEEE exp and division): measured
# 0.027-0.074% (SPEC §11.2, 524,288 pools a distribution) and 0.06-0.10% (SPEC D6); 1.5x the
# largest, plus a Poisson margin of 4 sigma + 2 so that small counts do not fail by chance.
POOL_RATE = 1.5e-3


def rate_limit(total, rate):
  """The most of `total` things that may differ at `rate`: the mean plus a Poisson margin of
  4 sigma + 2 (small counts do not fail by chance; a systematic fault still does)."""
  mean = rate * total
  return math.floor(mean + 4 * math.sqrt(mean) + 2)


def pool_rate_limit(total):
  return rate_limit(total, POOL_RATE)


def check_cache_d2(got, want, orig, written, label="", stats=None, plain_scales=False):
  """oracle.compare_cache (every differing entry explained by SPEC D2's exp/div rule, scale
  bytes equal, unwritten entries unchanged) and at most pool_rate_limit of the written
  entries differing. Returns (differing, written)."""
  bad, total = O.compare_cache(got, want, orig, written, label, stats, plain_scales)
  assert bad <= pool_rate_limit(total), (
      f"{label}: {bad} of {total} pools differ (at most {pool_rate_limit(total)})")
  return bad, total


# Tail values that may differ between two compositions on a GPU: 2 of 8,192 measured (the
# H200, prefill then decode vs one prefill); 1/1024 leaves 4x that and rejects a systematic
# fault (every key of a token off: 128 of a request's 1,024 ring values).
TAIL_RATE = 2.0 ** -10
# Two fp32 GEMMs summed in other orders (a kernel against XLA's dot, or XLA's against itself
# under another autotuned algorithm) are ~2^-18 of a row's rms apart, which now and then flips
# a key's or gate's bf16 rounding: one ulp of that value, at most 2^-7 of it. The LayerNorm
# and the rope's rotation carry that step to the tail at about its size, so a value near 0
# moves many of its own ulps (6, 1.4e-3 of a row of rms 1, at M = 128 with XLA's GEMM on both
# sides) but not past 2^-7 of its row's largest magnitude (the synthetic keys are centred:
# their mean is small against their spread). A wrong row or token is off by about the rms,
# and two ulps of the row's largest value still fail.
GEMM_TAIL_FLOOR = 2.0 ** -7
# K-cache entries that may differ, of all entries: keys differ in ~2.4e-4 of their values
# (the tail rate above) and an entry pools 4 x 128 of them, so ~12% of entries see one
# (analysis; to confirm on the GPU): compare_cache bounds each such entry.
ENTRY_RATE = 2.0 ** -3


def check_equivalent(got_kv, got_tail, want_kv, want_tail, gemm_floor=0.0):
  """Caches of two compositions within SPEC D2 (u8[pages, PAGE, 132], bf16[blocks, 2, RING,
  128], numpy): a key may differ by one bf16 rounding (GEMMs of other shapes), so a tail
  value by one bf16 ulp (at TAIL_RATE: rate_limit) and a pooled entry (read as SPEC
  §0.1 lays a page out: all PAGE x 128 codes, then the PAGE scales) by one fp8 code, or by
  what one flipped pooled bf16 value moves through the Hadamard (O.compare_cache), its
  scale bytes equal; at most ENTRY_RATE of the entries differ. gemm_floor: where the two
  sides' keys and gates come from GEMMs summed in other orders (a kernel against XLA's
  dot), a value may also differ by up to gemm_floor x the largest magnitude of its 128-value
  row (a value near 0 after cancellation or LayerNorm's centring moves many of its own
  ulps)."""
  gt, wt = np.asarray(got_tail), np.asarray(want_tail)
  assert gt.shape == wt.shape and gt.dtype == wt.dtype == O.BF16, (gt.dtype, wt.dtype)
  off = O.bits(gt) != O.bits(wt)
  assert off.sum() <= rate_limit(off.size, TAIL_RATE), (
      f"tail: {off.sum()} of {off.size} values differ")
  ulps = np.abs(O.bf16_rank(gt[off]) - O.bf16_rank(wt[off]))
  g64, w64 = gt.astype(np.float64), wt.astype(np.float64)
  peak = np.broadcast_to(np.max(np.abs(w64), axis=-1, keepdims=True), wt.shape)[off]
  delta = np.abs(g64[off] - w64[off])
  bad = (ulps > 1) & ~(delta <= gemm_floor * peak)
  assert not np.any(bad), (
      f"tail: a value {ulps[bad].max()} bf16 ulp off and more than {gemm_floor:.3g} of its "
      f"row's largest magnitude: got {g64[off][bad][:4]}, want {w64[off][bad][:4]}, "
      f"largest {peak[bad][:4]}")
  entries = O.differing_entries(got_kv, want_kv)
  pages, page, _ = np.shape(want_kv)
  assert len(entries) <= ENTRY_RATE * pages * page, f"kv_cache: {len(entries)} entries differ"
  # Every entry not in `entries` is equal by construction; those are compared as written.
  O.compare_cache(got_kv, want_kv, want_kv, entries, "kv_cache")


# mqa_logits against the float64 evaluation, as a share of sum_h |w| sum_d |q k| * scale
# (oracle.mqa_logits' bound). Products of e4m3 values are exact, but sm_90's fp8 wgmma
# sums them keeping about 13 bits below the largest term and truncating: with every term
# positive (each dot its own abs-sum) the kernel is measured up to 2^-9.9 off on the H200,
# as every fp8 wgmma kernel is (DeepGEMM's logits the same). 2^-9 bounds that; it cannot
# see a bf16 read of the head weights (2^-9.3), so EXACT_DOTS_BOUND does.
LOGITS_BOUND = 2.0 ** -9
# Dots the tensor cores sum exactly (codes of 0..2 in halves: every partial sum a multiple
# of 1/4 below 2^11): the kernel's error is then its fp32 head sum, at most heads / 4 + 3
# roundings of 2^-24 of the bound (2^-19.7 at 64 heads); 2^-18 bounds it and rejects bf16
# weights or logits (2^-9.3, 2^-9), a dropped dimension and scales read row-wise.
EXACT_DOTS_BOUND = 2.0 ** -18


def check_logits(got, want, bound, n, limit=LOGITS_BOUND):
  """Rows of kernel logits got f32[rows, >= n[r]] against the float64 want and its abs-sum
  bound (oracle.mqa_logits_vectorized): -inf exactly where want is, |got - want| <=
  limit * bound elsewhere, over each row's first n[r] pools. Returns the largest
  |got - want| / bound."""
  worst = 0.0
  for r in range(got.shape[0]):
    g, x, b = got[r, :n[r]], want[r, :n[r]], bound[r, :n[r]]
    none = np.isneginf(x)
    np.testing.assert_array_equal(np.isneginf(g), none, err_msg=f"row {r}")
    err = np.abs(g[~none].astype(np.float64) - x[~none])
    ratio = err / np.maximum(b[~none], 1e-300)
    assert np.all(err <= limit * b[~none] + 1e-30), (
        f"row {r}: |logit - f64| up to {float(np.max(ratio)):.3g} of the abs-sum bound "
        f"(at most {limit:.3g})")
    if err.size:
      worst = max(worst, float(np.max(ratio)))
  return worst


# Key LayerNorm values one bf16 ulp off the reference's (SPEC D2: <= 1 ulp, report the
# rate): 1.2e-5 of the values measured (SPEC §11.2, inductor vs the JAX two-pass); 1e-4 is
# 8x that, with a Poisson margin (the kernel's grouped order: to confirm on the GPU).
KEY_RATE = 1e-4


def key_rate_limit(total):
  return rate_limit(total, KEY_RATE)


def check_key(got, want, label=""):
  """oracle.compare_key (within 1 bf16 ulp, NaN where want is) and at most key_rate_limit
  of the values 1 ulp off. Returns (off, total)."""
  bad, total = O.compare_key(got, want, label)
  assert bad <= key_rate_limit(total), (
      f"{label}: {bad} of {total} key values one ulp off (at most {key_rate_limit(total)})")
  return bad, total
