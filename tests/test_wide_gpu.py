"""Rows wider than one CTA's top-k (32,768 pools) on the GPU: up to limits.TOPK_MAX_POOLS
(262,144 pools, 1M tokens) pool_topk's kernel holds a row in a cluster of 4-16 CTAs (its kept
keys gathered into one, or, where the bound keeps too many, a radix select over the whole
cluster); past it the kernel runs over chunks, then over the chunks' candidates
(plan.topk_chunks). Either way equal to the reference top-k bit for bit on the same logits;
select_pools and select_slots at those widths (their one kernel up to the limit, past it
mqa_logits' kernel, the chunked top-k and expand_and_remap's kernel) equal to the CPU
reference on logits exact in fp32, and within the logits bound on ordinary ones; no XLA sort
in any of their programs."""
import functools
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from bounds import check_logits
from test_select_gpu import (
  _block_table,
  _contexts,
  _exact_inputs,
  _logit_rows,
  _ref_topk,
  _select_inputs,
  _slots_params,
)

import glm5_jax
from glm5_jax import plan
from glm5_jax import reference as ref
from glm5_jax.limits import TOPK_CLUSTER_MAX_ROWS, TOPK_MAX_POOLS
from glm5_testing import oracle as O

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]
I32 = np.int32


def _targets(fn, *args):
  """The compiled program's text, checked for no XLA sort."""
  text = fn.lower(*args).compile().as_text()
  assert re.search(r"\bsort\(", text) is None
  return text


