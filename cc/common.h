// Shared by every kernel family: FFI alias, handler checks and CUDA errors, launch with PDL.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace glm5 {

constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();

inline bool fits_i32(int64_t v) { return v >= std::numeric_limits<int32_t>::min() && v <= kI32Max; }

// The checks of one FFI handler, bound to its target name (handlers.h) so that every error
// reads "glm5_<op>: ...", as the Python side's trace-time errors name their op. Helpers that
// compute a value while checking return ffi::ErrorOr<T> and fail with
// ffi::Unexpected(check.fail(...)).
struct Check {
  const char* op;

  ffi::Error fail(std::string_view what) const {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + std::string(what));
  }

  // `launch_status` is what the launch call returned; cudaGetLastError is read (and cleared)
  // anyway, so an error left by an earlier asynchronous launch is reported here too.
  ffi::Error cuda(cudaError_t launch_status = cudaSuccess) const {
    const cudaError_t last = cudaGetLastError();
    const cudaError_t err = launch_status != cudaSuccess ? launch_status : last;
    if (err == cudaSuccess) return ffi::Error::Success();
    return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorName(err) + ": " +
                                cudaGetErrorString(err));
  }
};

constexpr size_t kDefaultSmem = 48 * 1024;  // dynamic smem without opting in
constexpr size_t kOptinSmem = 227 * 1024;  // sm_90's most dynamic smem a CTA may opt in to

// Lets `kernel` take `smem` bytes of dynamic shared memory (past the default 48 KiB). The
// attribute belongs to the current device: call it at every launch, never once per process.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem <= kDefaultSmem) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

// A positive int32 divisor fixed for a launch (RING, PAGE, block_size), prepared on the host
// for the multiply-high division (Granlund & Montgomery): n / d = (umulhi(n, mul) + n) >> shift
// with shift = ceil(log2 d) and mul = floor(2^32 (2^shift - d) / d) + 1, exact for every
// 0 <= n < 2^31 (then umulhi(n, mul) < n, so the sum fits 32 bits). A runtime `/` or `%`
// compiles to a ~20-instruction dependent sequence; the kernels divide on their critical paths
// (tail block and ring row before the ring loads, block before the block-table load).
struct Divisor {
  int32_t d = 1;
  uint32_t mul = 1;
  uint32_t shift = 0;

  constexpr Divisor() = default;
  constexpr explicit Divisor(int32_t divisor) : d(divisor) {
    while ((uint64_t{1} << shift) < static_cast<uint64_t>(divisor)) ++shift;
    mul = static_cast<uint32_t>(
        (uint64_t{1} << 32) * ((uint64_t{1} << shift) - static_cast<uint64_t>(divisor)) /
            static_cast<uint64_t>(divisor) + 1);
  }

  // The divisor of a dimension that may be 0 (an empty cache's PAGE): 1 there, where there is
  // nothing to index.
  static constexpr Divisor extent(int64_t n) {
    return Divisor(static_cast<int32_t>(n > 0 ? n : 1));
  }

  // n / d and n % d for 0 <= n < 2^31.
  __host__ __device__ constexpr int32_t div(int32_t n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(u, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{u} * mul) >> 32);
#endif
    return static_cast<int32_t>((hi + u) >> shift);
  }
  __host__ __device__ constexpr int32_t mod(int32_t n) const { return n - div(n) * d; }
};

// The edges of the method, checked by the host compiler (__umulhi is not constexpr).
#ifndef __CUDA_ARCH__
static_assert(Divisor(1).div(kI32Max) == kI32Max && Divisor(4).mod(kI32Max) == 3);
static_assert(Divisor(12).div(kI32Max) == kI32Max / 12 && Divisor(12).mod(35) == 11);
static_assert(Divisor(kI32Max).div(kI32Max) == 1 && Divisor(kI32Max).div(kI32Max - 1) == 0);
static_assert(Divisor(3).div(kI32Max) == kI32Max / 3 && Divisor(65).mod(kI32Max) == kI32Max % 65);
static_assert(Divisor::extent(0).d == 1 && Divisor::extent(64).d == 64);
#endif

// Whether a buffer can take `bytes`-wide vector accesses.
inline bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// cudaLaunchKernelEx on `stream`; with `pdl` the kernel may start before its predecessor
// finishes, so it must call pdl_wait() before reading any input. `pdl` is every handler's
// "pdl" attribute, decided in Python by the routing value: part of the jit cache key, so
// turning PDL off recompiles instead of reusing an executable built with it. `cluster` > 1 groups
// `cluster` consecutive CTAs along x into a thread-block cluster (gridDim.x % cluster == 0);
// past kPortableCluster the kernel is allowed a non-portable one first, at every launch (a
// function attribute is the current device's, as allow_smem's).
constexpr unsigned kPortableCluster = 8;  // the cluster size every sm_90 launch takes
template <typename... Params, typename... Args>
cudaError_t launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, bool pdl, unsigned cluster, Args&&... args) {
  if (cluster > kPortableCluster)
    if (cudaError_t err = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        err != cudaSuccess)
      return err;
  cudaLaunchAttribute attr[2] = {};
  unsigned count = 0;
  if (pdl) {
    attr[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[count].id = cudaLaunchAttributeClusterDimension;
    attr[count].val.clusterDim.x = cluster;
    attr[count].val.clusterDim.y = 1;
    attr[count++].val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  return launch_cluster(kernel, grid, block, smem, stream, pdl, 1u, std::forward<Args>(args)...);
}

// No-ops when not compiled for sm_90+ (griddepcontrol does not exist there).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Loads meant to run before pdl_wait(): weak ld.global, not ld.global.nc (__ldg). ptxas
// (CUDA 13.0, sm_90a) hoists griddepcontrol.wait above .nc loads, so that they would wait for
// the previous grid after all; weak loads stay where they are written (cc/projection.cuh's
// load_weight too; tests/test_sass.py holds the kernels that load before their wait to it).
__device__ __forceinline__ int32_t load_before_wait(const int32_t* p) {
  int32_t v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float4 load_before_wait(const float4* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

}  // namespace glm5
