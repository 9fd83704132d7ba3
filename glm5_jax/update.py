"""The update part's composite ops, each declared by the ops whose work it does (its parts),
from which it takes its shape rule, kernel limits and FFI attributes:

- indexer_update: indexer_projection, indexer_query and kpool_update as one op;
- update_epilogue: its last two on the f32 sums of XLA's projection GEMM, in one FFI call;
- update_epilogue_q: indexer_q's GEMM and update_epilogue in one FFI call;
- indexer_update_q: indexer_q's GEMM and indexer_update's kernels in one FFI call.

Where each runs its kernel by default and which the stage runs: glm5_jax.plan.
Shapes and dtypes: see glm5_jax.reference.update."""
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from . import indexer, kpool, plan
from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op, Routing, Split
from .limits import RAW_HEADS_MULTIPLE
from .reference.numerics import DIM

I32, BF16 = indexer.I32, indexer.BF16
OP = "indexer_update"
# The ops the composite ops are made of.
PROJECTION, QUERY, KPOOL_UPDATE, Q = (Op.registry[name] for name in (
    "indexer_projection", "indexer_query", "kpool_update", "indexer_q"))
# Each composite op's parts, in the order its kernel does their work.
PARTS = {
    "indexer_update": (PROJECTION, QUERY, KPOOL_UPDATE),
    "update_epilogue": (QUERY, KPOOL_UPDATE),
    "update_epilogue_q": (Q, QUERY, KPOOL_UPDATE),
    "indexer_update_q": (Q, PROJECTION, QUERY, KPOOL_UPDATE),
}


def _attributes(op):
  """Every FFI attribute of `op`'s parts' kernels (their names do not collide), pdl
  implicit."""
  return {name: typ for part in PARTS[op] for name, typ in part.attributes.items()
          if name != "pdl"}


def _supports(parts):
  """A kernel_supports: where each part's kernel supports its share ([(Op, avals, params)]
  of parts(*avals, **params), by the parts' own rules)."""
  return lambda *avals, **params: all(op.kernel_supports(*a, **p)
                                      for op, a, p in parts(*avals, **params))


def _attribute_values(parts):
  """An attribute_values: the parts' kernels' attribute values."""
  def values(*avals, **params):
    out = {}
    for op, a, p in parts(*avals, **params):
      out.update(op.attribute_values(*a, **p))
    return out
  return values


def _grid(tslot):
  """The [B, N, 128] bf16 aval in which kpool_update sees a call's key and gate."""
  return jax.core.ShapedArray(tuple(tslot.shape) + (DIM,), BF16)


def _epilogue_ops(q, key_raw, head_w, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                  positions, *, scale, eps, padded, w_out_dtype, scale_format, round_scale):
  """[(Op, operand avals, params)] of indexer_query and kpool_update on these projection
  results (indexer_update's epilogue, update_epilogue's whole call)."""
  query = dict(scale=scale, eps=eps, padded=padded, w_out_dtype=w_out_dtype)
  update = dict(scale_format=scale_format, round_scale=round_scale)
  grid = _grid(tslot)
  return [(QUERY, (q, key_raw, head_w, norm_weight, norm_bias), query),
          (KPOOL_UPDATE, (kv_cache, tail, tslot, grid, grid, ape, loc, positions), update)]


def _parts(x, w_cat, q, *rest, heads, tactic, **params):
  """[(Op, operand avals, params)] of the three ops one call runs: the intermediates'
  avals from the projection's shapes (its tactic not checked here: the calling op's shape
  rule checks the caller's; one chosen by a table, indexer_update_q's, is for the
  projection's kernel_supports to take or not), key and gate as kpool_update sees them."""
  projection = dict(heads=heads, tactic=tactic)
  key_raw, head_w, _ = (jax.core.ShapedArray(s, d)
                        for s, d in indexer.projection_shapes(OP, x, w_cat, heads))
  return ([(PROJECTION, (x, w_cat), projection)]
          + _epilogue_ops(q, key_raw, head_w, *rest, **params))


