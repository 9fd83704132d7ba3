"""Indexer projection and query epilogue (SPEC §1, §2), separate or fused.
Shapes and dtypes: see glm5_jax.reference.indexer."""
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from . import plan
from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op, Routing, Split
from .limits import (
  BLOCK_K,
  FUSED_WARPS,
  GEMV_K,
  GEMV_SPLIT,
  MAX_BLOCKS,
  MAX_SPLIT,
  MAX_STAGES,
  MAX_WARPS,
  Q_MAX_BLOCKS,
  Q_TACTICS,
  Q_TILE_ROWS,
  Q_WARPS,
  Q_WGMMA_ROWS,
  Q_WGMMA_SPLIT,
  TILE_ROWS,
  WGMMA_BOX_K,
  WGMMA_CLUSTER,
  WGMMA_SPLIT,
  WGMMA_WARPS,
)
from .reference.indexer import padded_heads
from .reference.numerics import DIM

I32, F32, BF16 = np.int32, np.float32, jnp.bfloat16
W_OUT_DTYPES = (np.dtype(F32), np.dtype(BF16))


def projection_shapes(op, x, w_cat, heads):
  """[(shape, dtype)] of the projection's key, head weights and gate for x bf16[M, K] and
  w_cat bf16[256 + heads, K], errors naming `op`."""
  expect(op, "x", x, BF16, (None, None))
  m, k = x.shape
  if heads <= 0:
    fail(op, "heads", f"must be > 0, got {heads}")
  expect(op, "w_cat", w_cat, BF16, (2 * DIM + heads, k))
  return [((m, DIM), BF16), ((m, heads), F32), ((m, DIM), BF16)]


def query_shapes(op, q, head_w, norm_weight, norm_bias, m, heads, scale, eps,
                 padded, w_out_dtype):
  """[(shape, dtype)] of the query epilogue's q_fp8, w_out and key for q bf16[m, heads, 128]
  (head_w None: not an operand), errors naming `op`."""
  expect(op, "q", q, BF16, (m, heads, DIM))
  if head_w is not None:
    expect(op, "head_w", head_w, F32, (m, heads))
  expect(op, "norm_weight", norm_weight, F32, (DIM,))
  expect(op, "norm_bias", norm_bias, F32, (DIM,))
  padded_heads(op, heads, padded)
  if np.dtype(w_out_dtype) not in W_OUT_DTYPES:
    fail(op, "w_out_dtype", f"must be float32 or bfloat16, got {w_out_dtype}", TypeError)
  if not (np.isfinite(scale) and np.isfinite(eps) and eps >= 0):
    fail(op, "scale/eps", f"must be finite (eps >= 0), got {scale}, {eps}")
  return [((m, padded, DIM), jnp.float8_e4m3fn), ((m, padded), w_out_dtype),
          ((m, DIM), BF16)]


# The projection kernels' tiling rule. It lives here only: cc/projection.cuh holds the
# matching compile-time sizes and validates the (warps, split) it is given. 16 weight rows
# per CTA; a tactic (warps, split) = warps per CTA and CTAs per cluster splitting K; a warp's
# span of K is 1..MAX_BLOCKS blocks of BLOCK_K held in registers, or whole stages of
# MAX_BLOCKS blocks (at most MAX_STAGES).
# split = GEMV_SPLIT names the GEMV tactic (warps, GEMV_SPLIT): no mma and no cluster, one
# CTA per w_cat row whose warps split K, a warp's lanes taking GEMV_K of it per 16-byte load,
# 1..MAX_BLOCKS loads held in registers (K = GEMV_K * warps * loads). For few tokens: each
# token's sums take one pass over the CTA.
# split = WGMMA_SPLIT names the wgmma tactic (WGMMA_WARPS, WGMMA_SPLIT): one warpgroup a CTA
# owning 64 w_cat rows (rows past 256 + heads read as zeros) and a WGMMA_CLUSTER-th of K,
# the weights and x streamed by the TMA in boxes of WGMMA_BOX_K through a ring (indexer_q's wgmma
# kernel's way), a cluster of WGMMA_CLUSTER CTAs adding its sums over DSMEM (K =
# WGMMA_K * boxes). For the projection beside q's GEMM (indexer_update_q), where the mma
# tactics' loads of every 16-row tile's x and weights wait behind q's stream.
WGMMA_K = WGMMA_CLUSTER * WGMMA_BOX_K


