"""Logits ops: MQA logits over the pooled cache, pool top-k, bf16 -> fp32 upcast
(SPEC §5b, §5c, §8). Shapes and dtypes: see glm5_jax.reference.logits."""
import numpy as np
import jax
import jax.numpy as jnp

from . import reference as ref
from ._checks import check_cache, check_scale_format, expect, fail
from ._primitive import Op, Routing, Split, local_ids
from .expand import check_remap, expand_and_remap, remap_attribute_values
from .limits import (
  LOGITS_HEADS,
  LOGITS_ITEM_POOLS,
  LOGITS_MAX_ROWS,
  LOGITS_PAGE_MULTIPLE,
  TOPK_MAX_POOLS,
)
from .plan import TopkChunks, select_kernel_default, topk_chunks, topk_row_words
from .reference.expand import remap_stride
from .reference.numerics import DIM

I32, F32 = np.int32, np.float32


def _upcast_shapes(logits, row_ends):
  expect("upcast_logits", "logits", logits, jnp.bfloat16, (None, None))
  expect("upcast_logits", "row_ends", row_ends, I32, (logits.shape[0],))
  return [(logits.shape, F32)]


_upcast = Op("upcast_logits", ref.upcast_logits, _upcast_shapes, rows=((0, 0), (0,)),
             kernel="glm5_upcast_logits",
             kernel_off='upcast_logits "kernel" against "reference": XLA\'s fused convert wins',
             split=Split(("rows", "rows"), ("rows",)))


def upcast_logits(logits: jax.Array, row_ends: jax.Array, *,
                  routing: Routing | None = None) -> jax.Array:
  """bf16[rows, width] logits -> f32 below row_ends i32[rows] (SPEC §8).

  Columns at or past a row's end are unspecified. fp32 logits are returned
  unchanged. routing: None = Routing.from_env().
  """
  if jnp.result_type(logits) == jnp.float32:
    return logits
  return _upcast(logits, row_ends, routing=routing)[0]


def _check_queries(op, q_fp8, w_out, kv_cache, scale_format):
  """The logits ops' shared arguments; returns the row count."""
  expect(op, "q_fp8", q_fp8, jnp.float8_e4m3fn, (None, None, DIM))
  rows, heads = q_fp8.shape[:2]
  expect(op, "w_out", w_out, F32, (rows, heads))
  check_cache(op, kv_cache)
  check_scale_format(op, scale_format)
  return rows


def _mqa_shapes(q_fp8, w_out, kv_cache, page_table, pool_lens, *, max_pools,
                scale_format):
  op = "mqa_logits"
  rows = _check_queries(op, q_fp8, w_out, kv_cache, scale_format)
  expect(op, "page_table", page_table, I32, (rows, None))
  expect(op, "pool_lens", pool_lens, I32, (rows,))
  if max_pools < 0:
    fail(op, "max_pools", f"must be >= 0, got {max_pools}")
  return [((rows, max_pools), F32)]


