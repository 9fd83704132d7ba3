// indexer_projection (SPEC §1): x bf16[M, K] @ w_cat bf16[N = 256 + H, K]^T, written as
// key bf16[M, 128] (rows 0..127), head weights f32[M, H] (rows 128..127+H) and gate
// bf16[M, 128] (the last 128 rows): fp32 sums of exact bf16 products, one RNE rounding to
// bf16 for key and gate, none for the head weights.
//
// Swap-AB on mma.sync m16n8k16 (bf16 in, fp32 accumulate): 16 weight rows are the A side,
// 8 tokens the B side. Grid (split, N / 16, ceil(M / 128)); the `split` CTAs of one row tile
// form a thread-block cluster and split K, and each CTA's `warps` warps split its part again,
// so a warp owns a span of kBlocks * 32 consecutive K. The dot product does not care which K
// a fragment slot stands for (A and B only have to agree), so in every 32-wide K block lane
// (g, q) = (lane / 4, lane % 4) loads the 16 contiguous bytes at K offset 8q of weight rows g
// and g + 8 and of token g; words 0-1 feed one mma, words 2-3 the next.
//
// Order of the sums (fixed, so a tactic gives the same bits on every run): each warp runs its
// K blocks in order through one accumulator per 8-token tile; the CTA adds its warps' tiles in
// warp order in shared memory; the cluster adds its CTAs' sums in rank order over DSMEM. The
// tactic (warps, split) changes the order, hence the bits within the fp32 tolerance.
//
// Programmatic dependent launch: the weights (model parameters, not written by the preceding
// kernel) are loaded into registers before pdl_wait(); x is read after it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "common.h"
#include "handlers.h"

namespace glm5 {
namespace {

namespace cg = cooperative_groups;

constexpr int kLanes = 32;
constexpr int kRows = 16;                   // weight rows per CTA (mma M)
constexpr int kTile = 8;                    // tokens per mma (mma N)
constexpr int kStep = 2 * kTile;            // tokens a warp handles per loop step
constexpr int kChunk = 128;                 // tokens per CTA; grid z covers more
constexpr int kBlockK = 32;                 // K per fragment block (two mma K steps)
constexpr int kMaxBlocks = 8;               // K blocks per warp, held in registers
constexpr int kMaxWarps = 8;
constexpr int kMaxSplit = 8;                // portable cluster size
constexpr int kKeyRows = 128;               // key rows = gate rows = head dim
constexpr size_t kDefaultSmem = 48 * 1024;  // dynamic smem without opting in

static_assert(kChunk % kStep == 0, "a chunk is whole loop steps");

struct ProjectionArgs {
  const uint16_t* x;      // bf16[M, K]
  const uint16_t* w;      // bf16[256 + H, K]
  uint16_t* key;          // bf16[M, 128]
  float* weights;         // f32[M, H]
  uint16_t* gate;         // bf16[M, 128]
  int64_t tokens;         // M
  int64_t k;              // K
  int32_t heads;          // H
  int32_t chunk_pad;      // min(M, kChunk) rounded up to kStep: smem tokens per warp
};

// 16 bytes of weights, streamed once: no L1 allocation.
__device__ __forceinline__ uint4 load_weight(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// c += A (16 rows x 16 K, bf16) * B (16 K x 8 tokens, bf16), fp32.
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide K block: rows g (lo) and g + 8 (hi) against token g's words x.
__device__ __forceinline__ void mma_block(float (&c)[4], const uint4& lo, const uint4& hi,
                                          const uint4& x) {
  mma(c, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
  mma(c, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
}

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// Element (token t, row) of the product, row uniform over the CTA's region.
__device__ __forceinline__ void store(const ProjectionArgs& a, int64_t t, int32_t row,
                                      float total) {
  if (row < kKeyRows)
    a.key[t * kKeyRows + row] = bf16_bits(total);
  else if (row < kKeyRows + a.heads)
    a.weights[t * a.heads + (row - kKeyRows)] = total;
  else
    a.gate[t * kKeyRows + (row - kKeyRows - a.heads)] = bf16_bits(total);
}

// partial: f32[warps][chunk_pad][16] (token-major, row fastest), in dynamic shared memory.
template <int kBlocks>
__global__ void __launch_bounds__(kMaxWarps * kLanes)
    indexer_projection_kernel(const ProjectionArgs a) {
  extern __shared__ float partial[];
  const cg::cluster_group cluster = cg::this_cluster();
  const int split = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int warps = blockDim.x / kLanes;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int g = lane / 4, q = lane % 4;
  const int32_t row0 = blockIdx.y * kRows;
  const int64_t k0 = static_cast<int64_t>(rank * warps + warp) * (kBlocks * kBlockK) + 8 * q;

  // Weights first: they do not depend on the preceding kernel.
  uint4 lo[kBlocks], hi[kBlocks];
  const uint16_t* w_lo = a.w + (row0 + g) * a.k + k0;
  const uint16_t* w_hi = w_lo + kTile * a.k;
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    lo[b] = load_weight(w_lo + b * kBlockK);
    hi[b] = load_weight(w_hi + b * kBlockK);
  }
  pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion before reading

  const int64_t chunk0 = static_cast<int64_t>(blockIdx.z) * kChunk;
  const int chunk = static_cast<int>(min(static_cast<int64_t>(kChunk), a.tokens - chunk0));
  float* const mine = partial + warp * a.chunk_pad * kRows;
#pragma unroll 1
  for (int s = 0; s < chunk; s += kStep) {
    // Tokens past the end repeat the last one; their sums are not stored.
    uint4 xv[2][kBlocks];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t t = min(chunk0 + s + h * kTile + g, a.tokens - 1);
      const uint4* px = reinterpret_cast<const uint4*>(a.x + t * a.k + k0);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) xv[h][b] = __ldg(px + b * (kBlockK / 8));
    }
    float c[2][4] = {};
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      mma_block(c[0], lo[b], hi[b], xv[0][b]);
      mma_block(c[1], lo[b], hi[b], xv[1][b]);
    }
    // c[h] = rows (g, g + 8) x tokens (2q, 2q + 1) of tile h.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* const out = mine + (s + h * kTile + 2 * q) * kRows + g;
      out[0] = c[h][0];
      out[kRows] = c[h][1];
      out[kTile] = c[h][2];
      out[kRows + kTile] = c[h][3];
    }
  }
  __syncthreads();