class ProjectionTactic(NamedTuple):
  """A projection kernel tactic: warps per CTA and split, the FFI attributes `warps` and
  `split` as the handler takes them: CTAs per cluster splitting K for an mma tactic,
  GEMV_SPLIT for the GEMV, WGMMA_SPLIT for the wgmma tactic (see `kind`)."""
  warps: int
  split: int

  @property
  def kind(self) -> plan.TacticKind:
    return {GEMV_SPLIT: plan.TacticKind.GEMV,
            WGMMA_SPLIT: plan.TacticKind.WGMMA}.get(self.split, plan.TacticKind.MMA)

  @classmethod
  def of(cls, kind: plan.TacticKind, warps: int = 0, split: int = 0) -> "ProjectionTactic":
    """The tactic of a plan table's (kind, warps, split): split for MMA only, warps fixed
    for WGMMA."""
    if kind is plan.TacticKind.GEMV:
      return cls(warps, GEMV_SPLIT)
    if kind is plan.TacticKind.WGMMA:
      return cls(WGMMA_WARPS, WGMMA_SPLIT)
    return cls(warps, split)

  @classmethod
  def given(cls, tactic) -> "ProjectionTactic | None":
    """A `tactic=` argument: None, or (warps, split) ints (the old tuples)."""
    return None if tactic is None else cls(*(int(v) for v in tactic))


def tile_k(k: int, warps: int, split: int) -> tuple[int, int] | None:
  """(blocks per stage, stages) of each warp's span of K under the tactic (warps, split),
  or None where it does not tile K: K = BLOCK_K * warps * split * blocks with blocks in
  1..MAX_BLOCKS (one stage) or a multiple of MAX_BLOCKS (stages of MAX_BLOCKS); for the
  GEMV (split GEMV_SPLIT), (loads, 1) with K = GEMV_K * warps * loads, loads in
  1..MAX_BLOCKS."""
  kind = ProjectionTactic(warps, split).kind
  if kind is plan.TacticKind.GEMV:
    loads, rest = divmod(k, GEMV_K * warps)
    return (loads, 1) if not rest and 1 <= loads <= MAX_BLOCKS else None
  if kind is plan.TacticKind.WGMMA:
    boxes, rest = divmod(k, WGMMA_K)
    return (boxes, 1) if warps == WGMMA_WARPS and not rest and boxes >= 1 else None
  blocks, rest = divmod(k, BLOCK_K * warps * split)
  if rest or blocks < 1:
    return None
  if blocks <= MAX_BLOCKS:
    return blocks, 1
  if blocks % MAX_BLOCKS == 0 and blocks // MAX_BLOCKS <= MAX_STAGES:
    return MAX_BLOCKS, blocks // MAX_BLOCKS
  return None


def table_tactic(table, rows: int, k: int, gemv: bool = True) -> ProjectionTactic:
  """The tactic of a plan tactic table (plan.PROJECTION_TACTICS, plan.UPDATE_Q_TACTICS) at
  M = rows and K = k, as plan.TacticRow says; GEMV rows skipped unless `gemv`. The last
  row's tactic may not tile K: then the op runs the reference (kernel_supports)."""
  *rest, (_, kind, warps, split) = table
  for row in rest:
    if rows in row.rows and (gemv or row.kind is not plan.TacticKind.GEMV):
      tactic = (table_tactic(plan.PROJECTION_TACTICS, rows, k, gemv=False) if row.kind is None
                else ProjectionTactic.of(row.kind, row.warps, row.split))
      if tile_k(k, *tactic):
        return tactic
  if kind is None:
    return table_tactic(plan.PROJECTION_TACTICS, rows, k, gemv=False)
  return ProjectionTactic.of(kind, warps, split)


def table_words(table) -> str:
  """A plan tactic table in words."""
  def words(row):
    if row.kind is None:
      return "indexer_projection's table without its GEMV rows"
    return f"{row.kind.value} {tuple(ProjectionTactic.of(row.kind, row.warps, row.split))}"
  *rest, last = table
  return ", ".join([f"{words(r)} at {r.rows} where it tiles K" for r in rest]
                   + [f"else {words(last)}"])


