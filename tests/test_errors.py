"""Bad input raises at trace time, naming the op and the argument."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_testing.cases import CASES


def _replace(i, fn):
  def mutate(args):
    args = list(args)
    args[i] = fn(args[i])
    return args
  return mutate


def _cast(dtype):
  return lambda a: a.astype(dtype)


def _cut(axis):
  return lambda a: jax.lax.slice_in_dim(a, 0, a.shape[axis] - 1, axis=axis)


def _with(op, **params):
  """The op's case function with its static params overridden."""
  fn = CASES[op].fn
  if isinstance(fn, functools.partial):
    return functools.partial(fn.func, *fn.args, **{**fn.keywords, **params})
  return functools.partial(fn, **params)


BAD_ARGS = [
    ("kpool_update", _replace(0, _cast(jnp.int8)), TypeError, "kv_cache must be uint8"),
    ("kpool_update", _replace(0, _cut(2)), ValueError, r"kv_cache must have shape \(\*, \*, 132\)"),
    ("kpool_update", _replace(1, lambda t: t[:, :, :6]), ValueError, "tail ring size"),
    ("kpool_update", _replace(3, _cut(2)), ValueError, "key must have shape"),
    ("kpool_update", _replace(4, _cast(jnp.float32)), TypeError, "gate must be bfloat16"),
    ("kpool_update", _replace(5, _cut(0)), ValueError, "ape must have shape"),
    ("kpool_update", _replace(6, _cut(1)), ValueError, "loc must have shape"),
    ("kpool_update", _replace(7, _cast(jnp.float32)), TypeError, "positions must be int32"),
    ("kpool_compress", _replace(4, _cut(0)), ValueError, "loc must have shape"),
    ("kpool_compress", _replace(5, _cast(jnp.int32)), TypeError, "write_mask must be bool"),
    ("kpool_compress", _replace(1, _cut(1)), ValueError, "slot_key must have shape"),
    ("kpool_seed_tail", _replace(3, _cut(0)), ValueError, "tslot must have shape"),
    ("kpool_seed_tail", _replace(2, _cast(jnp.float32)), TypeError, "gate must be bfloat16"),
    ("expand_pools", _replace(0, _cast(jnp.int16)), TypeError, "pool_ids must be int32"),
    ("expand_pools", _replace(1, _cut(0)), ValueError, "seq_lens must have shape"),
    ("expand_and_remap", _replace(1, _cut(0)), ValueError, "positions must have shape"),
    ("expand_and_remap", _replace(3, lambda a: a[:, :0]), ValueError,
     "block_table must not be empty"),
    ("expand_and_remap", _replace(2, _cast(jnp.uint32)), TypeError, "req_ids must be int32"),
    ("select_pools", _replace(0, _cast(jnp.bfloat16)), TypeError, "q_fp8 must be float8_e4m3fn"),
    ("select_pools", _replace(1, _cut(1)), ValueError, "w_out must have shape"),
    ("select_pools", _replace(2, _cut(2)), ValueError, "kv_cache must have shape"),
    ("select_pools", _replace(3, _cast(jnp.int16)), TypeError, "page_table must be int32"),
    ("select_pools", _replace(4, _cut(0)), ValueError, "req_ids must have shape"),
    ("select_pools", _replace(5, _cast(jnp.float32)), TypeError, "positions must be int32"),
    # select_slots: select_pools' arguments, then the remap's block table.
    ("select_slots", _replace(0, _cast(jnp.bfloat16)), TypeError, "q_fp8 must be float8_e4m3fn"),
    ("select_slots", _replace(3, _cast(jnp.int16)), TypeError, "page_table must be int32"),
    ("select_slots", _replace(4, _cut(0)), ValueError, "req_ids must have shape"),
    ("select_slots", _replace(5, _cast(jnp.float32)), TypeError, "positions must be int32"),
    ("select_slots", _replace(6, _cast(jnp.int16)), TypeError, "block_table must be int32"),
    ("select_slots", _replace(6, lambda a: a[0]), ValueError,
     r"block_table must have shape \(\*, \*\)"),
    ("select_slots", _replace(6, lambda a: a[:, :0]), ValueError,
     r"block_table must not be empty, got \(3, 0\)"),
    ("select_slots", _replace(6, lambda a: a[:0]), ValueError, "block_table must not be empty"),
    ("upcast_logits", _replace(0, _cast(jnp.float16)), TypeError, "logits must be bfloat16"),
    ("upcast_logits", _replace(1, _cut(0)), ValueError, "row_ends must have shape"),
    ("mqa_logits", _replace(0, _cast(jnp.bfloat16)), TypeError, "q_fp8 must be float8_e4m3fn"),
    ("mqa_logits", _replace(1, _cut(1)), ValueError, "w_out must have shape"),
    ("mqa_logits", _replace(3, _cut(0)), ValueError, "page_table must have shape"),
    ("pool_topk", _replace(0, _cast(jnp.bfloat16)), TypeError, "logits must be float32"),
    ("pool_topk", _replace(1, _cut(0)), ValueError, "pool_lens must have shape"),
    ("indexer_projection", _replace(1, _cut(0)), ValueError,
     r"w_cat must have shape \(272, 1024\)"),
    ("indexer_projection", _replace(0, _cast(jnp.float32)), TypeError, "x must be bfloat16"),
    ("indexer_query", _replace(1, _cut(1)), ValueError, "key_raw must have shape"),
    ("indexer_query", _replace(2, _cut(0)), ValueError, "head_w must have shape"),
    ("indexer_query", _replace(3, _cast(jnp.bfloat16)), TypeError, "norm_weight must be float32"),
    ("indexer_projection_fused", _replace(2, _cut(1)), ValueError, "q must have shape"),
    ("indexer_projection_fused", _replace(4, _cut(0)), ValueError, "norm_bias must have shape"),
    # indexer_update: each part checked by its op's rule, named as indexer_update.
    ("indexer_update", _replace(0, _cut(0)), ValueError,
     r"x must have requests x next_n = 3 x 2 rows \(tslot's shape\), got \(5, 1024\)"),
    ("indexer_update", _replace(1, _cut(1)), ValueError, "w_cat must have shape"),
    ("indexer_update", _replace(2, _cut(0)), ValueError, "q must have shape"),
    ("indexer_update", _replace(3, _cast(jnp.bfloat16)), TypeError, "norm_weight must be float32"),
    ("indexer_update", _replace(5, _cut(2)), ValueError, r"kv_cache must have shape \(\*, \*,"),
    ("indexer_update", _replace(6, lambda t: t[:, :, :6]), ValueError, "tail ring size"),
    ("indexer_update", _replace(7, _cast(jnp.int16)), TypeError, "tslot must be int32"),
    ("indexer_update", _replace(8, _cut(0)), ValueError, "ape must have shape"),
    ("indexer_update", _replace(9, _cut(1)), ValueError, "loc must have shape"),
    ("indexer_update", _replace(10, _cast(jnp.float32)), TypeError, "positions must be int32"),
    # update_epilogue: raw against q, each part by its op's rule, named as update_epilogue.
    ("update_epilogue", _replace(0, _cut(1)), ValueError, r"raw must have shape \(6, 272\)"),
    ("update_epilogue", _replace(0, _cast(jnp.bfloat16)), TypeError, "raw must be float32"),
    ("update_epilogue", _replace(1, _cut(0)), ValueError,
     r"q must have requests x next_n = 3 x 2 rows \(tslot's shape\), got \(5, 16, 128\)"),
    ("update_epilogue", _replace(2, _cast(jnp.bfloat16)), TypeError, "norm_weight must be float32"),
    ("update_epilogue", _replace(4, _cut(2)), ValueError, r"kv_cache must have shape \(\*, \*,"),
    ("update_epilogue", _replace(6, _cast(jnp.int16)), TypeError, "tslot must be int32"),
    ("update_epilogue", _replace(9, _cast(jnp.float32)), TypeError, "positions must be int32"),
]


