"""The CUDA kernels' limits and tile sizes, declared once.

The ops' checks, tactics and routing read them from here (indexer, logits, update, expand
import them under the same names); the kernels read them from cc/limits.h, which is
generated from this module and checked in:

  python scripts/limits_header.py

tests/test_cc_sources.py regenerates the header and fails where the checked-in one differs.
Each NAME becomes glm5::limits::kName (an int, or an int array for a tuple); a tuple of
tactic names NAME_TACTICS becomes one kName<Tactic> constant per tactic, its index (the FFI
attribute that names it). Plain ints and tuples only: the header is all the C++ sees.
"""
# The SPEC's sizes, declared by the executable spec (glm5_jax.reference.numerics): the
# header carries them too, so that cc/constants.h states no number of its own.
from .reference.numerics import DIM, POOL  # noqa: F401 (into the header)

WARP = 32  # lanes per warp

# indexer_projection's mma tactics (cc/projection.cuh): TILE_ROWS w_cat rows per CTA; a
# tactic (warps, split) is warps per CTA and CTAs per cluster splitting K; a warp's span of K
# is 1..MAX_BLOCKS blocks of BLOCK_K held in registers, or whole stages of MAX_BLOCKS blocks
# (MAX_STAGES bounds the int32 stage count). MAX_SPLIT is the portable cluster size.
TILE_ROWS = 16
BLOCK_K = 32
MAX_BLOCKS = 8
MAX_WARPS = 8
MAX_SPLIT = 8
MAX_STAGES = 1 << 20
# split GEMV_SPLIT names the GEMV tactic: one CTA per w_cat row, a warp's lanes taking GEMV_K
# of K per 16-byte load (8 bf16 a lane), 1..MAX_BLOCKS loads held in registers.
GEMV_SPLIT = 0
GEMV_K = 8 * WARP
# split WGMMA_SPLIT names the wgmma tactic: one warpgroup (WGMMA_WARPS) a CTA, clusters of
# WGMMA_CLUSTER CTAs splitting K in TMA boxes of WGMMA_BOX_K (one 128-byte swizzle row of
# bf16; indexer_q's wgmma kernel takes the same boxes).
WGMMA_SPLIT = -1
WGMMA_WARPS = 4
WGMMA_CLUSTER = 8
WGMMA_BOX_K = 64
# indexer_projection_fused's warps where no tactic is given (its split is always 1).
FUSED_WARPS = 8

# indexer_q's tactics (cc/q_gemm.cu), the FFI attribute `tactic` being the index here:
# - "mma": Q_TILE_ROWS wq_b rows per CTA, Q_WARPS warps each owning K / Q_WARPS of them in
#   1..Q_MAX_BLOCKS blocks of BLOCK_K, mma.sync;
# - "wgmma": Q_WGMMA_ROWS wq_b rows per CTA (one warpgroup, an m64 tile), K split in
#   Q_WGMMA_SPLIT over a cluster, each part >= 1 boxes of WGMMA_BOX_K through a TMA ring.
Q_TACTICS = ("mma", "wgmma")
Q_TILE_ROWS = 32
Q_WARPS = 8
Q_MAX_BLOCKS = 8
Q_WGMMA_ROWS = 64
Q_WGMMA_SPLIT = 2

# update_epilogue reads raw's rows of 256 + H floats in 16-byte loads: H a multiple of this.
RAW_HEADS_MULTIPLE = 4

# expand_and_remap's kernel: one CTA per row, a thread per pool in whole warps (the ballot),
# its shared memory sized for the largest G: G % WARP == 0 and REMAP_GROUPS[0] <= G <=
# REMAP_GROUPS[1].
REMAP_GROUPS = (32, 1024)

# The select kernels (cc/select*.cu*): q_fp8 with LOGITS_HEADS (padded) heads, 8-head mma
# tiles; K-cache pages of a multiple of LOGITS_PAGE_MULTIPLE entries (one warp's tile of pools
# lies in one page); at most LOGITS_MAX_ROWS rows (the CTA's row tables live in shared memory
# beside the ring); LOGITS_ITEM_POOLS pools per work item (the consumer warps' tiles); the
# top-k holds a row of at most TOPK_CTA_POOLS pools in one CTA's registers, and of at most
# TOPK_MAX_POOLS (1M tokens) in those of a cluster of 8 CTAs.
LOGITS_HEADS = (32, 64)
LOGITS_PAGE_MULTIPLE = 16
LOGITS_MAX_ROWS = 8192
LOGITS_ITEM_POOLS = 64
TOPK_CTA_POOLS = 32768
TOPK_MAX_POOLS = 262144
# A row wider than TOPK_CTA_POOLS takes a cluster whose CTAs fit one wave of the SMs with
# the other rows' (cc launch_topk's topk_parts; plan.topk_row_pools): 4-8 CTAs a row (16 at
# one row of 1M tokens) up to TOPK_CLUSTER_MAX_ROWS rows, rows of up to TOPK_MAX_POOLS; a
# pair of CTAs a row up to TOPK_PAIR_MAX_ROWS rows (128 CTAs at 64), rows of up to two CTAs'
# TOPK_CTA_POOLS. Past them the plan cuts the rows into chunks of one CTA's width.
TOPK_CLUSTER_MAX_ROWS = 16
TOPK_PAIR_MAX_ROWS = 64
# The select path's logits score the rows of one request (next_n consecutive rows, MTP) from
# one read of its K tiles, in units of at most LOGITS_GROUP_ROWS rows.
LOGITS_GROUP_ROWS = 4

COMMAND = "python scripts/limits_header.py"


def _camel(name: str) -> str:
  return "".join(part.capitalize() for part in name.lower().split("_"))


def _declarations():
  """(C++ declaration, Python name) of every limit, in the order of this module."""
  for name, value in list(globals().items()):
    if not name.isupper() or name.startswith("_") or name == "COMMAND":
      continue
    if name.endswith("_TACTICS"):
      prefix = _camel(name[: -len("_TACTICS")])
      for index, tactic in enumerate(value):
        yield f"inline constexpr int k{prefix}{_camel(tactic)} = {index};", f"{name}[{index}]"
    elif isinstance(value, tuple):
      yield (f"inline constexpr int k{_camel(name)}[] = {{{', '.join(map(str, value))}}};",
             name)
    else:
      yield f"inline constexpr int k{_camel(name)} = {value};", name


def header() -> str:
  """The text of cc/limits.h."""
  lines = [f"// Generated from glm5_jax/limits.py by `{COMMAND}`: edit that",
           "// module, not this file (tests/test_cc_sources.py checks that they agree).",
           "#pragma once", "", "namespace glm5::limits {", ""]
  lines += [f"{decl}  // {name}" for decl, name in _declarations()]
  lines += ["", "}  // namespace glm5::limits", ""]
  return "\n".join(lines)