def projection_tactic(rows: int, k: int, tactic: tuple[int, int] | None = None,
                      gemv: bool = True) -> ProjectionTactic:
  """The tactic glm5_indexer_projection runs at M = rows: `tactic` where given, else
  plan.PROJECTION_TACTICS' (without its GEMV unless `gemv`)."""
  if tactic is not None:
    return ProjectionTactic.given(tactic)
  return table_tactic(plan.PROJECTION_TACTICS, rows, k, gemv)


def q_kernel_tiles(n: int, k: int, tactic: str = "mma") -> bool:
  """Whether glm5_indexer_q's tactic tiles wq_b bf16[N, K]: "mma", N a multiple of
  Q_TILE_ROWS and K = BLOCK_K * Q_WARPS * blocks with blocks in 1..Q_MAX_BLOCKS; "wgmma", N a
  multiple of Q_WGMMA_ROWS and K = Q_WGMMA_SPLIT * WGMMA_BOX_K * boxes, boxes >= 1."""
  if tactic == "wgmma":
    boxes, rest = divmod(k, Q_WGMMA_SPLIT * WGMMA_BOX_K)
    return n % Q_WGMMA_ROWS == 0 and not rest and boxes >= 1
  blocks, rest = divmod(k, BLOCK_K * Q_WARPS)
  return n % Q_TILE_ROWS == 0 and not rest and 1 <= blocks <= Q_MAX_BLOCKS


def q_tactic(rows: int, n: int, k: int, tactic: str | None = None) -> str:
  """The tactic glm5_indexer_q runs for qr bf16[rows, k] and wq_b bf16[n, k]: `tactic` where
  given, else plan.Q_TACTIC at every M (where it does not tile, the op runs the
  reference)."""
  del rows, n, k
  return plan.Q_TACTIC if tactic is None else tactic


def projection_tactics(k: int, max_split: int = MAX_SPLIT) -> list[tuple[int, int]]:
  """Every power-of-two tactic (warps, split) that tiles K, and with max_split > 1 every
  GEMV tactic (warps, GEMV_SPLIT) and the wgmma tactic that does (benchmark sweeps,
  tests)."""
  splits = (GEMV_SPLIT, WGMMA_SPLIT, 1, 2, 4, 8) if max_split > 1 else (1, 2, 4, 8)
  return [(w, s) for w in (1, 2, 4, 8) for s in splits
          if w <= MAX_WARPS and s <= max_split and tile_k(k, w, s)]


def check_tactic(op, tactic, k, max_split=MAX_SPLIT):
  """An explicit (warps, split) must tile K; split GEMV_SPLIT (the GEMV) and WGMMA_SPLIT
  (the wgmma tactic, WGMMA_WARPS warps) only where K is split across CTAs at all
  (max_split > 1)."""
  if tactic is None:
    return
  warps, split = tactic
  kind = ProjectionTactic(warps, split).kind
  gemv = max_split > 1 and kind is plan.TacticKind.GEMV
  wg = max_split > 1 and kind is plan.TacticKind.WGMMA
  if not (1 <= warps <= MAX_WARPS and (gemv or wg or 1 <= split <= max_split)):
    splits = (f"{GEMV_SPLIT} (the GEMV), {WGMMA_SPLIT} (wgmma) or " if max_split > 1
              else "") + f"1..{max_split}"
    fail(op, "tactic", f"must be (warps 1..{MAX_WARPS}, split {splits}), got {tuple(tactic)}")
  if not tile_k(k, warps, split):
    rule = (f"K must be {GEMV_K} * warps * loads with loads in 1..{MAX_BLOCKS}" if gemv else
            f"warps must be {WGMMA_WARPS} and K a multiple of {WGMMA_K}" if wg else
            f"K must be 32 * warps * split * blocks with blocks in 1..{MAX_BLOCKS} or a "
            f"multiple of {MAX_BLOCKS}")
    fail(op, "tactic", f"{tuple(tactic)} does not tile K = {k}: {rule}")


