"""indexer_update and update_epilogue on any machine: indexer_update's reference is the
three ops' references composed (as indexer_stage composed them before the op existed) and
update_epilogue's their last two on the GEMM's sums, the caches are updated in place under
donation, and the routing picks XLA's GEMM + update_epilogue by default, in the op and in
the stage (IndexerConfig(update="auto")). The kernels against the three kernels:
tests/test_update_gpu.py."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import Routing, indexer, plan, update
from glm5_jax import reference as ref
from glm5_testing.cases import stage_state, tree_bytes, update_state
from glm5_testing.tiers import diagonal

from graphs import copied_shapes, cuda_module, glm5_calls

HEADS, HIDDEN = 32, 1024    # a hidden size the projection kernel tiles at every M


def update_args(b, n, seed=0):
  return update_state(b, n, seed, heads=HEADS, hidden=HIDDEN)


def three_references(x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                     positions, *, heads, scale, eps, padded, w_out_dtype, scale_format,
                     round_scale):
  """The three references, each jitted on its own, composed as indexer_stage did."""
  key_raw, head_w, gate = jax.jit(functools.partial(ref.indexer_projection, heads=heads))(
      x, w_cat)
  query = jax.jit(functools.partial(ref.indexer_query, scale=scale, eps=eps, padded=padded,
                                    w_out_dtype=w_out_dtype))
  q_fp8, w_out, key = query(q, key_raw, head_w, norm_weight, norm_bias)
  grid = tslot.shape + (128,)
  update = jax.jit(functools.partial(ref.kpool_update, scale_format=scale_format,
                                     round_scale=round_scale))
  kv_cache, tail = update(kv_cache, tail, tslot, key.reshape(grid), gate.reshape(grid), ape,
                          loc, positions)
  return key_raw, head_w, gate, q_fp8, w_out, key, kv_cache, tail


PARAMS = dict(heads=HEADS, scale=0.01, eps=1e-6, padded=64, w_out_dtype=jnp.float32)
# (scale_format, round_scale, w_out_dtype) of the composition tests.
FORMATS = [("fp32", True, jnp.float32), ("ue8m0", True, jnp.bfloat16), ("fp32", False, jnp.float32)]


@pytest.mark.parametrize("b,n,scale_format,round_scale,w_out_dtype", diagonal(
    [(1, 1), (4, 1), (3, 2), (2, 4)], FORMATS))
def test_reference_is_the_three_references_composed(b, n, scale_format, round_scale,
                                                    w_out_dtype):
  """Every result byte of reference.indexer_update (and of the op, its reference there)
  equals the three references run one after the other. On the CPU backend: on the H200
  (jax 0.11.2) the one program and the three differed at M = 1 and 4, where XLA compiles
  the GEMMs of a fused program in other ways (other rounding, within SPEC D2); the GPU's
  kernel against the reference: tests/test_primitives.py."""
  with jax.default_device(jax.devices("cpu")[0]):
    _composed_on_this_device(b, n, scale_format, round_scale, w_out_dtype)


def _composed_on_this_device(b, n, scale_format, round_scale, w_out_dtype):
  args = update_args(b, n, seed=b * 10 + n)
  params = dict(PARAMS, w_out_dtype=w_out_dtype, scale_format=scale_format,
                round_scale=round_scale)
  want = three_references(*args, **params)
  got = jax.jit(functools.partial(ref.indexer_update, **params))(*args)
  for g, w in zip(tree_bytes(got), tree_bytes(want), strict=True):
    np.testing.assert_array_equal(g, w)
  op = jax.jit(functools.partial(glm5_jax.indexer_update, **params))(*args)
  for g, w in zip(tree_bytes(op), tree_bytes(want), strict=True):
    np.testing.assert_array_equal(g, w)
  assert np.asarray(want[6] != args[5]).any(), "some pool must complete"


def test_donated_caches_are_updated_in_place():
  """Donated, the op writes its caches into the operands' buffers: no copy of the K cache
  in the compiled program (on the CPU the tail's bf16 <-> u16 bitcasts copy it, as for
  kpool_update); without donation the check sees the copy (negative control)."""
  args = update_args(3, 2)
  fn = functools.partial(glm5_jax.indexer_update, **PARAMS)
  donated = jax.jit(fn, donate_argnums=(5, 6))
  kv, tail = args[5].shape, args[6].shape
  copies = copied_shapes(donated.lower(*args).compile().as_text(), [kv, tail])
  assert kv not in copies, copies
  assert kv in copied_shapes(jax.jit(fn).lower(*args).compile().as_text(), [kv])
  fresh = list(args)
  fresh[5] = jnp.copy(args[5])
  before = fresh[5].unsafe_buffer_pointer()
  outs = donated(*fresh)
  assert fresh[5].is_deleted()
  assert outs[6].unsafe_buffer_pointer() == before


def cuda_calls(fn, args, donate=()):
  """The glm5_ FFI targets the CUDA lowering of fn calls, in order."""
  return glm5_calls(cuda_module(fn, args, donate))


def test_update_q_projection_tactic_table():
  """indexer_update_q's projection by M (plan.UPDATE_Q_TACTICS): the standalone table
  without the GEMV up to 32 rows (indexer_update's tactic there, so the stage's update modes
  sum the projection in one order), the wgmma tactic past 32 where it tiles K, else the
  table again; an explicit tactic as given (the old (warps, split) tuples), typed."""
  wgmma = (indexer.WGMMA_WARPS, indexer.WGMMA_SPLIT)
  assert plan.UPDATE_Q_TACTICS == (
      plan.TacticRow(plan.Rows(33, None), plan.TacticKind.WGMMA),
      plan.TacticRow(plan.Rows(1, None), None)) and wgmma == (4, -1)
  assert update.update_q_projection_tactic(64, 4096).kind is plan.TacticKind.WGMMA
  assert update.update_q_projection_tactic(1, 4096).kind is plan.TacticKind.MMA
  assert update.update_q_projection_tactic(1, 4096, (4, 0)).kind is plan.TacticKind.GEMV
  assert isinstance(update.update_q_projection_tactic(1, 4096, (4, 0)),
                    indexer.ProjectionTactic)
  for rows in (1, 2, 16, 32):
    assert update.update_q_projection_tactic(rows, 4096) == indexer.projection_tactic(
        rows, 4096, gemv=False) == (8, 4), rows
  for rows in (33, 64, 128):
    # K = 512 * boxes: 1, 8 and 12 boxes of each CTA's eighth of K.
    for k in (512, 4096, 6144):
      assert update.update_q_projection_tactic(rows, k) == wgmma, (rows, k)
    # K = 768: not a multiple of WGMMA_K = 512; the table's entry.
    assert update.update_q_projection_tactic(rows, 768) == indexer.projection_tactic(
        rows, 768, gemv=False) == (8, 4), rows
  assert update.update_q_projection_tactic(64, 4096, (8, 8)) == (8, 8)
  assert update.update_q_projection_tactic(1, 4096, (4, 0)) == (4, 0)


@pytest.mark.slow
def test_default_routing_and_the_stage_switch(monkeypatch):
  """Default routing: indexer_update runs its own kernel at its plan.KERNEL_ROWS, XLA's
  GEMM and update_epilogue's kernel at other M, its kernel at every M where the routing
  names it, the reference composition with both kernels off; the stage's update part
  follows IndexerConfig.update and plan.AUTO_UPDATE (the first of indexer_update_q,
  indexer_update, update_epilogue_q, update_epilogue whose kernel the routing chooses,
  else the ops; indexer_update_q's in one call with the select path); q by indexer_q where
  the call does not hold q's GEMM; the reference composition runs no kernel."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  assert {op: tuple(rows) for op, (rows, _) in plan.KERNEL_ROWS.items()} == {
      "indexer_update": (2, 16), "update_epilogue_q": (17, 128), "indexer_q": (2, 128),
      "indexer_update_q": (1, 64), "indexer_projection": (2, 64)}
  fused = Routing(ops={"indexer_update": True, "indexer_update_q": False})
  no_update_kernel = Routing(ops={"indexer_update": False, "indexer_update_q": False})
  no_update_q = Routing(ops={"indexer_update_q": False})
  no_epilogue = Routing(ops={"update_epilogue": False, "indexer_update": False,
                             "update_epilogue_q": False, "indexer_update_q": False})
  q_inside = Routing(ops={"update_epilogue_q": True, "indexer_update": False,
                          "indexer_update_q": False})
  update_q = Routing(ops={"indexer_update_q": True})
  fused_q_inside = Routing(ops={"indexer_update": True, "update_epilogue_q": True,
                                "indexer_update_q": False})
  fn = functools.partial(glm5_jax.indexer_update, **PARAMS)
  for rows, default in ((1, "glm5_update_epilogue"), (2, "glm5_indexer_update"),
                        (16, "glm5_indexer_update"), (17, "glm5_update_epilogue"),
                        (64, "glm5_update_epilogue")):
    args = update_args(rows, 1)
    assert cuda_calls(fn, args) == [default], rows
    assert plan.chooses_kernel(glm5_jax.indexer_update, *args, routing=Routing(),
                               **PARAMS) == (default == "glm5_indexer_update"), rows
    assert cuda_calls(functools.partial(fn, routing=fused), args) == [
        "glm5_indexer_update"], rows
    assert plan.chooses_kernel(glm5_jax.indexer_update, *args, routing=fused, **PARAMS), rows
    assert cuda_calls(functools.partial(fn, routing=no_epilogue), args) == [], rows
  config = dict(heads=HEADS, max_pools=1024)
  kernels = ("glm5_indexer_q", "glm5_indexer_update", "glm5_update_epilogue",
             "glm5_update_epilogue_q", "glm5_indexer_update_q", "glm5_indexer_update_select",
             "glm5_indexer_query", "glm5_kpool_update")
  q = ["glm5_indexer_q"]
  one, epilogue, ops, q_epilogue = q + ["glm5_indexer_update"], ["glm5_update_epilogue"], q + [
      "glm5_indexer_query", "glm5_kpool_update"], ["glm5_update_epilogue_q"]
  # (requests, routing, update) -> the update kernels the stage calls.
  outs = {}
  # indexer_update_q's kernels, inside indexer_update_select's one call with the select
  # path (plan.one_call: select_slots' kernel runs at these shapes)
  whole = ["glm5_indexer_update_select"]
  for b, routing, mode, want in ((1, Routing(), "auto", whole),
                                 (1, no_update_q, "auto", epilogue),
                                 (3, Routing(), "auto", whole),
                                 (3, no_update_q, "auto", one),
                                 (2, Routing(), "auto", whole),
                                 (32, Routing(), "auto", whole),
                                 (64, Routing(), "auto", whole),
                                 (65, Routing(), "auto", q_epilogue),
                                 (3, no_update_kernel, "auto", q + epilogue),
                                 (3, fused, "auto", one), (3, no_epilogue, "auto", ops),
                                 (3, Routing(), "ops", ops), (3, Routing(), "fused", one),
                                 (3, no_update_kernel, "fused", q + epilogue),
                                 (3, fused, "fused", one),
                                 (1, fused, "auto", ["glm5_indexer_update"]),
                                 (3, q_inside, "auto", q_epilogue),
                                 (17, q_inside, "auto", q_epilogue),
                                 (3, q_inside, "ops", ops), (3, fused_q_inside, "auto", one),
                                 (1, update_q, "auto", whole), (3, update_q, "auto", whole),
                                 (64, update_q, "auto", whole),
                                 (3, update_q, "ops", ops)):
    contexts = ([10, 1500, 77] * b)[:b]
    state = stage_state(contexts, 1, 0, config=glm5_jax.IndexerConfig(**config),
                        hidden=HIDDEN, q_lora=256)
    step = functools.partial(glm5_jax.indexer_stage, config=glm5_jax.IndexerConfig(
        update=mode, routing=routing, **config))
    calls = cuda_calls(step, state, donate=(1,))
    assert [c for c in calls if c in kernels] == want, (b, routing, mode, calls)
    if b == 3 and mode != "fused":
      # The CPU backend runs every op's reference: the compositions agree byte for byte.
      with jax.default_device(jax.devices("cpu")[0]):
        outs[routing, mode] = tree_bytes(jax.jit(step)(*state))
  first, *others = outs.values()
  for other in others:
    for g, w in zip(other, first, strict=True):
      np.testing.assert_array_equal(g, w)
  reference = functools.partial(glm5_jax.indexer_stage, config=glm5_jax.IndexerConfig(
      **config), use_reference=True)
  assert cuda_calls(reference, state, donate=(1,)) == []


