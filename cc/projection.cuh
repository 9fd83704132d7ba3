// The indexer projection's GEMM core (SPEC §1), shared by projection.cu and projection_fused.cu
// so that both produce every fp32 sum in the same order for the same tactic (warps, split).
//
// Swap-AB on mma.sync m16n8k16 (bf16 in, fp32 accumulate): 16 rows of w_cat (outputs n) are
// the A side, 8 token rows of x the B side. A warp owns a span of stages * kBlocks * 32
// consecutive K (part `part` = rank * warps + warp of K). The dot product does not care which
// K a fragment slot stands for (A and B only have to agree), so in every 32-wide K block lane
// (g, q) = (lane / 4, lane % 4) loads the 16 contiguous bytes at K offset 8q of weight rows g
// and g + 8 and of token row g; words 0-1 feed one mma, words 2-3 the next.
//
// Order of a warp's sum: its K blocks in order through one accumulator per 8-token tile; a
// span longer than kBlocks (the weights a warp holds in registers) runs in stages whose
// accumulators pass through shared memory unchanged (exact), so the order is the same as one
// stage of all the blocks. warp_total then adds the warps' sums in warp order.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "common.h"
#include "constants.h"
#include "limits.h"
#include "wgmma.cuh"

namespace glm5 {
namespace gemm {

// The tactics' sizes are glm5_jax.limits' (cc/limits.h), where the Python side reads them too.
constexpr int kTileN = limits::kTileRows;       // w_cat rows (outputs n) per CTA (mma M)
constexpr int kTile = 8;                        // token rows per mma (mma N)
constexpr int kStep = 2 * kTile;                // token rows a warp handles per loop step
constexpr int kChunk = 128;                     // token rows per CTA; grid z covers more
constexpr int kBlockK = limits::kBlockK;        // K per fragment block (two mma K steps)
constexpr int kMaxBlocks = limits::kMaxBlocks;  // K blocks per warp and stage, in registers
constexpr int kMaxStages = limits::kMaxStages;  // stages of kMaxBlocks (bounds int32 stages)
constexpr int kMaxWarps = limits::kMaxWarps;    // warps per CTA (attribute warps)
constexpr int kMaxSplit = limits::kMaxSplit;    // CTAs per cluster splitting K (attribute
                                                // split): the portable cluster size
constexpr int kKeyRows = kDim;                  // key rows = gate rows = head dim
constexpr int kGemvSplit = limits::kGemvSplit;  // attribute split naming the GEMV tactic
constexpr int kGemvK = limits::kGemvK;          // GEMV: K a warp covers per 16-byte lane load
static_assert(kTileN == 16 && kBlockK == 32, "one m16n8k16 tile of rows, two K steps a block");
static_assert(kGemvK == 8 * kWarp, "a GEMV lane loads 16 bytes of bf16");
// Attribute split naming the wgmma tactic (projection.cu): one warpgroup a CTA (warps
// kWgmmaWarps), clusters of kWgmmaCluster CTAs splitting K in boxes of wgmma::kBoxK
// (K = kWgmmaCluster * wgmma::kBoxK * boxes).
constexpr int kWgmmaSplit = limits::kWgmmaSplit;
constexpr int kWgmmaWarps = limits::kWgmmaWarps;
constexpr int kWgmmaCluster = limits::kWgmmaCluster;

static_assert(kChunk % kStep == 0, "a chunk is whole loop steps");

struct Gemm {
  const uint16_t* x;      // bf16[M, K]
  const uint16_t* w;      // bf16[N, K]
  int64_t rows;           // M
  int64_t k;              // K
  int32_t stages;         // stages of kBlocks K blocks per warp
  int32_t chunk_pad;      // min(M, kChunk) rounded up to kStep: smem token rows per warp
  // x is complete when the grid starts: the kernel launched just before it on the stream
  // calls launch_dependents only after its own PDL wait (indexer_q's kernels do), so every
  // grid before that one has completed. The kernel then reads x before its PDL wait and
  // waits only after its last read of x, before it exits, so that a dependent's wait on this
  // grid still covers the kernel before it (glm5_indexer_update_q: the projection runs
  // beside q's GEMM). Not for indexer_projection_fused, whose q input is that kernel's.
  bool inputs_ready = false;
};

// 16 bytes of weights, streamed once: no L1 allocation. A weak load, for before the PDL wait
// as common.h's load_before_wait (which says why not ld.global.nc), with the L1 hint those
// lack; found in the SASS here (ACQBULK first, the weights after it, with .nc loads).
__device__ __forceinline__ uint4 load_weight(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// c += A (16 outputs n x 16 K, bf16) * B (16 K x 8 token rows, bf16), fp32.
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide K block: outputs g (lo) and g + 8 (hi) against token row g's words x.
__device__ __forceinline__ void mma_block(float (&c)[4], const uint4& lo, const uint4& hi,
                                          const uint4& x) {
  mma(c, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
  mma(c, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
}

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// Lane (g, q)'s weights of w_cat rows n0 + g and n0 + g + 8, kBlocks K blocks from k0.
template <int kBlocks>
__device__ __forceinline__ void load_weights(uint4 (&lo)[kBlocks], uint4 (&hi)[kBlocks],
                                             const Gemm& a, int32_t n0, int64_t k0, int g) {
  const uint16_t* w_lo = a.w + (n0 + g) * a.k + k0;
  const uint16_t* w_hi = w_lo + kTile * a.k;
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    lo[b] = load_weight(w_lo + b * kBlockK);
    hi[b] = load_weight(w_hi + b * kBlockK);
  }
}

// Lane (g, q)'s x fragments of the step's 8-token tiles from token row `row`: x bf16[rows, k],
// kBlocks K blocks from column `col` (the lane's 8q offset included), `tiles` (1 or 2) tiles,
// the rest left unloaded. Token rows past the end repeat the last one (their sums are not
// stored). Shared by the projection and indexer_q (q_gemm.cu).
template <int kBlocks>
__device__ __forceinline__ void load_x(uint4 (&xv)[2][kBlocks], const uint16_t* x, int64_t k,
                                       int64_t rows, int64_t col, int64_t row, int tiles, int g) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h < tiles) {
      const int64_t t = min(row + h * kTile + g, rows - 1);
      const uint4* px = reinterpret_cast<const uint4*>(x + t * k + col);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) xv[h][b] = __ldg(px + b * (kBlockK / 8));
    }
  }
}

