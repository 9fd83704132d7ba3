"""glm5_jax.plan: the table's boundaries as the stage's plan reads them, the ops' default
rows taken from it, the tactic tables, and `python -m glm5_jax.info --plan`. Abstract
arguments only: nothing is computed, any machine plans any shape."""
import os
import subprocess
import sys

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import IndexerConfig, Routing, indexer, plan, update
from glm5_jax._primitive import Op
from glm5_jax.info import plan_report, stage_args
from glm5_jax.limits import (
  TOPK_CLUSTER_MAX_ROWS,
  TOPK_CTA_POOLS,
  TOPK_MAX_POOLS,
  TOPK_PAIR_MAX_ROWS,
)
from glm5_jax.plan import SelectPath, TacticKind, UpdatePath
from glm5_jax.stage import stage_plan

U = UpdatePath
NO_UPDATE_Q = Routing(ops={"indexer_update_q": False})
NO_UPDATE_KERNELS = Routing(ops={"indexer_update_q": False, "indexer_update": False})
DEFAULT = Routing()


def _plan(rows, next_n=1, context=8192, routing=DEFAULT, kernels=True, **config):
  config = IndexerConfig(max_pools=context // 4, routing=routing, **config)
  return stage_plan(config, kernels, *stage_args(rows, next_n, context, config))


@pytest.mark.parametrize("rows,routing,want", [
    # The default: indexer_update_q up to 64 rows, update_epilogue_q to 128, then
    # update_epilogue.
    (1, Routing(), U.UPDATE_Q), (16, Routing(), U.UPDATE_Q), (17, Routing(), U.UPDATE_Q),
    (64, Routing(), U.UPDATE_Q), (65, Routing(), U.EPILOGUE_Q), (128, Routing(), U.EPILOGUE_Q),
    (129, Routing(), U.EPILOGUE),
    # Without indexer_update_q: indexer_update to 16 rows, update_epilogue_q from 17.
    (1, NO_UPDATE_Q, U.EPILOGUE), (2, NO_UPDATE_Q, U.UPDATE), (16, NO_UPDATE_Q, U.UPDATE),
    (17, NO_UPDATE_Q, U.EPILOGUE_Q), (128, NO_UPDATE_Q, U.EPILOGUE_Q),
    (129, NO_UPDATE_Q, U.EPILOGUE),
    (16, NO_UPDATE_KERNELS, U.EPILOGUE), (17, NO_UPDATE_KERNELS, U.EPILOGUE_Q),
    # A word on an op wins over its rows; every kernel off: the ops.
    (129, Routing(ops={"indexer_update_q": True}), U.UPDATE_Q),
    (65, Routing(ops={"indexer_update": True}), U.UPDATE),
    (16, Routing(kernels=False), U.OPS)])
def test_update_path_boundaries(rows, routing, want):
  assert _plan(rows, routing=routing).update is want


@pytest.mark.parametrize("update_mode,fused,routing,kernels,want", [
    ("ops", False, Routing(), True, U.OPS),
    ("auto", True, Routing(), True, U.FUSED_PROJECTION),
    ("ops", True, Routing(), True, U.FUSED_PROJECTION),
    ("fused", False, Routing(), True, U.EPILOGUE),          # M 65: past indexer_update's rows
    ("fused", False, Routing(ops={"indexer_update": True}), True, U.UPDATE),
    ("fused", False, Routing(kernels=False), True, U.EPILOGUE),
    ("auto", False, Routing(), False, U.OPS),             # the reference composition
    ("fused", False, Routing(), False, U.UPDATE)])
def test_update_modes(update_mode, fused, routing, kernels, want):
  assert _plan(65, routing=routing, kernels=kernels, update=update_mode,
               fused=fused).update is want


@pytest.mark.parametrize("rows,context,routing,kernels,want", [
    (16, 8192, Routing(), True, SelectPath.SELECT_SLOTS),
    (16, 8192, Routing(ops={"select_slots": False}), True, SelectPath.SELECT_POOLS_EXPAND),
    (16, 8192, Routing(), False, SelectPath.SELECT_POOLS_EXPAND),
    (256, 131072, Routing(), True, SelectPath.SELECT_SLOTS),   # one CTA's row at any rows
    # GLM-5's window and 1M tokens: one select_slots call up to 16 rows (the top-k's
    # clusters), up to 64 at GLM-5's window (a pair of CTAs a row), chunks past them or
    # past the top-k kernel's pools; named: one call.
    (16, 202752, Routing(), True, SelectPath.SELECT_SLOTS),
    (64, 202752, Routing(), True, SelectPath.SELECT_SLOTS),
    (65, 202752, Routing(), True, SelectPath.SELECT_POOLS_EXPAND),
    (17, 4 * 65537, Routing(), True, SelectPath.SELECT_POOLS_EXPAND),
    (128, 202752, Routing(ops={"select_slots": True}), True, SelectPath.SELECT_SLOTS),
    (1, 4 * 262144, Routing(), True, SelectPath.SELECT_SLOTS),
    (1, 4 * (262144 + 64), Routing(), True, SelectPath.SELECT_POOLS_EXPAND)])
def test_select_path(rows, context, routing, kernels, want):
  assert _plan(rows, context=context, routing=routing, kernels=kernels).select is want


def test_plan_tactics():
  """The GEMM tactics on the plan's path: indexer_update_q's projection table, the standalone
  table on the ops path, none where XLA's GEMM runs; q's where its kernel runs."""
  p = _plan(64)
  assert p.projection_tactic == (4, -1) and p.projection_tactic.kind is TacticKind.WGMMA
  assert p.q_tactic == "wgmma"
  assert _plan(1).projection_tactic == (8, 4)
  p = _plan(1, update="ops")
  assert p.projection_tactic is None and p.q_tactic is None     # M = 1: XLA's GEMV and GEMM
  assert _plan(2, update="ops").projection_tactic.kind is TacticKind.GEMV
  p = _plan(65)
  assert p.projection_tactic is None and p.q_tactic == "wgmma"
  assert _plan(129).q_tactic is None


def _first(rows):
  return jax.core.ShapedArray((rows, 128), jnp.bfloat16)


@pytest.mark.parametrize("op", sorted(plan.KERNEL_ROWS))
def test_kernel_defaults_are_the_plans_rows(op):
  """Each op with default rows takes them from plan.KERNEL_ROWS, and says so in its note;
  the others run their kernel at every M by default."""
  (low, high), _ = plan.KERNEL_ROWS[op]
  spec = Op.registry[op]
  for rows in (1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 4096):
    assert bool(spec.kernel_default(_first(rows))) is (low <= rows <= high), (op, rows)
  assert spec.kernel_default_note.startswith(f"M {low} to {high}, ")


WIDTH_DEFAULTS = ("select_pools", "select_slots")   # plan.select_kernel_default


def test_ops_without_rows_default_everywhere():
  for name, spec in Op.registry.items():
    if spec.kernel and name not in plan.KERNEL_ROWS and name not in WIDTH_DEFAULTS:
      assert spec.kernel_default_note is None, name
      assert spec.kernel_default(_first(1)) and spec.kernel_default(_first(100000)), name


@pytest.mark.parametrize("op", WIDTH_DEFAULTS)
@pytest.mark.parametrize("rows,pools,want", [
    (1, 262144, True), (16, 50688, True), (16, 65537, True), (17, 50688, True),
    (64, 65536, True), (17, 65537, False), (65, 50688, False), (4096, 32768, True),
    (65, 32769, False), (1, 262145, False)])
def test_select_defaults_follow_the_chunks(op, rows, pools, want):
  """select_pools and select_slots run their one call by default wherever the top-k takes
  the row whole (plan.topk_chunks: one chunk): one CTA's width at any rows, the cluster's
  up to TOPK_CLUSTER_MAX_ROWS rows, a pair's (two CTAs' width) up to TOPK_PAIR_MAX_ROWS."""
  spec = Op.registry[op]
  assert bool(spec.kernel_default(_first(rows), k=512, max_pools=pools)) is want
  assert (plan.topk_chunks(pools, 512, rows).chunks == 1) is want
  # The note (README, BENCHMARKS.md, glm5_jax.info) names the limits of that rule.
  note = spec.kernel_default_note
  assert "topk_chunks" in note and all(f" {n} " in f" {note} ".replace(",", " ") for n in (
      TOPK_CTA_POOLS, TOPK_MAX_POOLS, TOPK_CLUSTER_MAX_ROWS, 2 * TOPK_CTA_POOLS,
      TOPK_PAIR_MAX_ROWS)), note
  assert spec.otherwise.startswith("mqa_logits, then pool_topk over chunks")


@pytest.mark.parametrize("rows,k,gemv,want", [
    (1, 4096, True, (4, 0)), (2, 4096, True, (4, 0)), (3, 4096, True, (8, 4)),
    (32, 4096, True, (8, 4)), (33, 4096, True, (8, 8)), (1, 4096, False, (8, 4)),
    # K 9216: the GEMV (K = 256 * 4 * loads) needs 9 loads: the mma row.
    (1, 9216, True, (8, 4)),
    # K 10240: past 32 rows (8, 8) tiles it (5 blocks), up to 32 the (8, 4) row holds even
    # where it does not tile (then the op runs its reference).
    (16, 10240, True, (8, 4)), (64, 10240, True, (8, 8)),
    # K 768: (8, 8) does not tile it: the last row's.
    (64, 768, True, (8, 4))])
def test_projection_tactic_table(rows, k, gemv, want):
  got = indexer.projection_tactic(rows, k, gemv=gemv)
  assert isinstance(got, indexer.ProjectionTactic) and got == want


def test_tactic_kinds():
  """Tactics are typed: the FFI's split values map to kinds and back."""
  P = indexer.ProjectionTactic
  assert P(4, indexer.GEMV_SPLIT).kind is TacticKind.GEMV
  assert P(indexer.WGMMA_WARPS, indexer.WGMMA_SPLIT).kind is TacticKind.WGMMA
  assert P(8, 8).kind is TacticKind.MMA
  assert P.of(TacticKind.WGMMA) == (4, -1) and P.of(TacticKind.GEMV, 4) == (4, 0)
  assert P.given((8, np.int64(4))) == (8, 4) and P.given(None) is None
  assert update.update_q_projection_tactic(33, 4096) == (4, -1)
  assert update.update_q_projection_tactic(32, 4096) == (8, 4)


def test_plan_report_words():
  lines = plan_report(65, 1, 8192)
  assert "  update: EPILOGUE_Q " + f"({U.EPILOGUE_Q.value})" in lines
  assert "  select: SELECT_SLOTS " + f"({SelectPath.SELECT_SLOTS.value})" in lines
  with pytest.raises(ValueError, match="rows must be a positive multiple of next_n"):
    plan_report(3, 2, 8192)


def test_info_plan_command(monkeypatch):
  """`python -m glm5_jax.info --plan` prints the plan at the shapes given, under the routing
  of the environment; without --plan the diagnostics."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  run = lambda *args, env=None: subprocess.run(
      [sys.executable, "-m", "glm5_jax.info", *args], capture_output=True, text=True,
      check=True, env=env).stdout
  out = run("--plan", "--rows", "16", "--next-n", "2", "--context", "32768")
  assert "update: UPDATE_Q " in out and "select: SELECT_SLOTS " in out
  assert "projection tactic: mma (warps 8, split 4)" in out
  env = dict(os.environ, GLM5_JAX_KERNELS="indexer_update_q=0")
  out = run("--plan", "--rows", "16", "--update", "auto", env=env)
  assert "update: UPDATE " in out
  assert f"glm5_jax {glm5_jax.__version__}" in run()


@pytest.mark.parametrize("context,calls,xla", [
    # both parts in one call (plan.one_call)
    (8192, "glm5_indexer_update_select", "none besides fusions"),
    (202752, "glm5_indexer_update_select", "none besides fusions"),
    # past the top-k kernel's pools (limits.TOPK_MAX_POOLS): its kernel over chunks
    (4 * 300000, "glm5_indexer_update_q, glm5_mqa_logits, glm5_pool_topk, glm5_pool_topk, "
     "glm5_expand_and_remap", "none besides fusions"),
    # up to a pair's rows (TOPK_PAIR_MAX_ROWS) one call; past them chunks of one CTA's
    # width
    ((202752, 64), "glm5_indexer_update_select", "none besides fusions"),
    ((202752, 65), "glm5_update_epilogue_q, glm5_mqa_logits, glm5_pool_topk, glm5_pool_topk, "
     "glm5_expand_and_remap", "dot_general x1")])
def test_info_plan_names_what_the_lowering_runs(context, calls, xla):
  """info --plan prints the CUDA lowering's FFI calls and any XLA sort or GEMM beside them:
  a fallback to XLA code is visible."""
  from glm5_jax.info import plan_report
  context, rows = context if isinstance(context, tuple) else (context, 16)
  lines = plan_report(rows, 1, context, routing=glm5_jax.Routing())
  assert f"  CUDA lowering: {calls}" in lines and f"  XLA code: {xla}" in lines
