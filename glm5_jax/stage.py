"""The indexer of one DSA layer for a decode step, composed of the ops
(the data flow of docs/semantics.md: §1 -> §2 -> §3 -> §5 -> §6 + §7)."""
import dataclasses
import functools
import math
import types

import numpy as np
import jax
import jax.numpy as jnp
from jax import export, lax

from . import indexer as _indexer
from . import plan as _plan
from . import reference
from ._checks import check_cache, check_scale_format, check_tail, expect, fail, finite, positive_int
from ._primitive import Routing
from .checks import pad_past_capacity
from .expand import expand_and_remap
from .indexer import (
  W_OUT_DTYPES,
  ProjectionTactic,
  indexer_projection,
  indexer_projection_fused,
  indexer_q,
  indexer_query,
)
from .kpool import kpool_update
from .limits import LOGITS_HEADS
from .logits import select_chunks, select_pools, select_slots
from .plan import SelectPath, StagePlan, UpdatePath
from .reference.numerics import DIM, POOL
from .update import (
  indexer_update,
  indexer_update_q,
  update_epilogue,
  update_epilogue_q,
  update_q_projection_tactic,
)
from .update_select import indexer_update_select

# Queries pad to the logits kernel's smallest head count (docs/semantics.md: padded >= 32).
MQA_MIN_HEADS = LOGITS_HEADS[0]
# IndexerConfig.update: the stage's update part as the plan chooses (glm5_jax.plan), always
# as the ops, or always as indexer_update.
UPDATES = ("auto", "ops", "fused")


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  """Static configuration; defaults are GLM-5.3-Flash's (SPEC §9).

  max_pools: width of the logits (max_model_len // 4); block_size: MLA tokens
  per block (block_table); w_out_dtype: the dtype of IndexerOutput.w_out; fused: the
  stage's op graph, indexer_projection_fused instead of indexer_projection +
  indexer_query (the outputs agree within SPEC D2); routing: where each op runs on CUDA
  (glm5_jax.Routing; by default GLM5_JAX_KERNELS and GLM5_JAX_PDL as they are when the
  config is built). The config is a static argument of the jitted stage, so a config with
  another routing (or fused) compiles anew instead of reusing a stale executable. update:
  "auto" (the default) runs the update part on the path glm5_jax.plan chooses by the
  routing and the shapes (plan.AUTO_UPDATE); "ops" as indexer_projection (or
  indexer_projection_fused), indexer_query and kpool_update; "fused" as indexer_update
  (plan.FUSED_UPDATE); "fused" not with fused=True ("auto" then means "ops").
  rope_dim: the indexer's RoPE head dim, which must be 0 (a NoPE indexer, SPEC §9).
  """
  heads: int = 32
  topk_tokens: int = 2048
  softmax_scale: float = DIM ** -0.5
  eps: float = 1e-6
  max_pools: int = 32768
  block_size: int = 128
  scale_format: str = "fp32"
  w_out_dtype: str = "float32"
  fused: bool = False
  update: str = "auto"
  routing: Routing = dataclasses.field(default_factory=Routing.from_env)
  rope_dim: int = 0

  def __post_init__(self):
    # Each field is checked here, once, so a bad config fails where it is built (and
    # names the field) rather than as a shape error of whichever op first uses it.
    op = "IndexerConfig"
    if self.rope_dim != 0:
      fail(op, "rope_dim", f"must be 0 (the kpool indexer is NoPE only, SPEC §9), "
           f"got {self.rope_dim}")
    if not isinstance(self.routing, Routing):
      fail(op, "routing", f"must be a glm5_jax.Routing, got {type(self.routing).__name__}",
           TypeError)
    positive_int(op, "heads", self.heads)
    # topk_tokens selects whole pools (k = topk_tokens // 4), block_size holds whole pools.
    positive_int(op, "topk_tokens", self.topk_tokens, POOL)
    positive_int(op, "max_pools", self.max_pools)
    positive_int(op, "block_size", self.block_size, POOL)
    finite(op, "softmax_scale", self.softmax_scale)
    finite(op, "eps", self.eps, minimum=0)
    check_scale_format(op, self.scale_format)
    try:
      w_out_dtype = np.dtype(self.w_out_dtype)
    except TypeError:
      w_out_dtype = None
    if w_out_dtype not in W_OUT_DTYPES:
      fail(op, "w_out_dtype", f"must be one of {[d.name for d in W_OUT_DTYPES]}, "
           f"got {self.w_out_dtype!r}", TypeError)
    if not isinstance(self.fused, bool):
      fail(op, "fused", f"must be a bool, got {self.fused!r}", TypeError)
    if self.update not in UPDATES:
      fail(op, "update", f"must be one of {UPDATES}, got {self.update!r}")
    if self.update == "fused" and self.fused:
      fail(op, "update", "must be 'ops' with fused=True: 'fused' (indexer_update) runs "
           "indexer_projection and indexer_query, fused=True indexer_projection_fused")

  @property
  def padded(self):
    return max(self.heads, MQA_MIN_HEADS)

  @property
  def scale(self):
    return float(np.float32(self.softmax_scale * self.heads ** -0.5))

  @property
  def width(self):
    """Logical top-k width: roundup(topk + 3, 128) (2176)."""
    return math.ceil((self.topk_tokens + POOL - 1) / 128) * 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexerWeights:
  """One layer's indexer parameters, prepared once (prepare_weights).

  wq_b bf16[heads*128, q_lora]; w_cat bf16[256 + heads, hidden] = [wk;
  weights_proj; gate]; norm_weight, norm_bias f32[128]; ape f32[4, 128].
  """
  wq_b: jax.Array
  w_cat: jax.Array
  norm_weight: jax.Array
  norm_bias: jax.Array
  ape: jax.Array


