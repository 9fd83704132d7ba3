"""The plan: which path and tactic runs at which shapes, declared once.

The tables below are the only place a row range or a tactic choice is written. The ops
take their default kernel rows (Op.kernel_default) and their tactic tables from them, and
glm5_jax.stage.stage_plan reads them, once per trace of indexer_stage, into a `StagePlan`
that the stage executes as it is.
`python -m glm5_jax.info --plan --rows M --next-n N --context C` prints it for those shapes.

A default's reason names the BENCHMARKS.json rows (op, variant) that decided it.
"""
import dataclasses
import enum
import functools
from typing import NamedTuple

import jax

from ._primitive import Op, Routing
from .limits import (
  LOGITS_ITEM_POOLS,
  TOPK_CLUSTER_MAX_ROWS,
  TOPK_CTA_POOLS,
  TOPK_MAX_POOLS,
  TOPK_PAIR_MAX_ROWS,
)


class Rows(NamedTuple):
  """M from `low` to `high`, both included (high None: no upper bound)."""
  low: int
  high: int | None

  def __contains__(self, rows: int) -> bool:
    return self.low <= rows and (self.high is None or rows <= self.high)

  def __str__(self) -> str:
    return f"M {self.low}+" if self.high is None else f"M {self.low} to {self.high}"


class Default(NamedTuple):
  """Where an op's kernel runs when the routing does not name the op, and why."""
  rows: Rows
  why: str


_UPDATE_PART = ('stage rows "kernel, update part only[, indexer_update_q][, barrier chain]" '
                "against each other")

# Each op whose kernel runs by default only at some rows: those rows (M = the op's first
# operand's dim 0) and the BENCHMARKS.json rows that chose them. An op not listed runs its
# kernel at every shape it supports (or nowhere by default: Op.kernel_off).
KERNEL_ROWS = {
    "indexer_projection": Default(Rows(2, 64), 'indexer_projection "kernel" against '
                                  '"reference": faster at these M only'),
    "indexer_q": Default(Rows(2, 128), f'indexer_q "kernel" against "reference", and the '
                         f'{_UPDATE_PART}'),
    "indexer_update_q": Default(Rows(1, 64), _UPDATE_PART),
    "indexer_update": Default(Rows(2, 16), _UPDATE_PART),
    "update_epilogue_q": Default(Rows(17, 128), _UPDATE_PART),
}


def kernel_default(op: str) -> dict:
  """Op(...) keywords kernel_default and kernel_default_note of `op` from KERNEL_ROWS."""
  rows, why = KERNEL_ROWS[op]
  return dict(kernel_default=lambda first, *rest, **params: first.shape[0] in rows,
              kernel_default_note=f"{rows}, {why}")


class UpdatePath(enum.Enum):
  """How the stage runs its update part (q, the projection, the query epilogue and
  kpool_update); the value is what runs, in words."""
  UPDATE_Q = "indexer_update_q: q's GEMM, the projection and the epilogue in one FFI call"
  UPDATE = "indexer_q, then indexer_update (its kernel, or XLA's GEMM + update_epilogue)"
  EPILOGUE_Q = "XLA's projection GEMM, then update_epilogue_q: q's GEMM and the epilogue"
  EPILOGUE = "indexer_q, XLA's projection GEMM, then update_epilogue"
  FUSED_PROJECTION = "indexer_q, indexer_projection_fused, kpool_update"
  OPS = "indexer_q, indexer_projection, indexer_query, kpool_update"


class SelectPath(enum.Enum):
  """How the stage runs its select part."""
  SELECT_SLOTS = "select_slots: logits, top-k and the slots in one FFI call"
  SELECT_POOLS_EXPAND = "select_pools, then expand_and_remap"


# IndexerConfig(update="auto"): the first path whose op the routing runs as its kernel at
# the call's shapes (each op's own word, limits and KERNEL_ROWS), in this order; OPS where
# none does. A later entry is the fallback where the ones before it are not chosen.
AUTO_UPDATE = ((UpdatePath.UPDATE_Q, "indexer_update_q"),
               (UpdatePath.UPDATE, "indexer_update"),
               (UpdatePath.EPILOGUE_Q, "update_epilogue_q"),
               (UpdatePath.EPILOGUE, "update_epilogue"))
# IndexerConfig(update="fused"): indexer_update where its kernel is chosen, else XLA's GEMM
# and update_epilogue (its kernel where chosen, else its reference).
FUSED_UPDATE = ((UpdatePath.UPDATE, "indexer_update"), (UpdatePath.EPILOGUE, None))
# The select part: select_slots where the routing runs its kernel, else the two ops.
SELECT = ((SelectPath.SELECT_SLOTS, "select_slots"), (SelectPath.SELECT_POOLS_EXPAND, None))


