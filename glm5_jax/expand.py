"""Pool expansion and the fused expand + sparse-MLA remap (SPEC §6, §7).
Shapes and dtypes: see glm5_jax.reference.expand."""
import numpy as np

from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op
from .reference.numerics import POOL

I32 = np.int32


def _expand_shapes(pool_ids, seq_lens, *, seq_offset, width):
  expect("expand_pools", "pool_ids", pool_ids, I32, (None, None))
  rows, groups = pool_ids.shape
  expect("expand_pools", "seq_lens", seq_lens, I32, (rows,))
  if width < groups * POOL + POOL - 1:
    fail("expand_pools", "width", f"must be >= 4 * G + 3 = {groups * POOL + POOL - 1}, got {width}")
  return [((rows, width), I32)]


_expand = Op("expand_pools", ref.expand_pools, _expand_shapes, rows=((0, 0), (0,)))


def expand_pools(pool_ids, seq_lens, *, seq_offset=0, width=None):
  """Token ids i32[rows, width] of pool ids i32[rows, G] plus each row's
  trailing incomplete pool (n = seq_lens + seq_offset); width >= 4G + 3
  (default), extra columns -1. SPEC §6."""
  width = pool_ids.shape[1] * POOL + POOL - 1 if width is None else int(width)
  return _expand(pool_ids, seq_lens, seq_offset=int(seq_offset), width=width)[0]


def _remap_shapes(pool_ids, positions, req_ids, block_table, *, block_size, width,
                  stride_rows, seq_offset, compact):
  op = "expand_and_remap"
  expect(op, "pool_ids", pool_ids, I32, (None, None))
  expect(op, "positions", positions, I32, (pool_ids.shape[0],))
  expect(op, "req_ids", req_ids, I32, (None,))
  expect(op, "block_table", block_table, I32, (None, None))
  if block_table.shape[0] == 0 or block_table.shape[1] == 0:
    fail(op, "block_table", f"must not be empty, got {tuple(block_table.shape)}")
  if block_size <= 0 or block_size % POOL:
    fail(op, "block_size", f"must be a positive multiple of 4, got {block_size}")
  if stride_rows <= 0:
    fail(op, "stride_rows", f"must be > 0, got {stride_rows}")
  need = pool_ids.shape[1] * POOL + POOL - 1
  if width < need:
    fail(op, "width", f"must be >= 4 * G + 3 = {need}, got {width}")
  rows = req_ids.shape[0]
  return [((rows, width), I32), ((rows,), I32)]


_remap = Op("expand_and_remap", ref.expand_and_remap, _remap_shapes,
            rows=((0, 0, 0, None), (0, 0)))


def expand_and_remap(pool_ids, positions, req_ids, block_table, *, block_size,
                     width, stride_rows=None, seq_offset=1, compact=True):
  """Expand + block-table remap + compaction + counts in one op (SPEC §6, §7).

  Returns (out i32[rows, width], counts i32[rows]), rows = len(req_ids);
  see glm5_jax.reference.expand_and_remap.
  """
  return tuple(_remap(pool_ids, positions, req_ids, block_table,
                      block_size=int(block_size), width=int(width),
                      stride_rows=int(stride_rows or block_size),
                      seq_offset=int(seq_offset), compact=bool(compact)))