def prepare_weights(wq_b: jax.Array, wk: jax.Array, weights_proj: jax.Array,
                    gate: jax.Array, norm_weight: jax.Array, norm_bias: jax.Array,
                    ape: jax.Array) -> IndexerWeights:
  """Concatenates [wk; weights_proj; gate] once per layer (never per step)."""
  w_cat = jnp.concatenate([wk, weights_proj, gate]).astype(jnp.bfloat16)
  return IndexerWeights(jnp.asarray(wq_b, jnp.bfloat16), w_cat,
                        jnp.asarray(norm_weight, jnp.float32),
                        jnp.asarray(norm_bias, jnp.float32),
                        jnp.asarray(ape, jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexerCache:
  """kv_cache u8[pages, PAGE, 132] and tail bf16[blocks, 2, RING, 128] (SPEC §0)."""
  kv_cache: jax.Array
  tail: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeBatch:
  """Decode metadata of B requests x N (next_n) rows each (rows = B*N, request-major).

  positions, loc, tslot i32[B, N] (-1 pads); req_ids i32[B*N];
  page_table i32[R, MP] (indexer K-cache pages per request);
  block_table i32[R, MB] (MLA blocks per request).
  """
  positions: jax.Array
  loc: jax.Array
  tslot: jax.Array
  req_ids: jax.Array
  page_table: jax.Array
  block_table: jax.Array

  # The per-step metadata as one operand. A serving loop builds positions, loc, tslot
  # and req_ids on the host every step; as a tree of arrays that is one host->device
  # transfer (and one dispatch argument) per array, which costs more than the step's
  # device time (issue 11). Packed, it is one small numpy array (16 bytes per row) and one
  # transfer; page_table and block_table change only when a request is admitted or grows,
  # so they stay device arrays passed on their own (glm5_jax.serving.indexer_step).
  PACKED_FIELDS = ("positions", "loc", "tslot", "req_ids")

  @staticmethod
  def pack(positions, loc, tslot, req_ids) -> np.ndarray:
    """i32[4, B, N]: positions, loc, tslot (i32[B, N] each) and req_ids (i32[B*N],
    request-major) stacked, built with numpy on the host. Pass it to a jitted step
    as is (one transfer) and rebuild the batch inside with DecodeBatch.unpack."""
    positions = np.asarray(positions)
    if positions.ndim != 2:
      raise ValueError(f"glm5_jax.DecodeBatch.pack: positions must have shape (B, N), "
                       f"got {positions.shape}")
    b, n = positions.shape
    fields = [positions]
    for name, value, shape in (("loc", loc, (b, n)), ("tslot", tslot, (b, n)),
                               ("req_ids", req_ids, (b * n,))):
      value = np.asarray(value)
      if value.shape != shape:
        raise ValueError(f"glm5_jax.DecodeBatch.pack: {name} must have shape {shape} "
                         f"(positions is {positions.shape}), got {value.shape}")
      fields.append(value.reshape(b, n))
    for name, value in zip(DecodeBatch.PACKED_FIELDS, fields):
      if not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"glm5_jax.DecodeBatch.pack: {name} must be integer, "
                        f"got {value.dtype}")
    return np.stack(fields).astype(np.int32, copy=False)

  @classmethod
  def unpack(cls, packed: jax.Array, page_table: jax.Array,
             block_table: jax.Array) -> "DecodeBatch":
    """The DecodeBatch of packed i32[4, B, N] (DecodeBatch.pack) and the two tables:
    slices and a reshape of one operand, free inside jit."""
    if packed.ndim != 3 or packed.shape[0] != len(cls.PACKED_FIELDS):
      raise ValueError(f"glm5_jax.DecodeBatch.unpack: packed must have shape (4, B, N) "
                       f"(DecodeBatch.pack), got {tuple(packed.shape)}")
    if packed.dtype != np.int32:
      raise TypeError(f"glm5_jax.DecodeBatch.unpack: packed must be int32, "
                      f"got {packed.dtype}")
    positions, loc, tslot, req_ids = (packed[i] for i in range(len(cls.PACKED_FIELDS)))
    return cls(positions, loc, tslot, req_ids.reshape(-1), page_table, block_table)

  def packed(self) -> np.ndarray:
    """This batch's per-step fields as DecodeBatch.pack's array (host numpy)."""
    return DecodeBatch.pack(*(np.asarray(getattr(self, f)) for f in self.PACKED_FIELDS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IndexerOutput:
  """q_fp8 e4m3[rows, padded, 128], w_out w_out_dtype[rows, padded], slots
  i32[rows, width] (physical sparse-MLA slots, valid prefix), counts i32[rows]."""
  q_fp8: jax.Array
  w_out: jax.Array
  slots: jax.Array
  counts: jax.Array


# jax.export serializes the stage's argument and result trees by these names (the
# dataclasses have no static fields: nothing to serialize but the name).
for _cls in (IndexerWeights, IndexerCache, DecodeBatch, IndexerOutput):
  export.register_pytree_node_serialization(
      _cls, serialized_name=f"glm5_jax.{_cls.__name__}",
      serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


def _ops(config, use_reference):
  """The ops the stage composes: glm5_jax.reference's functions, or the primitives
  under config.routing."""
  fns = (indexer_q, indexer_projection, indexer_query, indexer_projection_fused, kpool_update,
         indexer_update, update_epilogue, update_epilogue_q, indexer_update_q, select_pools,
         select_slots, expand_and_remap)
  # kernels: whether the ops are the primitives (the plan asks their routing; the
  # reference composition runs the ops).
  if use_reference:
    return types.SimpleNamespace(kernels=False, **{f.__name__: getattr(reference, f.__name__)
                                                   for f in fns})
  return types.SimpleNamespace(kernels=True, **{
      f.__name__: functools.partial(f, routing=config.routing) for f in fns})


@jax.custom_jvp
def _not_differentiable(*arrays):
  """Identity whose derivative is an error naming the stage: the stage calls it on its float
  arguments first, so that jax.grad (under jit too, and with use_reference=True, where no
  primitive would object) fails there rather than inside whichever op comes first."""
  return arrays


@_not_differentiable.defjvp
def _not_differentiable_jvp(primals, tangents):
  raise TypeError("glm5_jax.indexer_stage is not differentiable (a decode-time stage: "
                  "its cache writes, fp8 codes and top-k have no derivative)")


def _check_stage_inputs(weights, cache, x, qr, batch, config):
  """The stage's boundary (trace time): the arguments against each other and the config,
  so that a bad one is named here instead of surfacing as a reshape, dot or silently
  dropped write inside an op. Returns (requests, next_n)."""
  op = "indexer_stage"
  for arg, value, cls in (("config", config, IndexerConfig), ("weights", weights, IndexerWeights),
                          ("cache", cache, IndexerCache), ("batch", batch, DecodeBatch)):
    if not isinstance(value, cls):
      fail(op, arg, f"must be a glm5_jax.{cls.__name__}, got {type(value).__name__}", TypeError)
  inputs = (weights, cache.tail, x, qr)   # the float arguments, for the grad guard below
  i32, bf16, f32 = np.int32, jnp.bfloat16, np.float32
  aval = lambda arg, a: _aval(op, arg, a)
  # batch: requests x next_n rows, request-major.
  positions = aval("batch.positions", batch.positions)
  expect(op, "batch.positions", positions, i32, (None, None))
  b, n = positions.shape
  rows = b * n
  for arg in ("loc", "tslot"):
    expect(op, f"batch.{arg}", aval(f"batch.{arg}", getattr(batch, arg)), i32, (b, n))
  expect(op, "batch.req_ids", aval("batch.req_ids", batch.req_ids), i32, (rows,))
  tables = {}
  for arg in ("page_table", "block_table"):
    tables[arg] = aval(f"batch.{arg}", getattr(batch, arg))
    expect(op, f"batch.{arg}", tables[arg], i32, (None, None))
    if 0 in tables[arg].shape:
      fail(op, f"batch.{arg}", f"must have a row per request and a column at least, got "
           f"shape {tuple(tables[arg].shape)}")
  # req_ids name a row of both tables (SPEC §5e): a request with a row in one only would
  # select pools it has no slots for, or slots of pools it never scored.
  if tables["page_table"].shape[0] != tables["block_table"].shape[0]:
    fail(op, "batch.block_table", f"must have as many rows as batch.page_table (one per "
         f"request, named by req_ids): {tables['page_table'].shape[0]}, got shape "
         f"{tuple(tables['block_table'].shape)}")
  # weights: their head count is config.heads.
  h = config.heads
  wq_b, w_cat = aval("weights.wq_b", weights.wq_b), aval("weights.w_cat", weights.w_cat)
  expect(op, "weights.wq_b", wq_b, bf16, (None, None))
  if wq_b.shape[0] != h * DIM:
    fail(op, "weights.wq_b", f"must have config.heads * 128 = {h * DIM} rows (heads = {h}), "
         f"got shape {tuple(wq_b.shape)}")
  expect(op, "weights.w_cat", w_cat, bf16, (None, None))
  if w_cat.shape[0] != 2 * DIM + h:
    fail(op, "weights.w_cat", f"must have 256 + config.heads = {2 * DIM + h} rows "
         f"([wk; weights_proj; gate], heads = {h}), got shape {tuple(w_cat.shape)}")
  for arg, shape in (("norm_weight", (DIM,)), ("norm_bias", (DIM,)), ("ape", (POOL, DIM))):
    expect(op, f"weights.{arg}", aval(f"weights.{arg}", getattr(weights, arg)), f32, shape)
  # x and qr: one row per token; widths those of the weights (hidden, q_lora).
  x, qr = aval("x", x), aval("qr", qr)
  expect(op, "x", x, bf16, (None, None))
  if x.shape != (rows, w_cat.shape[1]):
    fail(op, "x", f"must have shape (rows, hidden) = ({rows}, {w_cat.shape[1]}): rows = "
         f"requests x next_n = {b} x {n} (batch.positions), hidden = weights.w_cat's dim 1; "
         f"got {tuple(x.shape)}")
  expect(op, "qr", qr, bf16, (None, None))
  if qr.shape != (rows, wq_b.shape[1]):
    fail(op, "qr", f"must have shape (rows, q_lora) = ({rows}, {wq_b.shape[1]}): rows = "
         f"requests x next_n = {b} x {n} (batch.positions), q_lora = weights.wq_b's dim 1; "
         f"got {tuple(qr.shape)}")
  # cache: each request owns a tail block (SPEC §0.2), so fewer blocks than requests
  # cannot hold them: the writes of the requests past the ring would be dropped.
  check_cache(op, aval("cache.kv_cache", cache.kv_cache), "cache.kv_cache")
  tail = aval("cache.tail", cache.tail)
  check_tail(op, tail, "cache.tail")
  if tail.shape[0] < b:
    fail(op, "cache.tail", f"must have a block per request (dim 0 >= requests = {b}), "
         f"got shape {tuple(tail.shape)}")
  _not_differentiable(*(a for a in jax.tree.leaves(inputs)
                        if jnp.issubdtype(a.dtype, jnp.floating)))
  return b, n


def _aval(op, arg, a):
  try:
    return jax.typeof(a)
  except TypeError:
    fail(op, arg, f"must be an array, got {type(a).__name__}", TypeError)


def indexer_stage(weights: IndexerWeights, cache: IndexerCache, x: jax.Array,
                  qr: jax.Array, batch: DecodeBatch, *, config: IndexerConfig | None = None,
                  use_reference: bool = False) -> tuple[IndexerOutput, IndexerCache]:
  """One layer's indexer for a decode step; returns (IndexerOutput, cache).

  x bf16[rows, hidden]; qr bf16[rows, q_lora]. Jit with the cache donated:
  jax.jit(indexer_stage, static_argnames=("config", "use_reference"),
  donate_argnames="cache"). Rows whose pools all fit in topk_tokens // 4 select
  every pool (causal fill); others the top-k of their MQA logits over the pooled
  cache (select_pools, per row, pool ids ascending). config None: IndexerConfig()
  when traced (pass one to choose the routing: it is then part of the jit cache key).
  use_reference=True composes glm5_jax.reference directly.
  """
  config = IndexerConfig() if config is None else config
  b, n = _check_stage_inputs(weights, cache, x, qr, batch, config)
  # A row past what its tables hold is a pad for every op that follows (SPEC §12).
  batch = pad_past_capacity(cache, batch, config)
  ops = _ops(config, use_reference)
  plan = stage_plan(config, ops.kernels, weights, cache, x, qr, batch)
  if plan.one_call:
    return _in_one_call(config, weights, cache, x, qr, batch)
  q_fp8, w_out, cache = update_path(ops, config, weights, cache, x, qr, batch, b * n, plan)
  slots, counts = select_path(ops, config, q_fp8, w_out, cache.kv_cache, batch, b * n,
                              plan=plan)
  return IndexerOutput(q_fp8, w_out, slots, counts), cache


def _update_select_params(config):
  """indexer_update_select's keywords as the stage calls it (indexer_update_q's and
  select_slots')."""
  return dict(scale=config.scale, eps=config.eps, padded=config.padded,
              scale_format=config.scale_format, k=config.topk_tokens // POOL,
              max_pools=config.max_pools, block_size=config.block_size, width=config.width)


def _in_one_call(config, weights, cache, x, qr, batch):
  """Both parts as one FFI call (glm5_jax.update_select): the same results as
  indexer_update_q then select_slots."""
  out = indexer_update_select(x, weights.w_cat, qr, weights.wq_b,
                              *_cache_args(weights, cache, batch), batch.page_table,
                              batch.req_ids, batch.block_table, routing=config.routing,
                              **_update_select_params(config))
  *_, q_fp8, w_out, _, kv_cache, tail, slots, counts, _ = out
  return IndexerOutput(q_fp8, w_out, slots, counts), IndexerCache(kv_cache, tail)


def _shaped(a):
  return jax.ShapeDtypeStruct(a.shape, a.dtype)


def stage_plan(config, kernels, weights, cache, x, qr, batch, select_pools=False) -> StagePlan:
  """The plan (glm5_jax.plan) of indexer_stage at these (checked) arguments' shapes: its
  update and select paths and GEMM tactics. kernels: whether the stage runs the ops as
  primitives (False: the reference composition); select_pools: whether the caller brings
  a select_pools of its own (the select part then runs it and expand_and_remap). Decided
  from avals alone (nothing is computed), each op asked at the arguments the stage would
  call it with."""
  rows, k = x.shape
  weights, cache, x, qr, batch = jax.tree.map(_shaped, (weights, cache, x, qr, batch))
  query = dict(scale=config.scale, eps=config.eps, padded=config.padded,
               w_out_dtype=np.dtype(config.w_out_dtype))
  update = dict(query, scale_format=config.scale_format)
  cache_args = _cache_args(weights, cache, batch)
  raw = jax.eval_shape(reference.projection_sums, x, weights.w_cat)
  q = jax.ShapeDtypeStruct((rows, config.heads, DIM), weights.wq_b.dtype)
  q_fp8 = jax.ShapeDtypeStruct((rows, config.padded, DIM), jnp.float8_e4m3fn)
  w_out = jax.ShapeDtypeStruct((rows, config.padded), jnp.float32)
  positions = jax.ShapeDtypeStruct((rows,), batch.positions.dtype)
  calls = {   # each op as the stage calls it
      "indexer_update_q": (indexer_update_q, (x, weights.w_cat, qr, weights.wq_b, *cache_args),
                           update),
      "indexer_update": (indexer_update, (x, weights.w_cat, q, *cache_args),
                         dict(update, heads=config.heads)),
      "update_epilogue_q": (update_epilogue_q, (raw, qr, weights.wq_b, *cache_args), update),
      "update_epilogue": (update_epilogue, (raw, q, *cache_args), update),
      "select_slots": (select_slots, (q_fp8, w_out, cache.kv_cache, batch.page_table,
                                      batch.req_ids, positions, batch.block_table),
                       dict(_select_params(config, batch), **_remap_params(config))),
      "indexer_update_select": (indexer_update_select, (
          x, weights.w_cat, qr, weights.wq_b, *cache_args, batch.page_table, batch.req_ids,
          batch.block_table), _update_select_params(config)),
      # and those whose tactics the plan reports
      "indexer_q": (indexer_q, (qr, weights.wq_b), {}),
      "indexer_projection": (indexer_projection, (x, weights.w_cat), dict(heads=config.heads)),
      "indexer_projection_fused": (indexer_projection_fused, (
          x, weights.w_cat, q, weights.norm_weight, weights.norm_bias),
          dict(query, heads=config.heads)),
  }

  def chosen(op):
    fn, args, params = calls[op]
    return _plan.chooses_kernel(fn, *args, routing=config.routing, **params)

  path = _plan.update_path(config.update, config.fused, kernels, chosen)
  select = _plan.select_path(kernels and not select_pools, chosen)
  # The GEMM kernels' tactics on that path (None where XLA's GEMM or a reference runs).
  projection = q_tactic = None
  if kernels:
    in_one_call = path in (UpdatePath.UPDATE_Q, UpdatePath.EPILOGUE_Q)
    if in_one_call or chosen("indexer_q"):
      q_tactic = _indexer.q_tactic(rows, *weights.wq_b.shape)
    if path is UpdatePath.UPDATE_Q:
      projection = update_q_projection_tactic(rows, k)
    elif (path is UpdatePath.UPDATE
          or (path is UpdatePath.OPS and chosen("indexer_projection"))):
      projection = _indexer.projection_tactic(rows, k)
    elif path is UpdatePath.FUSED_PROJECTION and chosen("indexer_projection_fused"):
      projection = ProjectionTactic(_indexer.fused_warps(), 1)
  chunks = None
  if kernels and select is SelectPath.SELECT_POOLS_EXPAND and not select_pools:
    chunks = select_chunks(calls["select_slots"][1][:-1], _select_params(config, batch),
                           config.routing)
  # (SELECT_SLOTS only where the stage runs the kernels and brings no select_pools.)
  one = _plan.one_call(path, select, np.dtype(config.w_out_dtype) == np.float32, chosen)
  return StagePlan(rows, path, select, projection, q_tactic, chunks, one)


def _cache_args(weights, cache, batch):
  """The operands the update part's composite ops take after their GEMM operands."""
  return (weights.norm_weight, weights.norm_bias, cache.kv_cache, cache.tail, batch.tslot,
          weights.ape, batch.loc, batch.positions)


def _select_params(config, batch=None):
  """The select ops' keywords; with the batch, its next_n too (the kernels score a request's
  next_n rows from one read of its K tiles; the references and a custom select_pools take
  no next_n)."""
  params = dict(k=config.topk_tokens // POOL, max_pools=config.max_pools,
                scale_format=config.scale_format)
  if batch is not None:
    params["next_n"] = batch.positions.shape[1]
  return params


def _remap_params(config):
  return dict(block_size=config.block_size, width=config.width)


def update_path(ops, config, weights, cache, x, qr, batch, rows, plan=None):
  """The stage up to the cache update (inputs already checked): q, the projection, the
  query epilogue and kpool_update on the plan's update path (None: stage_plan's at these
  shapes). Returns (q_fp8, w_out, IndexerCache)."""
  if plan is None:
    plan = stage_plan(config, ops.kernels, weights, cache, x, qr, batch, select_pools=True)
  b, n = batch.positions.shape
  query = dict(scale=config.scale, eps=config.eps, padded=config.padded,
               w_out_dtype=np.dtype(config.w_out_dtype))
  cache_args = _cache_args(weights, cache, batch)
  path = plan.update
  if path is UpdatePath.UPDATE_Q:
    *_, q_fp8, w_out, _, kv_cache, tail = ops.indexer_update_q(
        x, weights.w_cat, qr, weights.wq_b, *cache_args, scale_format=config.scale_format,
        **query)
    return q_fp8, w_out, IndexerCache(kv_cache, tail)
  if path is UpdatePath.EPILOGUE_Q:
    raw = reference.projection_sums(x, weights.w_cat)
    _, q_fp8, w_out, _, kv_cache, tail = ops.update_epilogue_q(
        raw, qr, weights.wq_b, *cache_args, scale_format=config.scale_format, **query)
    return q_fp8, w_out, IndexerCache(kv_cache, tail)
  # q = qr wq_b^T (indexer_q; its reference is one dot_general, the same HLO eagerly and
  # under jit, see reference.indexer_q).
  q = ops.indexer_q(qr, weights.wq_b)
  # The bf16 q as a tensor of its own in every composition: without the barrier the
  # reference program fused the convert into its consumers, XLA then picked another GEMM
  # for the same dot than in the kernel program (where an FFI call reads q), and q_fp8
  # differed in some fp8 codes. With it both programs run the same GEMM + convert; it costs
  # nothing where a kernel reads q.
  q = lax.optimization_barrier(q).reshape(rows, config.heads, DIM)
  if path is UpdatePath.UPDATE:
    *_, q_fp8, w_out, _, kv_cache, tail = ops.indexer_update(
        x, weights.w_cat, q, *cache_args, heads=config.heads,
        scale_format=config.scale_format, **query)
    return q_fp8, w_out, IndexerCache(kv_cache, tail)
  if path is UpdatePath.EPILOGUE:
    # XLA's GEMM with its f32 sums straight into update_epilogue (no slice copies).
    raw = reference.projection_sums(x, weights.w_cat)
    q_fp8, w_out, _, kv_cache, tail = ops.update_epilogue(
        raw, q, *cache_args, scale_format=config.scale_format, **query)
    return q_fp8, w_out, IndexerCache(kv_cache, tail)
  if path is UpdatePath.FUSED_PROJECTION:
    q_fp8, w_out, key, gate = ops.indexer_projection_fused(
        x, weights.w_cat, q, weights.norm_weight, weights.norm_bias,
        heads=config.heads, **query)
  else:
    key_raw, head_w, gate = ops.indexer_projection(x, weights.w_cat, heads=config.heads)
    q_fp8, w_out, key = ops.indexer_query(q, key_raw, head_w, weights.norm_weight,
                                          weights.norm_bias, **query)
  kv_cache, tail = ops.kpool_update(
      cache.kv_cache, cache.tail, batch.tslot, key.reshape(b, n, DIM),
      gate.reshape(b, n, DIM), weights.ape, batch.loc, batch.positions,
      scale_format=config.scale_format)
  return q_fp8, w_out, IndexerCache(kv_cache, tail)


def select_path(ops, config, q_fp8, w_out, kv_cache, batch, rows, select_pools=None,
                plan=None):
  """The stage from the updated cache on, on the plan's select path: select_slots, or
  select_pools (or `select_pools`, a function of its signature: sharding's context-parallel
  one) and expand_and_remap (the same slots and counts). plan None: select_slots where the
  routing runs its kernel at these shapes. Returns (slots, counts)."""
  positions = batch.positions.reshape(rows)
  # Rows whose pools all fit in the top-k select every pool (the causal fill), others
  # the top-k of their logits; decided per row inside the kernel: no branch here.
  args = (q_fp8, w_out.astype(jnp.float32), kv_cache, batch.page_table, batch.req_ids,
          positions)
  select = _select_params(config, batch if ops.kernels and select_pools is None else None)
  remap = _remap_params(config)
  if plan is None:
    plan_select = _plan.select_path(
        ops.kernels and select_pools is None,
        lambda op: _plan.chooses_kernel(select_slots, *args, batch.block_table,
                                        routing=config.routing, **select, **remap))
  else:
    plan_select = SelectPath.SELECT_POOLS_EXPAND if select_pools is not None else plan.select
  if plan_select is SelectPath.SELECT_SLOTS:
    return ops.select_slots(*args, batch.block_table, **select, **remap)
  select_pools = ops.select_pools if select_pools is None else select_pools
  pool_ids, _ = select_pools(*args, **select)
  return ops.expand_and_remap(pool_ids, positions, batch.req_ids, batch.block_table, **remap)
