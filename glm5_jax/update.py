"""indexer_update: indexer_projection, indexer_query and kpool_update as one op; and
update_epilogue, its last two on the f32 sums of XLA's projection GEMM in one FFI call (issue
12, the update path at the launch floor); update_epilogue_q, q's GEMM and that epilogue in
one FFI call; and indexer_update_q, q's GEMM and indexer_update's kernels in one FFI call.
By default indexer_update runs its own kernel (the projection's and the epilogue in one FFI
call) at UPDATE_KERNEL_ROWS, XLA's GEMM and update_epilogue's kernel at other M;
update_epilogue_q its kernel at EPILOGUE_Q_ROWS, indexer_update_q at UPDATE_Q_ROWS
(indexer.UPDATE_PART_MEASURED says why).
Shapes and dtypes: see glm5_jax.reference.update."""
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from . import indexer, kpool
from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op, Routing, Split
from .limits import RAW_HEADS_MULTIPLE
from .reference.numerics import DIM

I32, BF16 = indexer.I32, indexer.BF16
OP = "indexer_update"
# The ops whose work glm5_indexer_update does, in order (the last two in one launch).
PARTS = (indexer._projection, indexer._query, kpool._update)
# Where indexer_update runs its own kernel (the projection kernel + the epilogue in one FFI
# call) by default: M 2..16, where the stage's update part with it (and indexer_q's kernel)
# beat XLA's projection GEMM + update_epilogue (indexer.UPDATE_PART_MEASURED: 14.3 / 15.0 /
# 15.2 / 15.7 µs per layer at M 2 / 4 / 8 / 16 against 16.0 / 15.9 / 16.2 / 16.4 with the same
# q kernel; at M = 1 XLA's GEMV, past 16 update_epilogue_q is faster). Elsewhere XLA's GEMM
# and update_epilogue on its f32 sums (no slice copies). Until 2026-12-02 the kernel was off at
# every M: the bench then let XLA batch its projection GEMM over a run's independent steps.
UPDATE_KERNEL_ROWS = (2, 16)


def _grid(tslot):
  """The [B, N, 128] bf16 aval in which kpool_update sees a call's key and gate."""
  return jax.core.ShapedArray(tuple(tslot.shape) + (DIM,), BF16)


def _epilogue_ops(q, key_raw, head_w, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                  pos, *, scale, eps, padded, w_out_dtype, scale_format, round_scale):
  """[(Op, operand avals, params)] of indexer_query and kpool_update on these projection
  results (indexer_update's epilogue, update_epilogue's whole call)."""
  query = dict(scale=scale, eps=eps, padded=padded, w_out_dtype=w_out_dtype)
  update = dict(scale_format=scale_format, round_scale=round_scale)
  grid = _grid(tslot)
  return [(indexer._query, (q, key_raw, head_w, norm_weight, norm_bias), query),
          (kpool._update, (kv_cache, tail, tslot, grid, grid, ape, loc, pos), update)]


def _parts(x, w_cat, q, *rest, heads, tactic, **params):
  """[(Op, operand avals, params)] of the three ops one call runs: the intermediates'
  avals from the projection's shapes (its tactic not checked here: the calling op's shape
  rule checks the caller's; one chosen by a table, indexer_update_q's, is for the
  projection's kernel_supports to take or not), key and gate as kpool_update sees them."""
  projection = dict(heads=heads, tactic=tactic)
  key_raw, head_w, _ = (jax.core.ShapedArray(s, d)
                        for s, d in indexer._projection_shapes(OP, x, w_cat, heads))
  return ([(indexer._projection, (x, w_cat), projection)]
          + _epilogue_ops(q, key_raw, head_w, *rest, **params))


def _check_rows(op, name, arg, tslot):
  """M = B * N: `arg`'s rows against tslot i32[B, N] (rows request-major)."""
  b, n = tslot.shape
  if arg.shape[0] != b * n:
    fail(op, name, f"must have requests x next_n = {b} x {n} rows (tslot's shape), "
         f"got {tuple(arg.shape)}")


def _cache_shapes(op, kv_cache, tail, tslot, ape, loc, pos, scale_format, round_scale):
  """kpool_update's result shapes by its rule, errors naming `op`."""
  grid = _grid(tslot)
  return kpool._update_shapes(kv_cache, tail, tslot, grid, grid, ape, loc, pos,
                              scale_format=scale_format, round_scale=round_scale, op=op)


