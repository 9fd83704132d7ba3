// indexer_q (SPEC §1, step 1): q = qr bf16[M, K] @ wq_b bf16[N = H * 128, K]^T, written as
// bf16[M, N]: fp32 sums of exact bf16 products, one RNE rounding to bf16.
//
// A weight-streaming GEMM for decode's few rows: wq_b (12.6 MB at GLM-5.3-Flash) is the
// whole cost, so each CTA owns kRows = 32 consecutive rows of it (one contiguous 2 K * 32
// bytes span) and has the TMA copy them into shared memory in bulk, before the PDL wait
// (model parameters, not written by the preceding kernel). The projection's GEMM core held
// the weights in registers instead: measured on the H200 at every (warps, split) it read
// wq_b slower than XLA's GEMM (best 6.7 vs 5.6 µs at M=1, 14 vs 9 at M=64, bench --sweep).
//
// Warp w of kWarps owns K blocks [w * kBlocks, (w + 1) * kBlocks) of 32 K, for all 32 rows;
// its copies land on its own two mbarriers (the first and second half of its blocks), so it
// starts on the first half while the second is in flight. The mma is the projection's
// swap-AB mma.sync m16n8k16 (projection.cuh: mma_block and its lane layout): weight rows are
// the A side (two 16-row tiles share every x fragment), 8 token rows the B side.
//
// Order of the sums: per (row, token), a warp adds its K blocks in order through one fp32
// accumulator (each block two mma K steps of 16), then the kWarps warps' sums are added in
// warp order. Shared-memory rows are padded by 64 B so that the 16-byte fragment loads of
// rows g and g + 1 fall 64 B apart modulo 128: conflict-free.
#include <cuda_bf16.h>

#include <cstdint>

#include "bulk.cuh"
#include "common.h"
#include "handlers.h"
#include "projection.cuh"

namespace glm5 {
namespace {

using gemm::kBlockK;
using gemm::kStep;   // token rows per loop step: two 8-row mma tiles
using gemm::kTile;

constexpr int kWarps = 8;
constexpr int kRows = 32;                   // wq_b rows per CTA: two 16-row mma tiles
constexpr int kChunk = 64;                  // token rows per CTA; grid y covers more
constexpr int kMaxBlocks = 8;               // K blocks per warp: K <= 8 * 32 * 8 = 2048
constexpr int kPad = 64;                    // bytes of padding per shared weight row
constexpr int kHalves = 2;                  // mbarriers per warp (halves of its K blocks)
static_assert(kRows == kWarp, "lane r of each warp copies weight row r");

struct QArgs {
  const uint16_t* x;    // qr bf16[M, K]
  const uint16_t* w;    // wq_b bf16[N, K]
  uint16_t* q;          // bf16[M, N]
  int64_t rows;         // M
  int64_t n;            // N
};

// Shared memory: kWarps * kHalves mbarriers, the CTA's weight rows (stride 2 K + kPad
// bytes), then the warps' sums f32[kWarps][kStep][kRows].
template <int kBlocks>
struct Layout {
  static constexpr int kK = kWarps * kBlocks * kBlockK;
  static constexpr int kStride = 2 * kK + kPad;
  static constexpr int kBarriers = kWarps * kHalves * 8;
  static constexpr int kWeights = kBarriers;
  static constexpr int kSums = kWeights + kRows * kStride;
  static constexpr int kBytes = kSums + 4 * kWarps * kStep * kRows;
};

template <int kBlocks>
__global__ void __launch_bounds__(kWarps * kWarp, 1) indexer_q_kernel(const QArgs a) {
  using L = Layout<kBlocks>;
  constexpr int kFirst = (kBlocks + 1) / 2;                 // blocks in the first half
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, qd = lane % 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t chunk0 = static_cast<int64_t>(blockIdx.y) * kChunk;
  const int chunk = static_cast<int>(min(static_cast<int64_t>(kChunk), a.rows - chunk0));
  const int kw = warp * kBlocks * kBlockK;                  // the warp's first K
  const uint32_t bars = bulk::smem_address(smem) + warp * kHalves * 8;
  const uint32_t weights = bulk::smem_address(smem + L::kWeights);

  // The warp's K blocks of the 32 rows: lane r copies row r's span of each half.
  if (lane == 0) {
    for (int h = 0; h < kHalves; ++h) bulk::init(bars + 8 * h);
    bulk::fence_init();
  }
  __syncwarp();
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    const int b0 = h == 0 ? 0 : kFirst, blocks = h == 0 ? kFirst : kBlocks - kFirst;
    if (blocks == 0) continue;
    const uint32_t bytes = blocks * kBlockK * 2;
    if (lane == 0) bulk::arrive_expect(bars + 8 * h, bytes * kRows);
    __syncwarp();
    const int k = kw + b0 * kBlockK;
    bulk::copy(weights + lane * L::kStride + 2 * k, a.w + (n0 + lane) * L::kK + k, bytes,
              bars + 8 * h);
  }
  pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion to read