def _check_rows(op, name, arg, tslot):
  """M = B * N: `arg`'s rows against tslot i32[B, N] (rows request-major)."""
  b, n = tslot.shape
  if arg.shape[0] != b * n:
    fail(op, name, f"must have requests x next_n = {b} x {n} rows (tslot's shape), "
         f"got {tuple(arg.shape)}")


def _cache_shapes(op, kv_cache, tail, tslot, ape, loc, positions, scale_format, round_scale):
  """kpool_update's result shapes by its rule, errors naming `op`."""
  grid = _grid(tslot)
  return KPOOL_UPDATE.shapes(kv_cache, tail, tslot, grid, grid, ape, loc, positions,
                             scale_format=scale_format, round_scale=round_scale, op=op)


def _shapes(x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, positions, *,
            heads, tactic, scale, eps, padded, w_out_dtype, scale_format, round_scale, op=OP):
  """The three ops' result shapes in order, each part checked by its op's rule (errors
  name `op`), and M = B * N between x and tslot."""
  expect(op, "tslot", tslot, I32, (None, None))
  out = indexer.projection_shapes(op, x, w_cat, heads)
  indexer.check_tactic(op, tactic, x.shape[1])
  _check_rows(op, "x", x, tslot)
  out += indexer.query_shapes(op, q, None, norm_weight, norm_bias, x.shape[0], heads,
                              scale, eps, padded, w_out_dtype)
  return out + _cache_shapes(op, kv_cache, tail, tslot, ape, loc, positions, scale_format,
                             round_scale)


def _kernel_params(*avals, **params):
  """The projection's tactic taken at the whole call's rows (Split: every device's block
  runs the whole call's tactic, as indexer_projection's does)."""
  (op, a, p), *_ = _parts(*avals, **params)
  return op.kernel_params(*a, **p)


def _cache_localize(index, *args):
  """Split's localize of a call whose last six operands are kpool_update's (kv_cache, tail,
  tslot, ape, loc, positions): its ids (tslot, loc) made device-local by kpool_update's own
  rule, the operands before them as they are."""
  kv_cache, tail, tslot, ape, loc, positions = args[-6:]
  kv_cache, tail, tslot, _, _, ape, loc, positions = kpool.update_localize(
      index, kv_cache, tail, tslot, None, None, ape, loc, positions)
  return (*args[:-6], kv_cache, tail, tslot, ape, loc, positions)


_update = Op(
    OP, lambda *args, tactic, **params: ref.indexer_update(*args, **params), _shapes,
    aliases={5: 6, 6: 7}, kernel="glm5_indexer_update", attributes=_attributes(OP),
    attribute_values=_attribute_values(_parts), kernel_supports=_supports(_parts),
    kernel_limits="those of indexer_projection, indexer_query and kpool_update",
    **plan.kernel_default(OP),
    otherwise="XLA's GEMM + update_epilogue",
    kernel_params=_kernel_params,
    split=Split(("rows", None, "rows", None, None, "pages", "blocks", "requests", None,
                 "requests", "requests"), ("rows",) * 6 + ("pages", "blocks"), _cache_localize))


