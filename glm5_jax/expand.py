"""Pool expansion and the fused expand + sparse-MLA remap (SPEC §6, §7).
Shapes and dtypes: see glm5_jax.reference.expand."""
import numpy as np

from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op
from .reference.numerics import POOL

I32 = np.int32
I32_MAX = int(np.iinfo(I32).max)


def _check_int32(op, arg, value):
  """Static ints enter int32 arithmetic (the reference's and the kernel's)."""
  if not -I32_MAX - 1 <= value <= I32_MAX:
    fail(op, arg, f"must fit in int32, got {value}")


def _expand_shapes(pool_ids, seq_lens, *, seq_offset, width):
  expect("expand_pools", "pool_ids", pool_ids, I32, (None, None))
  rows, groups = pool_ids.shape
  expect("expand_pools", "seq_lens", seq_lens, I32, (rows,))
  if width < groups * POOL + POOL - 1:
    fail("expand_pools", "width", f"must be >= 4 * G + 3 = {groups * POOL + POOL - 1}, got {width}")
  _check_int32("expand_pools", "seq_offset", seq_offset)
  return [((rows, width), I32)]


# Kernel: any G (width is the result's shape, not an attribute).
_expand = Op("expand_pools", ref.expand_pools, _expand_shapes, rows=((0, 0), (0,)),
             attributes=lambda *, seq_offset, width: {"seq_offset": np.int64(seq_offset)})


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
  for arg, value in [("block_size", block_size), ("stride_rows", stride_rows),
                     ("seq_offset", seq_offset)]:
    _check_int32(op, arg, value)
  need = pool_ids.shape[1] * POOL + POOL - 1
  if width < need:
    fail(op, "width", f"must be >= 4 * G + 3 = {need}, got {width}")
  rows = req_ids.shape[0]
  return [((rows, width), I32), ((rows,), I32)]


def _remap_attributes(*, block_size, width, stride_rows, seq_offset, compact):
  return {"block_size": np.int64(block_size), "stride_rows": np.int64(stride_rows),
          "seq_offset": np.int64(seq_offset), "compact": np.bool_(compact)}


def _remap_kernel_supports(pool_ids, positions, req_ids, block_table, **params):
  """One CTA per row with a thread per pool and whole warps for the ballot
  (width >= 4G + 3 is checked at trace time)."""
  groups = pool_ids.shape[1]
  return groups % 32 == 0 and 32 <= groups <= 1024


_remap = Op("expand_and_remap", ref.expand_and_remap, _remap_shapes,
            rows=((0, 0, 0, None), (0, 0)), attributes=_remap_attributes,
            kernel_supports=_remap_kernel_supports,
            kernel_limits="G % 32 == 0, 32 <= G <= 1024")


def expand_and_remap(pool_ids, positions, req_ids, block_table, *, block_size,
                     width, stride_rows=None, seq_offset=1, compact=True):
  """Expand + block-table remap + compaction + counts in one op (SPEC §6, §7).

  Returns (out i32[rows, width], counts i32[rows]), rows = len(req_ids);
  see glm5_jax.reference.expand_and_remap. The CUDA kernel takes
  G % 32 == 0, 32 <= G <= 1024; other G run the reference on GPU too.
  """
  return tuple(_remap(pool_ids, positions, req_ids, block_table,
                      block_size=int(block_size), width=int(width),
                      stride_rows=int(stride_rows or block_size),
                      seq_offset=int(seq_offset), compact=bool(compact)))