  // The CTA's sums, in warp order, into warp 0's slab (each element read and written by
  // one thread).
  const int elements = chunk * kRows;
  for (int e = threadIdx.x; e < elements; e += blockDim.x) {
    float total = partial[e];
    for (int v = 1; v < warps; ++v) total += partial[v * a.chunk_pad * kRows + e];
    if (split == 1)
      store(a, chunk0 + e / kRows, row0 + e % kRows, total);
    else
      partial[e] = total;
  }
  if (split == 1) return;

  // Rank r adds elements r, r + split, ... over the cluster's CTAs in rank order.
  cluster.sync();
  for (int e = threadIdx.x * split + rank; e < elements; e += blockDim.x * split) {
    float total = *cluster.map_shared_rank(partial + e, 0);
    for (int c = 1; c < split; ++c) total += *cluster.map_shared_rank(partial + e, c);
    store(a, chunk0 + e / kRows, row0 + e % kRows, total);
  }
  cluster.sync();  // keep this CTA's sums alive until the cluster has read them
}

using Kernel = void (*)(ProjectionArgs);

template <int... kBlocks>
Kernel kernel_for(int blocks, std::integer_sequence<int, kBlocks...>) {
  Kernel kernel = nullptr;
  ((kernel = blocks == kBlocks + 1 ? indexer_projection_kernel<kBlocks + 1> : kernel), ...);
  return kernel;
}

struct Tactic {
  int warps, split;
};

// (warps, split) by token count. Every CTA cluster of 8 splits K so that the N / 16 row tiles
// make >= 136 CTAs (N >= 272) with all weights in flight at once; past 32 tokens 8 warps
// overlap more of the x reads (L2 latency) when K allows. The H200 sweep (BENCHMARKS.md,
// K 4096) found (8, 4) fastest at M 8-16 and (8, 8) at M 64: adopting it needs a GPU re-run.
Tactic auto_tactic(int64_t tokens, int64_t k) {
  if (tokens > 32 && k % (kBlockK * 8 * kMaxSplit) == 0) return {8, kMaxSplit};
  return {4, kMaxSplit};
}