@pytest.mark.parametrize("op,mutate,error,message", BAD_ARGS,
                         ids=[f"{b[0]}-{b[3][:24]}" for b in BAD_ARGS])
def test_bad_argument(op, mutate, error, message):
  case = CASES[op]
  args = mutate(case.make(np.random.default_rng(0)))
  with pytest.raises(error, match=f"glm5_jax.{op}: {message}"):
    jax.jit(case.fn)(*args)


BAD_PARAMS = [
    ("kpool_update", dict(scale_format="e8m0"), "scale_format must be one of"),
    ("kpool_update", dict(scale_format="ue8m0", round_scale=False), "round_scale"),
    ("expand_pools", dict(width=10), r"width must be >= 4 \* G \+ 3 = 35"),
    ("expand_and_remap", dict(block_size=6), "block_size must be a positive multiple of 4"),
    ("expand_and_remap", dict(width=100), "width must be >="),
    ("expand_pools", dict(seq_offset=2**31), "seq_offset must fit in int32"),
    ("expand_and_remap", dict(seq_offset=-2**31 - 1), "seq_offset must fit in int32"),
    ("expand_and_remap", dict(block_size=2**32), "block_size must fit in int32"),
    ("expand_and_remap", dict(stride_rows=2**31), "stride_rows must fit in int32"),
    ("expand_and_remap", dict(stride_rows=0), "stride_rows must be > 0, got 0"),
    ("expand_pools", dict(width=0), r"width must be >= 4 \* G \+ 3 = 35, got 0"),
    ("indexer_query", dict(padded=0), "padded must be >= the head count 4, got 0"),
    ("pool_topk", dict(k=0), "k must be > 0"),
    ("select_pools", dict(k=-4), "k must be > 0"),
    ("select_pools", dict(max_pools=0), "max_pools must be > 0"),
    ("select_pools", dict(scale_format="e8"), "scale_format must be one of"),
    ("select_pools", dict(next_n=0), "next_n must be >= 1, got 0"),
    ("select_slots", dict(next_n=-2), "next_n must be >= 1, got -2"),
    ("mqa_logits", dict(scale_format="bf16"), "scale_format must be one of"),
    ("select_slots", dict(k=0), "k must be > 0, got 0"),
    ("select_slots", dict(max_pools=-1), "max_pools must be > 0"),
    ("select_slots", dict(scale_format="e8"), "scale_format must be one of"),
    ("select_slots", dict(block_size=6), "block_size must be a positive multiple of 4, got 6"),
    ("select_slots", dict(block_size=0), "block_size must be a positive multiple of 4, got 0"),
    ("select_slots", dict(width=22), r"width must be >= 4 \* G \+ 3 = 23, got 22"),
    ("select_slots", dict(k=6, width=24), r"width must be >= 4 \* G \+ 3 = 27, got 24"),
    ("select_slots", dict(stride_rows=0), "stride_rows must be > 0, got 0"),
    ("select_slots", dict(stride_rows=-16), "stride_rows must be > 0, got -16"),
    ("select_slots", dict(stride_rows=2**31), "stride_rows must fit in int32"),
    ("select_slots", dict(block_size=2**32), "block_size must fit in int32"),
    ("indexer_query", dict(padded=2), "padded must be >= the head count 4"),
    ("indexer_query", dict(w_out_dtype=jnp.float16), "w_out_dtype must be float32 or bfloat16"),
    ("indexer_projection_fused", dict(heads=5), "w_cat must have shape"),
    ("indexer_update", dict(heads=5), "w_cat must have shape"),
    ("indexer_update", dict(padded=8), "padded must be >= the head count 16, got 8"),
    ("indexer_update", dict(scale_format="e8"), "scale_format must be one of"),
    ("indexer_update", dict(scale_format="ue8m0", round_scale=False), "round_scale"),
    ("indexer_update", dict(tactic=(16, 1)),
     r"tactic must be \(warps 1..8, split 0 \(the GEMV\), -1 \(wgmma\) or 1..8\)"),
    ("indexer_update", dict(tactic=(8, 8)), r"tactic \(8, 8\) does not tile K = 1024"),
    ("indexer_projection", dict(tactic=(16, 1)),
     r"tactic must be \(warps 1..8, split 0 \(the GEMV\), -1 \(wgmma\) or 1..8\)"),
    ("indexer_projection", dict(tactic=(8, 0)),
     r"tactic \(8, 0\) does not tile K = 1024: K must be 256 \* warps \* loads"),
    ("indexer_projection", dict(tactic=(4, 3)), "tactic .* does not tile K = 1024"),
    ("indexer_projection", dict(tactic=(8, -1)),
     r"tactic \(8, -1\) does not tile K = 1024: warps must be 4 and K a multiple of 512"),
    ("indexer_projection_fused", dict(tactic=(4, -1)),
     r"tactic must be \(warps 1..8, split 1..1\)"),
    ("indexer_projection_fused", dict(tactic=(8, 2)), r"tactic must be \(warps 1..8, split 1..1\)"),
    ("indexer_projection_fused", dict(tactic=(4, 0)), r"tactic must be \(warps 1..8, split 1..1\)"),
    ("indexer_projection_fused", dict(tactic=(3, 1)), "tactic .* does not tile K = 1024"),
    ("indexer_q", dict(tactic="tma"), r"tactic must be one of \('mma', 'wgmma'\) or None"),
]


