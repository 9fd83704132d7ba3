// Bulk copies by the TMA into shared memory, counted on mbarriers: the one set of helpers
// the streaming kernels share (indexer_q's weight rows, mqa_logits's K-cache tiles); and
// per-thread asynchronous copies (mqa_logits's queries and head weights).
#pragma once

#include <cstdint>

namespace glm5 {
namespace bulk {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier whose phase completes after `count` arrivals (and the bytes they expect).
// Call fence_init() once after the last init, before other threads or the TMA use it.
__device__ __forceinline__ void init(uint32_t bar, uint32_t count = 1) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also expects `bytes` of bulk copies on the current phase. Arrive
// before issuing the copies: the phase cannot complete while their bytes are pending.
__device__ __forceinline__ void arrive_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

// One plain arrival (release: the caller's earlier shared-memory reads and writes are
// ordered before whoever waits on the phase).
__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Spin until the phase of parity `parity` has completed (a fresh barrier: parity 1
// counts as completed, parity 0 not yet).
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(bar), "r"(parity)
      : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared
// `dst` by the TMA, counted on `bar`.
__device__ __forceinline__ void copy(uint32_t dst, const void* src, uint32_t bytes,
                                     uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The box at coordinates (c0, c1, c2) of the 3-d tensor map `map` (a __grid_constant__
// kernel parameter) to shared `dst` by the TMA, counted on `bar`; the map's swizzle decides
// the shared layout (dst 1024-byte aligned for the 128-byte swizzle).
__device__ __forceinline__ void copy_box(uint32_t dst, const void* map, int32_t c0, int32_t c1,
                                         int32_t c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// The box at coordinates (c0, c1) of the 2-d tensor map `map` (a __grid_constant__ kernel
// parameter) to shared `dst` by the TMA, counted on `bar` (as copy_box).
__device__ __forceinline__ void copy_box(uint32_t dst, const void* map, int32_t c0, int32_t c1,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Fetches the tensor map `map` (a __grid_constant__ kernel parameter) into the TMA's
// descriptor cache, so that the first copy_box does not wait for it. The map is a kernel
// parameter, not data of the previous kernel: this may run before pdl_wait().
__device__ __forceinline__ void prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
// (wgmma operands, bulk copies out of shared memory).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// A barrier of `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is
// __syncthreads'): the warps of a role synchronise without the others.
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// 16 bytes of shared memory.
__device__ __forceinline__ uint4 load16(uint32_t p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(p));
  return v;
}

// 16 bytes (`src` 16-byte aligned) and 4 bytes from global memory to shared `dst`
// without holding registers: a thread's copies are all in flight together. wait_copies()
// completes this thread's; a barrier after it shows them to the other threads.
__device__ __forceinline__ void copy16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copy4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

}  // namespace bulk
}  // namespace glm5
