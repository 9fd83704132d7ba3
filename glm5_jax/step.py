"""indexer_step: indexer_update_q and select_slots as one op, one FFI call on CUDA
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

from ._checks import fail
from ._primitive import Op, Routing

UPDATE_Q, SLOTS = (Op.registry[name] for name in ("indexer_update_q", "select_slots"))
OP = "indexer_step"
# The select path's keywords (select_slots'); the rest are indexer_update_q's.
SELECT_PARAMS = ("k", "max_pools", "block_size", "width", "stride_rows", "next_n")


def _split(params):
  """(indexer_update_q's params, select_slots' params) of the step's."""
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


def _reference(*args, **params):
  update, select = _split(params)
  out = tuple(UPDATE_Q._reference(*args[:12], routing=None, **update))
  q_fp8, w_out, kv = out[4], out[5], out[7]
  page_table, req_ids, block_table = args[12:]
  positions = args[11].reshape(-1)
  sel = SLOTS._reference(q_fp8, w_out.astype(jnp.float32), kv, page_table, req_ids,
                         positions, block_table, routing=None, **select)
  return out + tuple(sel)


def _attribute_values(*avals, **params):
  out = {}
  for op, a, p in _parts(*avals, **params):
    out.update(op.attribute_values(*a, **p))
  return out


_step = Op(
    OP, _reference, _shapes, aliases=dict(UPDATE_Q.aliases), kernel="glm5_indexer_step",
    attributes={n: t for op in (UPDATE_Q, SLOTS) for n, t in op.attributes.items()
                if n != "pdl"},
    attribute_values=_attribute_values,
    kernel_supports=lambda *avals, **params: all(
        op.kernel_supports(*a, **p) for op, a, p in _parts(*avals, **params)),
    kernel_limits="those of indexer_update_q and select_slots, w_out in float32",
    otherwise="the reference (the stage calls it only where both kernels run)")


def indexer_step(update_args, page_table, req_ids, block_table, *, update_params,
                 select_params, routing: Routing | None = None):
  """indexer_update_q(*update_args, **update_params)'s nine results, then
  select_slots(q_fp8, w_out, cache, page_table, req_ids, positions, block_table,
  **select_params)'s slots and counts (and logits), in one call. The params are the two
  ops' primitive params (update._update_q_params, logits._slots_params)."""
  params = {**update_params, **{n: select_params[n] for n in SELECT_PARAMS}}
  return tuple(_step(*update_args, page_table, req_ids, block_table, routing=routing,
                     **params))