@pytest.mark.parametrize("tactic,k,message", [
    ("wgmma", 1000, r"tactic 'wgmma' does not tile wq_b \(128, 1000\): N % 64 == 0, "
                    r"K = 128 \* boxes with boxes >= 1"),
    ("mma", 2304, r"tactic 'mma' does not tile wq_b \(128, 2304\): N % 32 == 0, "
                  r"K = 256 \* blocks with blocks in 1..8")])
def test_q_tactic_must_tile(tactic, k, message):
  """An explicit indexer_q tactic that does not tile wq_b is a trace-time error (None runs
  the reference where the default tactic does not tile)."""
  qr, wq_b = jnp.zeros((2, k), jnp.bfloat16), jnp.zeros((128, k), jnp.bfloat16)
  with pytest.raises(ValueError, match=f"glm5_jax.indexer_q: {message}"):
    jax.jit(functools.partial(glm5_jax.indexer_q, tactic=tactic))(qr, wq_b)
  assert jax.jit(glm5_jax.indexer_q)(qr, wq_b).shape == (2, 128)


@pytest.mark.parametrize("op,params,message", BAD_PARAMS,
                         ids=[f"{b[0]}-{next(iter(b[1]))}" for b in BAD_PARAMS])
def test_bad_static_option(op, params, message):
  fn = _with(op, **params)
  args = CASES[op].make(np.random.default_rng(0))
  with pytest.raises((ValueError, TypeError), match=f"glm5_jax.{op}: {message}"):
    jax.jit(fn)(*args)


