// indexer_query (SPEC §2): key LayerNorm (2a), q Hadamard + FP8 (2b), head-weight scaling
// (2c) and head padding (2d), in one launch.
//
// Work items, one warp each, CTAs of kWarps warps sized from the shapes only:
//   * warps [0, M * padded): the (token, head) row `row` of q_fp8 / w_out. Real heads
//     (h < H): lane l loads dims 4l..4l+3 (8 bytes), runs the shared Hadamard + FP8 of
//     hadamard_quant.cuh with the power-of-two scale 2^E (E = ceil(libdevice log2f(v))), stores
//     its 4 e4m3 codes as one word; lane 0 writes w_out = RN32(RN32(w * 2^E) * scale) (mul.rn,
//     no contraction), bf16 RNE when w_out is bf16. Padded heads (H <= h < padded) get zero
//     bytes and w_out = 0.
//   * warps [M * padded, M * padded + ceil(M / 2)): the key LayerNorm of two tokens, one per
//     half-warp; lane g of a half owns LayerNorm group g (dims 8g..8g+7, one 16-byte load).
//
// Key LayerNorm order (glm5_jax.reference.indexer.key_layernorm, the seed's grouped (mean, M2)
// combination), every step an explicit RN32 operation so nvcc cannot contract or reorder it:
//   mean_g = (((x0 + x1) + x2) + .. + x7) * 0.125
//   m2_g   = sequential sum over the group of (x_i - mean_g) * (x_i - mean_g)
//   mean   = (sequential sum over g = 0..15 of mean_g) * 0.0625
//   m2     = sequential sum over g of (m2_g + 8 * ((mean_g - mean) * (mean_g - mean)))
//   rstd   = rsqrtf(m2 * (1/128) + eps)                    (rsqrt.approx.f32, as XLA's rsqrt)
//   y      = bf16(((x - mean) * rstd) * w + b)             (multiply, then add: no FMA)
// The reference leaves the last multiply-add (and the squares' adds) to XLA, which may
// contract them on the GPU; SPEC D2 allows 1 bf16 ulp there. Everything else (q bytes, w_out)
// is bit-exact: the q path has no approximate function (division by 2^E is exact, log2f's
// M(e) rule is in the reference).
//
// Programmatic dependent launch: every input is read after pdl_wait().
#include <cuda_bf16.h>

#include <cstdint>
#include <limits>
#include <string>

#include "common.h"
#include "hadamard_quant.cuh"
#include "handlers.h"

namespace glm5 {
namespace {

constexpr int kWarps = 4;                       // warps per CTA
constexpr int kGroups = 16;                     // LayerNorm groups
constexpr int kGroupDims = kDim / kGroups;      // 8 dims per group
constexpr int kHalf = kLanes / 2;               // a half-warp per token

static_assert(kGroups == kHalf, "a half-warp lane owns one LayerNorm group");
static_assert(kGroupDims == 8, "a group is one 16-byte bf16 load");

struct QueryArgs {
  const uint16_t* q;            // bf16[M, H, 128]
  const uint16_t* key_raw;      // bf16[M, 128]
  const float* weights;         // f32[M, H]
  const float* norm_weight;     // f32[128]
  const float* norm_bias;       // f32[128]
  uint32_t* q_out;              // e4m3[M, padded, 128] as 32 words per row
  void* w_out;                  // f32 | bf16 [M, padded]
  uint16_t* key_out;            // bf16[M, 128]
  int64_t rows;                 // M * padded
  int64_t tokens;               // M
  int32_t heads;                // H
  int32_t padded;               // padded >= H
  float scale;
  float eps;
};

template <bool kBf16>
__device__ __forceinline__ void store_weight(const QueryArgs& a, int64_t row, float value) {
  if constexpr (kBf16)
    static_cast<__nv_bfloat16*>(a.w_out)[row] = __float2bfloat16_rn(value);
  else
    static_cast<float*>(a.w_out)[row] = value;
}

// q_fp8 / w_out of row `row` = (token t, head h).
template <bool kBf16>
__device__ __forceinline__ void query_row(const QueryArgs& a, int64_t row, int lane) {
  const int64_t t = row / a.padded;
  const int32_t h = static_cast<int32_t>(row - t * a.padded);
  uint32_t* const out = a.q_out + row * kLanes + lane;
  if (h >= a.heads) {  // padding head (SPEC 2d)
    *out = 0u;
    if (lane == 0) store_weight<kBf16>(a, row, 0.0f);
    return;
  }
  const int64_t src = t * a.heads + h;
  const float w = lane == 0 ? __ldg(a.weights + src) : 0.0f;
  float x[kPerLane];
  widen4(__ldg(reinterpret_cast<const uint2*>(a.q + src * kDim) + lane), x);

  hadamard128(x, lane);
  const int exponent = scale_exponent(plain_scale(normalise_amax(x)));
  const float q_scale = pow2_scale(exponent);
  *out = quantise4(x, q_scale);
  if (lane == 0) store_weight<kBf16>(a, row, __fmul_rn(__fmul_rn(w, q_scale), a.scale));
}

// Key LayerNorm of token 2 pair + (lane / 16); lane % 16 = group. All 32 lanes take part in
// the shuffles (width 16); a half past the last token loads and stores nothing.
__device__ __forceinline__ void key_norm(const QueryArgs& a, int64_t pair, int lane) {
  const int g = lane % kHalf;
  const int64_t t = 2 * pair + lane / kHalf;
  const bool live = t < a.tokens;
  float x[kGroupDims] = {};
  if (live) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(a.key_raw + t * kDim) + g);
    float lo[kPerLane], hi[kPerLane];
    widen4(make_uint2(raw.x, raw.y), lo);
    widen4(make_uint2(raw.z, raw.w), hi);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = lo[i], x[kPerLane + i] = hi[i];
  }