class TopkChunks(NamedTuple):
  """How pool_topk's kernel takes rows of `width` pools: `chunks` chunks of `pools` pools
  each (the row padded to chunks * pools), a top-k of each, then a top-k of the chunks'
  candidates (chunks * k of them); chunks == 1: one kernel call holds the whole row."""
  chunks: int
  pools: int

  @property
  def padded(self) -> int:
    return self.chunks * self.pools


# The top-k's widest row a call by rows, widest first: (up to this many rows, or None for
# any; pools). A cluster of up to 8 CTAs a row while the clusters fit one wave of the GPU's
# SMs, then a pair of CTAs a row (two CTAs' width, one wave at 64 rows), then one CTA's.
# Decided by the stage bench at 202,752 tokens, M=1/16/64, against the chunks
# (docs/performance.md).
TOPK_ROW_TIERS = ((TOPK_CLUSTER_MAX_ROWS, TOPK_MAX_POOLS),
                  (TOPK_PAIR_MAX_ROWS, min(2 * TOPK_CTA_POOLS, TOPK_MAX_POOLS)),
                  (None, TOPK_CTA_POOLS))


def topk_row_pools(rows: int) -> int:
  """The widest row pool_topk's kernel takes in one call at `rows` rows (TOPK_ROW_TIERS)."""
  return next(pools for high, pools in TOPK_ROW_TIERS if high is None or rows <= high)


def topk_row_words(width: str) -> str:
  """TOPK_ROW_TIERS in words, for the ops' limits and default notes: "`width` <= a up to r
  rows, b up to s rows, c past them"."""
  words = [f"{pools} up to {high} rows" if high is not None else f"{pools} past them"
           for high, pools in TOPK_ROW_TIERS]
  return f"{width} <= " + ", ".join(words)


