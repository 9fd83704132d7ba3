"""Pool expansion and the fused expand + sparse-MLA remap (SPEC §6, §7).
Shapes and dtypes: see glm5_jax.reference.expand."""
import numpy as np
import jax

from . import reference as ref
from ._checks import expect, fail
from ._primitive import Op, Routing, Split, local_ids
from .limits import REMAP_GROUPS, WARP
from .reference.expand import expand_width, max_block_id, remap_stride
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
  expand_width("expand_pools", groups, width)
  _check_int32("expand_pools", "seq_offset", seq_offset)
  return [((rows, width), I32)]


# Kernel: any G (width is the result's shape, not an attribute).
_expand = Op("expand_pools", ref.expand_pools, _expand_shapes, rows=((0, 0), (0,)),
             kernel="glm5_expand_pools", attributes=dict(seq_offset=np.int64),
             kernel_off='expand_pools "kernel" against "reference": XLA\'s fusion is as fast',
             split=Split(("rows", "rows"), ("rows",)))


def expand_pools(pool_ids: jax.Array, seq_lens: jax.Array, *, seq_offset: int = 0,
                 width: int | None = None, routing: Routing | None = None) -> jax.Array:
  """Token ids i32[rows, width] of pool ids i32[rows, G] plus each row's
  trailing incomplete pool (n = seq_lens + seq_offset); width >= 4G + 3
  (None: 4G + 3), extra columns -1. SPEC §6. routing: None = Routing.from_env()."""
  width = expand_width("expand_pools", pool_ids.shape[1], None if width is None else int(width))
  return _expand(pool_ids, seq_lens, seq_offset=int(seq_offset), width=width,
                 routing=routing)[0]


def check_remap(op, groups, block_table, *, block_size, width, stride_rows, seq_offset=1):
  """The remap's arguments of `op` (expand_and_remap, select_slots) for G = `groups` pool
  ids a row."""
  expect(op, "block_table", block_table, I32, (None, None))
  if block_table.shape[0] == 0 or block_table.shape[1] == 0:
    fail(op, "block_table", f"must not be empty, got {tuple(block_table.shape)}")
  if block_size <= 0 or block_size % POOL:
    fail(op, "block_size", f"must be a positive multiple of 4, got {block_size}")
  remap_stride(block_size, stride_rows, op)
  for arg, value in [("block_size", block_size), ("stride_rows", stride_rows),
                     ("seq_offset", seq_offset)]:
    _check_int32(op, arg, value)
  expand_width(op, groups, width)


def remap_attribute_values(*avals, block_size, stride_rows, **params):
  """The remap's derived attribute: max_block, the largest block-table entry that names a
  block (SPEC §12), computed here once for the kernels (expand_and_remap, select_slots)."""
  return dict(max_block=max_block_id(block_size, stride_rows))


def _remap_shapes(pool_ids, positions, req_ids, block_table, *, block_size, width,
                  stride_rows, seq_offset, compact):
  op = "expand_and_remap"
  expect(op, "pool_ids", pool_ids, I32, (None, None))
  expect(op, "positions", positions, I32, (pool_ids.shape[0],))
  expect(op, "req_ids", req_ids, I32, (None,))
  check_remap(op, pool_ids.shape[1], block_table, block_size=block_size, width=width,
              stride_rows=stride_rows, seq_offset=seq_offset)
  rows = req_ids.shape[0]
  return [((rows, width), I32), ((rows,), I32)]


def _remap_kernel_supports(pool_ids, positions, req_ids, block_table, **params):
  """A whole number of warps of pools within one CTA (width >= 4G + 3 is checked at
  trace time)."""
  groups = pool_ids.shape[1]
  return groups % WARP == 0 and REMAP_GROUPS[0] <= groups <= REMAP_GROUPS[1]


_remap = Op("expand_and_remap", ref.expand_and_remap, _remap_shapes,
            rows=((0, 0, 0, None), (0, 0)), kernel="glm5_expand_and_remap",
            attributes=dict(block_size=np.int64, stride_rows=np.int64, max_block=np.int64,
                            seq_offset=np.int64, compact=np.bool_),
            attribute_values=remap_attribute_values, kernel_supports=_remap_kernel_supports,
            kernel_limits="G % {} == 0, {} <= G <= {}".format(WARP, *REMAP_GROUPS),
            # The block table's values are the slots' blocks, not memory this op reads:
            # they pass through as they are (global where the table holds global ids).
            split=Split(("rows", "rows", "rows", "requests"), ("rows", "rows"),
                        lambda index, pool_ids, positions, req_ids, block_table: (
                            pool_ids, positions,
                            local_ids(req_ids, index, block_table.shape[0]), block_table)))


def expand_and_remap(pool_ids: jax.Array, positions: jax.Array, req_ids: jax.Array,
                     block_table: jax.Array, *, block_size: int, width: int,
                     stride_rows: int | None = None, seq_offset: int = 1,
                     compact: bool = True, routing: Routing | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """Expand + block-table remap + compaction + counts in one op (SPEC §6, §7).

  Returns (out i32[rows, width], counts i32[rows]), rows = len(req_ids);
  stride_rows > 0 (None: block_size); see glm5_jax.reference.expand_and_remap. The
  CUDA kernel takes G % 32 == 0, 32 <= G <= 1024 (REMAP_GROUPS); other G run the
  reference on GPU too. routing: None = Routing.from_env().
  """
  stride_rows = remap_stride(int(block_size), None if stride_rows is None else int(stride_rows))
  return tuple(_remap(pool_ids, positions, req_ids, block_table,
                      block_size=int(block_size), width=int(width), stride_rows=stride_rows,
                      seq_offset=int(seq_offset), compact=bool(compact), routing=routing))
