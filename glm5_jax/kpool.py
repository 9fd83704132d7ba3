"""kpool cache writers: decode update, prefill compress and tail seed
(SPEC §3, §4). The caches are updated in place: donate them at the jit
boundary. Shapes and dtypes: see glm5_jax.reference.kpool."""
import numpy as np
import jax.numpy as jnp

from . import reference as ref
from ._checks import check_cache, check_scale_format, check_tail, expect
from ._primitive import Op
from .reference.numerics import DIM, POOL

I32, F32, BF16 = np.int32, np.float32, jnp.bfloat16


def _update_shapes(kv_cache, tail, tslot, key, score, ape, loc, pos, *,
                   scale_format, round_scale):
  op = "kpool_update"
  check_cache(op, kv_cache)
  check_tail(op, tail)
  expect(op, "key", key, BF16, (None, None, DIM))
  grid = key.shape[:2]
  expect(op, "score", score, BF16, grid + (DIM,))
  expect(op, "ape", ape, F32, (POOL, DIM))
  for name, a in (("tslot", tslot), ("loc", loc), ("pos", pos)):
    expect(op, name, a, I32, grid)
  check_scale_format(op, scale_format, round_scale)
  return [(kv_cache.shape, kv_cache.dtype), (tail.shape, tail.dtype)]


def _scale_attributes(*, scale_format, round_scale):
  """FFI attributes of the scale options (C++ bool each)."""
  return {"ue8m0": scale_format == "ue8m0", "round_scale": bool(round_scale)}


_update = Op("kpool_update", ref.kpool_update, _update_shapes, aliases={0: 0, 1: 1},
             attributes=_scale_attributes)


def kpool_update(kv_cache, tail, tslot, key, score, ape, loc, pos, *,
                 scale_format="fp32", round_scale=True):
  """Decode tail stash + pool compression, requests x next_n tokens (SPEC §3).

  Returns the updated (kv_cache, tail); see glm5_jax.reference.kpool_update.
  """
  return tuple(_update(kv_cache, tail, tslot, key, score, ape, loc, pos,
                       scale_format=scale_format, round_scale=bool(round_scale)))


def _compress_shapes(kv_cache, slot_key, slot_score, ape, loc, write_mask, *,
                     scale_format, round_scale):
  op = "kpool_compress"
  check_cache(op, kv_cache)
  expect(op, "slot_key", slot_key, BF16, (None, POOL, DIM))
  n = slot_key.shape[0]
  expect(op, "slot_score", slot_score, BF16, (n, POOL, DIM))
  expect(op, "ape", ape, F32, (POOL, DIM))
  expect(op, "loc", loc, I32, (n,))
  expect(op, "write_mask", write_mask, np.bool_, (n,))
  check_scale_format(op, scale_format, round_scale)
  return [(kv_cache.shape, kv_cache.dtype)]


_compress = Op("kpool_compress", ref.kpool_compress, _compress_shapes, aliases={0: 0})


def kpool_compress(kv_cache, slot_key, slot_score, ape, loc, write_mask, *,
                   scale_format="fp32", round_scale=True):
  """Prefill pool compression into the K cache (SPEC §4a); returns kv_cache."""
  return _compress(kv_cache, slot_key, slot_score, ape, loc, write_mask,
                   scale_format=scale_format, round_scale=bool(round_scale))[0]


def _seed_shapes(tail, key, score, tslot):
  op = "kpool_seed_tail"
  check_tail(op, tail)
  expect(op, "key", key, BF16, (None, DIM))
  expect(op, "score", score, BF16, key.shape)
  expect(op, "tslot", tslot, I32, key.shape[:1])
  return [(tail.shape, tail.dtype)]


_seed = Op("kpool_seed_tail", ref.kpool_seed_tail, _seed_shapes, aliases={0: 0})


def kpool_seed_tail(tail, key, score, tslot):
  """Prefill: stash each request's last tokens in its tail ring (SPEC §4b);
  returns tail."""
  return _seed(tail, key, score, tslot)[0]
