"""Reference kpool cache writers: decode update (SPEC §3), prefill compress and
tail seed (§4).

Layouts (SPEC §0):
  kv_cache  u8[pages, PAGE, 132]: per page, PAGE entries of 128 fp8 bytes, then
            PAGE 4-byte scales (not interleaved). Flat slot `loc` = page*PAGE + entry.
  tail      bf16[tail_blocks, 2, RING, 128]: [b, 0] raw keys, [b, 1] gates.
Out-of-range slots and tail blocks never write (SPEC D4).
"""
import jax.numpy as jnp
from jax import lax

from .numerics import DIM, LOG2E, POOL, exp2, fma_bf16, rotate_quant, round_bf16, scale_bytes

# Tokens of a call traced per loop trip: MTP's next_n <= 4 runs as one straight graph; longer
# calls loop, since the GPU compiler's time grows with the unrolled tokens times the batch.
UNROLL_TOKENS = 4


def compress_pools(keys, gates, ape, *, scale_format="fp32", round_scale=True):
  """Softmax-pool four tokens and quantise (SPEC §3, the completion branch).

  keys, gates: f32[n, 4, 128] (bf16 values) in pool order; ape: f32[4, 128].
  Returns (fp8 bytes u8[n, 128], scale bytes u8[n, 4]).
  """
  z = gates + ape
  peak = jnp.full(z.shape[:1] + z.shape[2:], -jnp.inf, jnp.float32)
  for s in range(POOL):
    peak = jnp.fmax(peak, z[:, s])
  den = jnp.zeros_like(peak)
  acc = jnp.zeros_like(peak)
  for s in range(POOL):
    prob = exp2((z[:, s] - peak) * LOG2E)
    den = den + prob
    acc = fma_bf16(prob, keys[:, s], acc)
  q, scale, exponent = rotate_quant(round_bf16(acc / den), round_scale=round_scale)
  return lax.bitcast_convert_type(q, jnp.uint8), scale_bytes(scale, exponent, scale_format)


