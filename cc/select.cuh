// The select path's device code shared by its logits (select_logits.cuh) and top-k
// (select_topk.cuh): the pool tiles, the top-k's shape limits, a row's pool count.
//
// The select headers hold device code for cc/select.cu alone, in its anonymous namespace:
// one translation unit, so the kernels keep internal linkage and their names.
#pragma once

#include <cstdint>

#include "constants.h"
#include "limits.h"

namespace glm5 {
namespace {

// A tile is one warp's wgmma rows of pools, a work item the tiles of the consumer warps: one
// m64 wgmma (glm5_jax.limits: a page holds whole tiles, LOGITS_PAGE_MULTIPLE).
constexpr int kWarpPools = limits::kLogitsPageMultiple;   // pools per tile
constexpr int kItemPools = limits::kLogitsItemPools;      // pools per work item
constexpr int kConsumerWarps = kItemPools / kWarpPools;  // + a producer warp: kLogitsWarps
static_assert(kConsumerWarps == 4 && kItemPools == 64, "one warpgroup's m64 wgmma an item");
// Top-k: a row's keys live in registers, at most 32 keys per thread (64 registers a thread
// at 1024 threads): one CTA holds a row of kTopkCtaPools, a cluster of kTopkClusterParts
// CTAs (the portable cluster size) one of TOPK_MAX_POOLS.
constexpr int kTopkMaxThreads = 1024;
constexpr int kTopkMaxKeys = 32;
constexpr int kTopkCtaPools = limits::kTopkCtaPools;
static_assert(kTopkMaxThreads * kTopkMaxKeys == kTopkCtaPools, "a CTA's row fills its registers");
constexpr int kTopkClusterParts = 8;
// The widest rows (1M tokens) at up to kTopkWideRows rows: a non-portable cluster of 16
// (select_topk_cluster.cuh's launch_topk).
constexpr int kTopkWideParts = 16;
constexpr int kTopkWideRows = 1;
constexpr int kTopkMaxPools = limits::kTopkMaxPools;
static_assert(kTopkClusterParts * kTopkCtaPools == kTopkMaxPools,
              "the widest row fills the registers of a portable cluster");
// Keys gathered into shared memory after the bound (pool_topk_kernel): 2 per thread at 1024
// threads; the bound leaves ~1000-1500 of 8K-32K normal logits, and ~1000-1200 of a
// cluster's 32K-256K (numpy model of the bound), so such rows gather; rows of few distinct
// values (~3200 kept of 256K rounded logits) take the cluster's radix select.
constexpr int kTopkCandidates = 2048;
constexpr int kTopkClusterBoundWarps = 16;          // J of the bound in a cluster (warp_bound)
constexpr int kTopkDigitBits = 11;                   // radix digits: at most 3 per row
constexpr int kTopkBins = 1 << kTopkDigitBits;

// Pools of a row: pool_lens[r], or (positions[r] + 1) / 4 (0 for pads) without the int32
// overflow of pos + 1; at most `width` (the logits width).
__device__ __forceinline__ int32_t pools_of(int32_t v, bool from_positions, int32_t width) {
  int32_t n;
  if (from_positions)
    n = v < 0 ? 0 : v / kPool + (v % kPool == kPool - 1 ? 1 : 0);
  else
    n = v < 0 ? 0 : v;
  return min(n, width);
}

__device__ __forceinline__ int32_t row_pools(const int32_t* lens, bool from_positions, int r,
                                             int32_t width) {
  return pools_of(lens[r], from_positions, width);
}

}  // namespace
}  // namespace glm5