// The prefetched fragments become the step's (a register copy the loop keeps).
template <int kBlocks>
__device__ __forceinline__ void take_x(uint4 (&xv)[2][kBlocks], const uint4 (&xn)[2][kBlocks]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) xv[h][b] = xn[h][b];
}

// The 8-token tiles of the step at chunk offset s that hold a row of the chunk: the second
// only when the chunk passes s + 8 (below, its rows would all be padding: never read back).
__device__ __forceinline__ int step_tiles(int s, int chunk) { return chunk - s > kTile ? 2 : 1; }

// One token step at chunk offset s with its x fragments xv: the step's mma into `mine`
// (resuming from the sums stored there by an earlier stage), for its `tiles` tiles.
template <int kBlocks>
__device__ __forceinline__ void mma_step(float* mine, const uint4 (&lo)[kBlocks],
                                         const uint4 (&hi)[kBlocks],
                                         const uint4 (&xv)[2][kBlocks], int s, int tiles,
                                         bool resume, int g, int q) {
  // c[h] = outputs (g, g + 8) x token rows (2q, 2q + 1) of tile h.
  float c[2][4] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float* in = mine + (s + h * kTile + 2 * q) * kTileN + g;
    if (resume && h < tiles) {
      c[h][0] = in[0];
      c[h][1] = in[kTileN];
      c[h][2] = in[kTile];
      c[h][3] = in[kTileN + kTile];
    }
  }
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) mma_block(c[0], lo[b], hi[b], xv[0][b]);
  if (tiles == 2) {
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) mma_block(c[1], lo[b], hi[b], xv[1][b]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h < tiles) {
      float* const out = mine + (s + h * kTile + 2 * q) * kTileN + g;
      out[0] = c[h][0];
      out[kTileN] = c[h][1];
      out[kTile] = c[h][2];
      out[kTileN + kTile] = c[h][3];
    }
  }
}

