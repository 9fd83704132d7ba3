"""Reference pool expansion and sparse-MLA remap (SPEC §6, §7).

Index conventions: -1 = unused. Pool id g covers tokens 4g .. 4g + 3; a row's
token length n = positions + seq_offset; its trailing incomplete pool holds
tokens 4*(n // 4) .. n - 1 (none when n <= 0).
"""
import jax.numpy as jnp

from .checks import fail
from .numerics import POOL


def expand_width(op, groups, width):
  """The columns of an expansion of G pool ids: `width` (>= 4G + 3), 4G + 3 where None."""
  need = groups * POOL + POOL - 1
  if width is None:
    return need
  if width < need:
    fail(op, "width", f"must be >= 4 * G + 3 = {need}, got {width}")
  return width


def remap_stride(block_size, stride_rows, op="expand_and_remap"):
  """Slot rows per block of the sparse-MLA buffer: `stride_rows` (> 0), block_size where
  None."""
  if stride_rows is None:
    return block_size
  if stride_rows <= 0:
    fail(op, "stride_rows", f"must be > 0, got {stride_rows}")
  return stride_rows


def max_block_id(block_size, stride_rows):
  """The largest block-table entry that names a block (SPEC §12): its slots
  entry * stride_rows + [0, block_size) all fit int32. A negative entry or one above this
  names none, and its tokens are dropped (-1, not counted)."""
  return (2 ** 31 - 1 - (block_size - 1)) // stride_rows


def _tail_tokens(seq_lens):
  """(first token i32[rows], count i32[rows]) of each row's incomplete pool."""
  n = jnp.maximum(seq_lens, 0)
  start = n // POOL * POOL
  return start, n - start


def _expanded_tokens(pool_ids, seq_lens):
  """Logical token ids i32[rows, 4G + 3]: pools in rank order, then the tail."""
  rows, groups = pool_ids.shape
  pid = pool_ids.astype(jnp.int32)
  hist = jnp.where(pid[:, :, None] >= 0, pid[:, :, None] * POOL + jnp.arange(POOL), -1)
  start, count = _tail_tokens(seq_lens)
  j = jnp.arange(POOL - 1)
  tail = jnp.where(j < count[:, None], start[:, None] + j, -1)
  return jnp.concatenate([hist.reshape(rows, groups * POOL), tail], 1)


def _pad_columns(x, width):
  return jnp.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=-1)


def expand_pools(pool_ids, seq_lens, *, seq_offset=0, width=None):
  """pool ids -> token ids + the trailing incomplete pool (SPEC §6).

  pool_ids i32[rows, G] (-1 unused); seq_lens i32[rows] (n = seq_lens + seq_offset).
  Returns i32[rows, width]; width >= 4G + 3 (None: 4G + 3), wider rows are -1 filled.
  """
  width = expand_width("expand_pools", pool_ids.shape[1], width)
  return _pad_columns(_expanded_tokens(pool_ids, seq_lens + seq_offset), width)


def expand_and_remap(pool_ids, positions, req_ids, block_table, *, block_size,
                     width, stride_rows=None, seq_offset=1, compact=True):
  """Expand pool ids and map them to physical sparse-MLA slots (SPEC §6 + §7).

  pool_ids i32[expanded, G]; positions i32[expanded]; req_ids i32[rows];
  block_table i32[R, MB]; width >= 4G + 3; stride_rows > 0 (None: block_size).
  Token tok maps to
  block_table[req, tok // block_size] * stride_rows + tok % block_size; it is
  dropped when its block is >= MB or its entry names no block (negative, or above
  max_block_id: SPEC §12). Rows >= expanded and rows whose request is outside [0, R)
  hold no indices.
  Returns (out i32[rows, width], counts i32[rows]): valid slots first in
  column order and -1 after them (compact), or each in its own column
  (compact=False).
  """
  stride_rows = remap_stride(block_size, stride_rows)
  width = expand_width("expand_and_remap", pool_ids.shape[1], width)
  expanded = pool_ids.shape[0]
  rows = req_ids.shape[0]
  tokens = _expanded_tokens(pool_ids[:rows], positions[:rows] + seq_offset)
  tokens = jnp.pad(tokens, ((0, rows - min(rows, expanded)), (0, 0)), constant_values=-1)
  tokens = _pad_columns(tokens, width)
  n_req, max_blocks = block_table.shape
  req_ok = (req_ids >= 0) & (req_ids < n_req)
  blk = jnp.where(tokens >= 0, tokens // block_size, max_blocks)
  valid = (blk < max_blocks) & req_ok[:, None]
  req = jnp.clip(req_ids, 0, n_req - 1)
  base = block_table[req[:, None], jnp.minimum(blk, max_blocks - 1)]
  valid &= (base >= 0) & (base <= max_block_id(block_size, stride_rows))
  slots = jnp.where(valid, base * stride_rows + tokens % block_size, -1)
  counts = jnp.sum(valid, axis=1, dtype=jnp.int32)
  if not compact:
    return slots, counts
  dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, width)   # width is dropped
  out = jnp.full((rows, width), -1, jnp.int32)
  out = out.at[jnp.arange(rows)[:, None], dest].set(slots, mode="drop")
  return out, counts
