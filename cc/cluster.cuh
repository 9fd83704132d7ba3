// Thread-block cluster barriers and register stores into a peer CTA's shared memory, without
// the GPU-scope fence of cooperative_groups' cluster.sync(). On sm_90 (CUDA 13.0) any
// cluster-scope release (barrier.cluster.arrive's default, fence.acq_rel.cluster) compiles
// to MEMBAR.ALL.GPU, which waits until every earlier global store of the thread is
// acknowledged: ncu found membar among indexer_projection's main stall reasons (two
// cluster.sync() per CTA). Data handed between CTAs goes instead through
// st.async, which the receiving CTA's mbarrier counts (bytes); the barriers here are relaxed.
#pragma once

#include <cstdint>

#include "bulk.cuh"

namespace glm5 {
namespace cluster {

__device__ __forceinline__ uint32_t rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t size() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// Every thread of the CTA arrives (no release: orders nothing before it).
__device__ __forceinline__ void arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// Every thread of the CTA waits until every thread of the cluster has arrived.
__device__ __forceinline__ void wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// The shared::cluster address of this CTA's shared address `local` in CTA `peer`.
__device__ __forceinline__ uint32_t peer_address(uint32_t local, uint32_t peer) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(peer));
  return out;
}

// 16 bytes into peer shared memory at `dst` (shared::cluster, 16-byte aligned), counted as
// 16 bytes on the mbarrier `bar` (shared::cluster, in the same peer CTA).
__device__ __forceinline__ void store16_async(uint32_t dst, float4 v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
      : "memory");
}

// The same for four 32-bit words.
__device__ __forceinline__ void store16_async(uint32_t dst, uint4 v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
      : "memory");
}

// 4 bytes into peer shared memory at `dst` (4-byte aligned), counted as 4 bytes on `bar`.
__device__ __forceinline__ void store4_async(uint32_t dst, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(dst), "r"(v), "r"(bar)
               : "memory");
}

}  // namespace cluster
}  // namespace glm5