// Token steps whose x a warp holds in registers at once: the step it multiplies and
// kXRing - 1 loaded ahead. Each step's mma waits on little else than its x (a few mma per
// step), so with one step ahead a chunk of several steps (M = 64 at 8 x 8: four) paid about
// one L2 round trip a step; a warp of at most 2 K blocks (16 registers a step) keeps three
// steps ahead, wider warps one (their registers hold more weights).
template <int kBlocks>
constexpr int kXRing = kBlocks <= 2 ? 4 : 2;

// The warp's kBlocks K blocks from k0 for every token step of the chunk, into its slab
// `mine` f32[chunk_pad][16]; `resume` starts from the sums a previous stage stored there.
// Latency: both tiles' x loads of a step go out as one batch, kXRing - 1 steps ahead of the
// step multiplied (a ring of registers, its slots named at compile time: the steps are
// unrolled by kXRing); a tile of padding rows only (M <= 8: the second) is neither loaded nor
// multiplied. Each sum's order is unchanged (the same mma sequence per accumulator), hence
// the bits.
template <int kBlocks>
__device__ __forceinline__ void accumulate(const Gemm& a, float* mine, const uint4 (&lo)[kBlocks],
                                           const uint4 (&hi)[kBlocks], int64_t k0,
                                           int64_t chunk0, int chunk, bool resume) {
  constexpr int kRing = kXRing<kBlocks>;
  const int lane = threadIdx.x % kWarp, g = lane / 4, q = lane % 4;
  uint4 xr[kRing][2][kBlocks];
#pragma unroll
  for (int i = 0; i < kRing - 1; ++i) {
    const int s = i * kStep;
    if (s < chunk) load_x(xr[i], a.x, a.k, a.rows, k0, chunk0 + s, step_tiles(s, chunk), g);
  }
#pragma unroll 1
  for (int s0 = 0; s0 < chunk; s0 += kRing * kStep) {
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      const int s = s0 + i * kStep;
      if (s < chunk) {
        const int ahead = s + (kRing - 1) * kStep;
        if (ahead < chunk)
          load_x(xr[(i + kRing - 1) % kRing], a.x, a.k, a.rows, k0, chunk0 + ahead,
                 step_tiles(ahead, chunk), g);
        mma_step(mine, lo, hi, xr[i], s, step_tiles(s, chunk), resume, g, q);
      }
    }
  }
}

// The warp's sums of outputs n0 .. n0 + 15 over its K part `part` for token rows chunk0 ..
// chunk0 + chunk - 1, into its slab of partial f32[warps][chunk_pad][16] (token-major, n
// fastest). kStaged: a.stages stages of kBlocks blocks (a separate instantiation, so that the
// one-stage kernels keep their registers). Programmatic dependent launch: the first stage's
// weights (model parameters, not written by the preceding kernel) are loaded before
// pdl_wait(); x is read after it (before it with Gemm::inputs_ready).
template <int kBlocks, bool kStaged>
__device__ __forceinline__ void project(const Gemm& a, float* partial, int32_t n0, int part,
                                        int64_t chunk0, int chunk) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, q = lane % 4;
  const int64_t stage_k = kBlocks * kBlockK;
  const int64_t k0 = part * (kStaged ? a.stages * stage_k : stage_k) + 8 * q;
  float* const mine = partial + warp * a.chunk_pad * kTileN;
  uint4 lo[kBlocks], hi[kBlocks];
  load_weights(lo, hi, a, n0, k0, g);
  if (!a.inputs_ready) pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion to read
  accumulate(a, mine, lo, hi, k0, chunk0, chunk, false);
  if constexpr (kStaged) {
#pragma unroll 1
    for (int stage = 1; stage < a.stages; ++stage) {
      load_weights(lo, hi, a, n0, k0 + stage * stage_k, g);
      accumulate(a, mine, lo, hi, k0 + stage * stage_k, chunk0, chunk, true);
    }
  }
  // With inputs_ready the kernel waits just before it exits (projection.cu: after its
  // stores), not here: its results do not wait for its predecessor's completion.
}

// Element e = (token, n) of the CTA's tile summed over its warps in warp order (after a
// __syncthreads() past project()).
__device__ __forceinline__ float warp_total(const float* partial, const Gemm& a, int warps,
                                            int e) {
  float total = partial[e];
  for (int v = 1; v < warps; ++v) total += partial[v * a.chunk_pad * kTileN + e];
  return total;
}

