// Generated from glm5_jax/limits.py by `python scripts/limits_header.py`: edit that
// module, not this file (tests/test_cc_sources.py checks that they agree).
#pragma once

namespace glm5::limits {

inline constexpr int kDim = 128;  // DIM
inline constexpr int kPool = 4;  // POOL
inline constexpr int kWarp = 32;  // WARP
inline constexpr int kTileRows = 16;  // TILE_ROWS
inline constexpr int kBlockK = 32;  // BLOCK_K
inline constexpr int kMaxBlocks = 8;  // MAX_BLOCKS
inline constexpr int kMaxWarps = 8;  // MAX_WARPS
inline constexpr int kMaxSplit = 8;  // MAX_SPLIT
inline constexpr int kMaxStages = 1048576;  // MAX_STAGES
inline constexpr int kGemvSplit = 0;  // GEMV_SPLIT
inline constexpr int kGemvK = 256;  // GEMV_K
inline constexpr int kWgmmaSplit = -1;  // WGMMA_SPLIT
inline constexpr int kWgmmaWarps = 4;  // WGMMA_WARPS
inline constexpr int kWgmmaCluster = 8;  // WGMMA_CLUSTER
inline constexpr int kWgmmaBoxK = 64;  // WGMMA_BOX_K
inline constexpr int kFusedWarps = 8;  // FUSED_WARPS
inline constexpr int kQMma = 0;  // Q_TACTICS[0]
inline constexpr int kQWgmma = 1;  // Q_TACTICS[1]
inline constexpr int kQTileRows = 32;  // Q_TILE_ROWS
inline constexpr int kQWarps = 8;  // Q_WARPS
inline constexpr int kQMaxBlocks = 8;  // Q_MAX_BLOCKS
inline constexpr int kQWgmmaRows = 64;  // Q_WGMMA_ROWS
inline constexpr int kQWgmmaSplit = 2;  // Q_WGMMA_SPLIT
inline constexpr int kRawHeadsMultiple = 4;  // RAW_HEADS_MULTIPLE
inline constexpr int kRemapGroups[] = {32, 1024};  // REMAP_GROUPS
inline constexpr int kLogitsHeads[] = {32, 64};  // LOGITS_HEADS
inline constexpr int kLogitsPageMultiple = 16;  // LOGITS_PAGE_MULTIPLE
inline constexpr int kLogitsMaxRows = 8192;  // LOGITS_MAX_ROWS
inline constexpr int kLogitsItemPools = 64;  // LOGITS_ITEM_POOLS
inline constexpr int kTopkCtaPools = 32768;  // TOPK_CTA_POOLS
inline constexpr int kTopkMaxPools = 262144;  // TOPK_MAX_POOLS
inline constexpr int kTopkClusterMaxRows = 16;  // TOPK_CLUSTER_MAX_ROWS
inline constexpr int kTopkPairMaxRows = 64;  // TOPK_PAIR_MAX_ROWS
inline constexpr int kLogitsGroupRows = 4;  // LOGITS_GROUP_ROWS

}  // namespace glm5::limits