# Zero-valued params the reference and the op normalise by one rule (None = the default,
# anything else is checked): the reference raises what the op raises.
SHARED_RULES = [
    ("expand_pools", dict(width=0), r"width must be >= 4 \* G \+ 3 = 35, got 0"),
    ("expand_pools", dict(width=10), r"width must be >= 4 \* G \+ 3 = 35, got 10"),
    ("expand_and_remap", dict(stride_rows=0), "stride_rows must be > 0, got 0"),
    ("expand_and_remap", dict(stride_rows=-4), "stride_rows must be > 0, got -4"),
    ("expand_and_remap", dict(width=100), r"width must be >= 4 \* G \+ 3 = 131, got 100"),
    ("indexer_query", dict(padded=0), "padded must be >= the head count 4, got 0"),
]


@pytest.mark.parametrize("op,params,message", SHARED_RULES,
                         ids=[f"{b[0]}-{b[1]}" for b in SHARED_RULES])
def test_reference_shares_the_op_rule(op, params, message):
  fn = CASES[op].fn
  static = {**getattr(fn, "keywords", {}), **params}
  args = CASES[op].make(np.random.default_rng(0))
  for impl in (getattr(glm5_jax, op), getattr(glm5_jax.reference, op)):
    with pytest.raises(ValueError, match=f"glm5_jax.{op}: {message}"):
      jax.jit(functools.partial(impl, **static))(*args)


@pytest.mark.parametrize("op,params,default", [
    ("expand_pools", dict(width=None), dict(width=35)),
    ("expand_and_remap", dict(stride_rows=None), dict(stride_rows=16)),
    ("indexer_query", dict(padded=None), dict(padded=4))])
def test_none_is_the_default(op, params, default):
  """None means the documented default, for the op and the reference alike."""
  fn = CASES[op].fn
  static = getattr(fn, "keywords", {})
  args = CASES[op].make(np.random.default_rng(0))
  for impl in (getattr(glm5_jax, op), getattr(glm5_jax.reference, op)):
    got = jax.jit(functools.partial(impl, **{**static, **params}))(*args)
    want = jax.jit(functools.partial(impl, **{**static, **default}))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_fp32_logits_pass_through():
  logits = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
  assert glm5_jax.upcast_logits(logits, jnp.array([1, 2], jnp.int32)) is logits


def test_rope_indexer_is_refused():
  """The indexer is NoPE only (SPEC §9): a config with rope_dim != 0 is an error that
  names the class and the argument."""
  with pytest.raises(ValueError, match=r"IndexerConfig: rope_dim must be 0 .* got 64"):
    glm5_jax.IndexerConfig(rope_dim=64)
  assert glm5_jax.IndexerConfig(rope_dim=0).rope_dim == 0