def indexer_update(x: jax.Array, w_cat: jax.Array, q: jax.Array, norm_weight: jax.Array,
                   norm_bias: jax.Array, kv_cache: jax.Array, tail: jax.Array,
                   tslot: jax.Array, ape: jax.Array, loc: jax.Array, positions: jax.Array, *,
                   heads: int, scale: float, eps: float = 1e-6, padded: int | None = None,
                   w_out_dtype: DTypeLike = jnp.float32, scale_format: str = "fp32",
                   round_scale: bool = True, tactic: tuple[int, int] | None = None,
                   routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_projection -> indexer_query -> kpool_update as one op: (key_raw bf16[M, 128],
  head_w f32[M, heads], gate bf16[M, 128], q_fp8 e4m3[M, padded, 128], w_out[M, padded],
  key bf16[M, 128], kv_cache, tail), the three ops' results in order; x bf16[M, K] with
  M = B * N rows of tslot, loc, positions i32[B, N] (request-major). See
  glm5_jax.reference.indexer_update.

  The CUDA kernel (glm5_indexer_update; where the routing chooses it, by default at
  plan.KERNEL_ROWS' rows) launches the projection's kernel and one epilogue (a warp per
  request: the key LayerNorm and kpool_update; a warp per q row: the query epilogue) in one
  FFI call with PDL between them, at the shapes all three ops' kernels support. Its outputs
  are bit-identical to indexer_projection(tactic=projection_tactic(M, K, tactic)),
  indexer_query and kpool_update each run as its kernel: the same device code with the
  same arguments. Where it is not chosen: XLA's GEMM for the projection and
  update_epilogue on its f32 sums (its kernel where chosen), the composition the reference
  spells out. The caches are updated in place (donate them), as by kpool_update; w_cat is
  read before the preceding kernel has finished (PDL), as by indexer_projection. tactic:
  the projection kernel's (None: plan.PROJECTION_TACTICS by M). routing: None =
  Routing.from_env().
  """
  params = _params(heads, scale, eps, padded, w_out_dtype, scale_format, round_scale, tactic)
  args = (x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, positions)
  avals = [jax.typeof(a) for a in args]
  if not _update.kernel_chosen(Routing.resolve(routing, OP), avals, params):
    _shapes(*avals, **params)     # bad arguments named as indexer_update's, at trace time
    return _composed(*args, routing=routing, **params)
  return tuple(_update(*args, routing=routing, **params))


def _composed(x, w_cat, q, *rest, heads, tactic, routing, **epilogue):
  """indexer_update where its kernel is not chosen: the reference's composition with
  update_epilogue as an op (its kernel where chosen), not differentiable as indexer_update
  (the error names it, as the op's own would)."""
  del tactic                    # the projection kernel's; XLA's GEMM has none

  @jax.custom_jvp
  def composed(x, w_cat, q, *rest):
    raw = ref.projection_sums(x, w_cat)
    return ref.split_projection(raw, heads) + update_epilogue(raw, q, *rest, routing=routing,
                                                              **epilogue)
  composed.defjvp(_update._jvp)
  return composed(x, w_cat, q, *rest)


def _params(heads, scale, eps, padded, w_out_dtype, scale_format, round_scale, tactic):
  """indexer_update's keyword arguments as the primitive takes them."""
  return dict(indexer.query_params(OP, scale, eps, padded, heads, w_out_dtype),
              heads=int(heads), tactic=indexer.ProjectionTactic.given(tactic),
              scale_format=scale_format, round_scale=bool(round_scale))


# update_epilogue: indexer_update's epilogue alone, on the f32 sums of a projection GEMM of
# XLA's (reference.projection_sums), with no slice of them copied out.
EPILOGUE_OP = "update_epilogue"


def _epilogue_parts(raw, q, *rest, **params):
  """[(Op, operand avals, params)] of the two ops whose work one call does, their projection
  operands as split_projection gives them."""
  m, heads = q.shape[:2]
  key_raw = jax.core.ShapedArray((m, DIM), BF16)
  head_w = jax.core.ShapedArray((m, heads), indexer.F32)
  return _epilogue_ops(q, key_raw, head_w, *rest, **params)


def _epilogue_shapes(raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, positions,
                     *, scale, eps, padded, w_out_dtype, scale_format, round_scale,
                     op=EPILOGUE_OP):
  """(q_fp8, w_out, key, kv_cache, tail): the query's and kpool_update's result shapes by
  their rules (errors name `op`), raw f32[M, 256 + H] and M = B * N."""
  expect(op, "q", q, BF16, (None, None, DIM))
  m, heads = q.shape[:2]
  expect(op, "tslot", tslot, I32, (None, None))
  _check_rows(op, "q", q, tslot)
  expect(op, "raw", raw, indexer.F32, (m, 2 * DIM + heads))
  out = indexer.query_shapes(op, q, None, norm_weight, norm_bias, m, heads, scale, eps,
                             padded, w_out_dtype)
  return out + _cache_shapes(op, kv_cache, tail, tslot, ape, loc, positions, scale_format,
                             round_scale)


def _epilogue_kernel_supports(raw, q, *avals, **params):
  """H % RAW_HEADS_MULTIPLE == 0, and the query's and kpool_update's kernels' own rules."""
  return (q.shape[1] % RAW_HEADS_MULTIPLE == 0
          and _supports(_epilogue_parts)(raw, q, *avals, **params))


_epilogue = Op(
    EPILOGUE_OP, ref.update_epilogue, _epilogue_shapes, aliases={4: 3, 5: 4},
    kernel="glm5_update_epilogue", attributes=_attributes(EPILOGUE_OP),
    attribute_values=_attribute_values(_epilogue_parts),
    kernel_supports=_epilogue_kernel_supports,
    kernel_limits=(f"heads % {RAW_HEADS_MULTIPLE} == 0 and those of indexer_query and "
                   "kpool_update"),
    split=Split(("rows", "rows", None, None, "pages", "blocks", "requests", None, "requests",
                 "requests"), ("rows",) * 3 + ("pages", "blocks"), _cache_localize))


def update_epilogue(raw: jax.Array, q: jax.Array, norm_weight: jax.Array,
                    norm_bias: jax.Array, kv_cache: jax.Array, tail: jax.Array,
                    tslot: jax.Array, ape: jax.Array, loc: jax.Array, positions: jax.Array, *,
                    scale: float, eps: float = 1e-6, padded: int | None = None,
                    w_out_dtype: DTypeLike = jnp.float32, scale_format: str = "fp32",
                    round_scale: bool = True,
                    routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_query -> kpool_update on the projection's f32 sums raw f32[M, 256 + H]
  (glm5_jax.reference.projection_sums: key, head-weight and gate columns): (q_fp8
  e4m3[M, padded, 128], w_out[M, padded], key bf16[M, 128], kv_cache, tail); q bf16[M, H,
  128], the rest as indexer_update. See glm5_jax.reference.update_epilogue.

  The CUDA kernel (glm5_update_epilogue; on by default) is
  indexer_update's epilogue reading raw in place of the three projection results, so no
  slice of raw is copied out; its results are bit-identical to indexer_query's and
  kpool_update's kernels on reference.split_projection(raw). The caches are updated in
  place (donate them). routing: None = Routing.from_env().
  """
  params = _epilogue_params(q, scale, eps, padded, w_out_dtype, scale_format, round_scale)
  return tuple(_epilogue(raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                         positions, routing=routing, **params))


def _epilogue_params(q, scale, eps, padded, w_out_dtype, scale_format, round_scale):
  """update_epilogue's keyword arguments as the primitive takes them (q: its heads)."""
  return dict(indexer.query_params(EPILOGUE_OP, scale, eps, padded, q.shape[1], w_out_dtype),
              scale_format=scale_format, round_scale=bool(round_scale))


# update_epilogue_q: indexer_q's GEMM and update_epilogue's kernel launched by one FFI call.
# XLA records every FFI call of a jitted step as a child graph of its command buffer: q's
# GEMM inside the call the stage already makes costs one kernel with PDL between the two,
# not a child graph.
EPILOGUE_Q_OP = "update_epilogue_q"


def _q_aval(qr, wq_b):
  """q bf16[M, H, 128] as the epilogue sees indexer_q's bf16[M, H * 128]."""
  return jax.core.ShapedArray((qr.shape[0], wq_b.shape[0] // DIM, DIM), BF16)


def _epilogue_q_parts(raw, qr, wq_b, *rest, tactic, **params):
  """[(Op, operand avals, params)] of the three ops whose work one call does: indexer_q,
  indexer_query and kpool_update."""
  return ([(Q, (qr, wq_b), dict(tactic=tactic))]
          + _epilogue_parts(raw, _q_aval(qr, wq_b), *rest, **params))


def _epilogue_q_shapes(raw, qr, wq_b, *rest, tactic, **params):
  """(q, q_fp8, w_out, key, kv_cache, tail): indexer_q's result shape by its rule, then
  update_epilogue's on q as [M, H, 128] (errors name update_epilogue_q)."""
  out = Q.shapes(qr, wq_b, tactic=tactic, op=EPILOGUE_Q_OP)
  return out + _epilogue_shapes(raw, _q_aval(qr, wq_b), *rest, op=EPILOGUE_Q_OP, **params)


def _epilogue_q_kernel_supports(raw, qr, wq_b, *avals, tactic, **params):
  """indexer_q's kernel's rule at the call's tactic and update_epilogue's."""
  return (Q.kernel_supports(qr, wq_b, tactic=tactic)
          and _epilogue_kernel_supports(raw, _q_aval(qr, wq_b), *avals, **params))


def _epilogue_q_kernel_params(raw, qr, wq_b, *avals, tactic, **params):
  """q's tactic taken for the whole call (Split: every device's block sums as it would)."""
  return Q.kernel_params(qr, wq_b, tactic=tactic)


_epilogue_q = Op(
    EPILOGUE_Q_OP, lambda *args, tactic, **params: ref.update_epilogue_q(*args, **params),
    _epilogue_q_shapes, aliases={5: 4, 6: 5}, kernel="glm5_update_epilogue_q",
    attributes=_attributes(EPILOGUE_Q_OP),
    attribute_values=_attribute_values(_epilogue_q_parts),
    kernel_supports=_epilogue_q_kernel_supports,
    kernel_limits="those of indexer_q (its tactic) and update_epilogue",
    **plan.kernel_default(EPILOGUE_Q_OP),
    kernel_params=_epilogue_q_kernel_params,
    split=Split(("rows", "rows", None, None, None, "pages", "blocks", "requests", None,
                 "requests", "requests"), ("rows",) * 4 + ("pages", "blocks"), _cache_localize))


def update_epilogue_q(raw: jax.Array, qr: jax.Array, wq_b: jax.Array, norm_weight: jax.Array,
                      norm_bias: jax.Array, kv_cache: jax.Array, tail: jax.Array,
                      tslot: jax.Array, ape: jax.Array, loc: jax.Array, positions: jax.Array, *,
                      scale: float, eps: float = 1e-6, padded: int | None = None,
                      w_out_dtype: DTypeLike = jnp.float32, scale_format: str = "fp32",
                      round_scale: bool = True, tactic: str | None = None,
                      routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_q -> update_epilogue as one op: (q bf16[M, H * 128], q_fp8 e4m3[M, padded,
  128], w_out[M, padded], key bf16[M, 128], kv_cache, tail); raw f32[M, 256 + H] (the
  projection's sums), qr bf16[M, K], wq_b bf16[H * 128, K], the rest as update_epilogue. See
  glm5_jax.reference.update_epilogue_q.

  The CUDA kernel (glm5_update_epilogue_q; where the routing chooses it, by default at
  plan.KERNEL_ROWS' rows) launches indexer_q's GEMM (tactic: as indexer_q's) and
  update_epilogue's kernel in one FFI call with PDL between them: its results are
  bit-identical to indexer_q(tactic=...) and update_epilogue each run as its kernel. q's sums
  run in the kernel's order, not XLA's (within SPEC D2). wq_b is read before the preceding
  kernel has finished (PDL): pass it as a model parameter. The caches are updated in place
  (donate them). routing: None = Routing.from_env().
  """
  params = _epilogue_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format,
                              round_scale, tactic)
  return tuple(_epilogue_q(raw, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape,
                           loc, positions, routing=routing, **params))


def _epilogue_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format, round_scale,
                       tactic):
  """update_epilogue_q's keyword arguments as the primitive takes them (wq_b: its heads)."""
  heads = jax.typeof(wq_b).shape[0] // DIM
  return dict(indexer.query_params(EPILOGUE_Q_OP, scale, eps, padded, heads, w_out_dtype),
              scale_format=scale_format, round_scale=bool(round_scale), tactic=tactic)


# indexer_update_q: indexer_q's GEMM and indexer_update's kernels in one FFI call (cc/update.cu:
# q's GEMM, then the projection with PDL, reading x and w_cat while q's GEMM runs, then the
# epilogue with PDL). As two FFI calls (indexer_q's, indexer_update's) each is a child graph
# of its own in the command buffer and PDL does not cross them: the two GEMMs' weights would
# stream one after the other.
UPDATE_Q_OP = "indexer_update_q"


def update_q_projection_tactic(rows: int, k: int, tactic: tuple[int, int] | None = None
                               ) -> indexer.ProjectionTactic:
  """The projection's tactic inside indexer_update_q's kernel at M = rows, K: `tactic`
  where given, else plan.UPDATE_Q_TACTICS'."""
  if tactic is not None:
    return indexer.ProjectionTactic.given(tactic)
  return indexer.table_tactic(plan.UPDATE_Q_TACTICS, rows, k)


def _update_q_parts(x, w_cat, qr, wq_b, *rest, tactic, q_tactic, **params):
  """[(Op, operand avals, params)] of the four ops one call runs: indexer_q, then
  indexer_update's three on q seen as [M, H, 128], the projection at its tactic here."""
  q = _q_aval(qr, wq_b)
  tactic = update_q_projection_tactic(x.shape[0], x.shape[1], tactic)
  return ([(Q, (qr, wq_b), dict(tactic=q_tactic))]
          + _parts(x, w_cat, q, *rest, heads=q.shape[1], tactic=tactic, **params))


def _update_q_shapes(x, w_cat, qr, wq_b, *rest, tactic, q_tactic, **params):
  """(key_raw, head_w, gate, q, q_fp8, w_out, key, kv_cache, tail): indexer_q's result
  shape by its rule after indexer_update's three projection results, M = B * N between qr
  and tslot, then indexer_update's rule on q as [M, H, 128] (errors name
  indexer_update_q)."""
  q_out = Q.shapes(qr, wq_b, tactic=q_tactic, op=UPDATE_Q_OP)
  tslot = rest[4]
  expect(UPDATE_Q_OP, "tslot", tslot, I32, (None, None))
  _check_rows(UPDATE_Q_OP, "qr", qr, tslot)
  q = _q_aval(qr, wq_b)
  out = _shapes(x, w_cat, q, *rest, heads=q.shape[1], tactic=tactic, op=UPDATE_Q_OP,
                **params)
  return out[:3] + q_out + out[3:]


def _update_q_kernel_params(x, w_cat, qr, wq_b, *avals, tactic, q_tactic, **params):
  """Both GEMMs' tactics taken at the whole call's rows (Split: every device's block sums
  as the whole call would)."""
  return dict(tactic=update_q_projection_tactic(x.shape[0], x.shape[1], tactic),
              q_tactic=Q.kernel_params(qr, wq_b, tactic=q_tactic)["tactic"])


_update_q = Op(
    UPDATE_Q_OP,
    lambda *args, tactic, q_tactic, **params: ref.indexer_update_q(*args, **params),
    _update_q_shapes, aliases={6: 7, 7: 8}, kernel="glm5_indexer_update_q",
    attributes=_attributes(UPDATE_Q_OP),
    attribute_values=_attribute_values(_update_q_parts),
    kernel_supports=_supports(_update_q_parts),
    kernel_limits=("those of indexer_q (its tactic) and indexer_update, the projection at "
                   f"{indexer.table_words(plan.UPDATE_Q_TACTICS)} (or the tactic given), "
                   "which must tile K"),
    **plan.kernel_default(UPDATE_Q_OP),
    otherwise="indexer_q + indexer_update",
    kernel_params=_update_q_kernel_params,
    split=Split(("rows", None, "rows", None, None, None, "pages", "blocks", "requests", None,
                 "requests", "requests"), ("rows",) * 7 + ("pages", "blocks"), _cache_localize))


def indexer_update_q(x: jax.Array, w_cat: jax.Array, qr: jax.Array, wq_b: jax.Array,
                     norm_weight: jax.Array, norm_bias: jax.Array, kv_cache: jax.Array,
                     tail: jax.Array, tslot: jax.Array, ape: jax.Array, loc: jax.Array,
                     positions: jax.Array, *, scale: float, eps: float = 1e-6,
                     padded: int | None = None, w_out_dtype: DTypeLike = jnp.float32,
                     scale_format: str = "fp32", round_scale: bool = True,
                     tactic: tuple[int, int] | None = None, q_tactic: str | None = None,
                     routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_q -> indexer_update as one op, the whole update part of a decode step:
  (key_raw bf16[M, 128], head_w f32[M, H], gate bf16[M, 128], q bf16[M, H * 128], q_fp8
  e4m3[M, padded, 128], w_out[M, padded], key bf16[M, 128], kv_cache, tail); qr bf16[M, Kq]
  and wq_b bf16[H * 128, Kq] in place of indexer_update's q (H = wq_b's rows / 128; w_cat
  has 256 + H rows), the rest as indexer_update. See glm5_jax.reference.indexer_update_q.

  The CUDA kernel (glm5_indexer_update_q; where the routing chooses it, by default at
  plan.KERNEL_ROWS' rows) launches q's GEMM, the projection and the epilogue in one FFI
  call with PDL between them; the projection streams w_cat and x while q's GEMM runs. Its
  results are bit-identical to indexer_q(tactic=q_tactic) and
  indexer_update(tactic=update_q_projection_tactic(M, K, tactic)) each run as its kernel.
  Where it is not chosen: indexer_q then indexer_update, each routed as its own op. q's sums
  run in indexer_q's order, not XLA's (within SPEC D2). The weights are read before the
  preceding kernel has finished (PDL): pass them as model parameters. The caches are updated
  in place (donate them). tactic: the projection's (None: update_q_projection_tactic's);
  q_tactic: q's, as indexer_q's tactic. routing: None = Routing.from_env().
  """
  params = _update_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format, round_scale,
                            tactic, q_tactic)
  args = (x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
          positions)
  avals = [jax.typeof(a) for a in args]
  if not _update_q.kernel_chosen(Routing.resolve(routing, UPDATE_Q_OP), avals, params):
    _update_q_shapes(*avals, **params)     # bad arguments named as indexer_update_q's
    return _update_q_composed(*args, routing=routing, **params)
  return tuple(_update_q(*args, routing=routing, **params))


def _update_q_composed(x, w_cat, qr, wq_b, *rest, tactic, q_tactic, routing, **params):
  """indexer_update_q where its kernel is not chosen: indexer_q, then indexer_update, each
  its own op (its kernel where chosen); not differentiable as indexer_update_q."""

  @jax.custom_jvp
  def composed(x, w_cat, qr, wq_b, *rest):
    q = indexer.indexer_q(qr, wq_b, tactic=q_tactic, routing=routing)
    heads = wq_b.shape[0] // DIM
    out = indexer_update(x, w_cat, q.reshape(q.shape[0], heads, DIM), *rest, heads=heads,
                         tactic=tactic, routing=routing, **params)
    return out[:3] + (q,) + out[3:]
  composed.defjvp(_update_q._jvp)
  return composed(x, w_cat, qr, wq_b, *rest)


def _update_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format, round_scale, tactic,
                     q_tactic):
  """indexer_update_q's keyword arguments as the primitive takes them (wq_b: its heads)."""
  heads = jax.typeof(wq_b).shape[0] // DIM
  return dict(indexer.query_params(UPDATE_Q_OP, scale, eps, padded, heads, w_out_dtype),
              scale_format=scale_format, round_scale=bool(round_scale),
              tactic=indexer.ProjectionTactic.given(tactic), q_tactic=q_tactic)