  float sum = x[0];
#pragma unroll
  for (int i = 1; i < kGroupDims; ++i) sum = __fadd_rn(sum, x[i]);
  const float mean_g = __fmul_rn(sum, 1.0f / kGroupDims);
  float d = __fsub_rn(x[0], mean_g);
  float m2_g = __fmul_rn(d, d);
#pragma unroll
  for (int i = 1; i < kGroupDims; ++i) {
    d = __fsub_rn(x[i], mean_g);
    m2_g = __fadd_rn(m2_g, __fmul_rn(d, d));
  }

  // Groups in order 0..15; every lane of the half computes the same sums.
  float mean = __shfl_sync(kFullMask, mean_g, 0, kHalf);
#pragma unroll
  for (int j = 1; j < kGroups; ++j) mean = __fadd_rn(mean, __shfl_sync(kFullMask, mean_g, j, kHalf));
  mean = __fmul_rn(mean, 1.0f / kGroups);
  const float dm = __fsub_rn(mean_g, mean);
  const float term = __fadd_rn(m2_g, __fmul_rn(static_cast<float>(kGroupDims), __fmul_rn(dm, dm)));
  float m2 = __shfl_sync(kFullMask, term, 0, kHalf);
#pragma unroll
  for (int j = 1; j < kGroups; ++j) m2 = __fadd_rn(m2, __shfl_sync(kFullMask, term, j, kHalf));
  const float rstd = rsqrtf(__fadd_rn(__fmul_rn(m2, 1.0f / kDim), a.eps));
  if (!live) return;

  float wb[2][kGroupDims];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float4* p = reinterpret_cast<const float4*>((k == 0 ? a.norm_weight : a.norm_bias) +
                                                      kGroupDims * g);
    const float4 u = __ldg(p), v = __ldg(p + 1);
    wb[k][0] = u.x, wb[k][1] = u.y, wb[k][2] = u.z, wb[k][3] = u.w;
    wb[k][4] = v.x, wb[k][5] = v.y, wb[k][6] = v.z, wb[k][7] = v.w;
  }
  uint32_t words[kGroupDims / 2];
#pragma unroll
  for (int i = 0; i < kGroupDims; i += 2) {
    float y[2];
#pragma unroll
    for (int k = 0; k < 2; ++k)
      y[k] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x[i + k], mean), rstd), wb[0][i + k]),
                       wb[1][i + k]);
    const __nv_bfloat162 pair2 = __floats2bfloat162_rn(y[0], y[1]);  // .x = y[0], low half
    words[i / 2] = *reinterpret_cast<const uint32_t*>(&pair2);
  }
  *(reinterpret_cast<uint4*>(a.key_out + t * kDim) + g) =
      make_uint4(words[0], words[1], words[2], words[3]);
}

template <bool kBf16>
__global__ void __launch_bounds__(kWarps * kLanes) indexer_query_kernel(const QueryArgs a) {
  const int lane = threadIdx.x % kLanes;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion before reading
  if (warp < a.rows) {
    query_row<kBf16>(a, warp, lane);
  } else {
    const int64_t pair = warp - a.rows;
    if (2 * pair < a.tokens) key_norm(a, pair, lane);
  }
}

