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

// Lets `kernel` take `smem` bytes of dynamic shared memory (past the default 48 KiB). The
// attribute belongs to the current device: call it at every launch, never once per process.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem <= kDefaultSmem) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

// Whether a buffer can take `bytes`-wide vector accesses.
inline bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// cudaLaunchKernelEx on `stream`; with `pdl` the kernel may start before its predecessor
// finishes, so it must call pdl_wait() before reading any input. `pdl` is every handler's
// "pdl" attribute, decided in Python by the routing value: part of the jit cache key, so
// turning PDL off recompiles instead of reusing an executable built with it. `cluster` > 1 groups
// `cluster` consecutive CTAs along x into a thread-block cluster (gridDim.x % cluster == 0).
template <typename... Params, typename... Args>
cudaError_t launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, bool pdl, unsigned cluster, Args&&... args) {
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

}  // namespace glm5
