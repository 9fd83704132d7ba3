"""The default stage on the GPU, end to end at GLM-5.3-Flash sizes (hidden 4096, q_lora 1536,
32 heads, 64-entry pages), the default routing: at every M where the routing changes (1, 2,
16, 17, 64, 65, 128, 129, 256), next_n 1-4, max_pools 2048 to 32,768, 32,769 (past one
CTA's top-k row), 50,688 and 262,144 (GLM-5's window, 1M tokens: the top-k in a cluster)
and 262,145 (past it: the top-k over chunks), the kernels' program against
use_reference=True on the same device:
* the custom calls the compiled program runs are the ones tests/golden/stage_lowering.json
  pins for that shape (indexer_update_q, update_epilogue_q, update_epilogue, select_slots,
  or mqa_logits, pool_topk twice and expand_and_remap);
* counts equal, and >= 99% of each row's slots the reference's (near-tied pools may swap:
  q and the logits sum in other orders, SPEC D2);
* both caches within SPEC D2 (bounds.check_equivalent: keys from the projection kernel, not
  XLA's GEMM, may differ by a bf16 rounding, or near 0 by GEMM_TAIL_FLOOR of their row's
  largest magnitude; every K-cache scale byte equal).
"""
import json
import re

import numpy as np
import jax
import pytest
from bounds import GEMM_TAIL_FLOOR, check_equivalent
from test_stage_routing import GOLDEN, case_name

import glm5_jax
from glm5_jax import synthetic

from graphs import run_and_check_graphed

pytestmark = pytest.mark.gpu

STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))
SLOTS_AGREE = 0.99


def _case(rows, next_n, context, long=False):
  return pytest.param(rows, next_n, context, marks=[pytest.mark.long] if long else [],
                      id=case_name(rows, next_n, context))


# (rows, next_n, context tokens = 4 x max_pools): each a case of the golden record.
CASES = [
    _case(1, 1, 131072), _case(1, 1, 131076), _case(2, 2, 32768), _case(2, 1, 8192),
    _case(16, 4, 131072, long=True), _case(16, 1, 131076, long=True), _case(17, 1, 8192),
    _case(64, 2, 32768), _case(64, 4, 131072, long=True), _case(65, 1, 32768),
    _case(128, 4, 8192), _case(128, 2, 32768, long=True), _case(129, 1, 8192),
    _case(256, 4, 32768, long=True), _case(256, 1, 8192, long=True),
    # rows in a cluster's top-k (select_slots' one call), then past it: mqa_logits, pool_topk
    # over chunks, expand_and_remap
    _case(1, 1, 1048576, long=True), _case(16, 4, 202752, long=True),
    _case(64, 1, 202752, long=True), _case(1, 1, 1048580, long=True),
]


def _state(rows, next_n, context, seed=0):
  """(weights, cache, x, qr, batch) of rows // next_n requests at Flash sizes: request 0 at
  the longest context (every pool), request 1 (if any) short enough for the causal fill,
  the rest at random contexts of every pool phase."""
  rng = np.random.default_rng([rows, next_n, context, seed])
  config = glm5_jax.IndexerConfig(max_pools=context // 4)
  requests = rows // next_n
  weights = synthetic.layer(rng, config)
  top = context - next_n - 1
  contexts = rng.integers(2100, top, requests)
  contexts[0] = top
  if requests > 1:
    contexts[1] = 700
  cache, pt, bt = synthetic.decode_cache(rng, requests, context, next_n=next_n, page=64,
                                         spare_pages=2)
  positions = contexts[:, None] + np.arange(next_n)
  batch = synthetic.decode_batch(positions, cache, pt, bt)
  x, qr = synthetic.inputs(rng, rows)
  return config, (weights, cache, x, qr, batch)


def _golden_targets(rows, next_n, context):
  case = json.loads(GOLDEN.read_text())[case_name(rows, next_n, context)]
  return sorted(target for target, _ in case["calls"])


@pytest.mark.parametrize("rows,next_n,context", CASES)
def test_default_stage_matches_reference(rows, next_n, context):
  config, args = _state(rows, next_n, context)
  assert args[2].shape == (rows, 4096) and args[3].shape == (rows, 1536)
  compiled = STEP.lower(*args, config=config).compile()
  ran = sorted(re.findall(r'custom_call_target="(glm5_\w+)"', compiled.as_text()))
  assert ran == _golden_targets(rows, next_n, context), ran
  (out, new) = compiled(*args)
  want_out, want_new = STEP(*args, config=config, use_reference=True)
  counts, want_counts = np.asarray(out.counts), np.asarray(want_out.counts)
  np.testing.assert_array_equal(counts, want_counts, err_msg="counts")
  slots, want_slots = np.asarray(out.slots), np.asarray(want_out.slots)
  for r, c in enumerate(counts):
    agree = len(set(slots[r, :c].tolist()) & set(want_slots[r, :c].tolist()))
    assert agree >= SLOTS_AGREE * c, f"row {r}: {agree} of {c} slots agree"
    assert np.all(slots[r, c:] == -1)
  assert np.any(counts >= 2048), "no row took the top-k branch"
  check_equivalent(np.asarray(new.kv_cache), np.asarray(new.tail),
                   np.asarray(want_new.kv_cache), np.asarray(want_new.tail), GEMM_TAIL_FLOOR)
  assert np.any(np.asarray(new.kv_cache) != np.asarray(args[1].kv_cache)) or not np.any(
      np.asarray(args[4].loc) >= 0)


def test_command_buffer_check_fails_without_command_buffers(tmp_path):
  """Negative control of graphs.run_and_check_graphed: the same chained projection calls as
  test_projection_gpu's graph test, with XLA's command buffers off, must fail it."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      "x = jnp.ones((4, 4096), jnp.bfloat16); w = jnp.full((288, 4096), 0.5, jnp.bfloat16)\n"
      "def f(x, w):\n"
      "  return [glm5_jax.indexer_projection(x * (i + 1), w, heads=32)[1] for i in range(6)]\n"
      "print(float(jax.jit(f)(x, w)[-1][0, 0]))\n")
  target = glm5_jax.KERNEL_TARGETS["indexer_projection"]
  run_and_check_graphed(script, [target], tmp_path / "on")
  with pytest.raises(AssertionError):
    run_and_check_graphed(script, [target], tmp_path / "off",
                          flags="--xla_gpu_enable_command_buffer=")