// Elements e .. e + 3 (e % 4 == 0) as warp_total adds each: one 16-byte load a warp.
__device__ __forceinline__ float4 warp_total4(const float* partial, const Gemm& a, int warps,
                                              int e) {
  float4 total = *reinterpret_cast<const float4*>(partial + e);
  for (int v = 1; v < warps; ++v) {
    const float4 p = *reinterpret_cast<const float4*>(partial + v * a.chunk_pad * kTileN + e);
    total.x += p.x;
    total.y += p.y;
    total.z += p.z;
    total.w += p.w;
  }
  return total;
}

// K blocks per stage (1..kMaxBlocks) and stages when `warps * split` warps split K: one stage
// of 1..kMaxBlocks blocks, or whole stages of kMaxBlocks.
struct Staging {
  int blocks, stages;
};

// The tactic (warps, split) arrives as attributes, chosen in Python at lowering; C++ only
// validates it: warps in 1..kMaxWarps, split in 1..max_split (the fused kernel has no split
// attribute: max_split 1), and 32 * warps * split * blocks = K with blocks in 1..kMaxBlocks
// or a multiple of kMaxBlocks (at most kMaxStages stages). Where max_split > 1, split
// kGemvSplit is the GEMV (projection.cu): K = kGemvK * warps * loads, loads in
// 1..kMaxBlocks, returned as one stage of `loads` blocks. Returns the staging of K.
inline ffi::ErrorOr<Staging> check_tactic(const Check& check, int64_t k, int32_t warps,
                                          int32_t split, int32_t max_split) {
  const bool gemv = max_split > 1 && split == kGemvSplit;
  if (max_split > 1 && split == kWgmmaSplit) {  // boxes of K a CTA, as one stage
    const int64_t per_cta = int64_t{kWgmmaCluster} * wgmma::kBoxK;
    if (warps == kWgmmaWarps && k % per_cta == 0 && k / per_cta >= 1 &&
        k / per_cta <= kMaxStages)
      return Staging{static_cast<int>(k / per_cta), 1};
    return ffi::Unexpected(check.fail(
        "the wgmma tactic (split " + std::to_string(kWgmmaSplit) + ") needs warps = " +
        std::to_string(kWgmmaWarps) + " and K a multiple of " + std::to_string(per_cta) +
        ", got warps = " + std::to_string(warps) + ", K = " + std::to_string(k)));
  }
  if (warps < 1 || warps > kMaxWarps)
    return ffi::Unexpected(check.fail("attribute warps = " + std::to_string(warps) +
                                      " must be in 1.." + std::to_string(kMaxWarps)));
  if (!gemv && (split < 1 || split > max_split))
    return ffi::Unexpected(check.fail(
        "attribute split = " + std::to_string(split) + " must be " +
        (max_split > 1 ? std::to_string(kGemvSplit) + " (the GEMV), " +
                             std::to_string(kWgmmaSplit) + " (wgmma) or "
                       : std::string()) +
        "in 1.." + std::to_string(max_split)));
  const int64_t per_warp = gemv ? int64_t{kGemvK} * warps : int64_t{kBlockK} * warps * split;
  const int64_t blocks = k / per_warp;
  if (k % per_warp == 0 && blocks >= 1) {
    if (blocks <= kMaxBlocks) return Staging{static_cast<int>(blocks), 1};
    if (!gemv && blocks % kMaxBlocks == 0 && blocks / kMaxBlocks <= kMaxStages)
      return Staging{kMaxBlocks, static_cast<int>(blocks / kMaxBlocks)};
  }
  const std::string tactic =
      max_split == 1 ? "attribute warps = " + std::to_string(warps) + " does not"
                     : "attributes warps = " + std::to_string(warps) + ", split = " +
                           std::to_string(split) + " do not";
  if (gemv)
    return ffi::Unexpected(check.fail(tactic + " tile K = " + std::to_string(k) +
                                      ": the GEMV needs K = " + std::to_string(kGemvK) +
                                      " * warps * loads with loads in 1.." +
                                      std::to_string(kMaxBlocks)));
  return ffi::Unexpected(check.fail(
      tactic + " tile K = " + std::to_string(k) + ": K must be " + std::to_string(kBlockK) +
      " * warps * split * blocks with blocks in 1.." + std::to_string(kMaxBlocks) +
      " or a multiple of " + std::to_string(kMaxBlocks)));
}

