// indexer_projection_fused (SPEC §1 + §2, the seed's `fused`): indexer_projection followed by
// indexer_query in one launch: q_fp8 e4m3[M, padded, 128], w_out f32 | bf16 [M, padded],
// key bf16[M, 128] (LayerNormed), gate bf16[M, 128].
//
// Grid (N / 16 tiles of w_cat rows padded to whole clusters of 8, 1, ceil(M / 128)), CTAs of
// `warps` warps (the attribute warps, chosen in Python at lowering; validated here); tactic
// (warps, split 1): K is split over the warps only, so that the 8 key tiles fit one
// thread-block cluster. The tiles, the K partition and the GEMM core
// (projection.cuh) are glm5_indexer_projection's at tactic (warps, 1), so every key, head
// weight and gate sum is bit-identical to it; the epilogue is indexer_query's arithmetic
// (query.cuh), so all four outputs equal glm5_indexer_projection + glm5_indexer_query at that
// tactic bit for bit. Roles by tile, for the CTA's chunk of token rows:
//   * tiles 0..7 (key rows 16j..16j+15, the first cluster): the bf16 key sums go to shared
//     memory; after a cluster barrier, CTA j normalises token pairs j * warps + warp, ..., a
//     half-warp per token whose lane g reads group g (dims 8g..8g+7) from CTA g / 2 over DSMEM.
//   * head tiles (rows 128 + 16j ..): a warp per (token, head): its head_w sum, then the
//     q row's Hadamard + FP8 and w_out; the first head tile also writes the padded heads.
//   * gate tiles: bf16 gate; tiles past N (cluster padding) exit at once.
// Programmatic dependent launch as in the projection: weights before pdl_wait(), x, q and the
// LayerNorm parameters after it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cluster.cuh"
#include "common.h"
#include "handlers.h"
#include "projection.cuh"
#include "query.cuh"