def _projection_op_shapes(x, w_cat, *, heads, tactic):
  op = "indexer_projection"
  out = projection_shapes(op, x, w_cat, heads)
  check_tactic(op, tactic, x.shape[1])
  return out


def _projection_kernel_supports(x, w_cat, *, heads, tactic):
  """Whole 16-row tiles (H % 16 == 0) and a K the tactic tiles (an explicit tactic is
  checked at trace time; the table's may not tile every K)."""
  rows, k = x.shape
  return heads % TILE_ROWS == 0 and tile_k(k, *projection_tactic(rows, k, tactic)) is not None


def _projection_attributes(x, w_cat, *, heads, tactic):
  """The tactic, always explicit (heads comes from the result shapes)."""
  warps, split = projection_tactic(x.shape[0], x.shape[1], tactic)
  return dict(warps=warps, split=split)


_TILING = (f"K = {BLOCK_K} * warps * split * blocks, blocks 1..{MAX_BLOCKS} or a multiple "
           f"of {MAX_BLOCKS}")
_GEMV_TILING = f"K = {GEMV_K} * warps * loads, loads 1..{MAX_BLOCKS}"
_WGMMA_TILING = f"warps {WGMMA_WARPS}, K a multiple of {WGMMA_K}"

_projection = Op(
    "indexer_projection",
    lambda x, w_cat, *, heads, tactic: ref.indexer_projection(x, w_cat, heads=heads),
    _projection_op_shapes, rows=((0, None), (0, 0, 0)),
    kernel="glm5_indexer_projection",
    attributes=dict(warps=np.int32, split=np.int32), attribute_values=_projection_attributes,
    kernel_supports=_projection_kernel_supports,
    kernel_limits=(f"heads % {TILE_ROWS} == 0, {_TILING} (the GEMV, split {GEMV_SPLIT}: "
                   f"{_GEMV_TILING}; wgmma, split {WGMMA_SPLIT}: {_WGMMA_TILING}); tactic "
                   f"(warps, split) {table_words(plan.PROJECTION_TACTICS)}"),
    **plan.kernel_default("indexer_projection"),
    # A device's block of rows runs the whole call's tactic: the same fp32 sums.
    kernel_params=lambda x, w_cat, *, heads, tactic: dict(
        tactic=projection_tactic(x.shape[0], x.shape[1], tactic)),
    split=Split(("rows", None), ("rows",) * 3))


def q_shapes(qr, wq_b, *, tactic, op="indexer_q"):
  expect(op, "qr", qr, BF16, (None, None))
  m, k = qr.shape
  expect(op, "wq_b", wq_b, BF16, (None, k))
  if wq_b.shape[0] % DIM:
    fail(op, "wq_b", f"must have heads * {DIM} rows, got {wq_b.shape[0]}")
  if tactic is not None:
    if tactic not in Q_TACTICS:
      fail(op, "tactic", f"must be one of {Q_TACTICS} or None, got {tactic!r}")
    if not q_kernel_tiles(*wq_b.shape, tactic):
      fail(op, "tactic", f"{tactic!r} does not tile wq_b {tuple(wq_b.shape)}: {_Q_TILING[tactic]}")
  return [((m, wq_b.shape[0]), BF16)]


_Q_TILING = {
    "mma": (f"N % {Q_TILE_ROWS} == 0, K = {BLOCK_K * Q_WARPS} * blocks with blocks in "
            f"1..{Q_MAX_BLOCKS}"),
    "wgmma": (f"N % {Q_WGMMA_ROWS} == 0, K = {Q_WGMMA_SPLIT * WGMMA_BOX_K} * boxes with "
              "boxes >= 1")}


def _q_tactic(qr, wq_b, tactic):
  return q_tactic(qr.shape[0], *wq_b.shape, tactic)


