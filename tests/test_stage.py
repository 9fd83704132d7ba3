"""The composed decode step: jit, in-place caches under donation, the causal
and top-k branches, fused == unfused, against the reference composition."""
import dataclasses
import re

import numpy as np
import jax
import pytest
from bounds import check_cache_d2

import glm5_jax
from glm5_testing import tiers
from glm5_testing.cases import stage_state, tree_bytes

from graphs import copied_shapes, gemm_pinned

STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"),
               donate_argnames="cache")
CONFIG = glm5_jax.IndexerConfig(max_pools=1024)
# q's GEMM as XLA's dot in a kernel program: indexer_q's kernel (the default at
# plan.KERNEL_ROWS), update_epilogue_q's and indexer_update_q's sum q in another order
# than XLA's GEMM, within SPEC D2, not bit-equal (an H200 run: 5 of 8192 q_fp8 codes one off
# at M = 2); tests/test_q_gpu.py checks those kernels against the reference. Pinned, the rest
# of the stage is compared bit for bit.
PIN_Q = glm5_jax.Routing(ops={"indexer_q": False, "update_epilogue_q": False,
                              "indexer_update_q": False})


def state(contexts, next_n=1, seed=0):
  return stage_state(contexts, next_n, seed, config=CONFIG, hidden=512, q_lora=256)


def cache_copies(step, args, config):
  weights, cache, x, qr, batch = args
  text = step.lower(weights, cache, x, qr, batch, config=config).compile().as_text()
  return copied_shapes(text, [cache.kv_cache.shape, cache.tail.shape])


@pytest.mark.slow
def test_donated_step_has_no_cache_copy():
  """No copy of the paged K cache; on GPU none of the tail ring either (the
  CPU backend materialises the tail's bf16 <-> u16 bitcasts, B x 4 KB)."""
  args = state([10, 1500, 3001, 77])
  copies = cache_copies(STEP, args, CONFIG)
  if jax.default_backend() == "cpu":
    copies.discard(tuple(args[1].tail.shape))
  assert copies == set()
  text = STEP.lower(*args[:4], args[4], config=CONFIG).compile().as_text()
  assert re.search(r"input_output_alias=\{ \{4\}: \(5, \{\}, may-alias\), "
                   r"\{5\}: \(6, \{\}, may-alias\) \}", text)
  undonated = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))
  assert cache_copies(undonated, args, CONFIG), "the check must see copies without donation"


def test_donated_cache_is_reused():
  weights, cache, x, qr, batch = state([10, 1500, 3001, 77])
  before = cache.kv_cache.unsafe_buffer_pointer()
  _, new = STEP(weights, cache, x, qr, batch, config=CONFIG)
  assert cache.kv_cache.is_deleted()
  assert new.kv_cache.unsafe_buffer_pointer() == before


@pytest.mark.slow
@pytest.mark.parametrize("contexts,next_n", [([10, 1500, 3001, 77], 1), ([3, 2046], 1),
                                             ([40, 2999, 514], 4)])
@pytest.mark.parametrize("fused,update", [(True, "auto"), (False, "auto"), (False, "ops"),
                                          (False, "fused")])
def test_stage_matches_reference_composition(contexts, next_n, fused, update):
  """Bit-equal, but for the K cache where a kpool_update kernel runs: its fp8
  bytes follow the stock GPU arithmetic, within SPEC D2 of the reference. q's GEMM is
  XLA's in both programs (PIN_Q); with the default routing (indexer_q's kernel at
  these M) the caches are the same bytes as with q pinned: q does not reach them."""
  config = glm5_jax.IndexerConfig(max_pools=1024, fused=fused, update=update, routing=PIN_Q)
  weights, cache, x, qr, batch = state(contexts, next_n)
  kv_before = np.asarray(cache.kv_cache)
  want, got = (gemm_pinned(STEP, weights, cache, x, qr, batch, config=config,
                           use_reference=use_reference)
               for use_reference in (True, False))
  (out, new), (want_out, want_new) = got, want
  loc = np.asarray(batch.loc)
  bad, total = check_cache_d2(new.kv_cache, want_new.kv_cache, kv_before, loc[loc >= 0],
                              f"stage {contexts} next_n {next_n} {fused} {update}")
  assert total == np.count_nonzero(loc >= 0)
  if jax.default_backend() == "cpu":
    assert bad == 0
    for g, w in zip(tree_bytes((out, new.tail)), tree_bytes((want_out, want_new.tail))):
      np.testing.assert_array_equal(g, w)
    return
  # GPU: the default routing (q's kernel at these M; on the CPU every routing runs the same
  # references, so the comparison would be of a program with itself).
  _, routed = gemm_pinned(STEP, weights, cache, x, qr, batch, config=dataclasses.replace(
      config, routing=glm5_jax.Routing()))
  for g, w in zip(tree_bytes(routed), tree_bytes(new), strict=True):
    np.testing.assert_array_equal(g, w)
  # GPU: the logits kernel sums in its own order, so near-tied pools at the top-k
  # boundary may swap: equal counts, >= 99% of the selected slots (issue 10's rule).
  for g, w in zip(tree_bytes((out.q_fp8, out.w_out, out.counts, new.tail)),
                  tree_bytes((want_out.q_fp8, want_out.w_out, want_out.counts, want_new.tail))):
    np.testing.assert_array_equal(g, w)
  for r, c in enumerate(np.asarray(out.counts)):
    got, want = set(np.asarray(out.slots)[r, :c]), set(np.asarray(want_out.slots)[r, :c])
    assert len(got & want) >= 0.99 * c, f"row {r}: {len(got & want)} of {c}"


