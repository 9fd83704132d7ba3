"""indexer_update_select: indexer_update_q and select_slots as one op, one FFI call on CUDA
(cc/update.cu: q's GEMM, the projection, the epilogue, the logits and the top-k, PDL between
all five). As two calls each is a child graph of its own in the command buffer, and PDL does
not cross them: the logits kernel's row tables and first page lookups (indices only, read
before its PDL wait) then wait for the update part's end instead of overlapping its epilogue.

Operands: indexer_update_q's, then select_slots' page_table, req_ids and block_table (its
q_fp8, w_out and cache are the update's results, its positions the update's flattened).
Results: indexer_update_q's nine, then select_slots' slots, counts and logits. The stage
runs it where its plan runs both ops' kernels (glm5_jax.stage)."""
import numpy as np
import jax
import jax.numpy as jnp

from . import reference as ref
from ._checks import fail
from ._primitive import Op, Routing, Split, local_ids
from .logits import _slots_params
from .update import _attribute_values, _supports, _update_q_params

UPDATE_Q, SLOTS = (Op.registry[name] for name in ("indexer_update_q", "select_slots"))
OP = "indexer_update_select"
# The select path's keywords (select_slots'); the rest are indexer_update_q's.
SELECT_PARAMS = ("k", "max_pools", "block_size", "width", "stride_rows", "next_n")


def _split(params):
  """(indexer_update_q's params, select_slots' params) of the op's."""
  select = {n: params[n] for n in SELECT_PARAMS}
  select["scale_format"] = params["scale_format"]
  return {n: v for n, v in params.items() if n not in SELECT_PARAMS}, select


def _select_avals(update_avals, update_out, page_table, req_ids, block_table):
  """select_slots' operand avals: the update's q_fp8, w_out and cache, its positions flat."""
  q_fp8, w_out, kv = (jax.core.ShapedArray(s, d) for s, d in
                      (update_out[4], update_out[5], update_out[7]))
  positions = update_avals[11]
  flat = jax.core.ShapedArray((int(np.prod(positions.shape)),), positions.dtype)
  return (q_fp8, w_out, kv, page_table, req_ids, flat, block_table)


def _parts(*avals, **params):
  """[(Op, avals, params)] of the two ops the call runs."""
  update, select = _split(params)
  update_avals = avals[:12]
  update_out = UPDATE_Q.shapes(*update_avals, **update)
  return [(UPDATE_Q, update_avals, update),
          (SLOTS, _select_avals(update_avals, update_out, *avals[12:]), select)]


def _shapes(*avals, **params):
  (uop, ua, up), (sop, sa, sp) = _parts(*avals, **params)
  if np.dtype(params["w_out_dtype"]) != np.float32:
    fail(OP, "w_out_dtype", "must be float32 (the select path reads w_out as it is)")
  return list(uop.shapes(*ua, **up)) + list(sop.shapes(*sa, **sp))


def _reference(*args, tactic, q_tactic, w_out_dtype, next_n, **params):
  """reference.indexer_update_select at the primitive's params (the tactics and next_n change
  no result; w_out is float32)."""
  return ref.indexer_update_select(*args, **params)


def _localize(index, *args):
  """Each part's own ids made device-local by its rule: the update's cache slots
  (indexer_update_q's localize), the select path's pages and requests (select_slots')."""
  update = UPDATE_Q.split.localize(index, *args[:12])
  page_table, req_ids, block_table = args[12:]
  return (*update, local_ids(page_table, index, update[6].shape[0]),
          local_ids(req_ids, index, page_table.shape[0]), block_table)


_op = Op(
    OP, _reference, _shapes, aliases=dict(UPDATE_Q.aliases), kernel="glm5_indexer_update_select",
    attributes={n: t for op in (UPDATE_Q, SLOTS) for n, t in op.attributes.items()
                if n != "pdl"},
    attribute_values=_attribute_values(_parts), kernel_supports=_supports(_parts),
    kernel_limits="those of indexer_update_q and select_slots, w_out in float32",
    otherwise="the reference (the stage calls it only where both kernels run)",
    split=Split(UPDATE_Q.split.operands + ("requests", "rows", "requests"),
                UPDATE_Q.split.results + SLOTS.split.results, _localize))


def indexer_update_select(x: jax.Array, w_cat: jax.Array, qr: jax.Array, wq_b: jax.Array,
                          norm_weight: jax.Array, norm_bias: jax.Array, kv_cache: jax.Array,
                          tail: jax.Array, tslot: jax.Array, ape: jax.Array, loc: jax.Array,
                          positions: jax.Array, page_table: jax.Array, req_ids: jax.Array,
                          block_table: jax.Array, *, scale: float, k: int, max_pools: int,
                          block_size: int, width: int, eps: float = 1e-6,
                          padded: int | None = None, scale_format: str = "fp32",
                          round_scale: bool = True, stride_rows: int | None = None,
                          tactic: tuple[int, int] | None = None, q_tactic: str | None = None,
                          routing: Routing | None = None) -> tuple[jax.Array, ...]:
  """indexer_update_q -> select_slots as one op, a decode step's update part and select
  path in one FFI call on CUDA.

  Returns indexer_update_q's nine results (key_raw, head_w, gate, q, q_fp8, w_out f32, key,
  kv_cache, tail), then select_slots(q_fp8, w_out, kv_cache, page_table, req_ids,
  positions.reshape(-1), block_table)'s slots i32[rows, width] and counts i32[rows] and its
  logits workspace f32[rows, max_pools]: bit-equal to the two ops (their keywords; next_n is
  positions' columns). See glm5_jax.reference.indexer_update_select. The caches are updated
  in place (donate them).
  """
  update = _update_q_params(wq_b, scale, eps, padded, jnp.float32, scale_format, round_scale,
                            tactic, q_tactic)
  select = _slots_params(k, max_pools, block_size, width, stride_rows, scale_format,
                         jax.typeof(positions).shape[1])
  params = {**update, **{n: select[n] for n in SELECT_PARAMS}}
  return tuple(_op(x, w_cat, qr, wq_b, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                   positions, page_table, req_ids, block_table, routing=routing, **params))
