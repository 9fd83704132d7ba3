"""Indexer projection and query epilogue (SPEC §1, §2), separate or fused.
Shapes and dtypes: see glm5_jax.reference.indexer."""
import numpy as np
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

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


def _projection_shapes(op, x, w_cat, heads):
  expect(op, "x", x, BF16, (None, None))
  m, k = x.shape
  if heads <= 0:
    fail(op, "heads", f"must be > 0, got {heads}")
  expect(op, "w_cat", w_cat, BF16, (2 * DIM + heads, k))
  return [((m, DIM), BF16), ((m, heads), F32), ((m, DIM), BF16)]


def _query_shapes(op, q, head_w, norm_weight, norm_bias, m, heads, scale, eps,
                  padded, w_out_dtype):
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
# The tactic by rows (the H200 sweep, BENCHMARKS.md, K 4096, H 32): the GEMV (GEMV_WARPS
# warps) up to GEMV_ROWS rows (M=1 3.39-3.61 µs, the mma tactics 4.6-5.3; M=2 3.92, 8x4
# 4.8), then 8 warps in clusters of 4 up to AUTO_ROWS rows (fastest at M 4-16), clusters of
# 8 past that (fastest at M 64: more CTAs overlap the x reads) where that tiles K.
AUTO_ROWS, AUTO_SMALL, AUTO_LARGE = 32, (8, 4), (8, 8)
GEMV_ROWS, GEMV_WARPS = 2, 4
# M where the projection kernel beat XLA's GEMM on the H200 (BENCHMARKS.md, K 4096, H 32):
# its default; XLA's GEMM elsewhere. At M=1 the GEMV and XLA's GEMV are at parity (3.39-3.61
# vs 3.46-3.48 µs over two runs): XLA's, which may also fuse with its neighbours. M 32-64
# since the cluster's sums stopped fencing (cc/cluster.cuh): 6.06 vs 7.76 µs at M=32, 8.02 vs
# 8.81 at M=64; at M=128 both rows were host-bound (10.33 vs 9.28 µs, upper bounds).
PROJECTION_KERNEL_ROWS = (2, 64)


def default_rows(bounds, why):
  """An Op's kernel_default and kernel_default_note for a kernel that runs by default where
  its first operand's rows M lie in bounds = (low, high) (both included), `why` in words."""
  low, high = bounds
  return dict(kernel_default=lambda first, *rest, **params: low <= first.shape[0] <= high,
              kernel_default_note=f"M {low} to {high}, {why}")


def tile_k(k: int, warps: int, split: int) -> tuple[int, int] | None:
  """(blocks per stage, stages) of each warp's span of K under the tactic (warps, split),
  or None where it does not tile K: K = BLOCK_K * warps * split * blocks with blocks in
  1..MAX_BLOCKS (one stage) or a multiple of MAX_BLOCKS (stages of MAX_BLOCKS); for the
  GEMV (split GEMV_SPLIT), (loads, 1) with K = GEMV_K * warps * loads, loads in
  1..MAX_BLOCKS."""
  if split == GEMV_SPLIT:
    loads, rest = divmod(k, GEMV_K * warps)
    return (loads, 1) if not rest and 1 <= loads <= MAX_BLOCKS else None
  if split == WGMMA_SPLIT:
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