namespace glm5 {
namespace {

namespace cg = cooperative_groups;

using gemm::Gemm;
using gemm::kChunk;
using gemm::kKeyRows;
using gemm::kMaxWarps;
using gemm::kTileN;

constexpr int kKeyTiles = kKeyRows / kTileN;   // key tiles = CTAs per cluster
constexpr int kRowBatch = 4;                   // q rows a warp loads at once

static_assert(kTileN == 2 * kGroupDims, "a LayerNorm group is half a key tile");

struct FusedArgs {
  Gemm gemm;                  // x bf16[M, K], w bf16[256 + H, K]
  const uint16_t* q;          // bf16[M, H, 128]
  const float* norm_weight;   // f32[128]
  const float* norm_bias;     // f32[128]
  uint32_t* q_out;            // e4m3[M, padded, 128] as 32 words per row
  void* w_out;                // f32 | bf16 [M, padded]
  uint16_t* key;              // bf16[M, 128]
  uint16_t* gate;             // bf16[M, 128]
  int32_t heads;              // H
  int32_t padded;             // padded >= H
  float scale;
  float eps;
};

// Key tile `tile` of the first cluster: bf16 sums into keys bf16[chunk_pad][16], then the
// LayerNorm of the chunk's rows over the cluster's 8 tiles.
__device__ __forceinline__ void key_tile(const FusedArgs& a, const float* partial, uint16_t* keys,
                                         int tile, int64_t chunk0, int chunk) {
  const cg::cluster_group cluster = cg::this_cluster();
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int e = threadIdx.x; e < chunk * kTileN; e += blockDim.x)
    keys[e] = gemm::bf16_bits(gemm::warp_total(partial, a.gemm, warps, e));
  cluster.sync();
  const int g = lane % kHalf;
  for (int pair = tile * warps + warp; 2 * pair < chunk; pair += kKeyTiles * warps) {
    const int t = 2 * pair + lane / kHalf;
    const bool live = t < chunk;
    // Group g = rows 8 (g % 2) .. of key tile g / 2 (cluster rank g / 2).
    const uint4 raw = live ? *cluster.map_shared_rank(
                                 reinterpret_cast<const uint4*>(keys + t * kTileN) + g % 2, g / 2)
                           : make_uint4(0u, 0u, 0u, 0u);
    const uint4 y = layernorm_group(raw, a.norm_weight, a.norm_bias, a.eps, lane);
    if (live) *(reinterpret_cast<uint4*>(a.key + (chunk0 + t) * kDim) + g) = y;
  }
  // Keep this CTA's keys alive until the cluster has read them. Relaxed (cluster.cuh): the
  // peer loads above have returned, their values stored, before this thread arrives.
  cluster::arrive_relaxed();
  cluster::wait();
}

// Head tile of heads head0 .. head0 + 15: a warp per (token, head) q row, kRowBatch q rows
// loaded before quantising them (loads in flight together; independent rows interleave).
template <bool kBf16>
__device__ __forceinline__ void head_tile(const FusedArgs& a, const float* partial, int32_t head0,
                                          int64_t chunk0, int chunk) {
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int q_rows = chunk * kTileN;  // e = (token, head) = (e / 16, e % 16), as in partial
  for (int e0 = warp * kRowBatch; e0 < q_rows; e0 += warps * kRowBatch) {
    uint2 q[kRowBatch];
#pragma unroll
    for (int i = 0; i < kRowBatch; ++i) {
      const int e = e0 + i;
      if (e < q_rows)
        q[i] = load_query(
            a.q + ((chunk0 + e / kTileN) * a.heads + head0 + e % kTileN) * kDim, lane);
    }
#pragma unroll
    for (int i = 0; i < kRowBatch; ++i) {
      const int e = e0 + i;
      if (e >= q_rows) break;
      const float w = gemm::warp_total(partial, a.gemm, warps, e);
      query_row<kBf16>(q[i], w, a.q_out, a.w_out, (chunk0 + e / kTileN) * a.padded + head0 +
                       e % kTileN, a.scale, lane);
    }
  }
  if (head0 != 0) return;
  const int spare = a.padded - a.heads;
  for (int64_t i = warp; i < int64_t{chunk} * spare; i += warps)
    zero_row<kBf16>(a.q_out, a.w_out, (chunk0 + i / spare) * a.padded + a.heads + i % spare,
                    lane);
}

// Dynamic shared memory: partial f32[warps][chunk_pad][16], then keys bf16[chunk_pad][16].
template <int kBlocks, bool kStaged, bool kBf16>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
    indexer_projection_fused_kernel(const FusedArgs a) {
  extern __shared__ float partial[];
  const int tile = blockIdx.x;
  const int32_t n0 = tile * kTileN;
  if (n0 >= 2 * kKeyRows + a.heads) return;  // cluster padding (never in the key cluster)
  const int warps = blockDim.x / kWarp;
  const int64_t chunk0 = static_cast<int64_t>(blockIdx.z) * kChunk;
  const int chunk = static_cast<int>(min(static_cast<int64_t>(kChunk), a.gemm.rows - chunk0));
  const int warp = threadIdx.x / kWarp;
  gemm::project<kBlocks, kStaged>(a.gemm, partial, n0, warp, chunk0, chunk);
  __syncthreads();

  if (tile < kKeyTiles) {
    key_tile(a, partial, reinterpret_cast<uint16_t*>(partial + warps * a.gemm.chunk_pad * kTileN),
             tile, chunk0, chunk);
  } else if (n0 < kKeyRows + a.heads) {
    head_tile<kBf16>(a, partial, n0 - kKeyRows, chunk0, chunk);
  } else {
    const int32_t col0 = n0 - kKeyRows - a.heads;
    for (int e = threadIdx.x; e < chunk * kTileN; e += blockDim.x)
      a.gate[(chunk0 + e / kTileN) * kKeyRows + col0 + e % kTileN] =
          gemm::bf16_bits(gemm::warp_total(partial, a.gemm, warps, e));
  }
}

using Kernel = void (*)(FusedArgs);

template <bool kBf16>
struct Pick {
  template <int kBlocks, bool kStaged>
  struct Blocks {
    static constexpr Kernel kernel = indexer_projection_fused_kernel<kBlocks, kStaged, kBf16>;
  };
};

ffi::Error IndexerProjectionFusedImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> x,
                                      ffi::BufferR2<ffi::BF16> w_cat, ffi::BufferR3<ffi::BF16> q,
                                      ffi::BufferR1<ffi::F32> norm_weight,
                                      ffi::BufferR1<ffi::F32> norm_bias,
                                      ffi::Result<ffi::AnyBuffer> q_out,
                                      ffi::Result<ffi::AnyBuffer> w_out,
                                      ffi::ResultBufferR2<ffi::BF16> key,
                                      ffi::ResultBufferR2<ffi::BF16> gate, float scale, float eps,
                                      int32_t warps, bool pdl) {
  const Check check{targets::glm5_indexer_projection_fused};
  const auto xd = x.dimensions();
  const int64_t rows = xd[0], k = xd[1];
  const auto qd = q.dimensions();
  const int64_t heads = qd[1];
  if (qd[0] != rows || qd[2] != kDim || heads <= 0 || heads % kTileN != 0)
    return check.fail("q must be bf16[M, H, 128] with H % " + std::to_string(kTileN) + " == 0");
  const auto cd = w_cat.dimensions();
  if (cd[0] != 2 * kKeyRows + heads || cd[1] != k)
    return check.fail("w_cat must be bf16[256 + H, K]");
  const ffi::ErrorOr<int64_t> padded =
      check_query_buffers(check, norm_weight, norm_bias, q_out, w_out, rows, heads);
  if (padded.has_error()) return padded.error();
  const bool bf16_w_out = w_out->element_type() == ffi::DataType::BF16;
  const auto kd = key->dimensions(), gd = gate->dimensions();
  if (kd[0] != rows || kd[1] != kKeyRows || gd[0] != rows || gd[1] != kKeyRows)
    return check.fail("key and gate results must be bf16[M, 128]");
  const ffi::ErrorOr<gemm::Staging> st = gemm::check_tactic(check, k, warps, 1, 1);
  if (st.has_error()) return st.error();
  if (!aligned(x.untyped_data(), 16) || !aligned(w_cat.untyped_data(), 16) ||
      !aligned(q.untyped_data(), 8) || !aligned(norm_weight.untyped_data(), 16) ||
      !aligned(norm_bias.untyped_data(), 16) || !aligned(q_out->untyped_data(), 4) ||
      !aligned(key->untyped_data(), 16))
    return check.fail("operand buffers are not aligned (x, w_cat, norm params, key 16 B; "
                      "q 8 B; q_fp8 4 B)");
  if (rows == 0) return ffi::Error::Success();
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  if (chunks > 65535) return check.fail("too many rows for one grid");

  FusedArgs args;
  args.gemm = gemm::make_gemm(x.untyped_data(), w_cat.untyped_data(), rows, k, st->stages);
  args.q = reinterpret_cast<const uint16_t*>(q.untyped_data());
  args.norm_weight = norm_weight.typed_data();
  args.norm_bias = norm_bias.typed_data();
  args.q_out = reinterpret_cast<uint32_t*>(q_out->untyped_data());
  args.w_out = w_out->untyped_data();
  args.key = reinterpret_cast<uint16_t*>(key->untyped_data());
  args.gate = reinterpret_cast<uint16_t*>(gate->untyped_data());
  args.heads = static_cast<int32_t>(heads);
  args.padded = static_cast<int32_t>(*padded);
  args.scale = scale;
  args.eps = eps;

  const Kernel kernel = bf16_w_out
                            ? gemm::pick_kernel<Kernel, Pick<true>::Blocks>(*st)
                            : gemm::pick_kernel<Kernel, Pick<false>::Blocks>(*st);
  const size_t smem = gemm::partial_bytes(args.gemm, warps) +
                      sizeof(uint16_t) * args.gemm.chunk_pad * kTileN;
  if (cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess)
    return check.cuda(err);
  const int64_t tiles = cd[0] / kTileN;
  const dim3 grid(static_cast<unsigned>((tiles + kKeyTiles - 1) / kKeyTiles * kKeyTiles), 1,
                  static_cast<unsigned>(chunks));
  cudaError_t err = launch_cluster(kernel, grid, dim3(warps * kWarp), smem, stream,
                                   pdl, static_cast<unsigned>(kKeyTiles), args);
  return check.cuda(err);
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerProjectionFused, glm5::IndexerProjectionFusedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // x
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // w_cat
                                  .Arg<ffi::BufferR3<ffi::BF16>>()        // q
                                  .Arg<ffi::BufferR1<ffi::F32>>()         // norm_weight
                                  .Arg<ffi::BufferR1<ffi::F32>>()         // norm_bias
                                  .Ret<ffi::AnyBuffer>()                  // q_fp8 (e4m3)
                                  .Ret<ffi::AnyBuffer>()                  // w_out (f32 | bf16)
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // key
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // gate
                                  .Attr<float>("scale")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("warps")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