EPILOGUE = {k: v for k, v in PARAMS.items() if k != "heads"}


@pytest.mark.parametrize("b,n,scale_format,round_scale,w_out_dtype", diagonal(
    [(1, 1), (3, 2), (2, 4)], FORMATS))
def test_epilogue_reference_is_the_two_references_on_the_gemm_sums(b, n, scale_format,
                                                                   round_scale, w_out_dtype):
  """update_epilogue (reference and op) on projection_sums(x, w_cat) gives every byte of
  indexer_update's last five results (the three references composed); on the CPU
  backend, as the test above."""
  with jax.default_device(jax.devices("cpu")[0]):
    args = update_args(b, n, seed=b * 10 + n)
    params = dict(EPILOGUE, w_out_dtype=w_out_dtype, scale_format=scale_format,
                  round_scale=round_scale)
    want = three_references(*args, heads=HEADS, **params)[3:]
    raw = jax.jit(ref.projection_sums)(args[0], args[1])
    assert raw.shape == (b * n, 256 + HEADS) and raw.dtype == jnp.float32
    for fn in (ref.update_epilogue, glm5_jax.update_epilogue):
      got = jax.jit(functools.partial(fn, **params))(raw, *args[2:])
      for g, w in zip(tree_bytes(got), tree_bytes(want), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("b,n,scale_format,round_scale,w_out_dtype", diagonal(
    [(1, 1), (3, 2)], FORMATS[:2]))
def test_update_q_reference_is_q_then_the_three_references(b, n, scale_format, round_scale,
                                                            w_out_dtype):
  """indexer_update_q (reference and op) gives every byte of indexer_q's reference, then
  the three references on its q seen as [M, H, 128]; on the CPU backend, as above."""
  with jax.default_device(jax.devices("cpu")[0]):
    x, w_cat, _, *rest = update_args(b, n, seed=b * 10 + n)
    rng = np.random.default_rng(b + n)
    qr = jnp.asarray(rng.standard_normal((b * n, 256)), jnp.bfloat16)
    wq_b = jnp.asarray(rng.standard_normal((HEADS * 128, 256)) / 16, jnp.bfloat16)
    params = dict(EPILOGUE, w_out_dtype=w_out_dtype, scale_format=scale_format,
                  round_scale=round_scale)
    q = jax.jit(ref.indexer_q)(qr, wq_b)
    want = three_references(x, w_cat, q.reshape(b * n, HEADS, 128), *rest, heads=HEADS,
                            **params)
    want = want[:3] + (q,) + want[3:]
    for fn in (ref.indexer_update_q, glm5_jax.indexer_update_q):
      got = jax.jit(functools.partial(fn, **params))(x, w_cat, qr, wq_b, *rest)
      assert len(got) == 9
      for g, w in zip(tree_bytes(got), tree_bytes(want), strict=True):
        np.testing.assert_array_equal(g, w)