_q = Op(
    "indexer_q", lambda qr, wq_b, *, tactic: ref.indexer_q(qr, wq_b), q_shapes,
    rows=((0, None), (0,)), kernel="glm5_indexer_q",
    attributes=dict(tactic=np.int32),
    attribute_values=lambda qr, wq_b, *, tactic: dict(
        tactic=Q_TACTICS.index(_q_tactic(qr, wq_b, tactic))),
    kernel_supports=lambda qr, wq_b, *, tactic: q_kernel_tiles(
        *wq_b.shape, _q_tactic(qr, wq_b, tactic)),
    kernel_limits=(f"tactic \"wgmma\" (the default): {_Q_TILING['wgmma']}; "
                   f"\"mma\": {_Q_TILING['mma']}"),
    **plan.kernel_default("indexer_q"),
    # A device's block of rows runs the whole call's tactic: the same fp32 sums.
    kernel_params=lambda qr, wq_b, *, tactic: dict(tactic=_q_tactic(qr, wq_b, tactic)),
    split=Split(("rows", None), ("rows",)))


def indexer_q(qr: jax.Array, wq_b: jax.Array, *, tactic: str | None = None,
              routing: Routing | None = None) -> jax.Array:
  """q bf16[M, N] = qr bf16[M, K] @ wq_b bf16[N, K]^T (N = heads * 128): the query heads
  before the epilogue (indexer_query takes them as q.reshape(M, heads, 128)).

  The CUDA kernel streams wq_b through the TMA (cc/q_gemm.cu; limits: the README's op
  table) and reads it before the preceding kernel has finished (PDL): pass it as a model
  parameter. Its fp32 sums run in another order than XLA's GEMM: within SPEC D2, not
  bit-equal. tactic: "wgmma" or "mma" (Q_TACTICS; None: q_tactic's choice); the two sum in
  different orders. routing: where the op runs (None: from the env).
  """
  return _q(qr, wq_b, tactic=tactic, routing=routing)[0]


def _query_op_shapes(q, key_raw, head_w, norm_weight, norm_bias, *, scale, eps,
                     padded, w_out_dtype):
  op = "indexer_query"
  expect(op, "key_raw", key_raw, BF16, (None, DIM))
  m = key_raw.shape[0]
  if q.ndim != 3:
    fail(op, "q", f"must have shape (M, H, 128), got {tuple(q.shape)}")
  return query_shapes(op, q, head_w, norm_weight, norm_bias, m, q.shape[1],
                       scale, eps, padded, w_out_dtype)


# The query kernel's attributes; padded and the w_out dtype come from its result buffers.
_QUERY_ATTRIBUTES = dict(scale=np.float32, eps=np.float32)

_query = Op("indexer_query", ref.indexer_query, _query_op_shapes,
            rows=((0, 0, 0, None, None), (0, 0, 0)), kernel="glm5_indexer_query",
            attributes=_QUERY_ATTRIBUTES,
            split=Split(("rows",) * 3 + (None, None), ("rows",) * 3))


def _fused_shapes(x, w_cat, q, norm_weight, norm_bias, *, heads, scale, eps, padded,
                  w_out_dtype, tactic):
  op = "indexer_projection_fused"
  key, _, gate = projection_shapes(op, x, w_cat, heads)
  q_fp8, w_out, _ = query_shapes(op, q, None, norm_weight, norm_bias, x.shape[0],
                                  heads, scale, eps, padded, w_out_dtype)
  check_tactic(op, tactic, x.shape[1], max_split=1)
  return [q_fp8, w_out, key, gate]


def fused_warps(tactic: tuple[int, int] | None = None) -> int:
  """The warps glm5_indexer_projection_fused runs (its split is always 1)."""
  return FUSED_WARPS if tactic is None else tactic[0]


def _fused_kernel_supports(x, w_cat, q, norm_weight, norm_bias, *, heads, tactic, **params):
  """Whole 16-row tiles (H % 16 == 0) and a K that (warps, 1) tiles (an explicit tactic is
  checked at trace time)."""
  return heads % TILE_ROWS == 0 and tile_k(x.shape[1], fused_warps(tactic), 1) is not None