def write_entries(kv_cache, loc, data, scales, write):
  """Store entries at flat slots `loc` where `write` (and loc is in range).

  kv_cache u8[pages, PAGE, 132]; loc i32[n]; data u8[n, 128]; scales u8[n, 4].
  """
  pages, page = kv_cache.shape[:2]
  flat = jnp.asarray(kv_cache).reshape(pages, page * (DIM + 4))
  ok = write & (loc >= 0) & (loc < pages * page)
  pg = jnp.where(ok, loc // page, pages)          # `pages` is dropped
  entry = jnp.where(ok, loc % page, 0)
  data_cols = entry[:, None] * DIM + jnp.arange(DIM)
  scale_cols = page * DIM + entry[:, None] * 4 + jnp.arange(4)
  flat = flat.at[pg[:, None], data_cols].set(data, mode="drop")
  flat = flat.at[pg[:, None], scale_cols].set(scales, mode="drop")
  return flat.reshape(kv_cache.shape)


def _stash(tail, blk, row, key, gate):
  """tail[blk, :, row] = (key, gate) for blk < blocks (others dropped).

  Scattered as uint16: a bf16 scatter is widened to f32 on some backends,
  which costs a copy of a donated tail.
  """
  rows = jnp.stack([_bf16_bits(key), _bf16_bits(gate)], 1)           # [n, 2, 128]
  out = _bf16_bits(tail).at[blk[:, None], jnp.arange(2), row[:, None]].set(rows, mode="drop")
  return lax.bitcast_convert_type(out, jnp.bfloat16)


def _bf16_bits(x):
  return lax.bitcast_convert_type(x, jnp.uint16)


def kpool_update(kv_cache, tail, tslot, key, gate, ape, loc, positions, *,
                 scale_format="fp32", round_scale=True):
  """Decode tail stash + pool compression, per request in token order (SPEC §3).

  kv_cache u8[pages, PAGE, 132]; tail bf16[blocks, 2, RING, 128];
  tslot i32[B, N] (tail block * RING + positions % RING, -1 pad); key, gate bf16[B, N, 128];
  ape f32[4, 128]; loc i32[B, N] (pool slot, -1 none); positions i32[B, N] (-1 pad).
  Returns (kv_cache, tail). A completing token (loc >= 0, positions % 4 == 3) pools
  ring rows stashed earlier (also earlier in this call) with its own key/gate.
  Requests must own distinct tail blocks. A tail block past the ring buffer
  makes the token a no-op. A completing token with tslot < 0 pools the rows of
  tail block 0 (as stock) and stashes nothing; kernels run requests
  concurrently, so that read is defined only while no request of the same call
  stashes into block 0.
  """
  blocks, _, ring, _ = tail.shape
  apef = jnp.asarray(ape, jnp.float32)
  # Arrays, not numpy: the loop indexes them with a traced token (the op also runs eagerly).
  tslot, key, gate, loc, positions = map(jnp.asarray, (tslot, key, gate, loc, positions))

  def token(t, carry):
    kv_cache, tail = carry
    p, slot, ts = positions[:, t], loc[:, t], tslot[:, t]
    sp = jnp.maximum(p, 0)
    blk = jnp.maximum(ts, 0) // ring
    live = (p >= 0) & (blk < blocks)
    blk = jnp.minimum(blk, blocks - 1)
    rows = (sp[:, None] - 3 + jnp.arange(POOL - 1)) % ring          # [B, 3]
    stashed = _bf16_bits(tail)[blk[:, None], :, rows]                  # [B, 3, 2, 128]
    # The stash below must follow this read; saying so lets XLA update a
    # donated tail in place instead of copying it first.
    stashed, tail = lax.optimization_barrier((stashed, tail))
    stashed = lax.bitcast_convert_type(stashed, jnp.bfloat16).astype(jnp.float32)
    keys = jnp.concatenate([stashed[:, :, 0], key[:, t, None].astype(jnp.float32)], 1)
    gates = jnp.concatenate([stashed[:, :, 1], gate[:, t, None].astype(jnp.float32)], 1)
    data, scales = compress_pools(keys, gates, apef, scale_format=scale_format,
                                  round_scale=round_scale)
    complete = live & (slot >= 0) & (sp % POOL == POOL - 1)
    kv_cache = write_entries(kv_cache, slot, data, scales, complete)
    stash = live & (ts >= 0)
    return kv_cache, _stash(tail, jnp.where(stash, blk, blocks), sp % ring, key[:, t], gate[:, t])

  n = key.shape[1]
  if n == 0:                       # traced even at no trips, where key[:, t] has no column
    return kv_cache, tail
  return lax.fori_loop(0, n, token, (kv_cache, tail), unroll=min(n, UNROLL_TOKENS))


def kpool_compress(kv_cache, slot_key, slot_gate, ape, loc, write_mask, *,
                   scale_format="fp32", round_scale=True):
  """Prefill pool compression (SPEC §4a).

  kv_cache u8[pages, PAGE, 132]; slot_key, slot_gate bf16[n, 4, 128]; ape f32[4, 128];
  loc i32[n]; write_mask bool[n]. Returns kv_cache with entry loc[i] written
  where write_mask[i] and 0 <= loc[i] < pages * PAGE (write_entries).
  """
  data, scales = compress_pools(slot_key.astype(jnp.float32),
                                slot_gate.astype(jnp.float32),
                                ape.astype(jnp.float32),
                                scale_format=scale_format, round_scale=round_scale)
  return write_entries(kv_cache, loc, data, scales, write_mask)


def kpool_seed_tail(tail, key, gate, tslot):
  """Prefill tail seeding (SPEC §4b): each request's last (up to 4) tokens.

  tail bf16[blocks, 2, RING, 128]; key, gate bf16[n, 128]; tslot i32[n]
  (-1 skip). Token i is stashed at tail[tslot // RING, :, tslot % RING] unless
  token i + 4 lies in the same tail block (then it is not among the last four).
  """
  blocks, _, ring, _ = tail.shape
  n = tslot.shape[0]
  blk = jnp.maximum(tslot, 0) // ring
  ahead = jnp.concatenate([tslot[POOL:], jnp.full((min(POOL, n),), -1, tslot.dtype)])
  later = (ahead >= 0) & (ahead // ring == blk)
  write = (tslot >= 0) & ~later & (blk < blocks)
  return _stash(tail, jnp.where(write, blk, blocks), jnp.maximum(tslot, 0) % ring, key, gate)


def prefill_windows(tail, key, gate, positions, tslot):
  """The four (key, gate) rows of the pool each prefill row completes (SPEC §4a, §4c).

  tail bf16[blocks, 2, RING, 128]; key, gate bf16[rows, 128]; positions i32[rows]
  (-1 pad); tslot i32[rows] (tail block * RING + positions % RING). Returns (slot_key,
  slot_gate) bf16[rows, 4, 128]: slot s of row i is token positions[i] - 3 + s, taken from
  row i - 3 + s where that row holds it (same tail block, that position), else from
  ring row (positions[i] - 3 + s) % RING of row i's tail block, as stashed before this call
  (a chunk's first pool continues one an earlier chunk or decode step began). The
  rows of a request must be contiguous and in position order; a block past the tail
  reads block blocks - 1 (kpool_compress's write mask drops those rows).
  """
  blocks, _, ring, _ = tail.shape
  rows = key.shape[0]
  blk = jnp.minimum(jnp.maximum(tslot, 0) // ring, blocks - 1)
  pairs = jnp.stack([_bf16_bits(key), _bf16_bits(gate)], 1)                 # [rows, 2, 128]
  back = jnp.arange(POOL - 1, -1, -1)                                       # slot s: 3 - s
  want = positions[:, None] - back                                          # [rows, 4]
  src = jnp.arange(rows)[:, None] - back
  srcc = jnp.maximum(src, 0)
  in_call = (src >= 0) & (positions[srcc] == want) & (blk[srcc] == blk[:, None])
  ring_rows = _bf16_bits(tail)[blk[:, None], :, want % ring]                # [rows, 4, 2, 128]
  window = jnp.where(in_call[:, :, None, None], pairs[srcc], ring_rows)
  window = lax.bitcast_convert_type(window, jnp.bfloat16)
  return window[:, :, 0], window[:, :, 1]