def _shapes(x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos, *,
            heads, tactic, scale, eps, padded, w_out_dtype, scale_format, round_scale, op=OP):
  """The three ops' result shapes in order, each part checked by its op's rule (errors
  name `op`), and M = B * N between x and tslot."""
  expect(op, "tslot", tslot, I32, (None, None))
  out = indexer._projection_shapes(op, x, w_cat, heads)
  indexer._check_tactic(op, tactic, x.shape[1])
  _check_rows(op, "x", x, tslot)
  out += indexer._query_shapes(op, q, None, norm_weight, norm_bias, x.shape[0], heads,
                               scale, eps, padded, w_out_dtype)
  return out + _cache_shapes(op, kv_cache, tail, tslot, ape, loc, pos, scale_format,
                             round_scale)


def _kernel_supports(*avals, **params):
  """Where each of the three ops' kernels supports its part (their own rules)."""
  return all(op.kernel_supports(*a, **p) for op, a, p in _parts(*avals, **params))


def _attribute_values(*avals, **params):
  """The three ops' kernel attribute values (projection tactic, scale format flags)."""
  values = {}
  for op, a, p in _parts(*avals, **params):
    values.update(p, **op.attribute_values(*a, **p))
  return values


def _kernel_params(*avals, **params):
  """The projection's tactic taken at the whole call's rows (Split: every device's block
  runs the whole call's tactic, as indexer_projection's does)."""
  (op, a, p), *_ = _parts(*avals, **params)
  return op.kernel_params(*a, **p)


def _cache_localize(index, *args):
  """Split's localize of a call whose last six operands are kpool_update's (kv_cache, tail,
  tslot, ape, loc, pos; indexer_update and update_epilogue): its ids (tslot, loc) made
  device-local by kpool_update's own rule, the operands before them as they are."""
  kv_cache, tail, tslot, ape, loc, pos = args[-6:]
  kv_cache, tail, tslot, _, _, ape, loc, pos = kpool._update_localize(
      index, kv_cache, tail, tslot, None, None, ape, loc, pos)
  return (*args[:-6], kv_cache, tail, tslot, ape, loc, pos)


# Every attribute of the three ops' kernels (their names do not collide), pdl implicit.
_ATTRIBUTES = {name: typ for op in PARTS for name, typ in op.attributes.items() if name != "pdl"}

_update = Op(
    OP, lambda *args, tactic, **params: ref.indexer_update(*args, **params), _shapes,
    aliases={5: 6, 6: 7}, kernel="glm5_indexer_update", attributes=_ATTRIBUTES,
    attribute_values=_attribute_values, kernel_supports=_kernel_supports,
    kernel_limits="those of indexer_projection, indexer_query and kpool_update",
    **indexer.default_rows(UPDATE_KERNEL_ROWS, "where the stage's update part was faster "
                           f"with it ({indexer.UPDATE_PART_MEASURED})"),
    otherwise="XLA's GEMM + update_epilogue",
    kernel_params=_kernel_params,
    split=Split(("rows", None, "rows", None, None, "pages", "blocks", "requests", None,
                 "requests", "requests"), ("rows",) * 6 + ("pages", "blocks"), _cache_localize))


