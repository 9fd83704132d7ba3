// indexer_q (SPEC §1, step 1): q = qr bf16[M, K] @ wq_b bf16[N = H * 128, K]^T, written as
// bf16[M, N]: fp32 sums of exact bf16 products, one RNE rounding to bf16.
//
// The projection's GEMM core (projection.cuh: swap-AB mma.sync, K split over the warps of a
// CTA and the CTAs of a cluster, sums in warp order then rank order) with a plain store. At
// GLM-5.3-Flash's N = 4096 the grid has 256 tiles of 16 outputs times `split` CTAs, where
// the projection's N = 288 has 18: wq_b's 12.6 MB are read by ~1,000 CTAs, which the
// projection's latency-bound 72 cannot do. The tactic (warps, split) is chosen in Python
// (glm5_jax.indexer.q_tactic) and only validated here; it sets the order of the sums, so
// the bits, within the fp32 tolerance of XLA's GEMM (SPEC D2).
#include <cuda_bf16.h>

#include <cstdint>

#include "common.h"
#include "handlers.h"
#include "projection.cuh"

namespace glm5 {
namespace {

using namespace gemm;

struct QArgs {
  Gemm gemm;      // qr bf16[M, K], wq_b bf16[N, K]
  uint16_t* q;    // bf16[M, N]
  int64_t n;      // N
};

template <int kBlocks, bool kStaged>
__global__ void __launch_bounds__(kMaxWarps * kWarp) indexer_q_kernel(const QArgs a) {
  tile<kBlocks, kStaged>(a.gemm,
                         [&](int64_t t, int32_t n, float total) { a.q[t * a.n + n] = bf16_bits(total); });
}

using Kernel = void (*)(QArgs);

template <int kBlocks, bool kStaged>
struct Pick {
  static constexpr Kernel kernel = indexer_q_kernel<kBlocks, kStaged>;
};

ffi::Error IndexerQImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> qr,
                        ffi::BufferR2<ffi::BF16> wq_b, ffi::ResultBufferR2<ffi::BF16> q,
                        int32_t warps, int32_t split, bool pdl) {
  const Check check{targets::glm5_indexer_q};
  const auto xd = qr.dimensions(), wd = wq_b.dimensions(), qd = q->dimensions();
  const int64_t rows = xd[0], k = xd[1], n = wd[0];
  if (wd[1] != k) return check.fail("wq_b must be bf16[N, K] with qr's K");
  if (n <= 0 || n % kTileN != 0) return check.fail("wq_b's rows N must be a multiple of 16");
  if (n > kI32Max) return check.fail("wq_b has too many rows");
  if (qd[0] != rows || qd[1] != n) return check.fail("q result must be bf16[M, N]");
  const ffi::ErrorOr<Staging> st = check_tactic(check, k, warps, split, kMaxSplit);
  if (st.has_error()) return st.error();
  if (!aligned(qr.untyped_data(), 16) || !aligned(wq_b.untyped_data(), 16))
    return check.fail("qr and wq_b must be 16 B aligned");
  if (rows == 0) return ffi::Error::Success();
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  if (chunks > 65535) return check.fail("too many rows for one grid");

  QArgs args;
  args.gemm = make_gemm(qr.untyped_data(), wq_b.untyped_data(), rows, k, st->stages);
  args.q = reinterpret_cast<uint16_t*>(q->untyped_data());
  args.n = n;
  const Kernel kernel = pick_kernel<Kernel, Pick>(*st);
  const size_t smem = partial_bytes(args.gemm, warps);
  if (cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess) return check.cuda(err);
  const dim3 grid(static_cast<unsigned>(split), static_cast<unsigned>(n / kTileN),
                  static_cast<unsigned>(chunks));
  return check.cuda(launch_cluster(kernel, grid, dim3(warps * kWarp), smem, stream, pdl,
                                   static_cast<unsigned>(split), args));
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerQ, glm5::IndexerQImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // qr
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // wq_b
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // q
                                  .Attr<int32_t>("warps")
                                  .Attr<int32_t>("split")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
