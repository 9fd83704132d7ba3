// upcast_logits (SPEC §8): out[r, c] = f32(logits[r, c]) for c < clamp(row_ends[r], 0, width);
// columns at or past the row end are not written.
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "handlers.h"

namespace glm5 {
namespace {

constexpr int kUpcastThreads = 256;
constexpr int kUpcastChunk = 8;           // bf16 per 16-byte load
constexpr int kUpcastUnroll = 4;          // chunks a thread loads before it stores
constexpr int64_t kUpcastMaxCtas = 1024;  // rows * splits stays around this (seed `cap`)

// bf16 is the high half of an f32, so widening is exact: f32 bits = bf16 bits << 16.
// A 32-bit word holds two bf16, the lower-addressed one in the low half.
__device__ __forceinline__ uint32_t widen_lo(uint32_t w) { return w << 16; }
__device__ __forceinline__ uint32_t widen_hi(uint32_t w) { return w & 0xffff0000u; }

struct UpcastArgs {
  const uint16_t* src;        // bf16[rows, width] (logits)
  uint32_t* dst;              // f32[rows, width] as bits
  const int32_t* row_ends;    // s32[rows]
  int64_t width;
};

// CTA (row, split). Rows are dense, so row r is the flat range [r*width, r*width + e).
// kVector: 8-element chunks aligned in the flat index space (hence 16 B in and 32 B out,
// given 16 B aligned bases) move with vector accesses; the unaligned head and tail
// (< 8 elements each) go scalar. Without kVector everything goes scalar.
template <bool kVector>
__global__ void __launch_bounds__(kUpcastThreads) upcast_logits_kernel(const UpcastArgs a) {
  // Inputs are read with __ldg (ld.global.nc, as for the restrict-qualified kernel parameters
  // they were): nvcc does not infer read-only for pointers held in an Args struct.
  const uint16_t* src = a.src;
  uint32_t* dst = a.dst;
  const int64_t width = a.width;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const int64_t row_end = __ldg(a.row_ends + row);
  const int64_t end_col = min(max(row_end, int64_t{0}), width);
  const int64_t begin = row * width;
  const int64_t end = begin + end_col;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kUpcastThreads + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.y) * kUpcastThreads;

  if constexpr (!kVector) {
#pragma unroll 1
    for (int64_t i = begin + first; i < end; i += step) dst[i] = widen_lo(__ldg(src + i));
  } else {
    // [begin, vb) head, [vb, ve) whole aligned chunks, [ve, end) tail.
    const int64_t up = (begin + kUpcastChunk - 1) / kUpcastChunk * kUpcastChunk;
    const int64_t vb = min(up, end);
    const int64_t ve = max(end / kUpcastChunk * kUpcastChunk, vb);
    // kUpcastUnroll chunks in flight per thread: one outstanding 16-byte load per
    // thread leaves a large upcast latency-bound.
    const int64_t stride = step * kUpcastChunk;
#pragma unroll 1
    for (int64_t i = vb + first * kUpcastChunk; i < ve; i += kUpcastUnroll * stride) {
      uint4 in[kUpcastUnroll];
#pragma unroll
      for (int k = 0; k < kUpcastUnroll; ++k)
        if (i + k * stride < ve)
          in[k] = __ldg(reinterpret_cast<const uint4*>(src + i + k * stride));
#pragma unroll
      for (int k = 0; k < kUpcastUnroll; ++k) {
        const int64_t j = i + k * stride;
        if (j >= ve) break;
        const uint4 w = in[k];
        // Intrinsic stores: with plain stores LLVM re-split them into u32/u32/v2 pieces.
        __stwb(reinterpret_cast<uint4*>(dst + j),
               make_uint4(widen_lo(w.x), widen_hi(w.x), widen_lo(w.y), widen_hi(w.y)));
        __stwb(reinterpret_cast<uint4*>(dst + j + 4),
               make_uint4(widen_lo(w.z), widen_hi(w.z), widen_lo(w.w), widen_hi(w.w)));
      }
    }
    if (blockIdx.y == 0 && threadIdx.x < 2 * kUpcastChunk) {
      const bool head = threadIdx.x < kUpcastChunk;
      const int64_t i = head ? begin + threadIdx.x : ve + (threadIdx.x - kUpcastChunk);
      if (i < (head ? vb : end)) dst[i] = widen_lo(__ldg(src + i));
    }
  }
}

ffi::Error UpcastLogitsImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> logits,
                            ffi::BufferR1<ffi::S32> row_ends, ffi::ResultBufferR2<ffi::F32> out,
                            bool pdl) {
  const Check check{targets::glm5_upcast_logits};
  const auto dims = logits.dimensions();
  const int64_t rows = dims[0], width = dims[1];
  if (out->dimensions()[0] != rows || out->dimensions()[1] != width)
    return check.fail("out shape differs from logits shape");
  if (row_ends.dimensions()[0] != rows) return check.fail("row_ends length != logits rows");
  if (rows > kI32Max) return check.fail("too many rows for one grid");
  if (rows == 0 || width == 0) return ffi::Error::Success();

  UpcastArgs args;
  args.src = reinterpret_cast<const uint16_t*>(logits.typed_data());
  args.dst = reinterpret_cast<uint32_t*>(out->typed_data());
  args.row_ends = row_ends.typed_data();
  args.width = width;

  // Grid from shapes only (command-buffer contract): enough CTAs to fill the GPU, one chunk
  // per thread when rows are few and short.
  const int64_t chunk = kUpcastThreads * kUpcastChunk;
  const int64_t splits =
      std::min((width + chunk - 1) / chunk, std::max(int64_t{1}, kUpcastMaxCtas / rows));
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(splits));
  auto kernel = aligned(args.src, 16) && aligned(args.dst, 16) ? upcast_logits_kernel<true>
                                                               : upcast_logits_kernel<false>;
  cudaError_t err = launch(kernel, grid, dim3(kUpcastThreads), 0, stream, pdl, args);
  return check.cuda(err);
}

}  // namespace
}  // namespace glm5

// BufferR<n> aliases: a comma inside <> would split the macro argument.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5UpcastLogits, glm5::UpcastLogitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()  // logits
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // row_ends
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // out
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