ffi::Error IndexerQueryImpl(cudaStream_t stream, ffi::BufferR3<ffi::BF16> q,
                            ffi::BufferR2<ffi::BF16> key_raw, ffi::BufferR2<ffi::F32> weights,
                            ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
                            ffi::Result<ffi::AnyBuffer> q_out,
                            ffi::Result<ffi::AnyBuffer> w_out,
                            ffi::ResultBufferR2<ffi::BF16> key_out, float scale, float eps) {
  auto fail = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("glm5_indexer_query: ") + what);
  };
  const auto qd = q.dimensions();
  const int64_t tokens = qd[0], heads = qd[1];
  if (qd[2] != kDim) return fail("q must be bf16[M, H, 128]");
  const auto kd = key_raw.dimensions();
  if (kd[0] != tokens || kd[1] != kDim) return fail("key_raw must be bf16[M, 128]");
  const auto wd = weights.dimensions();
  if (wd[0] != tokens || wd[1] != heads) return fail("weights must be f32[M, H]");
  if (norm_weight.dimensions()[0] != kDim || norm_bias.dimensions()[0] != kDim)
    return fail("norm_weight and norm_bias must be f32[128]");
  // e4m3 has no native C++ type in the FFI headers: q_fp8 is bound as an AnyBuffer.
  const auto od = q_out->dimensions();
  if (q_out->element_type() != ffi::DataType::F8E4M3FN || od.size() != 3 || od[0] != tokens ||
      od[1] < heads || od[2] != kDim)
    return fail("q_fp8 result must be e4m3[M, padded >= H, 128]");
  const int64_t padded = od[1];
  const auto wod = w_out->dimensions();
  const ffi::DataType wtype = w_out->element_type();
  if (wtype != ffi::DataType::F32 && wtype != ffi::DataType::BF16)
    return fail("w_out result must be f32 or bf16");
  if (wod.size() != 2 || wod[0] != tokens || wod[1] != padded)
    return fail("w_out result must have shape [M, padded]");
  const auto kod = key_out->dimensions();
  if (kod[0] != tokens || kod[1] != kDim) return fail("key result must be bf16[M, 128]");
  if (padded > std::numeric_limits<int32_t>::max()) return fail("too many heads");
  // Vector accesses (XLA buffers are at least 16 B aligned; checked so that a violation fails
  // here, not as a device fault).
  if (!aligned(q.untyped_data(), 8) || !aligned(key_raw.untyped_data(), 16) ||
      !aligned(norm_weight.untyped_data(), 16) || !aligned(norm_bias.untyped_data(), 16) ||
      !aligned(q_out->untyped_data(), 4) || !aligned(key_out->untyped_data(), 16))
    return fail("operand buffers are not aligned (q 8 B; key_raw, norm params, key 16 B; "
                "q_fp8 4 B)");
  if (tokens == 0) return ffi::Error::Success();
  const int64_t rows = tokens * padded;
  const int64_t warps = rows + (tokens + 1) / 2;
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  if (blocks > std::numeric_limits<int32_t>::max()) return fail("too many rows for one grid");

  QueryArgs args;
  args.q = reinterpret_cast<const uint16_t*>(q.untyped_data());
  args.key_raw = reinterpret_cast<const uint16_t*>(key_raw.untyped_data());
  args.weights = weights.typed_data();
  args.norm_weight = norm_weight.typed_data();
  args.norm_bias = norm_bias.typed_data();
  args.q_out = reinterpret_cast<uint32_t*>(q_out->untyped_data());
  args.w_out = w_out->untyped_data();
  args.key_out = reinterpret_cast<uint16_t*>(key_out->untyped_data());
  args.rows = rows;
  args.tokens = tokens;
  args.heads = static_cast<int32_t>(heads);
  args.padded = static_cast<int32_t>(padded);
  args.scale = scale;
  args.eps = eps;

  auto kernel = wtype == ffi::DataType::BF16 ? indexer_query_kernel<true>
                                             : indexer_query_kernel<false>;
  cudaError_t err = launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kWarps * kLanes), 0,
                           stream, /*pdl=*/true, args);
  return cuda_status("glm5_indexer_query", err);
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerQuery, glm5::IndexerQueryImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR3<ffi::BF16>>()        // q
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // key_raw
                                  .Arg<ffi::BufferR2<ffi::F32>>()         // weights
                                  .Arg<ffi::BufferR1<ffi::F32>>()         // norm_weight
                                  .Arg<ffi::BufferR1<ffi::F32>>()         // norm_bias
                                  .Ret<ffi::AnyBuffer>()                  // q_fp8 (e4m3)
                                  .Ret<ffi::AnyBuffer>()                  // w_out (f32 | bf16)
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // key
                                  .Attr<float>("scale")
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});