_fused = Op(
    "indexer_projection_fused",
    lambda *args, tactic, **params: ref.indexer_projection_fused(*args, **params),
    _fused_shapes, rows=((0, None, 0, None, None), (0, 0, 0, 0)),
    kernel="glm5_indexer_projection_fused",
    attributes=dict(_QUERY_ATTRIBUTES, warps=np.int32),
    attribute_values=lambda *avals, tactic, **params: dict(warps=fused_warps(tactic)),
    kernel_supports=_fused_kernel_supports,
    kernel_limits=(f"heads % {TILE_ROWS} == 0, {_TILING} at (warps, split) "
                   f"({FUSED_WARPS}, 1)"),
    kernel_off=('indexer_projection_fused "kernel" against "projection + query kernels": '
                "slower at every M"),
    split=Split(("rows", None, "rows", None, None), ("rows",) * 4))


def indexer_projection(x: jax.Array, w_cat: jax.Array, *, heads: int,
                       tactic: tuple[int, int] | None = None,
                       routing: Routing | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(key bf16[M, 128], head_w f32[M, heads], gate bf16[M, 128]) of
  x bf16[M, K] against w_cat = [wk; weights_proj; gate] bf16[256 + heads, K].

  The CUDA kernel takes heads % 16 == 0 and a K its tactic tiles (projection_tactic,
  tile_k; other shapes run the reference) and reads w_cat before the preceding kernel
  has finished (PDL): pass the weights in as model parameters, not as the output of the
  op just before. tactic: None (the table by M, projection_tactic) or (warps, split),
  warps per CTA and CTAs per cluster splitting K (split GEMV_SPLIT: the GEMV, no mma;
  (WGMMA_WARPS, WGMMA_SPLIT): TMA and wgmma in clusters of WGMMA_CLUSTER), for
  benchmark sweeps; it changes the fp32 summation order, not the result's tolerance; the
  reference ignores it.
  routing: where the op runs on CUDA (None: Routing.from_env()).
  """
  tactic = ProjectionTactic.given(tactic)
  return tuple(_projection(x, w_cat, heads=int(heads), tactic=tactic, routing=routing))


def query_params(op, scale, eps, padded, heads, w_out_dtype):
  return dict(scale=float(scale), eps=float(eps),
              padded=padded_heads(op, heads, padded),
              w_out_dtype=np.dtype(w_out_dtype))


def indexer_query(q: jax.Array, key_raw: jax.Array, head_w: jax.Array,
                  norm_weight: jax.Array, norm_bias: jax.Array, *, scale: float,
                  eps: float = 1e-6, padded: int | None = None,
                  w_out_dtype: DTypeLike = jnp.float32, routing: Routing | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q_fp8 e4m3[M, padded, 128], w_out[M, padded], key bf16[M, 128]): key
  LayerNorm, q Hadamard + FP8, head-weight scaling and padding (SPEC §2);
  see glm5_jax.reference.indexer_query. routing: None = Routing.from_env()."""
  params = query_params("indexer_query", scale, eps, padded, q.shape[1], w_out_dtype)
  return tuple(_query(q, key_raw, head_w, norm_weight, norm_bias, routing=routing, **params))


def indexer_projection_fused(x: jax.Array, w_cat: jax.Array, q: jax.Array,
                             norm_weight: jax.Array, norm_bias: jax.Array, *, heads: int,
                             scale: float, eps: float = 1e-6, padded: int | None = None,
                             w_out_dtype: DTypeLike = jnp.float32,
                             tactic: tuple[int, int] | None = None,
                             routing: Routing | None = None
                             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """indexer_projection + indexer_query in one op: (q_fp8 e4m3[M, padded, 128],
  w_out[M, padded], key bf16[M, 128], gate bf16[M, 128]).

  The CUDA kernel (off unless the routing names it: Op.kernel_off) takes heads % 16 == 0
  and a K that (warps, 1) tiles (other shapes run the reference) and splits K over the
  warps of a CTA only. tactic: None (8 warps, fused_warps) or (warps, 1); its outputs are
  bit-identical to indexer_projection(tactic=(warps, 1)) followed by indexer_query's
  kernel. As for indexer_projection, w_cat is read before the preceding kernel has
  finished (PDL). routing: None = Routing.from_env().
  """
  params = query_params("indexer_projection_fused", scale, eps, padded, heads, w_out_dtype)
  tactic = ProjectionTactic.given(tactic)
  return tuple(_fused(x, w_cat, q, norm_weight, norm_bias, heads=int(heads), tactic=tactic,
                      routing=routing, **params))
