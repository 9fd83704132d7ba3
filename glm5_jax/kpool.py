"""kpool cache writers: decode update, prefill compress and tail seed
(SPEC §3, §4). The caches are updated in place: donate them at the jit
boundary. Shapes and dtypes: see glm5_jax.reference.kpool."""
import numpy as np
import jax
import jax.numpy as jnp

from . import reference as ref
from ._checks import check_cache, check_scale_format, check_tail, expect
from ._primitive import Op, Routing, Split, local_ids
from .reference.numerics import DIM, POOL

I32, F32, BF16 = np.int32, np.float32, jnp.bfloat16


def _update_shapes(kv_cache, tail, tslot, key, gate, ape, loc, positions, *,
                   scale_format, round_scale, op="kpool_update"):
  # op: the name errors give (the update part's composite ops check their kpool_update part
  # here too, through Op.shapes).
  check_cache(op, kv_cache)
  check_tail(op, tail)
  expect(op, "key", key, BF16, (None, None, DIM))
  grid = key.shape[:2]
  expect(op, "gate", gate, BF16, grid + (DIM,))
  expect(op, "ape", ape, F32, (POOL, DIM))
  for name, a in (("tslot", tslot), ("loc", loc), ("positions", positions)):
    expect(op, name, a, I32, grid)
  check_scale_format(op, scale_format, round_scale)
  return [(kv_cache.shape, kv_cache.dtype), (tail.shape, tail.dtype)]


def _slots(kv_cache):
  """Flat K-cache slots of a (device's) cache: pages * PAGE."""
  return kv_cache.shape[0] * kv_cache.shape[1]


def _tail_slots(tail):
  """Tail slots (block * RING + row) of a (device's) tail: blocks * RING."""
  return tail.shape[0] * tail.shape[2]


def update_localize(index, kv_cache, tail, tslot, key, gate, ape, loc, positions):
  """kpool_update's operands on device `index` of a split call (Split.localize): tslot and
  loc made device-local."""
  return (kv_cache, tail, local_ids(tslot, index, _tail_slots(tail)), key, gate, ape,
          local_ids(loc, index, _slots(kv_cache)), positions)


# The scale options of both kernels' handlers (cc/kpool.cu): round_scale is the static
# param of that name, ue8m0 the UE8M0 scale format.
_SCALE_ATTRIBUTES = dict(ue8m0=np.bool_, round_scale=np.bool_)


def _scale_attribute_values(*avals, scale_format, **params):
  return dict(ue8m0=scale_format == "ue8m0")


_update = Op("kpool_update", ref.kpool_update, _update_shapes, aliases={0: 0, 1: 1},
             kernel="glm5_kpool_update",
             attributes=_SCALE_ATTRIBUTES, attribute_values=_scale_attribute_values,
             split=Split(("pages", "blocks", "rows", "rows", "rows", None, "rows", "rows"),
                         ("pages", "blocks"), update_localize))


def kpool_update(kv_cache: jax.Array, tail: jax.Array, tslot: jax.Array, key: jax.Array,
                 gate: jax.Array, ape: jax.Array, loc: jax.Array, positions: jax.Array, *,
                 scale_format: str = "fp32", round_scale: bool = True,
                 routing: Routing | None = None) -> tuple[jax.Array, jax.Array]:
  """Decode tail stash + pool compression, requests x next_n rows (SPEC §3).

  Returns the updated (kv_cache, tail); see glm5_jax.reference.kpool_update.
  routing: None = Routing.from_env().
  """
  return tuple(_update(kv_cache, tail, tslot, key, gate, ape, loc, positions,
                       scale_format=scale_format, round_scale=bool(round_scale),
                       routing=routing))


def _compress_shapes(kv_cache, slot_key, slot_gate, ape, loc, write_mask, *,
                     scale_format, round_scale):
  op = "kpool_compress"
  check_cache(op, kv_cache)
  expect(op, "slot_key", slot_key, BF16, (None, POOL, DIM))
  n = slot_key.shape[0]
  expect(op, "slot_gate", slot_gate, BF16, (n, POOL, DIM))
  expect(op, "ape", ape, F32, (POOL, DIM))
  expect(op, "loc", loc, I32, (n,))
  expect(op, "write_mask", write_mask, np.bool_, (n,))
  check_scale_format(op, scale_format, round_scale)
  return [(kv_cache.shape, kv_cache.dtype)]


_compress = Op(
    "kpool_compress", ref.kpool_compress, _compress_shapes, aliases={0: 0},
    kernel="glm5_kpool_compress",
    attributes=_SCALE_ATTRIBUTES, attribute_values=_scale_attribute_values,
    split=Split(("pages", "rows", "rows", None, "rows", "rows"), ("pages",),
                lambda index, kv_cache, slot_key, slot_gate, ape, loc, write_mask: (
                    kv_cache, slot_key, slot_gate, ape,
                    local_ids(loc, index, _slots(kv_cache)), write_mask)))


def kpool_compress(kv_cache: jax.Array, slot_key: jax.Array, slot_gate: jax.Array,
                   ape: jax.Array, loc: jax.Array, write_mask: jax.Array, *,
                   scale_format: str = "fp32", round_scale: bool = True,
                   routing: Routing | None = None) -> jax.Array:
  """Prefill pool compression into the K cache (SPEC §4a); returns kv_cache.

  Row i's pool is written at loc[i] where write_mask[i] and 0 <= loc[i] < pages * PAGE
  (others never write); rows must target distinct slots. See
  glm5_jax.reference.kpool_compress. routing: None = Routing.from_env().
  """
  return _compress(kv_cache, slot_key, slot_gate, ape, loc, write_mask,
                   scale_format=scale_format, round_scale=bool(round_scale),
                   routing=routing)[0]


def _seed_shapes(tail, key, gate, tslot):
  op = "kpool_seed_tail"
  check_tail(op, tail)
  expect(op, "key", key, BF16, (None, DIM))
  expect(op, "gate", gate, BF16, key.shape)
  expect(op, "tslot", tslot, I32, key.shape[:1])
  return [(tail.shape, tail.dtype)]


# Split: a row looks 4 rows ahead (is it among its request's last four?); at a block's
# end it sees none, as the unsharded op sees another request there when each
# request's rows lie in one device's block.
_seed = Op("kpool_seed_tail", ref.kpool_seed_tail, _seed_shapes, aliases={0: 0},
           split=Split(("blocks", "rows", "rows", "rows"), ("blocks",),
                       lambda index, tail, key, gate, tslot: (
                           tail, key, gate, local_ids(tslot, index, _tail_slots(tail)))))


def kpool_seed_tail(tail: jax.Array, key: jax.Array, gate: jax.Array, tslot: jax.Array, *,
                    routing: Routing | None = None) -> jax.Array:
  """Prefill: stash each request's last rows in its tail ring (SPEC §4b);
  returns tail."""
  return _seed(tail, key, gate, tslot, routing=routing)[0]