def topk_chunks(width: int, k: int, rows: int) -> TopkChunks:
  """The top-k's chunks at `rows` rows of `width` pools: one call holds a row of at most
  topk_row_pools(rows) pools; a wider row is cut into the fewest chunks that fit, of
  equal width (a multiple of LOGITS_ITEM_POOLS: the logits kernel's item, 16-byte aligned
  rows). A pool of the row's top-k is in its chunk's top-k, and the chunks' candidates keep
  ascending ids, so the second top-k (ties by ascending position) is the row's, exactly.
  Chunks only shrink the row where k is below half the limit (every chunk is wider than k)."""
  limit = topk_row_pools(rows)
  if width <= limit or 2 * k >= limit:
    return TopkChunks(1, width)
  chunks = -(-width // limit)
  per = -(-width // chunks)
  return TopkChunks(chunks, -(-per // LOGITS_ITEM_POOLS) * LOGITS_ITEM_POOLS)


def select_kernel_default() -> dict:
  """Op(...) keywords kernel_default and kernel_default_note of select_pools and
  select_slots: their one call wherever pool_topk's kernel takes the row whole
  (topk_chunks: one chunk); past it, mqa_logits then pool_topk over chunks."""
  return dict(
      kernel_default=lambda q, *rest, k, max_pools, **params:
          topk_chunks(max_pools, k, q.shape[0]).chunks == 1,
      kernel_default_note=f"{topk_row_words('max_pools')} (topk_chunks: one chunk)")


class TacticKind(enum.Enum):
  """The projection kernel's algorithms."""
  MMA = "mma"        # mma.sync on 16-row tiles, CTAs of `warps` in clusters of `split`
  GEMV = "gemv"      # no mma, no cluster: a CTA per w_cat row whose warps split K
  WGMMA = "wgmma"    # TMA ring and wgmma, one warpgroup a CTA, a cluster over K


class TacticRow(NamedTuple):
  """A row of a tactic table: at `rows` the tactic (kind, warps, split), split for MMA only
  (warps fixed for WGMMA); kind None: PROJECTION_TACTICS' tactic without its GEMV rows. A
  table's tactic at M is that of its first row covering M whose tactic tiles K (and is
  allowed); its last row covers every M and is taken as it is."""
  rows: Rows
  kind: TacticKind | None
  warps: int = 0
  split: int = 0


EVERY = Rows(1, None)
# indexer_projection's tactic where none is given: the GEMV up to 2 rows (few tokens' sums
# take one pass over a CTA), 8-warp CTAs in clusters of 8 past 32 rows (more CTAs overlap
# the x reads), else in clusters of 4. Decided by the indexer_projection rows "kernel GEMV 4
# warps", "kernel 8x4", "kernel 8x8" and the rest of its tactic sweep.
PROJECTION_TACTICS = (TacticRow(Rows(1, 2), TacticKind.GEMV, 4),
                      TacticRow(Rows(33, None), TacticKind.MMA, 8, 8),
                      TacticRow(EVERY, TacticKind.MMA, 8, 4))
# The projection inside indexer_update_q, beside q's GEMM (its critical path there): the
# wgmma tactic past 32 rows, else the standalone table without the GEMV (its CTA per w_cat
# row slows q's GEMM; up to 32 rows another tactic than indexer_update's would sum in
# another order). Decided by the stage rows "kernel, update part only, indexer_update_q,
# barrier chain" (scripts/update_q_tactics.py sweeps them).
UPDATE_Q_TACTICS = (TacticRow(Rows(33, None), TacticKind.WGMMA),
                    TacticRow(EVERY, None))
# indexer_q's tactic at every M (one tactic keeps a token's sums independent of the batch):
# wgmma, which tiles every wq_b that mma tiles. Decided by the indexer_q rows "kernel"
# (wgmma) and "kernel mma".
Q_TACTIC = "wgmma"


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """What indexer_stage runs at one set of shapes: the update and select paths, the
  tactics of the GEMM kernels on that path (None: XLA's GEMM, or the op's reference) and
  the top-k's chunks where select_pools runs its kernels over chunks of the rows.
  The ops take their tactics from the same tables (each device of a split call takes the
  whole call's), so the stage passes none."""
  rows: int
  update: UpdatePath
  select: SelectPath
  projection_tactic: tuple | None = None
  q_tactic: str | None = None
  topk_chunks: TopkChunks | None = None
  one_call: bool = False

  def lines(self) -> list[str]:
    """The plan in words, a line per choice."""
    topk = ("one call a row" if self.topk_chunks is None else
            f"{self.topk_chunks.chunks} chunks of {self.topk_chunks.pools} pools a row, then "
            "the chunks' candidates (plan.topk_chunks)")
    return [f"rows: {self.rows}",
            f"update: {self.update.name} ({self.update.value})",
            f"select: {self.select.name} ({self.select.value})",
            "one call: " + ("indexer_update_select (both parts in one FFI call)"
                            if self.one_call else "no (each part its own calls)"),
            f"top-k: {topk}",
            f"projection tactic: {_words(self.projection_tactic)}",
            f"q tactic: {self.q_tactic or 'none (XLA GEMM or reference)'}"]


def _words(tactic):
  if tactic is None:
    return "none (XLA GEMM or reference)"
  return f"{tactic.kind.value} (warps {tactic.warps}, split {tactic.split})"


def chooses_kernel(fn, *args, routing: Routing, **params) -> bool:
  """Whether the public op function `fn`, called with arrays of these shapes and dtypes and
  these keywords, runs its op's kernel on a GPU under `routing`: its one call of the op's
  primitive asked at its own avals and params (Op.kernel_chosen). Traced from avals alone:
  nothing is computed. False where fn binds no such primitive (it composes other ops)."""
  op = Op.registry[fn.__name__]
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  jaxpr = jax.make_jaxpr(functools.partial(fn, routing=routing, **params))(*avals)
  calls = [e for e in jaxpr.eqns if e.primitive is op.primitive]
  if len(calls) != 1:
    return False
  params = dict(calls[0].params)
  return op.kernel_chosen(params.pop("routing"), [v.aval for v in calls[0].invars], params)


def first_chosen(table, chosen):
  """The path of the first (path, op) of `table` where op is None or chosen(op), else
  None."""
  return next((path for path, op in table if op is None or chosen(op)), None)


def update_path(update: str, fused: bool, kernels: bool, chosen) -> UpdatePath:
  """The update path of IndexerConfig(update=update, fused=fused); kernels: whether the
  stage runs the ops as primitives (False: the reference composition); chosen(op): whether
  the routing runs `op`'s kernel at the stage's shapes."""
  if update == "fused":
    return first_chosen(FUSED_UPDATE, chosen) if kernels else UpdatePath.UPDATE
  if update == "auto" and kernels and not fused:
    path = first_chosen(AUTO_UPDATE, chosen)
    if path is not None:
      return path
  return UpdatePath.FUSED_PROJECTION if fused else UpdatePath.OPS


def select_path(kernels: bool, chosen) -> SelectPath:
  """The select path; kernels and chosen as for update_path."""
  return first_chosen(SELECT, chosen) if kernels else SelectPath.SELECT_POOLS_EXPAND


def one_call(update: UpdatePath, select: SelectPath, w_out_f32: bool, chosen) -> bool:
  """Whether the stage runs both parts as indexer_update_select, one FFI call: where each
  part is one call of its kernel (UPDATE_Q, SELECT_SLOTS), w_out is float32 (the select
  path reads it as it is) and the routing runs indexer_update_select's kernel. In one call
  PDL joins the update's epilogue and the logits, whose row tables and first page lookups
  then overlap it (docs/performance.md, section 5)."""
  return (update is UpdatePath.UPDATE_Q and select is SelectPath.SELECT_SLOTS and w_out_f32
          and chosen("indexer_update_select"))
