// indexer_q (SPEC §1, step 1): q = qr bf16[M, K] @ wq_b bf16[N = H * 128, K]^T, written as
// bf16[M, N]: fp32 sums of exact bf16 products, one RNE rounding to bf16.
//
// A weight-streaming GEMM for decode's few rows: wq_b (12.6 MB at GLM-5.3-Flash) is the
// whole cost, so each CTA owns kRows = 32 consecutive rows of it (one contiguous 2 K * 32
// bytes span) and has the TMA copy them into shared memory in bulk, before the PDL wait
// (model parameters, not written by the preceding kernel). The projection's GEMM core, which
// holds the weights in registers instead, read wq_b slower than XLA's GEMM at every
// (warps, split) (bench --sweep).
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
#include <string>

#include "bulk.cuh"
#include "cluster.cuh"
#include "common.h"
#include "handlers.h"
#include "limits.h"
#include "projection.cuh"
#include "q_gemm.cuh"
#include "wgmma.cuh"
#include "wgmma_ring.cuh"

namespace glm5 {
namespace {

using gemm::kBlockK;
using gemm::kStep;   // token rows per loop step: two 8-row mma tiles
using gemm::kTile;

constexpr int kWarps = limits::kQWarps;
constexpr int kRows = limits::kQTileRows;   // wq_b rows per CTA: two 16-row mma tiles
constexpr int kChunk = 64;                  // token rows per CTA; grid y covers more
constexpr int kMaxBlocks = limits::kQMaxBlocks;  // K blocks per warp: K <= kWarps * 32 * 8
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
  // After the wait, never before: glm5_indexer_update_q's projection reads x as soon as this
  // trigger lets it start (gemm::Gemm::inputs_ready, projection.cuh).
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

// ---------------------------------------------------------------------------------------
// The wgmma tactic (kWgmma). Each CTA (one warpgroup) owns kRows = 64 wq_b rows (one m64
// tile) and half of K: a cluster of kSplit = 2 CTAs covers the rows' whole K, and N / kRows
// clusters the whole of wq_b (128 CTAs at GLM-5.3-Flash's N = 4096: one wave on 132 SMs).
// The K half streams through a ring of kSlots slots in shared memory: slot s holds one
// 64-column box of the CTA's weights (kRows x 128 B) and of the token rows (kN x 128 B,
// rows past M zero-filled by the TMA), counted on the slot's mbarrier. The first kSlots
// weight boxes are copied before the PDL wait, their token boxes after it; thread 0 refills
// the slot of box b - 1 with box b - 1 + kSlots once the wgmma group of box b - 1 has
// completed (the group of box b still running). Both operands are K-major in the 128-byte
// swizzle; one wgmma m64nNk16 (N = the token rows, 16-64) per 16 K; more than kMaxTokens rows
// take more grid rows.
//
// Why a ring of 6: with every box of K issued at once the boxes land together and the wgmma
// work runs after the last one; 6 in flight was the fastest of 4 to 12 at every M, and
// holding only those boxes lets two CTAs share an SM (two grid rows run at once) and frees K
// from the bound of shared memory.
//
// The shape: 128 rows a CTA in clusters of 4 (two warpgroups, K in quarters) was slower at
// every M: clusters of 4 whose CTAs fill an SM cost more to place, and the 4-way exchange
// more again.
//
// The halves meet in registers: the rows of a warp belong to one rank (kOwned = 32 rows,
// two warps' m64 fragments), and the warps of the other rank's rows hand their accumulators
// to the same warp and lane of that rank by st.async (16 bytes a store) into a receive
// region of its own, outside the ring, counted on the owner's receive mbarrier. The owner's
// thread adds the peer's fragment to its own, rounds once to bf16 and writes. The only
// cluster barrier is a relaxed one at the start (every receive mbarrier initialised before a
// peer sends); no CTA waits for its peer to finish reading its operands, and nothing is
// staged in shared memory. It replaced a cluster barrier after the mainloop, the partial
// blocks written over the ring and a TMA copy of them to the peer, which took longer from the
// wgmma's end to the peer's half received (per-CTA %globaltimer stamps), for the same bits.
//
// Order of the sums: per (token, row), one fp32 accumulator from +0 per half of K takes the
// half's 16-K wgmma steps in K order (the order of the 16 products inside a step is the
// tensor core's), then q = s0 + s1 over the halves (rank order), one RNE rounding. The same
// for every N instantiation and every token position: a token's bits do not depend on the
// rows beside it (tested).
namespace wg {

constexpr int kThreads = 128;                 // one warpgroup
constexpr int kRows = limits::kQWgmmaRows;    // wq_b rows per CTA: one m64 tile
constexpr int kSplit = limits::kQWgmmaSplit;  // CTAs per cluster: halves of K
constexpr int kOwned = kRows / kSplit;        // rows each rank adds up and writes
constexpr int kSlots = 6;                     // the ring: boxes in flight (see above)
constexpr int kMaxTokens = wgmma::kMaxTokens;  // token rows per CTA; grid y covers more
constexpr int kOwnerWarps = kOwned / 16;      // warps whose m64 fragments hold a rank's rows
static_assert(kOwned * kSplit == kRows && kOwned % 16 == 0, "owned rows are whole warps'");
static_assert(kSplit == 2, "the exchange hands one peer's fragments to each rank");

struct Args {
  uint16_t* q;          // bf16[M, N]
  int64_t rows;         // M
  int64_t n;            // N
  int32_t boxes;        // K boxes per half
};

// Dynamic shared memory from a 1024-aligned base: the ring's slots (wgmma::Ring: each the
// weights' box [kRows][128 B] then the tokens' [kN][128 B]); then the receive region, the
// peer's fragments of this rank's rows: f32[kOwnerWarps][kN / 8][kWarp lanes][4] (a warp's
// 16-byte loads of one j contiguous: conflict-free).
template <int kN>
struct Layout {
  using Ring = wgmma::Ring<kRows, kN, kSlots>;
  static constexpr int kOperands = Ring::kBytes;
  static constexpr int kReceive = kOwned * kN * 4;               // one peer's fragments
  static constexpr int kBytes = wgmma::kAtom + kOperands + kReceive;
  static_assert(kReceive == kOwnerWarps * (kN / 8) * kWarp * 16, "one float4 a lane and j");
};

template <int kN>
__global__ void __launch_bounds__(kThreads, 1) indexer_q_wgmma_kernel(
    const Args a, const __grid_constant__ CUtensorMap w_map,
    const __grid_constant__ CUtensorMap x_map) {
  using L = Layout<kN>;
  __shared__ __align__(8) uint64_t bars[kSlots + 1];   // the slots' full barriers, receive
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = L::Ring::base_of(smem_raw);
  const uint32_t full = bulk::smem_address(bars), receive_bar = full + 8 * kSlots;
  const int rank = static_cast<int>(cluster::rank());
  const int64_t n0 = static_cast<int64_t>(blockIdx.x / kSplit) * kRows;
  const int32_t k0 = rank * a.boxes * wgmma::kBoxK;
  const int32_t chunk0 = static_cast<int32_t>(blockIdx.y) * kN;
  const int first = L::Ring::first(a.boxes);       // boxes issued before the loop
  const typename L::Ring ring{base, full, &w_map, &x_map, k0, static_cast<int32_t>(n0), chunk0};

  if (threadIdx.x == 0) {
    ring.init();
    bulk::init(receive_bar);
    // The peer's fragments of this rank's rows, expected before it can send (the cluster
    // barrier below).
    bulk::arrive_expect(receive_bar, L::kReceive);
    bulk::fence_init();
    // Model parameters, not written by the preceding kernel: before the PDL wait.
    for (int b = 0; b < first; ++b) ring.load_weights(b);
  }
  cluster::arrive_relaxed();  // waited on after the mainloop, before the first send
  pdl_wait();
  if (threadIdx.x == 0)
    for (int b = 0; b < first; ++b) ring.load_tokens(b);
  pdl_launch_dependents();  // after the wait, as in the mma kernel (Gemm::inputs_ready)
  __syncthreads();          // the barriers are initialised

  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  float d[kN / 2];  // the first wgmma writes it (accumulate = false)
  ring.sum(d, a.boxes);

  // Rows 16 warp + g and + 8 belong to rank `owner`; lane (g, t) of warp w of the other rank
  // holds the same rows' other half in the same d[] positions: d[4 j + i] is (row g + 8 (i /
  // 2), token 8 j + 2 t + i % 2).
  const int owner = warp / kOwnerWarps;
  const uint32_t receive = base + L::kOperands;
  const uint32_t mine = receive + 16 * ((warp % kOwnerWarps) * (kN / 8) * kWarp + lane);
  cluster::wait();  // every receive mbarrier of the cluster is initialised
  if (owner != rank) {
    const uint32_t to = cluster::peer_address(mine, owner);
    const uint32_t bar = cluster::peer_address(receive_bar, owner);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
      cluster::store16_async(to + 16 * kWarp * j,
                             make_float4(d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]),
                             bar);
    return;  // nothing of this CTA is read by the peer
  }
  bulk::wait(receive_bar, 0);
  const int valid = static_cast<int>(min(static_cast<int64_t>(kN), a.rows - chunk0));
  // q's element (token chunk0, row n0 + 16 warp + g): this thread's first output.
  uint16_t* const out = a.q + static_cast<int64_t>(chunk0) * a.n + n0 + warp * 16 + g;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const uint4 p = bulk::load16(mine + 16 * kWarp * j);
    const float peer[4] = {__uint_as_float(p.x), __uint_as_float(p.y), __uint_as_float(p.z),
                           __uint_as_float(p.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = 8 * j + 2 * t + i % 2;
      // s0 + s1 in rank order (one RNE rounding to bf16).
      const float total = rank == 0 ? d[4 * j + i] + peer[i] : peer[i] + d[4 * j + i];
      if (c < valid) out[c * a.n + 8 * (i / 2)] = gemm::bf16_bits(total);
    }
  }
}

template <int kN>
cudaError_t launch_as(cudaStream_t stream, bool pdl, const Args& args, const void* x,
                      const void* w, int64_t k) {
  CUtensorMap w_map{}, x_map{};
  if (cudaError_t err = wgmma::bf16_map(&w_map, w, args.n, k, kRows); err != cudaSuccess)
    return err;
  if (cudaError_t err = wgmma::bf16_map(&x_map, x, args.rows, k, kN); err != cudaSuccess)
    return err;
  const auto kernel = indexer_q_wgmma_kernel<kN>;
  const size_t smem = Layout<kN>::kBytes;
  if (cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(args.n / kRows * kSplit),
                  static_cast<unsigned>((args.rows + kN - 1) / kN));
  return launch_cluster(kernel, grid, dim3(kThreads), smem, stream, pdl, kSplit, args, w_map,
                        x_map);
}

}  // namespace wg

ffi::Error IndexerQImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> qr,
                        ffi::BufferR2<ffi::BF16> wq_b, ffi::ResultBufferR2<ffi::BF16> q,
                        int32_t tactic, bool pdl) {
  const Check check{targets::glm5_indexer_q};
  const ffi::ErrorOr<QGemmLaunch> plan = prepare_q_gemm(check, qr, wq_b, q, tactic);
  if (plan.has_error()) return plan.error();
  return check.cuda(launch_q_gemm(stream, pdl, *plan));
}

}  // namespace