@pytest.mark.parametrize("contexts,next_n,scale_format", tiers.first(
    ([6, 13], 2, "fp32"), ([10, 1500, 3001, 77], 1, "fp32"), ([40, 2999, 514], 4, "ue8m0")))
def test_update_switch_is_bit_equal(contexts, next_n, scale_format):
  """IndexerConfig(update="fused") (indexer_update) and "auto" (indexer_update_q's one
  call where every kernel is on) give the stage's every output byte and both caches as
  the three ops do (update="ops"), under the routing of each run: on the CPU all are the
  reference; on a GPU with every kernel on, the same kernels with the same arguments. On a
  GPU with the default routing the projection may run XLA's GEMM in one and the kernel in
  the other: see test_stage_matches_reference_composition."""
  routing = glm5_jax.Routing(kernels=True) if jax.default_backend() == "gpu" else None
  base = dict(max_pools=1024, scale_format=scale_format)
  if routing is not None:
    base["routing"] = routing
  args = state(contexts, next_n)
  # (three programs, each with XLA's q GEMM: gemm_pinned makes it one GEMM in all)
  outs = [gemm_pinned(STEP, *args, config=glm5_jax.IndexerConfig(update=update, **base))
          for update in ("ops", "fused", "auto")]
  for other in outs[1:]:
    for g, w in zip(tree_bytes(other), tree_bytes(outs[0]), strict=True):
      np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("contexts,next_n", tiers.first(([40, 2999, 514], 4),
                                                      ([10, 1500, 3001, 77], 1)))
def test_q_in_epilogue_is_bit_equal_to_the_q_kernel(contexts, next_n):
  """update_epilogue_q's kernel routed on (q's GEMM inside the epilogue's FFI call) gives the
  stage's every output byte and both caches as indexer_q's kernel routed on (q's GEMM its
  own FFI call, then XLA's projection GEMM and update_epilogue): on a GPU the same kernels
  on the same arguments; on the CPU both the reference."""
  args = state(contexts, next_n)
  base = dict(max_pools=1024)
  outs = [gemm_pinned(STEP, *args, config=glm5_jax.IndexerConfig(
              routing=glm5_jax.Routing(ops={op: True}), **base))
          for op in ("update_epilogue_q", "indexer_q")]
  for g, w in zip(tree_bytes(outs[0]), tree_bytes(outs[1]), strict=True):
    np.testing.assert_array_equal(g, w)


def test_causal_branch_selects_every_token():
  """All contexts within topk_tokens: each row lists tokens 0..pos in order."""
  weights, cache, x, qr, batch = state([5, 2046, 700])
  out, _ = STEP(weights, cache, x, qr, batch, config=CONFIG)
  pos = np.asarray(batch.positions)[:, 0]
  np.testing.assert_array_equal(np.asarray(out.counts), pos + 1)
  bt = np.asarray(batch.block_table)
  for r, p in enumerate(pos):
    tok = np.arange(p + 1)
    want = bt[r, tok // CONFIG.block_size] * CONFIG.block_size + tok % CONFIG.block_size
    np.testing.assert_array_equal(np.asarray(out.slots)[r, :p + 1], want)
    assert (np.asarray(out.slots)[r, p + 1:] == -1).all()


def test_rows_choose_causal_or_topk_independently():
  """One batch with rows on both sides of topk_tokens: the short rows list every
  token in order (causal fill) while the long ones select 2048 tokens + tail."""
  weights, cache, x, qr, batch = state([5, 3001, 700])
  out, _ = STEP(weights, cache, x, qr, batch, config=CONFIG)
  counts = np.asarray(out.counts)
  assert counts.tolist() == [6, 2048 + 3002 % 4, 701]
  bt = np.asarray(batch.block_table)
  for r, p in ((0, 5), (2, 700)):
    tok = np.arange(p + 1)
    want = bt[r, tok // CONFIG.block_size] * CONFIG.block_size + tok % CONFIG.block_size
    np.testing.assert_array_equal(np.asarray(out.slots)[r, :p + 1], want)


def test_topk_branch_selects_topk_pools_plus_tail():
  weights, cache, x, qr, batch = state([3001, 2100])
  out, _ = STEP(weights, cache, x, qr, batch, config=CONFIG)
  pos = np.asarray(batch.positions)[:, 0]
  np.testing.assert_array_equal(np.asarray(out.counts), 2048 + (pos + 1) % 4)
  slots = np.asarray(out.slots)
  for r in range(2):
    valid = slots[r, :out.counts[r]]
    assert len(set(valid.tolist())) == len(valid)


@pytest.mark.parametrize("contexts,next_n,scale_format", tiers.first(
    ([40, 2999, 514], 4, "ue8m0"), ([10, 1500, 3001, 77], 1, "fp32"), ([3900, 13], 2, "fp32")))
def test_select_switch_is_bit_equal(contexts, next_n, scale_format):
  """The default routing (the select path as select_slots' one call where its kernel is
  chosen) gives every output byte and both caches as Routing(ops={"select_slots": False})
  (select_pools + expand_and_remap): on a GPU the same logits kernel, and a top-k writing
  the slots the remap would."""
  base = dict(max_pools=1024, scale_format=scale_format)
  args = state(contexts, next_n)
  outs = [gemm_pinned(STEP, *args, config=glm5_jax.IndexerConfig(routing=routing, **base))
          for routing in (glm5_jax.Routing(ops={"select_slots": False}), glm5_jax.Routing())]
  for g, w in zip(tree_bytes(outs[1]), tree_bytes(outs[0]), strict=True):
    np.testing.assert_array_equal(g, w)