def projection_tactic(rows: int, k: int, tactic: tuple[int, int] | None = None,
                      gemv: bool = True) -> tuple[int, int]:
  """The (warps, split) glm5_indexer_projection runs at M = rows: `tactic` where given,
  else the table by rows (the GEMV up to GEMV_ROWS rows where it tiles K and `gemv`,
  AUTO_SMALL up to AUTO_ROWS rows, AUTO_LARGE past that where it tiles K). It may not tile
  K: then the op runs the reference (kernel_supports)."""
  if tactic is not None:
    return tuple(tactic)
  if gemv and rows <= GEMV_ROWS and tile_k(k, GEMV_WARPS, GEMV_SPLIT):
    return GEMV_WARPS, GEMV_SPLIT
  return AUTO_LARGE if rows > AUTO_ROWS and tile_k(k, *AUTO_LARGE) else AUTO_SMALL


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
  given, else "wgmma" (it tiles every wq_b that "mma" tiles; where it does not tile, the op
  runs the reference). The rows do not choose: one tactic for every M keeps a token's sums
  independent of the batch, and on the H200 wgmma is the faster from M=16 on (7.2 / 8.0 /
  9.5 µs at M 16 / 64 / 128 vs mma's 7.7 / 14.3 / 24.3; 6.8 vs 6.5 at M=1, BENCHMARKS.md)."""
  del rows, n, k
  return "wgmma" if tactic is None else tactic


def projection_tactics(k: int, max_split: int = MAX_SPLIT) -> list[tuple[int, int]]:
  """Every power-of-two tactic (warps, split) that tiles K, and with max_split > 1 every
  GEMV tactic (warps, GEMV_SPLIT) and the wgmma tactic that does (benchmark sweeps,
  tests)."""
  splits = (GEMV_SPLIT, WGMMA_SPLIT, 1, 2, 4, 8) if max_split > 1 else (1, 2, 4, 8)
  return [(w, s) for w in (1, 2, 4, 8) for s in splits
          if w <= MAX_WARPS and s <= max_split and tile_k(k, w, s)]


def _check_tactic(op, tactic, k, max_split=MAX_SPLIT):
  """An explicit (warps, split) must tile K; split GEMV_SPLIT (the GEMV) and WGMMA_SPLIT
  (the wgmma tactic, WGMMA_WARPS warps) only where K is split across CTAs at all
  (max_split > 1)."""
  if tactic is None:
    return
  warps, split = tactic
  gemv = max_split > 1 and split == GEMV_SPLIT
  wg = max_split > 1 and split == WGMMA_SPLIT
  if not (1 <= warps <= MAX_WARPS and (gemv or wg or 1 <= split <= max_split)):
    splits = (f"{GEMV_SPLIT} (the GEMV), {WGMMA_SPLIT} (wgmma) or " if max_split > 1
              else "") + f"1..{max_split}"
    fail(op, "tactic", f"must be (warps 1..{MAX_WARPS}, split {splits}), got {tactic}")
  if not tile_k(k, warps, split):
    rule = (f"K must be {GEMV_K} * warps * loads with loads in 1..{MAX_BLOCKS}" if gemv else
            f"warps must be {WGMMA_WARPS} and K a multiple of {WGMMA_K}" if wg else
            f"K must be 32 * warps * split * blocks with blocks in 1..{MAX_BLOCKS} or a "
            f"multiple of {MAX_BLOCKS}")
    fail(op, "tactic", f"{tactic} does not tile K = {k}: {rule}")


def _projection_op_shapes(x, w_cat, *, heads, tactic):
  op = "indexer_projection"
  out = _projection_shapes(op, x, w_cat, heads)
  _check_tactic(op, tactic, x.shape[1])
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
                   f"(warps, split) ({GEMV_WARPS}, {GEMV_SPLIT}) up "
                   f"to {GEMV_ROWS} rows where it tiles K, {AUTO_SMALL} up to {AUTO_ROWS} "
                   f"rows, {AUTO_LARGE} past that where it tiles K"),
    **default_rows(PROJECTION_KERNEL_ROWS, "where it beats XLA's GEMM"),
    # A device's block of rows runs the whole call's tactic: the same fp32 sums.
    kernel_params=lambda x, w_cat, *, heads, tactic: dict(
        tactic=projection_tactic(x.shape[0], x.shape[1], tactic)),
    split=Split(("rows", None), ("rows",) * 3))


def _q_shapes(qr, wq_b, *, tactic, op="indexer_q"):
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