ffi::ErrorOr<QGemmLaunch> prepare_q_gemm(const Check& check, ffi::BufferR2<ffi::BF16> qr,
                                         ffi::BufferR2<ffi::BF16> wq_b,
                                         ffi::ResultBufferR2<ffi::BF16> q, int32_t tactic) {
  const auto fail = [&](std::string_view what) { return ffi::Unexpected(check.fail(what)); };
  const auto xd = qr.dimensions(), wd = wq_b.dimensions(), qd = q->dimensions();
  QGemmLaunch plan;
  plan.x = qr.untyped_data();
  plan.w = wq_b.untyped_data();
  plan.q = q->untyped_data();
  plan.rows = xd[0];
  plan.k = xd[1];
  plan.n = wd[0];
  plan.tactic = tactic;
  const int64_t rows = plan.rows, k = plan.k, n = plan.n;
  if (wd[1] != k) return fail("wq_b must be bf16[N, K] with qr's K");
  if (qd[0] != rows || qd[1] != n) return fail("q result must be bf16[M, N]");
  if (!aligned(plan.x, 16) || !aligned(plan.w, 16))
    return fail("qr and wq_b must be 16 B aligned");
  if (tactic == kQWgmma) {
    const int64_t part = int64_t{wg::kSplit} * wgmma::kBoxK;
    if (n <= 0 || n % wg::kRows != 0 || n / wg::kRows * wg::kSplit > kI32Max)
      return fail("tactic wgmma: wq_b's rows N must be a multiple of " +
                        std::to_string(wg::kRows));
    if (k % part != 0 || k / part < 1 || k / part * wgmma::kBoxK > kI32Max)
      return fail("tactic wgmma: K = " + std::to_string(k) + " must be " +
                        std::to_string(part) + " * boxes, boxes >= 1");
    if ((rows + wg::kMaxTokens - 1) / wg::kMaxTokens > 65535 || !fits_i32(rows))
      return fail("too many rows for one grid");
    return plan;
  }
  if (tactic != kQMma)
    return fail("tactic must be " + std::to_string(kQMma) + " (mma) or " +
                std::to_string(kQWgmma) + " (wgmma)");
  if (n <= 0 || n % kRows != 0)
    return fail("wq_b's rows N must be a multiple of " + std::to_string(kRows));
  if (n / kRows > kI32Max) return fail("wq_b has too many rows");
  const int64_t per_block = int64_t{kWarps} * kBlockK;
  if (k % per_block != 0 || k / per_block < 1 || k / per_block > kMaxBlocks)
    return fail("K = " + std::to_string(k) + " must be " + std::to_string(per_block) +
                " * blocks, blocks in 1.." +
                      std::to_string(kMaxBlocks));
  if ((rows + kChunk - 1) / kChunk > 65535) return fail("too many rows for one grid");
  return plan;
}