// The GEMM operands of a launch (chunk_pad from M).
inline Gemm make_gemm(const void* x, const void* w, int64_t rows, int64_t k, int stages) {
  Gemm a;
  a.x = static_cast<const uint16_t*>(x);
  a.w = static_cast<const uint16_t*>(w);
  a.rows = rows;
  a.k = k;
  a.stages = stages;
  a.chunk_pad = static_cast<int32_t>((std::min<int64_t>(rows, kChunk) + kStep - 1) / kStep *
                                     kStep);
  return a;
}

// Bytes of partial f32[warps][chunk_pad][16].
inline size_t partial_bytes(const Gemm& a, int warps) {
  return sizeof(float) * warps * a.chunk_pad * kTileN;
}

// Elements of a chunk's `elements` (whole float4s) that each of `split` cluster ranks adds.
__host__ __device__ inline int cluster_span(int elements, int split) {
  return (elements / 4 + split - 1) / split * 4;
}

// Floats of the cluster's receive rows after partial (projection.cu): recv f32[split][span]
// at the widest chunk; its mbarrier follows them.
__host__ __device__ inline int cluster_recv_floats(const Gemm& a, int split) {
  return split * cluster_span(a.chunk_pad * kTileN, split);
}

// Bytes after partial for the cluster's sums: the receive rows and the mbarrier; none
// without a cluster.
inline size_t cluster_bytes(const Gemm& a, int split) {
  return split > 1 ? sizeof(float) * cluster_recv_floats(a, split) + 16 : 0;
}

// The kernel Pick<kBlocks, kStaged>::kernel for a tiling: one stage of 1..kMaxBlocks blocks,
// or stages of kMaxBlocks.
template <typename Kernel, template <int, bool> class Pick, int... kBlocks>
Kernel pick_kernel(Staging st, std::integer_sequence<int, kBlocks...>) {
  if (st.stages > 1) return Pick<kMaxBlocks, true>::kernel;
  Kernel kernel = nullptr;
  ((kernel = st.blocks == kBlocks + 1 ? Pick<kBlocks + 1, false>::kernel : kernel), ...);
  return kernel;
}

template <typename Kernel, template <int, bool> class Pick>
Kernel pick_kernel(Staging st) {
  return pick_kernel<Kernel, Pick>(st, std::make_integer_sequence<int, kMaxBlocks>());
}

}  // namespace gemm

// indexer_projection's launch (projection.cu) as a checked plan and its stream work, so that
// glm5_indexer_projection and glm5_indexer_update (update.cu) launch the kernel by one rule.
struct ProjectionArgs {
  gemm::Gemm gemm;        // x bf16[M, K], w bf16[256 + H, K]
  uint16_t* key;          // bf16[M, 128]
  float* head_w;          // f32[M, H]
  uint16_t* gate;         // bf16[M, 128]
  int32_t heads;          // H
};

struct ProjectionLaunch {
  ProjectionArgs args;
  void (*kernel)(ProjectionArgs) = nullptr;  // null: no rows, or the wgmma tactic
  int32_t wgmma_boxes = 0;   // the wgmma tactic (kernel null): K boxes a CTA; 0: another
  dim3 grid;
  int32_t warps = 0;
  int32_t cluster = 1;   // CTAs per cluster along x: split (the mma tactics), 1 (the GEMV)
  size_t smem = 0;
};

// Validates the buffers and the tactic (warps, split); no stream work.
ffi::ErrorOr<ProjectionLaunch> prepare_projection(const Check& check, ffi::BufferR2<ffi::BF16> x,
                                                  ffi::BufferR2<ffi::BF16> w_cat,
                                                  ffi::ResultBufferR2<ffi::BF16> key,
                                                  ffi::ResultBufferR2<ffi::F32> head_w,
                                                  ffi::ResultBufferR2<ffi::BF16> gate,
                                                  int32_t warps, int32_t split);

cudaError_t launch_projection(cudaStream_t stream, bool pdl, const ProjectionLaunch& plan);

}  // namespace glm5
