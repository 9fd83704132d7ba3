"""indexer_update as the CUDA kernel (glm5_indexer_update) on the GPU.

(a) Bit-identical to the three kernels it launches: glm5_indexer_projection (same tactic),
    glm5_indexer_query and glm5_kpool_update, each its own FFI call with the same
    arguments, give every byte of every result (key_raw, head_w, gate, q_fp8, w_out, key
    and both caches) at M = 0, 1, 2, 4, 16, 64 rows of next_n 1, 2, 4, both scale formats
    (and unrounded fp32 scales), f32 and bf16 w_out, with PDL on and off, the table's
    tactic and explicit ones.
(b) Donated, the caches are updated in place and a second step continues from them; the
    FFI call runs inside a command buffer.
(c) update_epilogue's kernel (glm5_update_epilogue: the same epilogue reading a GEMM's f32
    sums) is bit-identical to indexer_query's and kpool_update's kernels on the reference's
    split of those sums (XLA's slices and bf16 converts).
(d) update_epilogue_q's kernel (q's GEMM and that epilogue in one FFI call) is bit-identical
    to indexer_q's kernel then update_epilogue's.
(e) indexer_update_q's kernel (q's GEMM, the projection beside it, the epilogue: one FFI
    call) is bit-identical to indexer_q's kernel then indexer_update's, with x and qr made
    by the kernel just before the call (the projection reads x before its PDL wait); with
    the tail ring and indices made just before the call (the epilogue loads them before its
    wait), indexer_update_q and indexer_update are bit-identical to the ops one call each.
Its kernels against the reference: tests/test_primitives.py (CASES["indexer_update"],
inputs whose GEMM is exact in any order) and tests/test_stage.py.
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import Routing, synthetic
from glm5_testing.cases import stage_state, tree_bytes, update_state

from graphs import copied_shapes, glm5_calls, run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]

TARGET = "glm5_indexer_update"
PARTS = ["glm5_indexer_projection", "glm5_indexer_query", "glm5_kpool_update"]
HEADS, PADDED = 32, 64
# (requests, next_n): M = requests x next_n rows.
GRIDS = [(1, 1), (2, 1), (1, 2), (1, 4), (16, 1), (8, 2), (4, 4), (64, 1), (32, 2), (16, 4)]
SCALES = [("fp32", True), ("ue8m0", True), ("fp32", False)]


PARAMS = dict(heads=HEADS, scale=glm5_jax.IndexerConfig().scale, padded=PADDED)


def update_args(b, n, seed=0):
  return update_state(b, n, seed, heads=HEADS, hidden=synthetic.HIDDEN)


def three_ops(x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos, *,
              heads, scale, padded, w_out_dtype, scale_format, round_scale, tactic, routing):
  """The three public ops, each its own FFI call, as indexer_stage composes them."""
  key_raw, head_w, gate = glm5_jax.indexer_projection(x, w_cat, heads=heads, tactic=tactic,
                                                      routing=routing)
  return (key_raw, head_w, gate) + query_then_update(
      q, key_raw, head_w, gate, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos,
      scale=scale, padded=padded, w_out_dtype=w_out_dtype, scale_format=scale_format,
      round_scale=round_scale, routing=routing)


def query_then_update(q, key_raw, head_w, gate, norm_weight, norm_bias, kv_cache, tail, tslot,
                      ape, loc, pos, *, scale, padded, w_out_dtype, scale_format, round_scale,
                      routing):
  """indexer_query, then kpool_update on its key: (q_fp8, w_out, key, kv_cache, tail)."""
  q_fp8, w_out, key = glm5_jax.indexer_query(q, key_raw, head_w, norm_weight, norm_bias,
                                             scale=scale, padded=padded,
                                             w_out_dtype=w_out_dtype, routing=routing)
  grid = tslot.shape + (128,)
  kv_cache, tail = glm5_jax.kpool_update(kv_cache, tail, tslot, key.reshape(grid),
                                         gate.reshape(grid), ape, loc, pos,
                                         scale_format=scale_format, round_scale=round_scale,
                                         routing=routing)
  return q_fp8, w_out, key, kv_cache, tail


def targets(fn, args):
  return glm5_calls(jax.jit(fn).lower(*args).as_text())


def run_both(args, routing, **params):
  """(fused results, three ops' results), each from its own jit, after checking that each
  lowers to the kernels (never silently to a reference)."""
  params = dict(PARAMS, routing=routing, **params)
  fused = functools.partial(glm5_jax.indexer_update, **params)
  parts = functools.partial(three_ops, **params)
  assert targets(fused, args) == [TARGET]
  assert targets(parts, args) == PARTS
  copies = lambda: [jnp.copy(a) for a in args]     # each run its own caches
  return jax.jit(fused)(*copies()), jax.jit(parts)(*copies())


# The results' names: indexer_update's; the other ops' are slices of these with q.
NAMES = ["key_raw", "head_w", "gate", "q_fp8", "w_out", "key", "kv_cache", "tail"]
UPDATE_Q_NAMES = NAMES[:3] + ["q"] + NAMES[3:]


def assert_bits(got, want, names=NAMES):
  """Every byte of each result equal, a difference counted by the result's name."""
  for name, g, w in zip(names, tree_bytes(got), tree_bytes(want), strict=True):
    diff = g != w
    assert not diff.any(), f"{name}: {diff.sum()} of {diff.size} bytes differ"


@pytest.mark.parametrize("scale_format,round_scale", SCALES)
@pytest.mark.parametrize("b,n", GRIDS)
def test_bit_identical_to_the_three_kernels(b, n, scale_format, round_scale):
  args = update_args(b, n, seed=100 * b + n)
  got, want = run_both(args, Routing(kernels=True), w_out_dtype=jnp.float32,
                       scale_format=scale_format, round_scale=round_scale, tactic=None)
  assert_bits(got, want)
  assert np.asarray(got[6] != args[5]).any() or b * n < 4, "some pool must complete"


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("tactic", [None, (4, 2), (8, 1), (2, 8)])
@pytest.mark.parametrize("w_out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b,n", [(1, 1), (8, 2), (16, 4)])
def test_bit_identical_at_every_tactic_and_pdl(b, n, w_out_dtype, tactic, pdl):
  args = update_args(b, n, seed=7 * b + n)
  got, want = run_both(args, Routing(kernels=True, pdl=pdl), w_out_dtype=w_out_dtype,
                       scale_format="ue8m0", round_scale=True, tactic=tactic)
  assert_bits(got, want)


def test_no_rows():
  """M = 0: nothing launched, every (empty) result and the caches as the three ops leave
  them."""
  args = list(update_args(1, 1))
  for i in (0, 2, 7, 9, 10):                     # x, q, tslot, loc, pos: no rows
    args[i] = args[i][:0]
  got, want = run_both(tuple(args), Routing(kernels=True), w_out_dtype=jnp.float32,
                       scale_format="fp32", round_scale=True, tactic=None)
  assert_bits(got, want)


def test_donated_step_updates_in_place_and_continues():
  """Two donated steps (the rows of step 2 at the next positions): the caches stay in the
  operands' buffers (no copy in the compiled program) and equal the three kernels' run."""
  b, n = 8, 2
  config = glm5_jax.IndexerConfig(heads=HEADS, max_pools=1024)
  rng = np.random.default_rng(5)
  contexts = list(rng.integers(3, 900, b))
  weights, cache, x, _, batch = stage_state(contexts, 2 * n, 5, config=config,
                                            hidden=synthetic.HIDDEN, q_lora=256)
  q = jnp.asarray(rng.standard_normal((b * n, HEADS, 128)), jnp.bfloat16)
  # Step s: rows s*n .. s*n + n - 1 of each request.
  steps = [tuple(a[:, s * n:(s + 1) * n] for a in (batch.tslot, batch.loc, batch.positions))
           for s in range(2)]
  xs = x.reshape(b, 2 * n, -1)
  step_x = [xs[:, s * n:(s + 1) * n].reshape(b * n, -1) for s in range(2)]
  params = dict(PARAMS, w_out_dtype=jnp.float32, scale_format="fp32", round_scale=True,
                tactic=None, routing=Routing(kernels=True))
  fused = jax.jit(functools.partial(glm5_jax.indexer_update, **params), donate_argnums=(5, 6))
  parts = jax.jit(functools.partial(three_ops, **params))
  w = (weights.w_cat, q, weights.norm_weight, weights.norm_bias)
  kv, tail = jnp.copy(cache.kv_cache), jnp.copy(cache.tail)
  rkv, rtail = jnp.copy(cache.kv_cache), jnp.copy(cache.tail)
  ptrs = (kv.unsafe_buffer_pointer(), tail.unsafe_buffer_pointer())
  hlo = fused.lower(step_x[0], *w, kv, tail, steps[0][0], weights.ape, *steps[0][1:]
                    ).compile().as_text()
  assert not copied_shapes(hlo, [kv.shape, tail.shape])
  for s, (tslot, loc, pos) in enumerate(steps):
    outs = fused(step_x[s], *w, kv, tail, tslot, weights.ape, loc, pos)
    assert kv.is_deleted() and tail.is_deleted()
    kv, tail = outs[6], outs[7]
    assert (kv.unsafe_buffer_pointer(), tail.unsafe_buffer_pointer()) == ptrs
    rkv, rtail = parts(step_x[s], *w, rkv, rtail, tslot, weights.ape, loc, pos)[6:]
  for g, r in zip(tree_bytes((kv, tail)), tree_bytes((rkv, rtail)), strict=True):
    np.testing.assert_array_equal(g, r)


def test_kernel_runs_inside_a_command_buffer(tmp_path):
  """With XLA's default flags the chained FFI calls are captured in a CUDA graph."""
  script = (
      "import jax, jax.numpy as jnp, numpy as np, glm5_jax\n"
      "m, k, h = 2, 4096, 32\n"
      "x = jnp.ones((m, k), jnp.bfloat16); w = jnp.full((256 + h, k), 0.01, jnp.bfloat16)\n"
      "q = jnp.ones((m, h, 128), jnp.bfloat16); nw = jnp.ones(128, jnp.float32)\n"
      "nb = jnp.zeros(128, jnp.float32); ape = jnp.zeros((4, 128), jnp.float32)\n"
      "kv = jnp.zeros((2, 8, 132), jnp.uint8); tail = jnp.ones((2, 2, 4, 128), jnp.bfloat16)\n"
      "pos = jnp.array([[3], [7]], jnp.int32); ts = jnp.array([[3], [7]], jnp.int32)\n"
      "loc = jnp.array([[0], [1]], jnp.int32)\n"
      "def f(kv, tail):\n"
      "  for i in range(6):\n"
      "    *_, kv, tail = glm5_jax.indexer_update(x * (i + 1), w, q, nw, nb, kv, tail, ts,\n"
      "        ape, loc + 2 * i, pos, heads=h, scale=0.01, padded=64)\n"
      "  return kv, tail\n"
      "kv, tail = jax.jit(f)(kv, tail)\n"
      "print(int((kv != 0).any()))\n")
  out = run_and_check_graphed(script, [TARGET], tmp_path)
  assert out.split()[-1] == "1", out


def two_ops(raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos, *, scale,
            padded, w_out_dtype, scale_format, round_scale, routing):
  """update_epilogue as the stage's update path ran it before: the projection sums split
  (XLA's slices and converts), then indexer_query and kpool_update, each its own FFI call."""
  key_raw, head_w, gate = glm5_jax.reference.split_projection(raw, q.shape[1])
  return query_then_update(q, key_raw, head_w, gate, norm_weight, norm_bias, kv_cache, tail,
                           tslot, ape, loc, pos, scale=scale, padded=padded,
                           w_out_dtype=w_out_dtype, scale_format=scale_format,
                           round_scale=round_scale, routing=routing)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("w_out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale_format,round_scale", SCALES)
# M = 129-256 route to update_epilogue by default (tests/golden/stage_lowering.json): up to
# 256 rows, across 128 | 129.
@pytest.mark.parametrize("b,n", [(1, 1), (2, 1), (1, 4), (16, 1), (4, 4), (64, 1), (16, 4),
                                 (128, 1), (129, 1), (64, 4)])
def test_epilogue_bit_identical_to_the_two_kernels(b, n, scale_format, round_scale,
                                                   w_out_dtype, pdl):
  args = update_args(b, n, seed=31 * b + n)
  raw = jax.jit(glm5_jax.reference.projection_sums)(args[0], args[1])
  rest = args[2:]
  routing = Routing(kernels=True, pdl=pdl)
  params = dict(scale=PARAMS["scale"], padded=PADDED, w_out_dtype=w_out_dtype,
                scale_format=scale_format, round_scale=round_scale, routing=routing)
  fused = functools.partial(glm5_jax.update_epilogue, **params)
  parts = functools.partial(two_ops, **params)
  assert targets(fused, (raw,) + rest) == ["glm5_update_epilogue"]
  assert targets(parts, (raw,) + rest) == ["glm5_indexer_query", "glm5_kpool_update"]
  copies = lambda: [raw] + [jnp.copy(a) for a in rest]
  got, want = jax.jit(fused)(*copies()), jax.jit(parts)(*copies())
  assert_bits(got, want, NAMES[3:])
  assert np.asarray(got[3] != rest[3]).any() or b * n < 4, "some pool must complete"


# (d) update_epilogue_q: indexer_q's GEMM and update_epilogue's kernel in one FFI call.
Q_LORA = 1536                  # GLM-5.3-Flash's q_lora: K of the q GEMM
Q_GRIDS = [(1, 1), (2, 1), (1, 4), (16, 1), (4, 4), (64, 1), (16, 4), (35, 2), (64, 2)]


def q_then_epilogue(raw, qr, wq_b, *rest, tactic, routing, **params):
  """update_epilogue_q as two FFI calls: indexer_q's kernel (the same tactic), then
  update_epilogue's kernel on its q seen as [M, H, 128]."""
  q = glm5_jax.indexer_q(qr, wq_b, tactic=tactic, routing=routing)
  return (q,) + glm5_jax.update_epilogue(raw, q.reshape(q.shape[0], HEADS, 128), *rest,
                                         routing=routing, **params)


def q_epilogue_args(b, n, seed):
  """update_epilogue_q's operands at the stage's shapes: XLA's projection sums, random qr
  and wq_b (K = Q_LORA, scaled so that q is O(1)), the decode cache of update_args."""
  x, w_cat, _, *rest = update_args(b, n, seed=seed)
  rng = np.random.default_rng(seed)
  raw = jax.jit(glm5_jax.reference.projection_sums)(x, w_cat)
  qr = jnp.asarray(rng.standard_normal((b * n, Q_LORA)), jnp.bfloat16)
  wq_b = jnp.asarray(rng.standard_normal((HEADS * 128, Q_LORA)) * Q_LORA ** -0.5, jnp.bfloat16)
  return (raw, qr, wq_b, *rest)


def assert_one_call_is_two(one, two, calls, args, names):
  """one (one FFI call) and two (the FFI calls `calls`, in order) lower to those calls and
  give the same bytes of every result, each jit on caches of its own. Returns one's."""
  assert targets(one, args) == [calls[0]]
  assert targets(two, args) == calls[1:]
  copies = lambda: [jnp.copy(a) for a in args]
  got, want = jax.jit(one)(*copies()), jax.jit(two)(*copies())
  assert_bits(got, want, names)
  return got


def assert_q_epilogue_bits(args, routing, **params):
  params = dict(scale=PARAMS["scale"], padded=PADDED, routing=routing, **params)
  return assert_one_call_is_two(
      functools.partial(glm5_jax.update_epilogue_q, **params),
      functools.partial(q_then_epilogue, **params),
      ["glm5_update_epilogue_q", "glm5_indexer_q", "glm5_update_epilogue"], args,
      UPDATE_Q_NAMES[3:])


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("tactic", [None, "mma"])
@pytest.mark.parametrize("scale_format,round_scale,w_out_dtype",
                         [("fp32", True, jnp.float32), ("ue8m0", True, jnp.bfloat16),
                          ("fp32", False, jnp.float32)])
@pytest.mark.parametrize("b,n", Q_GRIDS)
def test_q_epilogue_bit_identical_to_q_then_epilogue(b, n, scale_format, round_scale,
                                                     w_out_dtype, tactic, pdl):
  """Every byte of every result (q, q_fp8, w_out, key, both caches) as indexer_q's kernel
  then update_epilogue's, each its own FFI call: M = 1..128 (one and two grid rows of the
  wgmma tactic), both tactics, both scale formats, f32 and bf16 w_out, PDL on and off."""
  args = q_epilogue_args(b, n, seed=13 * b + n)
  got = assert_q_epilogue_bits(args, Routing(kernels=True, pdl=pdl), tactic=tactic,
                               w_out_dtype=w_out_dtype, scale_format=scale_format,
                               round_scale=round_scale)
  assert np.asarray(got[4] != args[5]).any() or b * n < 4, "some pool must complete"
  q = np.asarray(got[0], np.float32)
  assert np.abs(q).max() > 0.5, "q must carry the GEMM's values"


def test_q_epilogue_no_rows():
  """M = 0: nothing launched, the (empty) results and the caches as the two ops leave them."""
  args = list(q_epilogue_args(1, 1, seed=3))
  for i in (0, 1, 7, 9, 10):                     # raw, qr, tslot, loc, pos: no rows
    args[i] = args[i][:0]
  assert_q_epilogue_bits(tuple(args), Routing(kernels=True), tactic=None,
                         w_out_dtype=jnp.float32, scale_format="fp32", round_scale=True)


# (e) indexer_update_q: q's GEMM, the projection beside it and the epilogue in one FFI call.
def with_fresh_inputs(fn):
  """fn with x and qr made by one XLA kernel just before the call (each + tail[0] * 0.0: the
  multiply by 0.0 is not simplified away), as a model's layer makes them: the projection
  inside indexer_update_q reads x before its PDL wait (cc/projection.cuh, inputs_ready)."""
  def fresh(x, w_cat, qr, *rest):
    tail = rest[4]                  # after wq_b, norm_weight, norm_bias, kv_cache
    dep = (tail.reshape(-1)[0].astype(jnp.float32) * 0.0).astype(qr.dtype)
    return fn(x + dep, w_cat, qr + dep, *rest)
  return fresh


def q_then_update(x, w_cat, qr, wq_b, *rest, tactic, q_tactic, routing,
                  update=glm5_jax.indexer_update, **params):
  """indexer_update_q as two FFI calls: indexer_q's kernel (q_tactic), then indexer_update's
  (the projection's tactic indexer_update_q takes) on its q seen as [M, H, 128]; or with
  update=three_ops the projection's, query's and kpool_update's calls in its place."""
  tactic = glm5_jax.update.update_q_projection_tactic(x.shape[0], x.shape[1], tactic)
  q = glm5_jax.indexer_q(qr, wq_b, tactic=q_tactic, routing=routing)
  out = update(x, w_cat, q.reshape(q.shape[0], HEADS, 128), *rest, heads=HEADS,
               tactic=tactic, routing=routing, **params)
  return out[:3] + (q,) + out[3:]


def update_q_args(b, n, seed):
  """indexer_update_q's operands at the stage's shapes: update_args with random qr and wq_b
  (K = Q_LORA, scaled so that q is O(1)) for q."""
  x, w_cat, _, *rest = update_args(b, n, seed=seed)
  rng = np.random.default_rng(seed)
  qr = jnp.asarray(rng.standard_normal((b * n, Q_LORA)), jnp.bfloat16)
  wq_b = jnp.asarray(rng.standard_normal((HEADS * 128, Q_LORA)) * Q_LORA ** -0.5, jnp.bfloat16)
  return (x, w_cat, qr, wq_b, *rest)


def assert_update_q_bits(args, routing, **params):
  params = dict(scale=PARAMS["scale"], padded=PADDED, routing=routing, **params)
  return assert_one_call_is_two(
      with_fresh_inputs(functools.partial(glm5_jax.indexer_update_q, **params)),
      with_fresh_inputs(functools.partial(q_then_update, **params)),
      ["glm5_indexer_update_q", "glm5_indexer_q", TARGET], args, UPDATE_Q_NAMES)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("q_tactic", [None, "mma"])
@pytest.mark.parametrize("scale_format,round_scale,w_out_dtype",
                         [("fp32", True, jnp.float32), ("ue8m0", True, jnp.bfloat16),
                          ("fp32", False, jnp.float32)])
@pytest.mark.parametrize("b,n", Q_GRIDS)
def test_update_q_bit_identical_to_q_then_update(b, n, scale_format, round_scale, w_out_dtype,
                                                 q_tactic, pdl):
  """Every byte of every result (key_raw, head_w, gate, q, q_fp8, w_out, key, both caches)
  as indexer_q's kernel then indexer_update's, each its own FFI call: M = 1..128 (one and two
  grid rows of the wgmma tactic; the projection's table of tactics by M), both q tactics,
  both scale formats, f32 and bf16 w_out, PDL on and off."""
  args = update_q_args(b, n, seed=17 * b + n)
  got = assert_update_q_bits(args, Routing(kernels=True, pdl=pdl), tactic=None,
                             q_tactic=q_tactic, w_out_dtype=w_out_dtype,
                             scale_format=scale_format, round_scale=round_scale)
  assert np.asarray(got[7] != args[6]).any() or b * n < 4, "some pool must complete"
  assert np.abs(np.asarray(got[3], np.float32)).max() > 0.5, "q must carry the GEMM's values"


@pytest.mark.parametrize("tactic", [(4, 2), (8, 1), (2, 8),
                                    (glm5_jax.indexer.WGMMA_WARPS, glm5_jax.indexer.WGMMA_SPLIT)])
def test_update_q_explicit_projection_tactics(tactic):
  """The projection's explicit tactics (other grids and clusters beside q's GEMM; the wgmma
  tactic's TMA ring and clusters of eight)."""
  assert_update_q_bits(update_q_args(8, 2, seed=5), Routing(kernels=True), tactic=tactic,
                       q_tactic=None, w_out_dtype=jnp.float32, scale_format="fp32",
                       round_scale=True)


def test_update_q_no_rows():
  """M = 0: nothing launched, the (empty) results and the caches as the two ops leave them."""
  args = list(update_q_args(1, 1, seed=3))
  for i in (0, 2, 8, 10, 11):                     # x, qr, tslot, loc, pos: no rows
    args[i] = args[i][:0]
  assert_update_q_bits(tuple(args), Routing(kernels=True), tactic=None, q_tactic=None,
                       w_out_dtype=jnp.float32, scale_format="fp32", round_scale=True)


def with_fresh_operands(fn, tail_at):
  """fn with the tail ring doubled and tslot, loc and pos rewritten by XLA kernels just
  before the call (each from x[0] * 0.0, which is not simplified away): the epilogue of
  indexer_update and indexer_update_q loads those before its PDL wait (cc/kpool.cu,
  update_epilogue_kernel's `early`), so a load that ran ahead of their writers would read
  the buffers' old bytes. tail_at: the tail's position (tslot, ape, loc, pos follow)."""
  def fresh(*args):
    args = list(args)
    zero = args[0].reshape(-1)[0].astype(jnp.float32) * 0.0
    tail = args[tail_at]
    args[tail_at] = (tail.astype(jnp.float32) * 2.0 + zero).astype(tail.dtype)
    for i in (tail_at + 1, tail_at + 3, tail_at + 4):        # tslot, loc, pos
      args[i] = args[i] + zero.astype(jnp.int32)
    return fn(*args)
  return fresh


@pytest.mark.parametrize("b", [1, 16, 64])
def test_epilogue_early_loads_see_operands_made_just_before(b):
  """indexer_update_q and indexer_update on a tail ring and indices that XLA writes just
  before the call, against the ops one FFI call each (kpool_update's kernel reads them after
  its wait): every byte, at one token a request (the path that loads them early)."""
  params = dict(scale=PARAMS["scale"], padded=PADDED, routing=Routing(kernels=True),
                tactic=None, w_out_dtype=jnp.float32, scale_format="fp32", round_scale=True)
  args = update_q_args(b, 1, seed=31 + b)
  got = assert_one_call_is_two(
      with_fresh_operands(functools.partial(glm5_jax.indexer_update_q, q_tactic=None,
                                            **params), 7),
      # Four FFI calls, each reading its operands after its PDL wait.
      with_fresh_operands(functools.partial(q_then_update, update=three_ops, q_tactic=None,
                                            **params), 7),
      ["glm5_indexer_update_q", "glm5_indexer_q"] + PARTS, args, UPDATE_Q_NAMES)
  assert np.asarray(got[7] != args[6]).any() or b < 4, "some pool must complete"
  args = update_args(b, 1, seed=37 + b)
  assert_one_call_is_two(
      with_fresh_operands(functools.partial(glm5_jax.indexer_update, heads=HEADS, **params), 6),
      with_fresh_operands(functools.partial(three_ops, heads=HEADS, **params), 6),
      [TARGET] + PARTS, args, NAMES)


def test_update_q_chained_steps_in_a_command_buffer():
  """Four calls of indexer_update_q in one jit (the same rows each time), each call's x and
  qr made from the call before's head_w and q (so that both GEMMs read what the kernels just
  before them wrote), against the same calls as indexer_q + indexer_update: every byte of
  the last call's results and caches."""
  x, w_cat, qr, wq_b, *rest = update_q_args(16, 1, seed=9)
  params = dict(scale=PARAMS["scale"], padded=PADDED, routing=Routing(kernels=True),
                tactic=None, q_tactic=None, w_out_dtype=jnp.float32, scale_format="fp32",
                round_scale=True)

  def steps(fn, x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, *ids):
    for _ in range(4):
      out = fn(x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, *ids, **params)
      kv_cache, tail = out[7], out[8]
      qr = (out[3][:, :qr.shape[1]].astype(jnp.float32) * 0.5 + qr.astype(jnp.float32) * 0.5
            ).astype(qr.dtype)
      x = (x.astype(jnp.float32) + out[1][:, :1]).astype(x.dtype)     # + head_w's column 0
    return out
  args = (x, w_cat, qr, wq_b, *rest)
  copies = lambda: [jnp.copy(a) for a in args]
  got = jax.jit(functools.partial(steps, glm5_jax.indexer_update_q))(*copies())
  want = jax.jit(functools.partial(steps, q_then_update))(*copies())
  assert_bits(got, want, UPDATE_Q_NAMES)