def indexer_update(x: jax.Array, w_cat: jax.Array, q: jax.Array, norm_weight: jax.Array,
                   norm_bias: jax.Array, kv_cache: jax.Array, tail: jax.Array,
                   tslot: jax.Array, ape: jax.Array, loc: jax.Array, pos: jax.Array, *,
                   heads: int, scale: float, eps: float = 1e-6, padded: int | None = None,
                   w_out_dtype: DTypeLike = jnp.float32, scale_format: str = "fp32",
                   round_scale: bool = True, tactic: tuple[int, int] | None = None,
                   routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_projection -> indexer_query -> kpool_update as one op: (key_raw bf16[M, 128],
  head_w f32[M, heads], gate bf16[M, 128], q_fp8 e4m3[M, padded, 128], w_out[M, padded],
  key bf16[M, 128], kv_cache, tail), the three ops' results in order; x bf16[M, K] with
  M = B * N rows of tslot, loc, pos i32[B, N] (request-major). See
  glm5_jax.reference.indexer_update.

  By default the CUDA kernel at UPDATE_KERNEL_ROWS (M 2..16, where it was faster), elsewhere
  XLA's GEMM for the projection and update_epilogue on its f32 sums (its kernel where
  chosen), the composition the reference spells out. The CUDA kernel (glm5_indexer_update;
  where the routing chooses it) launches the projection's kernel and one epilogue (a warp
  per request: the key LayerNorm and kpool_update; a warp per q row: the query epilogue)
  in one FFI call with PDL between them, at the shapes all three ops' kernels support
  (others run the reference; kernel_chosen says which). Its outputs are bit-identical to
  indexer_projection(tactic=projection_tactic(M, K, tactic)), indexer_query and
  kpool_update each run as its kernel: the same device code with the same arguments.
  The caches are updated in place (donate them), as by kpool_update; w_cat is read
  before the preceding kernel has finished (PDL), as by indexer_projection. tactic: the
  projection kernel's (None: the table by M). routing: None = Routing.from_env().
  """
  params = _params(heads, scale, eps, padded, w_out_dtype, scale_format, round_scale, tactic)
  args = (x, w_cat, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos)
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
  tactic = None if tactic is None else tuple(int(v) for v in tactic)
  return dict(indexer._query_params(OP, scale, eps, padded, heads, w_out_dtype),
              heads=int(heads), tactic=tactic, scale_format=scale_format,
              round_scale=bool(round_scale))


def kernel_chosen(*args: jax.Array, heads: int, scale: float, eps: float = 1e-6,
                  padded: int | None = None, w_out_dtype: DTypeLike = jnp.float32,
                  scale_format: str = "fp32", round_scale: bool = True,
                  tactic: tuple[int, int] | None = None,
                  routing: Routing | None = None) -> bool:
  """Whether indexer_update(*args, ...) with these arguments would call its kernel on a
  GPU (the routing, the kernel's limits; off by default): indexer_stage's
  IndexerConfig(update="auto") runs the update part as this op's one FFI call where it
  would. Decided from shapes at trace time, whatever the platform."""
  params = _params(heads, scale, eps, padded, w_out_dtype, scale_format, round_scale, tactic)
  return _update.kernel_chosen(Routing.resolve(routing, OP), [jax.typeof(a) for a in args],
                               params)


# update_epilogue: indexer_update's epilogue alone, on the f32 sums of a projection GEMM of
# XLA's (reference.projection_sums): the update path at M = 1 where indexer_update_q is not
# chosen (indexer.UPDATE_PART_MEASURED).
# Without it XLA's GEMM is followed by three slice copies of its output, the query kernel and
# kpool_update.
EPILOGUE_OP = "update_epilogue"


def _epilogue_parts(raw, q, *rest, **params):
  """[(Op, operand avals, params)] of the two ops whose work one call does, their projection
  operands as split_projection gives them."""
  m, heads = q.shape[:2]
  key_raw = jax.core.ShapedArray((m, DIM), BF16)
  head_w = jax.core.ShapedArray((m, heads), indexer.F32)
  return _epilogue_ops(q, key_raw, head_w, *rest, **params)


def _epilogue_shapes(raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos, *,
                     scale, eps, padded, w_out_dtype, scale_format, round_scale,
                     op=EPILOGUE_OP):
  """(q_fp8, w_out, key, kv_cache, tail): the query's and kpool_update's result shapes by
  their rules (errors name `op`), raw f32[M, 256 + H] and M = B * N."""
  expect(op, "q", q, BF16, (None, None, DIM))
  m, heads = q.shape[:2]
  expect(op, "tslot", tslot, I32, (None, None))
  _check_rows(op, "q", q, tslot)
  expect(op, "raw", raw, indexer.F32, (m, 2 * DIM + heads))
  out = indexer._query_shapes(op, q, None, norm_weight, norm_bias, m, heads, scale, eps,
                              padded, w_out_dtype)
  return out + _cache_shapes(op, kv_cache, tail, tslot, ape, loc, pos, scale_format,
                             round_scale)


def _epilogue_kernel_supports(raw, q, *avals, **params):
  """H % RAW_HEADS_MULTIPLE == 0, and the query's and kpool_update's kernels' own rules."""
  return q.shape[1] % RAW_HEADS_MULTIPLE == 0 and all(
      op.kernel_supports(*a, **p) for op, a, p in _epilogue_parts(raw, q, *avals, **params))


def _epilogue_attribute_values(*avals, **params):
  """The two kernels' attribute values (the scale format flags)."""
  values = {}
  for op, a, p in _epilogue_parts(*avals, **params):
    values.update(op.attribute_values(*a, **p))
  return values


_epilogue = Op(
    EPILOGUE_OP, ref.update_epilogue, _epilogue_shapes, aliases={4: 3, 5: 4},
    kernel="glm5_update_epilogue",
    attributes={name: typ for op in PARTS[1:] for name, typ in op.attributes.items()
                if name != "pdl"},
    attribute_values=_epilogue_attribute_values, kernel_supports=_epilogue_kernel_supports,
    kernel_limits=(f"heads % {RAW_HEADS_MULTIPLE} == 0 and those of indexer_query and "
                   "kpool_update"),
    split=Split(("rows", "rows", None, None, "pages", "blocks", "requests", None, "requests",
                 "requests"), ("rows",) * 3 + ("pages", "blocks"), _cache_localize))


def update_epilogue(raw: jax.Array, q: jax.Array, norm_weight: jax.Array,
                    norm_bias: jax.Array, kv_cache: jax.Array, tail: jax.Array,
                    tslot: jax.Array, ape: jax.Array, loc: jax.Array, pos: jax.Array, *,
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
  return tuple(_epilogue(raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos,
                         routing=routing, **params))


def _epilogue_params(q, scale, eps, padded, w_out_dtype, scale_format, round_scale):
  """update_epilogue's keyword arguments as the primitive takes them (q: its heads)."""
  return dict(indexer._query_params(EPILOGUE_OP, scale, eps, padded, q.shape[1], w_out_dtype),
              scale_format=scale_format, round_scale=bool(round_scale))


def epilogue_kernel_chosen(*args: jax.Array, scale: float, eps: float = 1e-6,
                           padded: int | None = None, w_out_dtype: DTypeLike = jnp.float32,
                           scale_format: str = "fp32", round_scale: bool = True,
                           routing: Routing | None = None) -> bool:
  """Whether update_epilogue(*args, ...) would call its kernel on a GPU (the routing, its
  limits), decided from shapes at trace time: indexer_stage's update path runs XLA's GEMM
  and this op where it would and indexer_update's kernel is not chosen, the three ops
  elsewhere."""
  params = _epilogue_params(args[1], scale, eps, padded, w_out_dtype, scale_format,
                            round_scale)
  return _epilogue.kernel_chosen(Routing.resolve(routing, EPILOGUE_OP),
                                 [jax.typeof(a) for a in args], params)


# update_epilogue_q: indexer_q's GEMM and update_epilogue's kernel launched by one FFI call.
# In a jitted step XLA records every FFI call as a CUDA graph of its own, a child node of the
# command buffer (bench/NOTES.md, eighteenth session), so indexer_q's kernel as its own call
# cost the stage a child graph per layer; inside the call the stage already makes it costs
# one more kernel, with PDL between the two.
EPILOGUE_Q_OP = "update_epilogue_q"
# Where update_epilogue_q's kernel runs by default: past indexer_update's rows, up to the
# rows measured, where the stage's update part was fastest with it (indexer.UPDATE_PART_MEASURED:
# 16.6 / 18.3 / 20.9 µs per layer at M 32 / 64 / 128 against 16.9 / 18.7 / 21.2 for the next
# best). Under ncu its q GEMM alone takes 6.8 / 7.2 / 8.0 µs at M = 1 / 16 / 64 against XLA's
# 5.7 / 9.2 / 10.4 (GEMM + split-K reduction; bench/NOTES.md, nineteenth session).
EPILOGUE_Q_ROWS = (UPDATE_KERNEL_ROWS[1] + 1, indexer.UPDATE_PART_MAX_ROWS)


def _q_aval(qr, wq_b):
  """q bf16[M, H, 128] as the epilogue sees indexer_q's bf16[M, H * 128]."""
  return jax.core.ShapedArray((qr.shape[0], wq_b.shape[0] // DIM, DIM), BF16)


def _epilogue_q_parts(raw, qr, wq_b, *rest, tactic, **params):
  """[(Op, operand avals, params)] of the three ops whose work one call does: indexer_q,
  indexer_query and kpool_update."""
  return ([(indexer._q, (qr, wq_b), dict(tactic=tactic))]
          + _epilogue_parts(raw, _q_aval(qr, wq_b), *rest, **params))


def _epilogue_q_shapes(raw, qr, wq_b, *rest, tactic, **params):
  """(q, q_fp8, w_out, key, kv_cache, tail): indexer_q's result shape by its rule, then
  update_epilogue's on q as [M, H, 128] (errors name update_epilogue_q)."""
  out = indexer._q_shapes(qr, wq_b, tactic=tactic, op=EPILOGUE_Q_OP)
  return out + _epilogue_shapes(raw, _q_aval(qr, wq_b), *rest, op=EPILOGUE_Q_OP, **params)


def _epilogue_q_kernel_supports(raw, qr, wq_b, *avals, tactic, **params):
  """indexer_q's kernel's rule at the call's tactic and update_epilogue's."""
  (q_op, q_avals, q_params), *_ = _epilogue_q_parts(raw, qr, wq_b, *avals, tactic=tactic,
                                                    **params)
  return (q_op.kernel_supports(*q_avals, **q_params)
          and _epilogue_kernel_supports(raw, _q_aval(qr, wq_b), *avals, **params))


def _epilogue_q_attribute_values(*avals, **params):
  """The three kernels' attribute values (q's tactic index, the scale format flags)."""
  values = {}
  for op, a, p in _epilogue_q_parts(*avals, **params):
    values.update(op.attribute_values(*a, **p))
  return values


def _epilogue_q_kernel_params(raw, qr, wq_b, *avals, tactic, **params):
  """q's tactic taken for the whole call (Split: every device's block sums as it would)."""
  return indexer._q.kernel_params(qr, wq_b, tactic=tactic)


_epilogue_q = Op(
    EPILOGUE_Q_OP, lambda *args, tactic, **params: ref.update_epilogue_q(*args, **params),
    _epilogue_q_shapes, aliases={5: 4, 6: 5}, kernel="glm5_update_epilogue_q",
    attributes={name: typ for op in (indexer._q, _epilogue) for name, typ in op.attributes.items()
                if name != "pdl"},
    attribute_values=_epilogue_q_attribute_values, kernel_supports=_epilogue_q_kernel_supports,
    kernel_limits="those of indexer_q (its tactic) and update_epilogue",
    **indexer.default_rows(EPILOGUE_Q_ROWS, "where the stage's update part was fastest "
                           f"with it ({indexer.UPDATE_PART_MEASURED})"),
    kernel_params=_epilogue_q_kernel_params,
    split=Split(("rows", "rows", None, None, None, "pages", "blocks", "requests", None,
                 "requests", "requests"), ("rows",) * 4 + ("pages", "blocks"), _cache_localize))


def update_epilogue_q(raw: jax.Array, qr: jax.Array, wq_b: jax.Array, norm_weight: jax.Array,
                      norm_bias: jax.Array, kv_cache: jax.Array, tail: jax.Array,
                      tslot: jax.Array, ape: jax.Array, loc: jax.Array, pos: jax.Array, *,
                      scale: float, eps: float = 1e-6, padded: int | None = None,
                      w_out_dtype: DTypeLike = jnp.float32, scale_format: str = "fp32",
                      round_scale: bool = True, tactic: str | None = None,
                      routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_q -> update_epilogue as one op: (q bf16[M, H * 128], q_fp8 e4m3[M, padded,
  128], w_out[M, padded], key bf16[M, 128], kv_cache, tail); raw f32[M, 256 + H] (the
  projection's sums), qr bf16[M, K], wq_b bf16[H * 128, K], the rest as update_epilogue. See
  glm5_jax.reference.update_epilogue_q.

  The CUDA kernel (glm5_update_epilogue_q) launches indexer_q's GEMM (tactic: as
  indexer_q's) and update_epilogue's kernel in one FFI call with PDL between them: its
  results are bit-identical to indexer_q(tactic=...) and update_epilogue each run as its
  kernel. q's sums run in the kernel's order, not XLA's (within SPEC D2). wq_b is read
  before the preceding kernel has finished (PDL): pass it as a model parameter. The caches
  are updated in place (donate them). routing: None = Routing.from_env().
  """
  params = _epilogue_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format,
                              round_scale, tactic)
  return tuple(_epilogue_q(raw, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape,
                           loc, pos, routing=routing, **params))


def _epilogue_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format, round_scale,
                       tactic):
  """update_epilogue_q's keyword arguments as the primitive takes them (wq_b: its heads)."""
  heads = jax.typeof(wq_b).shape[0] // DIM
  return dict(indexer._query_params(EPILOGUE_Q_OP, scale, eps, padded, heads, w_out_dtype),
              scale_format=scale_format, round_scale=bool(round_scale), tactic=tactic)


def epilogue_q_kernel_chosen(*args: jax.Array, scale: float, eps: float = 1e-6,
                             padded: int | None = None, w_out_dtype: DTypeLike = jnp.float32,
                             scale_format: str = "fp32", round_scale: bool = True,
                             tactic: str | None = None, routing: Routing | None = None) -> bool:
  """Whether update_epilogue_q(*args, ...) would call its kernel on a GPU (the routing, its
  limits), decided from shapes at trace time: indexer_stage's update path runs XLA's
  projection GEMM and this op where it would (no separate q GEMM)."""
  params = _epilogue_q_params(args[2], scale, eps, padded, w_out_dtype, scale_format,
                              round_scale, tactic)
  return _epilogue_q.kernel_chosen(Routing.resolve(routing, EPILOGUE_Q_OP),
                                   [jax.typeof(a) for a in args], params)


# indexer_update_q: indexer_q's GEMM and indexer_update's kernels in one FFI call (cc/update.cu:
# q's GEMM, then the projection with PDL, reading x and w_cat while q's GEMM runs, then the
# epilogue with PDL). As two FFI calls (indexer_q's, indexer_update's) each is a child
# graph of its own in the command buffer and PDL does not cross them: the two GEMMs, 15 MB of
# weights, streamed one after the other.
UPDATE_Q_OP = "indexer_update_q"
# Where indexer_update_q's kernel runs by default: M 1..64. M 2..32 where the stage's update
# part was fastest with it (indexer.UPDATE_PART_MEASURED: 12.9 / 12.9 / 13.0 / 13.2 / 13.5 /
# 14.9 µs per layer at M 2 / 3 / 4 / 8 / 16 / 32 against 14.2 / 14.9 / 14.9 / 15.2 / 15.6 /
# 16.6 for the paths routed before); M 33..64 since its projection runs its own tactic there
# (UPDATE_Q_TACTICS: at M = 64 10.42 / 10.89 µs a layer with the wgmma tactic against
# update_epilogue_q's 11.46 / 11.82, barrier chain, twenty-sixth session); M = 1 since its
# projection waits for q's GEMM only before exiting (the 1K update part, barrier chain, 8.33
# against XLA's GEMV and update_epilogue's 9.78, the whole stage 11.92 against 13.66, one
# run, twenty-sixth session; 9.0 against 9.3 before, twenty-fifth). At M 96 / 128 it read
# 16.76 / 16.65 against update_epilogue_q's 17.06 / 16.62: within the runs' spread, so
# update_epilogue_q stays past 64. The stage runs it in preference to indexer_update's and
# update_epilogue_q's kernels where it is chosen.
UPDATE_Q_ROWS = (1, 64)
# The projection's (warps, split) inside indexer_update_q by M: (up to rows, tactic), the
# last entry for every M past the one before; None: indexer.projection_tactic's table
# without the GEMV (the projection's standalone and in indexer_update). Beside q's GEMM the
# projection is the update part's critical path (a 1K timeline with that table: it ended
# 1.2 µs after q's GEMM at M = 16 and 3.8 µs after it at M = 64), and past 32 rows the
# wgmma tactic (TMA ring, wgmma, clusters of 8 over K) ends it soonest. Update part, 1K,
# 11 layers, barrier chain, µs a layer (H200, bench/NOTES.md twenty-fifth and twenty-sixth
# sessions), the table / (4, 8) / wgmma in one run: M = 48 10.82 / 10.83 / 10.18, M = 64
# 11.50 / 11.48 / 10.89 (another run 11.48 / 11.56 / 10.42); before, (4, 8) against the
# table's (8, 8) at M = 64: 11.45 against 13.20. Up to 32 rows the table stays: at M = 32
# the wgmma tactic (CTAs of 32 tokens) took 12.81 against 9.44, at M 2-16 it read
# within the runs' spread (8.48-8.57 against 8.44-8.55, 8.52 against 8.64-8.90 at 16), and
# a tactic other than indexer_update's there makes IndexerConfig.update's compositions sum
# the projection in two orders (the H200 run of tests/test_stage.py: 4 failures). The GEMV
# is never used beside q's GEMM: its CTA per w_cat row slowed q's GEMM from 6.2 to 8.0 /
# 9.8 µs a layer at M = 1 / 2 (twenty-second session).
UPDATE_Q_TACTICS = ((32, None), (None, (indexer.WGMMA_WARPS, indexer.WGMMA_SPLIT)))


def update_q_projection_tactic(rows: int, k: int, tactic: tuple[int, int] | None = None
                               ) -> tuple[int, int]:
  """The (warps, split) of the projection inside indexer_update_q's kernel at M = rows, K:
  `tactic` where given, else UPDATE_Q_TACTICS' entry for the rows where it names one that
  tiles K, else indexer.projection_tactic's table without the GEMV."""
  if tactic is None:
    tactic = next(t for upto, t in UPDATE_Q_TACTICS if upto is None or rows <= upto)
    if tactic is not None and not indexer.tile_k(k, *tactic):
      tactic = None
  return indexer.projection_tactic(rows, k, tactic, gemv=False)


def _update_q_parts(x, w_cat, qr, wq_b, *rest, tactic, q_tactic, **params):
  """[(Op, operand avals, params)] of the four ops one call runs: indexer_q, then
  indexer_update's three on q seen as [M, H, 128], the projection at its tactic here."""
  q = _q_aval(qr, wq_b)
  tactic = update_q_projection_tactic(x.shape[0], x.shape[1], tactic)
  return ([(indexer._q, (qr, wq_b), dict(tactic=q_tactic))]
          + _parts(x, w_cat, q, *rest, heads=q.shape[1], tactic=tactic, **params))


def _update_q_shapes(x, w_cat, qr, wq_b, *rest, tactic, q_tactic, **params):
  """(key_raw, head_w, gate, q, q_fp8, w_out, key, kv_cache, tail): indexer_q's result
  shape by its rule after indexer_update's three projection results, M = B * N between qr
  and tslot, then indexer_update's rule on q as [M, H, 128] (errors name
  indexer_update_q)."""
  q_out = indexer._q_shapes(qr, wq_b, tactic=q_tactic, op=UPDATE_Q_OP)
  tslot = rest[4]
  expect(UPDATE_Q_OP, "tslot", tslot, I32, (None, None))
  _check_rows(UPDATE_Q_OP, "qr", qr, tslot)
  q = _q_aval(qr, wq_b)
  out = _shapes(x, w_cat, q, *rest, heads=q.shape[1], tactic=tactic, op=UPDATE_Q_OP,
                **params)
  return out[:3] + q_out + out[3:]


def _update_q_kernel_supports(*avals, **params):
  """Where each of the four ops' kernels supports its part (their own rules; the
  projection's at update_q_projection_tactic's tactic, which must tile K)."""
  return all(op.kernel_supports(*a, **p) for op, a, p in _update_q_parts(*avals, **params))


def _update_q_attribute_values(*avals, **params):
  """The four kernels' attribute values: the projection's (warps, split), q's tactic index
  (the FFI attribute "tactic"), the scale format flags."""
  values = {}
  for op, a, p in _update_q_parts(*avals, **params):
    values.update(op.attribute_values(*a, **p))
  return values


def _update_q_kernel_params(x, w_cat, qr, wq_b, *avals, tactic, q_tactic, **params):
  """Both GEMMs' tactics taken at the whole call's rows (Split: every device's block sums
  as the whole call would)."""
  return dict(tactic=update_q_projection_tactic(x.shape[0], x.shape[1], tactic),
              q_tactic=indexer._q.kernel_params(qr, wq_b, tactic=q_tactic)["tactic"])


_update_q = Op(
    UPDATE_Q_OP,
    lambda *args, tactic, q_tactic, **params: ref.indexer_update_q(*args, **params),
    _update_q_shapes, aliases={6: 7, 7: 8}, kernel="glm5_indexer_update_q",
    attributes={name: typ for op in (indexer._q,) + PARTS for name, typ in op.attributes.items()
                if name != "pdl"},
    attribute_values=_update_q_attribute_values, kernel_supports=_update_q_kernel_supports,
    kernel_limits=("those of indexer_q (its tactic) and indexer_update, the projection at "
                   "update_q_projection_tactic's (warps, split) (UPDATE_Q_TACTICS, or the one "
                   "given), which must tile K"),
    **indexer.default_rows(UPDATE_Q_ROWS, "where the stage's update part was fastest "
                           f"with it ({indexer.UPDATE_PART_MEASURED})"),
    otherwise="indexer_q + indexer_update",
    kernel_params=_update_q_kernel_params,
    split=Split(("rows", None, "rows", None, None, None, "pages", "blocks", "requests", None,
                 "requests", "requests"), ("rows",) * 7 + ("pages", "blocks"), _cache_localize))


def indexer_update_q(x: jax.Array, w_cat: jax.Array, qr: jax.Array, wq_b: jax.Array,
                     norm_weight: jax.Array, norm_bias: jax.Array, kv_cache: jax.Array,
                     tail: jax.Array, tslot: jax.Array, ape: jax.Array, loc: jax.Array,
                     pos: jax.Array, *, scale: float, eps: float = 1e-6,
                     padded: int | None = None, w_out_dtype: DTypeLike = jnp.float32,
                     scale_format: str = "fp32", round_scale: bool = True,
                     tactic: tuple[int, int] | None = None, q_tactic: str | None = None,
                     routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_q -> indexer_update as one op, the whole update part of a decode step:
  (key_raw bf16[M, 128], head_w f32[M, H], gate bf16[M, 128], q bf16[M, H * 128], q_fp8
  e4m3[M, padded, 128], w_out[M, padded], key bf16[M, 128], kv_cache, tail); qr bf16[M, Kq]
  and wq_b bf16[H * 128, Kq] in place of indexer_update's q (H = wq_b's rows / 128; w_cat
  has 256 + H rows), the rest as indexer_update. See glm5_jax.reference.indexer_update_q.

  By default the CUDA kernel at UPDATE_Q_ROWS (M 1..64, where it was faster). The CUDA
  kernel (glm5_indexer_update_q; where the routing chooses it) launches q's GEMM,
  the projection and the epilogue in one FFI call with PDL between them; the projection
  streams w_cat and x while q's GEMM runs. Its results are bit-identical to
  indexer_q(tactic=q_tactic) and indexer_update(tactic=update_q_projection_tactic(M, K,
  tactic)) each run as its kernel.
  Where it is not chosen: indexer_q then indexer_update, each routed as its own op. q's sums
  run in indexer_q's order, not XLA's (within SPEC D2). The weights are read before the
  preceding kernel has finished (PDL): pass them as model parameters. The caches are updated
  in place (donate them). tactic: the projection's (None: update_q_projection_tactic's,
  by UPDATE_Q_TACTICS); q_tactic: q's, as indexer_q's tactic. routing: None = Routing.from_env().
  """
  params = _update_q_params(wq_b, scale, eps, padded, w_out_dtype, scale_format, round_scale,
                            tactic, q_tactic)
  args = (x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos)
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
  tactic = None if tactic is None else tuple(int(v) for v in tactic)
  return dict(indexer._query_params(UPDATE_Q_OP, scale, eps, padded, heads, w_out_dtype),
              scale_format=scale_format, round_scale=bool(round_scale), tactic=tactic,
              q_tactic=q_tactic)


def update_q_kernel_chosen(*args: jax.Array, scale: float, eps: float = 1e-6,
                           padded: int | None = None, w_out_dtype: DTypeLike = jnp.float32,
                           scale_format: str = "fp32", round_scale: bool = True,
                           tactic: tuple[int, int] | None = None, q_tactic: str | None = None,
                           routing: Routing | None = None) -> bool:
  """Whether indexer_update_q(*args, ...) would call its kernel on a GPU (the routing, its
  limits), decided from shapes at trace time: indexer_stage's update "auto" runs the whole
  update part as this op's one FFI call where it would."""
  params = _update_q_params(args[3], scale, eps, padded, w_out_dtype, scale_format,
                            round_scale, tactic, q_tactic)
  return _update_q.kernel_chosen(Routing.resolve(routing, UPDATE_Q_OP),
                                 [jax.typeof(a) for a in args], params)
