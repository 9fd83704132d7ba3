// Sizes every kernel family shares, each defined here once (SPEC §0, §9).
#pragma once

#include "limits.h"

namespace glm5 {

constexpr int kWarp = limits::kWarp;  // lanes per warp
constexpr int kPool = limits::kPool;  // tokens per pool (one kpool entry; one quad of ids)
constexpr int kDim = limits::kDim;    // head dim: q, key and gate rows, the Hadamard size
constexpr int kEntryBytes = kDim + 4;  // one K-cache entry: 128 fp8 bytes + a 4-byte scale

}  // namespace glm5
