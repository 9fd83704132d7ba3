"""The variants of an op the bench times: the public op with and without its kernel,
and other ways to write the op (Alternative), e.g. with Pallas or as other ops.
The stock op order (Triton) is bench/stock.py."""
import contextlib
import functools
import os
from typing import Callable, NamedTuple

import jax.numpy as jnp

import glm5_jax
from glm5_jax.reference.numerics import DIM

from . import pallas_ops
from .sizes import BF16, CONFIG, F32, HEADS, PADDED

REFERENCE, KERNEL, NO_PDL, TRITON = "reference", "kernel", "kernel, PDL off", "triton"
PALLAS = "pallas"
THREE_DOTS = "reference, three dots"
TWO_KERNELS = "projection + query kernels"
GEMM_QUERY = "XLA GEMM + query kernel"
UPDATE_FUSED = "kernel, update fused"    # the stage with IndexerConfig(update="fused")
UPDATE_OPS = "kernel, update as three ops"    # the stage with IndexerConfig(update="ops")
UPDATE_ONLY = "kernel, update part only"      # the stage's update part alone (issue 12)
# The update part alone with IndexerConfig(update="ops").
UPDATE_ONLY_OPS = "kernel, update part only, three ops"
# The update part alone as indexer_update's one FFI call (update="fused", its kernel routed on).
UPDATE_ONLY_FUSED = "kernel, update part only, indexer_update"
# The stage with Routing(ops={"select_slots": False}): select_pools + expand_and_remap.
SELECT_OPS = "kernel, select as two ops"
Q_KERNEL = "kernel, q kernel"                 # the stage with indexer_q's kernel on
Q_KERNEL_NO_PDL = "kernel, q kernel, PDL off"  # the same without PDL (does it cost there?)
UPDATE_ONLY_Q_KERNEL = "kernel, update part only, q kernel"   # the update part, indexer_q on
# The update part as indexer_q's kernel, then indexer_update's (both FFI calls, PDL between).
UPDATE_ONLY_FUSED_Q_KERNEL = "kernel, update part only, indexer_update, q kernel"
# The stage with update_epilogue_q's kernel on: q's GEMM inside the epilogue's FFI call.
Q_EPILOGUE = "kernel, q in epilogue"
UPDATE_ONLY_Q_EPILOGUE = "kernel, update part only, q in epilogue"   # its update part alone
# The stage with indexer_update_q's kernel on: the whole update part in one FFI call.
UPDATE_Q = "kernel, indexer_update_q"
UPDATE_ONLY_UPDATE_Q = "kernel, update part only, indexer_update_q"   # its update part alone
# The stage group's rows with --stage-chain-barrier: layers and steps ordered by optimization
# barriers instead of the chain's two fusions a layer (bench/stage.py's _step).
BARRIER_CHAIN = ", barrier chain"
VARIANTS = (REFERENCE, KERNEL, NO_PDL, TRITON, PALLAS, THREE_DOTS, TWO_KERNELS, GEMM_QUERY,
            UPDATE_FUSED, UPDATE_OPS, UPDATE_ONLY, UPDATE_ONLY_OPS, UPDATE_ONLY_FUSED,
            SELECT_OPS, Q_KERNEL, Q_KERNEL_NO_PDL, UPDATE_ONLY_Q_KERNEL,
            UPDATE_ONLY_FUSED_Q_KERNEL, Q_EPILOGUE, UPDATE_ONLY_Q_EPILOGUE, UPDATE_Q,
            UPDATE_ONLY_UPDATE_Q)


def three_dots(x, w_cat):
  """indexer_projection as a JAX user would write it from the model: three dots."""
  dot = lambda w: jnp.dot(x, w.T, preferred_element_type=F32)
  key, head_w, gate = (dot(w_cat[:DIM]), dot(w_cat[DIM:DIM + HEADS]),
                       dot(w_cat[DIM + HEADS:]))
  return key.astype(BF16), head_w, gate.astype(BF16)


def unfused(x, w_cat, q, norm_weight, norm_bias, projection=None, query=None):
  """indexer_projection_fused as indexer_projection then indexer_query (the public ops
  unless given)."""
  projection = projection or functools.partial(glm5_jax.indexer_projection, heads=HEADS)
  query = query or glm5_jax.indexer_query
  key_raw, head_w, gate = projection(x, w_cat)
  return (*query(q, key_raw, head_w, norm_weight, norm_bias, scale=CONFIG.scale,
                 padded=PADDED), gate)


class Alternative(NamedTuple):
  """The op written another way: lowered with GLM5_JAX_KERNELS=`kernels`, it must call
  exactly the FFI targets `targets`; call as Workload.call."""
  kernels: str
  targets: tuple
  call: Callable


_QUERY = glm5_jax.KERNEL_TARGETS["indexer_query"]

# op -> {variant: Alternative}
ALTERNATIVES = {
    "upcast_logits": {
        PALLAS: Alternative("0", (), lambda st, f, a: (st, (pallas_ops.upcast_logits(*a),)))},
    "indexer_projection": {
        THREE_DOTS: Alternative("0", (), lambda st, f, a: (st, three_dots(*a)))},
    "indexer_projection_fused": {
        THREE_DOTS: Alternative("0", (), lambda st, f, a: (st, unfused(
            *a, *f, projection=three_dots, query=glm5_jax.reference.indexer_query))),
        TWO_KERNELS: Alternative(
            "0,indexer_projection=1,indexer_query=1",
            (glm5_jax.KERNEL_TARGETS["indexer_projection"], _QUERY),
            lambda st, f, a: (st, unfused(*a, *f))),
        GEMM_QUERY: Alternative("0,indexer_query=1", (_QUERY,),
                                lambda st, f, a: (st, unfused(*a, *f)))},
}


def alternative(op, variant):
  """The Alternative that `variant` of `op` runs, or None (the public op itself)."""
  return ALTERNATIVES.get(op, {}).get(variant)


def with_call(work, variant):
  """The Workload with its op written another way for an alternative variant."""
  alt = alternative(work.op, variant)
  return work._replace(call=alt.call) if alt else work


def expected_targets(op, variant):
  """The FFI targets the lowering of `variant` of `op` must call."""
  alt = alternative(op, variant)
  if alt:
    return set(alt.targets)
  return {glm5_jax.KERNEL_TARGETS[op]} if variant in (KERNEL, NO_PDL) else set()


@contextlib.contextmanager
def variant_env(variant, op=None):
  """GLM5_JAX_KERNELS (read at lowering) and GLM5_JAX_PDL (read at each launch,
  i.e. command-buffer capture) for one JAX variant of `op`."""
  alt = alternative(op, variant)
  kernels = alt.kernels if alt else "0" if variant == REFERENCE else "1"
  want = {"GLM5_JAX_KERNELS": kernels,
          "GLM5_JAX_PDL": "0" if variant == NO_PDL else None}
  old = {k: os.environ.get(k) for k in want}

  def apply(env):
    for k, v in env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  apply(want)
  try:
    yield
  finally:
    apply(old)