def _logits_kernel_supports(q_fp8, kv_cache, max_pools):
  rows, page = q_fp8.shape[0], kv_cache.shape[1]
  return (q_fp8.shape[1] in LOGITS_HEADS and page > 0 and page % LOGITS_PAGE_MULTIPLE == 0
          and rows <= LOGITS_MAX_ROWS and rows * -(-max_pools // LOGITS_ITEM_POOLS) < 2 ** 31)


def _ue8m0(*avals, scale_format, **params):
  return dict(ue8m0=scale_format == "ue8m0")


_LOGITS_LIMITS = (f"{' or '.join(map(str, LOGITS_HEADS))} padded heads, PAGE % "
                  f"{LOGITS_PAGE_MULTIPLE} == 0, rows <= {LOGITS_MAX_ROWS}")

_mqa = Op("mqa_logits", ref.mqa_logits, _mqa_shapes,
          rows=((0, 0, None, 0, 0), (0,)), kernel="glm5_mqa_logits",
          attributes=dict(ue8m0=np.bool_), attribute_values=_ue8m0,
          kernel_supports=lambda q_fp8, w_out, kv_cache, *rest, max_pools, **params: (
              _logits_kernel_supports(q_fp8, kv_cache, max_pools)),
          kernel_limits=_LOGITS_LIMITS,
          split=Split(("rows", "rows", "pages", "rows", "rows"), ("rows",),
                      lambda index, q_fp8, w_out, kv_cache, page_table, pool_lens: (
                          q_fp8, w_out, kv_cache,
                          local_ids(page_table, index, kv_cache.shape[0]), pool_lens)))


def mqa_logits(q_fp8: jax.Array, w_out: jax.Array, kv_cache: jax.Array,
               page_table: jax.Array, pool_lens: jax.Array, *, max_pools: int,
               scale_format: str = "fp32", routing: Routing | None = None) -> jax.Array:
  """Pool scores f32[rows, max_pools] of fp8 queries against the paged K cache
  (SPEC §5b); see glm5_jax.reference.mqa_logits for shapes. The kernel sums in its
  own fixed order (cc/select.cu), its fp8 dots on tensor cores that truncate their sums:
  within 2^-9 * sum_h |w| sum_d |q k| * scale of the exact value (docs/semantics.md §5b,
  tests/test_select_gpu.py), not bit-equal to the reference."""
  return _mqa(q_fp8, w_out, kv_cache, page_table, pool_lens,
              max_pools=int(max_pools), scale_format=scale_format, routing=routing)[0]


def _topk_shapes(logits, pool_lens, *, k):
  expect("pool_topk", "logits", logits, F32, (None, None))
  expect("pool_topk", "pool_lens", pool_lens, I32, (logits.shape[0],))
  if k <= 0:
    fail("pool_topk", "k", f"must be > 0, got {k}")
  return [((logits.shape[0], k), I32)]


_topk = Op("pool_topk", ref.pool_topk, _topk_shapes, rows=((0, 0), (0,)),
           kernel="glm5_pool_topk",
           kernel_supports=lambda logits, pool_lens, **params: logits.shape[1] <= TOPK_MAX_POOLS,
           kernel_limits=f"{topk_row_words('P')} a call (wider rows: over chunks)",
           otherwise="the kernel over chunks of the row, then over the chunks' candidates, "
                     "where plan.topk_chunks cuts the row; else the reference",
           split=Split(("rows", "rows"), ("rows",)))


def pool_topk(logits: jax.Array, pool_lens: jax.Array, *, k: int,
              routing: Routing | None = None) -> jax.Array:
  """The k best pool ids i32[rows, k] of f32[rows, P] logits below pool_lens
  (SPEC §5c): the k largest (ties by ascending id), listed in ascending id, -1 where
  fewer. The kernel equals the reference exactly. Rows wider than one kernel call holds
  run it over chunks of the row, then over the chunks' candidates (plan.topk_chunks):
  the same ids, exactly."""
  k = int(k)
  rows, width = jnp.shape(logits)
  chunks = _kernel_chunks(rows, width, k, routing)
  if chunks is not None:
    _topk_shapes(jax.typeof(logits), jax.typeof(pool_lens), k=k)
    padded = jnp.pad(logits, ((0, 0), (0, chunks.padded - width)))
    return _chunked_topk(padded, jnp.clip(pool_lens, 0, width), k, chunks, routing)
  return _topk(logits, pool_lens, k=k, routing=routing)[0]


def _kernel_chunks(rows, width, k, routing) -> TopkChunks | None:
  """plan.topk_chunks of rows of `width` pools where they cut the row and the routing runs
  pool_topk's kernel on the chunks; else None (one call: the kernel, or the reference)."""
  chunks = topk_chunks(width, k, rows)
  chunk_rows = rows * chunks.chunks
  if chunks.chunks > 1 and _topk.kernel_chosen(
      Routing.resolve(routing, _topk.name),
      [jax.ShapeDtypeStruct((chunk_rows, chunks.pools), F32),
       jax.ShapeDtypeStruct((chunk_rows,), I32)], dict(k=k)):
    return chunks
  return None


def _chunked_topk(logits, lens, k, chunks, routing):
  """pool_topk of f32[rows, chunks.padded] logits whose pools past lens i32[rows] (<= the
  unpadded width) are not eligible: each chunk's top-k (local ids ascending, -1 past), then
  the top-k of their candidates. The candidates lie in (chunk, id) order, so a position
  order is the id order (ties by ascending position are ties by ascending id), and every
  chunk before a row's last one is wider than k, so the valid candidates are a prefix."""
  rows = logits.shape[0]
  n, width = chunks.chunks, chunks.pools
  first = jnp.arange(n, dtype=I32) * width
  chunk_lens = jnp.clip(lens[:, None] - first, 0, width)                     # [rows, n]
  parts = logits.reshape(rows * n, width)
  local = _topk(parts, chunk_lens.reshape(-1), k=k, routing=routing)[0]      # [rows * n, k]
  values = jnp.take_along_axis(parts, jnp.maximum(local, 0), axis=1).reshape(rows, n * k)
  ids = jnp.where(local >= 0, local + jnp.tile(first, rows)[:, None], -1).reshape(rows, n * k)
  return candidates_topk(ids, values, jnp.sum(jnp.minimum(chunk_lens, k), axis=1, dtype=I32),
                         k=k, routing=routing)


def candidates_topk(ids, values, count, *, k, routing=None):
  """The top-k pool ids i32[rows, k] among candidates: ids i32[rows, C] in ascending order
  over each row's first count[r] (the valid ones), their logits f32[rows, C]. pool_topk
  ranks the positions (ties by ascending position, so by ascending id) and lists them in
  ascending order, which the ids keep; -1 where fewer."""
  pick = pool_topk(values, count, k=k, routing=routing)
  return jnp.where(pick >= 0, jnp.take_along_axis(ids, jnp.maximum(pick, 0), axis=1),
                   -1).astype(I32)


def _check_select(op, q_fp8, w_out, kv_cache, page_table, req_ids, positions, k, max_pools,
                  scale_format, next_n=1):
  """The select path's shared arguments (select_pools, select_slots); returns the rows."""
  rows = _check_queries(op, q_fp8, w_out, kv_cache, scale_format)
  expect(op, "page_table", page_table, I32, (None, None))
  expect(op, "req_ids", req_ids, I32, (rows,))
  expect(op, "positions", positions, I32, (rows,))
  if k <= 0:
    fail(op, "k", f"must be > 0, got {k}")
  if max_pools <= 0:
    fail(op, "max_pools", f"must be > 0, got {max_pools}")
  if next_n < 1:
    fail(op, "next_n", f"must be >= 1, got {next_n}")
  return rows


def _select_shapes(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, k, max_pools,
                   scale_format, next_n=1):
  rows = _check_select("select_pools", q_fp8, w_out, kv_cache, page_table, req_ids,
                       positions, k, max_pools, scale_format, next_n)
  return [((rows, k), I32), ((rows, max_pools), F32)]


def _select_kernel_supports(q_fp8, w_out, kv_cache, *rest, max_pools, **params):
  return _logits_kernel_supports(q_fp8, kv_cache, max_pools) and max_pools <= TOPK_MAX_POOLS


def _localize_select(index, q_fp8, w_out, kv_cache, page_table, req_ids, *rest):
  """A device's block of a select call: its pages and requests as local ids (req_ids name
  rows of the page table, and of select_slots' block table, split alike)."""
  return (q_fp8, w_out, kv_cache, local_ids(page_table, index, kv_cache.shape[0]),
          local_ids(req_ids, index, page_table.shape[0]), *rest)


_SELECT_OPERANDS = ("rows", "rows", "pages", "requests", "rows", "rows")
_SELECT_LIMITS = f"{_LOGITS_LIMITS}, max_pools <= {TOPK_MAX_POOLS}"
_SELECT_OTHERWISE = ("mqa_logits, then pool_topk over chunks{} where plan.topk_chunks cuts the "
                     "row; else the reference")


def _without_next_n(reference):
  """A select reference as the op's: next_n (how the kernel shares K reads) changes nothing
  it computes."""
  return lambda *args, next_n, **params: reference(*args, **params)


_select = Op(
    "select_pools", _without_next_n(ref.select_pools), _select_shapes,
    rows=((0, 0, None, None, 0, 0), (0, 0)), kernel="glm5_select_pools",
    attributes=dict(ue8m0=np.bool_, next_n=np.int64), attribute_values=_ue8m0,
    kernel_supports=_select_kernel_supports, **select_kernel_default(),
    kernel_limits=_SELECT_LIMITS, otherwise=_SELECT_OTHERWISE.format(""),
    split=Split(_SELECT_OPERANDS, ("rows", "rows"), _localize_select))


def select_pools(q_fp8: jax.Array, w_out: jax.Array, kv_cache: jax.Array,
                 page_table: jax.Array, req_ids: jax.Array, positions: jax.Array, *, k: int,
                 max_pools: int, scale_format: str = "fp32", next_n: int = 1,
                 routing: Routing | None = None) -> tuple[jax.Array, jax.Array]:
  """The select path of a decode step (SPEC §5), one FFI call on CUDA: (pool_ids
  i32[rows, k], logits f32[rows, max_pools]). A row with at most k pools selects all of
  them without logits (the causal fill), the others the top-k of their logits; see
  glm5_jax.reference.select_pools for shapes and which logits are specified.

  next_n: the rows come as requests of next_n consecutive rows (DecodeBatch's request-major
  rows, MTP): the kernel scores the rows of a request (up to limits.LOGITS_GROUP_ROWS of
  them) from one read of its K tiles. A hint only: rows are grouped by equal req_ids, and
  each row's logits and ids are the same bits whatever next_n is."""
  args = (q_fp8, w_out, kv_cache, page_table, req_ids, positions)
  params = dict(k=int(k), max_pools=int(max_pools), scale_format=scale_format,
                next_n=int(next_n))
  chunks = select_chunks(args, params, routing)
  if chunks is not None:
    return _select_by_chunks(*args, chunks=chunks, routing=routing, **params)
  ids, logits = _select(*args, routing=routing, **params)
  return ids, logits


def select_chunks(args, params, routing) -> TopkChunks | None:
  """The chunks (plan.topk_chunks) over which select_pools, at these operands (arrays or
  avals) and keywords (k, max_pools, scale_format[, next_n]), runs mqa_logits' kernel then
  pool_topk's: where its own kernel does not take the width but those do; else None."""
  avals = [jax.typeof(a) for a in args]
  if _select.kernel_chosen(Routing.resolve(routing, _select.name), avals, params):
    return None
  rows = avals[0].shape[0]
  chunks = _kernel_chunks(rows, params["max_pools"], params["k"], routing)
  logits_avals = [*avals[:3], jax.ShapeDtypeStruct((rows, avals[3].shape[1]), I32),
                  jax.ShapeDtypeStruct((rows,), I32)]
  if chunks is not None and _mqa.kernel_chosen(
      Routing.resolve(routing, _mqa.name), logits_avals,
      dict(max_pools=chunks.padded, scale_format=params["scale_format"])):
    return chunks
  return None


def _select_by_chunks(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, chunks, k,
                      max_pools, scale_format, routing, next_n=1):
  """select_pools of rows wider than its kernel takes: the logits of the rows with more
  than k pools (the others select 0..n-1 whatever their logits; mqa_logits reads each row's
  pages on its own, whatever next_n), then the top-k over chunks; the same ids as
  select_pools' reference, exactly. chunks: select_chunks' answer at these operands."""
  _select_shapes(*map(jax.typeof, (q_fp8, w_out, kv_cache, page_table, req_ids, positions)),
                 k=k, max_pools=max_pools, scale_format=scale_format, next_n=next_n)
  table, n = ref.row_pages(page_table, req_ids, positions, max_pools)
  logits = mqa_logits(q_fp8, w_out, kv_cache, table, jnp.where(n > k, n, 0),
                      max_pools=chunks.padded, scale_format=scale_format, routing=routing)
  return _chunked_topk(logits, n, k, chunks, routing), logits[:, :max_pools]


def _slots_shapes(q_fp8, w_out, kv_cache, page_table, req_ids, positions, block_table, *, k,
                  max_pools, block_size, width, stride_rows, scale_format, next_n=1):
  op = "select_slots"
  rows = _check_select(op, q_fp8, w_out, kv_cache, page_table, req_ids, positions, k,
                       max_pools, scale_format, next_n)
  check_remap(op, k, block_table, block_size=block_size, width=width, stride_rows=stride_rows)
  return [((rows, width), I32), ((rows,), I32), ((rows, max_pools), F32)]


# select_slots is select_pools' kernel whose top-k writes each selected pool's slots where it
# writes the pool id (the remap's arguments as attributes): its limits and scale attribute
# are select_pools'.
_slots = Op(
    "select_slots", _without_next_n(ref.select_slots), _slots_shapes,
    rows=((0, 0, None, None, 0, 0, None), (0, 0, 0)), kernel="glm5_select_slots",
    attributes=dict(ue8m0=np.bool_, k=np.int64, block_size=np.int64, stride_rows=np.int64,
                    max_block=np.int64, next_n=np.int64),
    attribute_values=lambda *avals, **params: {**_select.attribute_values(*avals, **params),
                                               **remap_attribute_values(*avals, **params)},
    kernel_supports=_select.kernel_supports,
    **select_kernel_default(), kernel_limits=_select.kernel_limits,
    otherwise=_SELECT_OTHERWISE.format(", then expand_and_remap"),
    split=Split(_SELECT_OPERANDS + ("requests",), ("rows", "rows", "rows"), _localize_select))


def _slots_params(k, max_pools, block_size, width, stride_rows, scale_format, next_n=1):
  """select_slots' keyword arguments as the primitive takes them."""
  block_size = int(block_size)
  return dict(k=int(k), max_pools=int(max_pools), block_size=block_size, width=int(width),
              stride_rows=remap_stride(block_size, None if stride_rows is None
                                       else int(stride_rows), "select_slots"),
              scale_format=scale_format, next_n=int(next_n))


def select_slots(q_fp8: jax.Array, w_out: jax.Array, kv_cache: jax.Array,
                 page_table: jax.Array, req_ids: jax.Array, positions: jax.Array,
                 block_table: jax.Array, *, k: int, max_pools: int, block_size: int,
                 width: int, stride_rows: int | None = None, scale_format: str = "fp32",
                 next_n: int = 1, routing: Routing | None = None) -> tuple[jax.Array, jax.Array]:
  """The select path to the sparse-MLA slots, one FFI call on CUDA: (slots i32[rows,
  width], counts i32[rows]) = expand_and_remap(select_pools(...)'s pool ids, positions,
  req_ids, block_table) (SPEC §5-§7); see glm5_jax.reference.select_slots. The kernel
  is select_pools' whose top-k writes each selected pool's four slots where it would
  write the pool id (no expand launch), bit-equal to the two ops. next_n: as
  select_pools'."""
  params = _slots_params(k, max_pools, block_size, width, stride_rows, scale_format, next_n)
  args = (q_fp8, w_out, kv_cache, page_table, req_ids, positions)
  select = dict(k=params["k"], max_pools=params["max_pools"], scale_format=scale_format,
                next_n=params["next_n"])
  avals = [jax.typeof(a) for a in (*args, block_table)]
  chunks = (None if _slots.kernel_chosen(Routing.resolve(routing, _slots.name), avals, params)
            else select_chunks(args, select, routing))
  if chunks is not None:
    _slots_shapes(*avals, **params)
    ids, _ = _select_by_chunks(*args, chunks=chunks, routing=routing, **select)
    return expand_and_remap(ids, positions, req_ids, block_table, block_size=block_size,
                            width=width, stride_rows=stride_rows, routing=routing)
  slots, counts, _ = _slots(*args, block_table, routing=routing, **params)
  return slots, counts