  float* const sums = reinterpret_cast<float*>(smem + L::kSums);
  // Lane (g, qd)'s weight fragments: rows g and g + 8 of tile t, K offset kw + 32 b + 8 qd.
  const uint32_t frag = weights + g * L::kStride + 2 * (kw + 8 * qd);
  // The step's x fragments as in the projection (gemm::accumulate): one batch of loads, the
  // next step's issued before this step's mma, no loads for a tile of padding rows only.
  const int64_t col = kw + 8 * qd;
  uint4 xv[2][kBlocks];
  gemm::load_x(xv, a.x, L::kK, a.rows, col, chunk0, gemm::step_tiles(0, chunk), g);
  for (int s = 0; s < chunk; s += kStep) {
    const bool second = gemm::step_tiles(s, chunk) == 2;   // token rows 8..15 of the step
    const bool more = s + kStep < chunk;
    uint4 xn[2][kBlocks];
    if (more)
      gemm::load_x(xn, a.x, L::kK, a.rows, col, chunk0 + s + kStep,
                   gemm::step_tiles(s + kStep, chunk), g);
    float c[2][2][4] = {};                                  // [tile][token half][fragment]
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      if (s == 0 && (b == 0 || b == kFirst)) bulk::wait(bars + 8 * (b == 0 ? 0 : 1), 0);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const uint32_t p = frag + t * 16 * L::kStride + 2 * b * kBlockK;
        const uint4 lo = bulk::load16(p), hi = bulk::load16(p + 8 * L::kStride);
        gemm::mma_block(c[t][0], lo, hi, xv[0][b]);
        if (second) gemm::mma_block(c[t][1], lo, hi, xv[1][b]);
      }
    }
    // c[t][h] = rows (16 t + g, 16 t + g + 8) x token rows (8 h + 2 qd, 8 h + 2 qd + 1).
    float* const mine = sums + warp * kStep * kRows;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* const out = mine + (h * kTile + 2 * qd) * kRows + 16 * t + g;
        out[0] = c[t][h][0];
        out[kRows] = c[t][h][1];
        out[8] = c[t][h][2];
        out[kRows + 8] = c[t][h][3];
      }
    }
    __syncthreads();
    const int elements = min(kStep, chunk - s) * kRows;
    for (int e = threadIdx.x; e < elements; e += kWarps * kWarp) {
      float total = sums[e];
#pragma unroll
      for (int v = 1; v < kWarps; ++v) total += sums[v * kStep * kRows + e];
      a.q[(chunk0 + s + e / kRows) * a.n + n0 + e % kRows] = gemm::bf16_bits(total);
    }
    __syncthreads();  // the sums are rewritten by the next step
    if (more) gemm::take_x(xv, xn);
  }
}

using Kernel = void (*)(QArgs);

// The instantiation for `blocks` K blocks a warp, with its shared-memory bytes.
struct Pick {
  Kernel kernel = nullptr;
  size_t smem = 0;
};

template <int... kBlocks>
Pick pick(int blocks, std::integer_sequence<int, kBlocks...>) {
  Pick out;
  ((out = blocks == kBlocks + 1
              ? Pick{indexer_q_kernel<kBlocks + 1>, size_t{Layout<kBlocks + 1>::kBytes}}
              : out),
   ...);
  return out;
}

ffi::Error IndexerQImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> qr,
                        ffi::BufferR2<ffi::BF16> wq_b, ffi::ResultBufferR2<ffi::BF16> q,
                        bool pdl) {
  const Check check{targets::glm5_indexer_q};
  const auto xd = qr.dimensions(), wd = wq_b.dimensions(), qd = q->dimensions();
  const int64_t rows = xd[0], k = xd[1], n = wd[0];
  if (wd[1] != k) return check.fail("wq_b must be bf16[N, K] with qr's K");
  if (n <= 0 || n % kRows != 0) return check.fail("wq_b's rows N must be a multiple of 32");
  if (n / kRows > kI32Max) return check.fail("wq_b has too many rows");
  if (qd[0] != rows || qd[1] != n) return check.fail("q result must be bf16[M, N]");
  const int64_t per_block = int64_t{kWarps} * kBlockK;
  if (k % per_block != 0 || k / per_block < 1 || k / per_block > kMaxBlocks)
    return check.fail("K = " + std::to_string(k) + " must be 256 * blocks, blocks in 1.." +
                      std::to_string(kMaxBlocks));
  if (!aligned(qr.untyped_data(), 16) || !aligned(wq_b.untyped_data(), 16))
    return check.fail("qr and wq_b must be 16 B aligned");
  if (rows == 0) return ffi::Error::Success();
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  if (chunks > 65535) return check.fail("too many rows for one grid");

  QArgs args;
  args.x = reinterpret_cast<const uint16_t*>(qr.untyped_data());
  args.w = reinterpret_cast<const uint16_t*>(wq_b.untyped_data());
  args.q = reinterpret_cast<uint16_t*>(q->untyped_data());
  args.rows = rows;
  args.n = n;
  const int blocks = static_cast<int>(k / per_block);
  const Pick p = pick(blocks, std::make_integer_sequence<int, kMaxBlocks>());
  if (cudaError_t err = allow_smem(p.kernel, p.smem); err != cudaSuccess)
    return check.cuda(err);
  const dim3 grid(static_cast<unsigned>(n / kRows), static_cast<unsigned>(chunks));
  return check.cuda(launch(p.kernel, grid, dim3(kWarps * kWarp), p.smem, stream, pdl, args));
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerQ, glm5::IndexerQImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // qr
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // wq_b
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // q
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