def _split(width, rows):
  """Where a row of `width` pools is cut: between chunks where plan.topk_chunks cuts it,
  else between the cluster's first two CTAs (pool_topk_parts_kernel's span: 8 CTAs a row
  at up to 8 rows, 2 past TOPK_CLUSTER_MAX_ROWS; a split inside the first CTA's part
  where 4 or 16 hold the row)."""
  chunks = plan.topk_chunks(width, 512, rows)
  parts = 2 if rows > TOPK_CLUSTER_MAX_ROWS else 8
  return chunks.pools if chunks.chunks > 1 else ((width + parts - 1) // parts + 3) // 4 * 4


# The cluster's widths (8, 16 and 32 keys a thread) at up to 16 rows; a pair of CTAs a row
# at 17 and 64 rows (up to TOPK_PAIR_MAX_ROWS); the chunks at 65 and 130 rows and past
# the limit; "equal", "ties" and "special" rows keep more keys than one CTA gathers, so in a
# cluster they take its radix select.
@pytest.mark.parametrize("rows,width", [(1, 262144), (2, 50688), (3, 32769), (16, 65536),
                                        (17, 65536), (64, 50688), (65, 50688),
                                        (1, 202752 // 4 + 7), (5, 131072), (130, 40000),
                                        (1, 300000), (2, 2 * 262144 + 64)])
@pytest.mark.parametrize("kind", ["normal", "ties", "rising", "falling", "equal", "special"])
def test_wide_topk_equals_reference(rows, width, kind):
  rng = np.random.default_rng(rows * 13 + width)
  logits = _logit_rows(rng, rows, width, kind)
  split = _split(width, rows)
  if kind == "ties":                   # the best straddle a chunk or CTA boundary
    logits[:, split - 200:split + 200] = 99.0
  lens = rng.integers(0, width + 10, rows).astype(I32)
  edge = [width, split + 3, 512, -3, 511, width + 100, 1]
  lens[:min(rows, len(edge))] = edge[:rows]
  args = (jnp.asarray(logits), jnp.asarray(lens))
  calls = 1 if plan.topk_chunks(width, 512, rows).chunks == 1 else 2
  for k in (512, 37, 2048):
    fn = jax.jit(functools.partial(glm5_jax.pool_topk, k=k))
    assert _targets(fn, *args).count('custom_call_target="glm5_pool_topk"') == calls
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(_ref_topk(k)(logits, lens)),
                                  err_msg=f"k={k}")


# (requests, next_n, k, max_pools, block_size, stride_rows, width past 4k + 3, scale format)
WIDE_SLOTS = [
    (1, 1, 512, 262144, 128, None, 0, "fp32"),        # 1M tokens
    (2, 2, 512, 50688, 64, 80, 3, "ue8m0"),           # GLM-5's window, MTP rows
    (5, 1, 64, 40000, 128, None, 1, "fp32"),
    (3, 4, 512, 50688, 48, None, 2, "fp32"),
    (16, 4, 512, 50688, 64, None, 1, "ue8m0"),        # 64 MTP rows: a pair of CTAs a row
    (1, 2, 512, 300032, 64, None, 0, "fp32"),         # past the limit: over chunks
]


@pytest.mark.parametrize("requests,next_n,k,max_pools,block_size,stride_rows,extra,scale_format",
                         WIDE_SLOTS)
def test_wide_select_equals_reference(requests, next_n, k, max_pools, block_size, stride_rows,
                                      extra, scale_format):
  """select_slots and select_pools at wide rows give the CPU reference's slots, counts and
  ids bit for bit (logits exact in fp32: any summation order): select_slots' one kernel up
  to TOPK_MAX_POOLS, the chunked composition past it."""
  rng = np.random.default_rng(requests * 1000 + max_pools + k)
  contexts = _contexts(rng, requests, k, max_pools)
  args = _exact_inputs(rng, contexts, next_n, max_pools=max_pools, scale_format=scale_format)
  table = _block_table(rng, contexts, next_n, block_size)
  params = _slots_params(k, max_pools, block_size, stride_rows, extra, scale_format)
  select = dict(k=k, max_pools=max_pools, scale_format=scale_format)
  chunked = glm5_jax.logits.select_chunks(args, select, glm5_jax.Routing.from_env())
  assert (chunked is not None) == (max_pools > TOPK_MAX_POOLS)
  fn = jax.jit(functools.partial(glm5_jax.select_slots, **params))
  text = _targets(fn, *args, table)
  calls = sorted(re.findall(r'custom_call_target="(glm5_\w+)"', text))
  assert calls == (["glm5_expand_and_remap", "glm5_mqa_logits", "glm5_pool_topk",
                    "glm5_pool_topk"] if chunked else ["glm5_select_slots"]), calls
  got = [np.asarray(a) for a in fn(*args, table)]
  host = [np.asarray(a) for a in args]
  want = jax.jit(functools.partial(ref.select_slots, **params), backend="cpu")(*host,
                                                                               np.asarray(table))
  np.testing.assert_array_equal(got[1], np.asarray(want[1]), err_msg="counts")
  np.testing.assert_array_equal(got[0], np.asarray(want[0]), err_msg="slots")
  ids, logits = jax.jit(functools.partial(glm5_jax.select_pools, **select))(*args)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids := jax.jit(
      functools.partial(ref.select_pools, **select), backend="cpu")(*host)[0]))
  assert want_ids.shape == (requests * next_n, k) and logits.shape[1] == max_pools


def test_wide_select_logits_within_bound():
  """select_pools at GLM-5's window on ordinary inputs: its logits within the documented
  bound of a float64 evaluation, its ids the reference top-k of those logits."""
  rng = np.random.default_rng(7)
  args, max_pools = _select_inputs(rng, [202000, 1500, 150000], 1, max_pools=50688)
  k = 512
  fn = jax.jit(functools.partial(glm5_jax.select_pools, k=k, max_pools=max_pools))
  _targets(fn, *args)
  ids, logits = (np.asarray(a) for a in fn(*args))
  q, w, kv, table, req, pos = (np.asarray(a) for a in args)
  n = np.minimum(np.where(pos >= 0, (pos.astype(np.int64) + 1) // 4, 0), max_pools)
  big = n > k
  want, bound = O.mqa_logits_vectorized(q[big], w[big], kv, table[req[big]], n[big],
                                        max_pools=max_pools)
  check_logits(logits[big], want, bound, n[big])
  np.testing.assert_array_equal(ids, np.asarray(_ref_topk(k)(np.where(
      big[:, None], logits, 0).astype(np.float32), n.astype(I32))))
  assert ids[1].tolist() == list(range(n[1])) + [-1] * (k - n[1])