ffi::Error ProjectionImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> x,
                          ffi::BufferR2<ffi::BF16> w_cat, ffi::ResultBufferR2<ffi::BF16> key,
                          ffi::ResultBufferR2<ffi::F32> weights,
                          ffi::ResultBufferR2<ffi::BF16> gate, int32_t warps, int32_t split) {
  auto fail = [](const std::string& what) {
    return ffi::Error::InvalidArgument("glm5_indexer_projection: " + what);
  };
  const auto xd = x.dimensions();
  const int64_t tokens = xd[0], k = xd[1];
  const auto wd = weights->dimensions();
  const int64_t heads = wd[1];
  if (wd[0] != tokens || heads <= 0 || heads % kRows != 0)
    return fail("head weights result must be f32[M, H] with H % 16 == 0");
  const auto cd = w_cat.dimensions();
  if (cd[0] != 2 * kKeyRows + heads || cd[1] != k)
    return fail("w_cat must be bf16[256 + H, K]");
  const auto kd = key->dimensions(), gd = gate->dimensions();
  if (kd[0] != tokens || kd[1] != kKeyRows || gd[0] != tokens || gd[1] != kKeyRows)
    return fail("key and gate results must be bf16[M, 128]");
  if (heads > std::numeric_limits<int32_t>::max() / 2) return fail("too many heads");

  Tactic t = auto_tactic(tokens, k);
  if (warps != 0 || split != 0) {
    if (warps < 1 || warps > kMaxWarps || split < 1 || split > kMaxSplit)
      return fail("attributes warps must be in 1..8 and split in 1..8 (or both 0: automatic)");
    t = {warps, split};
  }
  const int64_t per_warp = int64_t{kBlockK} * t.warps * t.split;
  const int64_t blocks = k / per_warp;
  if (k % per_warp != 0 || blocks < 1 || blocks > kMaxBlocks)
    return fail("K = " + std::to_string(k) + " is not 32 * warps * split * blocks with blocks " +
                "in 1..8 (warps " + std::to_string(t.warps) + ", split " +
                std::to_string(t.split) + ")");
  if (!aligned(x.untyped_data(), 16) || !aligned(w_cat.untyped_data(), 16))
    return fail("x and w_cat must be 16 B aligned");
  if (tokens == 0) return ffi::Error::Success();
  const int64_t chunks = (tokens + kChunk - 1) / kChunk;
  if (chunks > 65535) return fail("too many tokens for one grid");

  ProjectionArgs args;
  args.x = reinterpret_cast<const uint16_t*>(x.untyped_data());
  args.w = reinterpret_cast<const uint16_t*>(w_cat.untyped_data());
  args.key = reinterpret_cast<uint16_t*>(key->untyped_data());
  args.weights = weights->typed_data();
  args.gate = reinterpret_cast<uint16_t*>(gate->untyped_data());
  args.tokens = tokens;
  args.k = k;
  args.heads = static_cast<int32_t>(heads);
  args.chunk_pad = static_cast<int32_t>((std::min<int64_t>(tokens, kChunk) + kStep - 1) /
                                        kStep * kStep);

  const Kernel kernel =
      kernel_for(static_cast<int>(blocks), std::make_integer_sequence<int, kMaxBlocks>());
  const size_t smem = sizeof(float) * t.warps * args.chunk_pad * kRows;
  if (smem > kDefaultSmem) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return cuda_status("glm5_indexer_projection", err);
  }
  const dim3 grid(static_cast<unsigned>(t.split), static_cast<unsigned>(cd[0] / kRows),
                  static_cast<unsigned>(chunks));
  cudaError_t err = launch_cluster(kernel, grid, dim3(t.warps * kLanes), smem, stream,
                                   /*pdl=*/true, static_cast<unsigned>(t.split), args);
  return cuda_status("glm5_indexer_projection", err);
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerProjection, glm5::ProjectionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // x
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // w_cat
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // key
                                  .Ret<ffi::BufferR2<ffi::F32>>()         // head weights
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // gate
                                  .Attr<int32_t>("warps")
                                  .Attr<int32_t>("split"),
                              {ffi::Traits::kCmdBufferCompatible});
