// The TMA ring that feeds the bf16 wgmma kernels (indexer_q's wgmma tactic in q_gemm.cu, the
// projection's in projection.cu): one warpgroup a CTA, kRows weight rows (one m64 tile)
// against kN token rows, K streamed in boxes of kBoxK through kSlots slots of shared memory.
// Written once here so that both kernels stream and sum K the same way.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "bulk.cuh"
#include "wgmma.cuh"

namespace glm5 {
namespace wgmma {

// Slot s (from the kAtom-aligned `base`) holds one box of the weights [kRows][128 B] then
// one of the tokens [kN][128 B] (rows past the tensor zero-filled by the TMA), counted on the
// slot's mbarrier at `full` + 8 s: box b (K from k0 + b kBoxK) in slot b % kSlots. Thread 0
// issues the copies; the warpgroup consumes them.
template <int kRows, int kN, int kSlots>
struct Ring {
  // The first kAtom-aligned shared address at or after dynamic shared memory `smem` (the
  // kernel's kBytes reserve kAtom for it): where the first slot goes.
  static __device__ __forceinline__ uint32_t base_of(const void* smem) {
    const uint32_t raw = bulk::smem_address(smem);
    return raw + (kAtom - raw % kAtom) % kAtom;
  }

  // Boxes thread 0 issues before sum(), one a slot: sum() refills from box first(boxes) on.
  static __device__ __forceinline__ int first(int boxes) { return min(boxes, kSlots); }

  static constexpr int kWeightBox = kRows * 128;
  static constexpr int kTokenBox = kN * 128;
  static constexpr int kSlot = kWeightBox + kTokenBox;
  static constexpr int kBytes = kSlots * kSlot;  // the slots, from `base`
  static_assert(kRows == 64, "one m64 tile of weight rows");
  static_assert(kSlot % kAtom == 0, "each box starts on a swizzle atom");

  uint32_t base;             // the first slot (shared, kAtom-aligned)
  uint32_t full;             // the slots' mbarriers (shared), 8 bytes apart
  const CUtensorMap* w_map;  // the weights bf16[N, K]: boxes of kRows x kBoxK
  const CUtensorMap* x_map;  // the tokens bf16[M, K]: boxes of kN x kBoxK
  int32_t k0;                // this CTA's first K
  int32_t n0;                // its first weight row
  int32_t chunk0;            // its first token row

  // Thread 0, before any copy: the tensor maps prefetched, the slots' barriers initialised
  // (the caller fences the initialisation with its own barriers').
  __device__ __forceinline__ void init() const {
    bulk::prefetch_map(w_map);
    bulk::prefetch_map(x_map);
    for (int s = 0; s < kSlots; ++s) bulk::init(full + 8 * s);
  }

  // Box b's weights; the slot's barrier then expects the whole slot (weights and tokens).
  __device__ __forceinline__ void load_weights(int b) const {
    const int s = b % kSlots;
    bulk::arrive_expect(full + 8 * s, kSlot);
    bulk::copy_box(base + s * kSlot, w_map, k0 + b * kBoxK, n0, full + 8 * s);
  }

  // Box b's tokens, counted on the barrier load_weights(b) armed.
  __device__ __forceinline__ void load_tokens(int b) const {
    const int s = b % kSlots;
    bulk::copy_box(base + s * kSlot + kWeightBox, x_map, k0 + b * kBoxK, chunk0, full + 8 * s);
  }

  // d = the CTA's weight rows x its token rows over `boxes` boxes of K, the first(boxes)
  // already issued by thread 0: each box's 16-K wgmma steps in K order
  // into one fp32 accumulator from +0 (the first step does not accumulate). Once box b - 1's
  // wgmma group has completed in every warp (box b's may still run), thread 0 refills its
  // slot with box b - 1 + kSlots. All threads of the warpgroup call it.
  __device__ __forceinline__ void sum(float (&d)[kN / 2], int boxes) const {
    fence();
    for (int b = 0; b < boxes; ++b) {
      bulk::wait(full + 8 * (b % kSlots), (b / kSlots) & 1);
      const uint32_t wb = base + (b % kSlots) * kSlot, xb = wb + kWeightBox;
#pragma unroll
      for (int s = 0; s < kBoxK / 16; ++s)
        mma_bf16<kN>(d, desc(wb + 32 * s), desc(xb + 32 * s), b + s > 0);
      commit();
      wait_pending<1>();
      if (b >= 1 && b - 1 + kSlots < boxes) {
        __syncthreads();
        if (threadIdx.x == 0) {
          load_weights(b - 1 + kSlots);
          load_tokens(b - 1 + kSlots);
        }
      }
    }
    wait();
  }
};

}  // namespace wgmma
}  // namespace glm5