# Where the update part's kernels run by default (H200, 2026-12-02, bench/NOTES.md
# twenty-first session): the stage's update part alone, 1K context, 11 layers, 16 decode steps
# an executable with layers and steps chained (each reads the output before it, so XLA cannot
# batch a layer's GEMMs over the steps), from one profiled run (step_times --timeline), µs per
# layer at M = 1 / 2 / 4 / 8 / 16 / 32 / 64 / 128:
#   XLA's q GEMM, XLA's projection GEMM, update_epilogue: 11.4 / 16.9 / 15.9 / 16.9 / 17.0 /
#     17.7 / 19.9 / 24.1 (the default before)
#   indexer_q's kernel instead of XLA's q GEMM:             12.8 / 16.0 / 15.9 / 16.2 / 16.4 /
#     17.1 / 18.7 / 21.2
#   indexer_q's kernel, then indexer_update's kernel:        13.5 / 14.3 / 15.0 / 15.2 / 15.7 /
#     16.9 / 19.6 / 24.3
#   XLA's projection GEMM, then update_epilogue_q:          12.4 / 15.6 / 15.5 / 15.8 / 15.9 /
#     16.6 / 18.3 / 20.9
# So XLA's GEMV at M = 1, indexer_q + indexer_update at M 2-16, update_epilogue_q past that.
# (The rows the bench measured before 2026-12-02 let XLA batch its GEMMs over 16 independent
# steps, 0.55 µs a layer for wq_b's 12.6 MB against its 2.6 µs floor, and read the other way.)
# The same bench, twenty-second session, one run, the default above against indexer_update_q
# (q's GEMM, the projection beside it, the epilogue: one FFI call):
#   the default above:  11.3 / 14.1 / 14.9 / 15.2 / 15.6 / 16.6 / 18.2 / 20.7
#   indexer_update_q:   13.8 / 15.7 / 13.0 / 13.2 / 13.5 / 14.9 / 18.3 / 23.9
# and at M = 1 / 2 / 3 once its projection no longer took the GEMV (another run): the default
# above 11.1 / 14.2 / 14.9, indexer_update_q 12.7 / 12.9 / 12.9.
# So indexer_update_q at M 2-32; XLA's GEMV at M = 1, update_epilogue_q past 32.
# Twenty-fifth session (barrier chain): with its projection at 4-warp CTAs
# (update.UPDATE_Q_TACTICS) indexer_update_q took 11.45 µs a layer at M = 64 against the
# default's 13.78, and 19.45 against 16.73 at M = 128: indexer_update_q at M 2-64 since.
# Twenty-sixth session (barrier chain): its projection waiting for q's GEMM only before
# exiting, and at the wgmma tactic past 32 rows: 8.33 / 8.03 / 10.39 at M = 1 / 16 / 64
# against XLA's GEMV path's 9.78 at M = 1 and update_epilogue_q's 11.46 at 64:
# indexer_update_q at M 1-64 since.
UPDATE_PART_MEASURED = ("the stage's update part on the H200, bench/NOTES.md twenty-first to "
                        "twenty-sixth sessions")
# The largest M those rows measured: no update-part kernel is a default past it.
UPDATE_PART_MAX_ROWS = 128
# indexer_q's kernel: at M 2 up to the rows measured (XLA's GEMV is faster at M = 1).
Q_KERNEL_ROWS = (2, UPDATE_PART_MAX_ROWS)


_q = Op(
    "indexer_q", lambda qr, wq_b, *, tactic: ref.indexer_q(qr, wq_b), _q_shapes,
    rows=((0, None), (0,)), kernel="glm5_indexer_q",
    attributes=dict(tactic=np.int32),
    attribute_values=lambda qr, wq_b, *, tactic: dict(
        tactic=Q_TACTICS.index(_q_tactic(qr, wq_b, tactic))),
    kernel_supports=lambda qr, wq_b, *, tactic: q_kernel_tiles(
        *wq_b.shape, _q_tactic(qr, wq_b, tactic)),
    kernel_limits=(f"tactic \"wgmma\" (the default): {_Q_TILING['wgmma']}; "
                   f"\"mma\": {_Q_TILING['mma']}"),
    **default_rows(Q_KERNEL_ROWS, f"where it beat XLA's GEMM ({UPDATE_PART_MEASURED})"),
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
  return _query_shapes(op, q, head_w, norm_weight, norm_bias, m, q.shape[1],
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
  key, _, gate = _projection_shapes(op, x, w_cat, heads)
  q_fp8, w_out, _ = _query_shapes(op, q, None, norm_weight, norm_bias, x.shape[0],
                                  heads, scale, eps, padded, w_out_dtype)
  _check_tactic(op, tactic, x.shape[1], max_split=1)
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
    kernel_off=("slower than the indexer_projection and indexer_query kernels at every "
                "measured M (1-64)"),
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
  tactic = None if tactic is None else tuple(int(v) for v in tactic)
  return tuple(_projection(x, w_cat, heads=int(heads), tactic=tactic, routing=routing))


def _query_params(op, scale, eps, padded, heads, w_out_dtype):
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
  params = _query_params("indexer_query", scale, eps, padded, q.shape[1], w_out_dtype)
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
  params = _query_params("indexer_projection_fused", scale, eps, padded, heads, w_out_dtype)
  tactic = None if tactic is None else tuple(int(v) for v in tactic)
  return tuple(_fused(x, w_cat, q, norm_weight, norm_bias, heads=int(heads), tactic=tactic,
                      routing=routing, **params))