cudaError_t launch_q_gemm(cudaStream_t stream, bool pdl, const QGemmLaunch& plan) {
  if (plan.rows == 0) return cudaSuccess;
  if (plan.tactic == kQWgmma) {
    wg::Args args;
    args.q = static_cast<uint16_t*>(plan.q);
    args.rows = plan.rows;
    args.n = plan.n;
    args.boxes = static_cast<int32_t>(plan.k / (int64_t{wg::kSplit} * wgmma::kBoxK));
    const int tokens = wgmma::tokens_per_cta(plan.rows);
    return tokens == 16   ? wg::launch_as<16>(stream, pdl, args, plan.x, plan.w, plan.k)
           : tokens == 32 ? wg::launch_as<32>(stream, pdl, args, plan.x, plan.w, plan.k)
                          : wg::launch_as<wg::kMaxTokens>(stream, pdl, args, plan.x, plan.w,
                                                          plan.k);
  }
  QArgs args;
  args.x = static_cast<const uint16_t*>(plan.x);
  args.w = static_cast<const uint16_t*>(plan.w);
  args.q = static_cast<uint16_t*>(plan.q);
  args.rows = plan.rows;
  args.n = plan.n;
  const int blocks = static_cast<int>(plan.k / (int64_t{kWarps} * kBlockK));
  const Pick p = pick(blocks, std::make_integer_sequence<int, kMaxBlocks>());
  if (cudaError_t err = allow_smem(p.kernel, p.smem); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(plan.n / kRows),
                  static_cast<unsigned>((plan.rows + kChunk - 1) / kChunk));
  return launch(p.kernel, grid, dim3(kWarps * kWarp), p.smem, stream, pdl, args);
}

}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerQ, glm5::IndexerQImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // qr
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // wq_b
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // q
                                  .Attr<int32_t>("tactic")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
