// The query epilogue's arithmetic (SPEC §2), shared by query.cu (indexer_query) and
// projection_fused.cu (indexer_projection_fused) so that both give the same bits from the same
// inputs.
//
// q row (2b, 2c): a warp runs the Hadamard + FP8 of hadamard_quant.cuh with the power-of-two
// scale 2^E (E = ceil(libdevice log2f(v))) on one (token, head) row, lane l storing the 4 e4m3
// codes of dims 4l..4l+3 as one word; w_out = RN32(RN32(w * 2^E) * scale) (mul.rn, no
// contraction), bf16 RNE when w_out is bf16. Padded heads get zero bytes and w_out = 0 (2d).
//
// Key LayerNorm (2a) of one token by a half-warp, lane g owning group g (dims 8g..8g+7), in the
// order of glm5_jax.reference.indexer.key_layernorm (the seed's grouped (mean, M2)
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
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common.h"
#include "constants.h"
#include "hadamard_quant.cuh"

namespace glm5 {

constexpr int kGroups = 16;                     // LayerNorm groups
constexpr int kGroupDims = kDim / kGroups;      // 8 dims per group
constexpr int kHalf = kWarp / 2;               // a half-warp per token

static_assert(kGroups == kHalf, "a half-warp lane owns one LayerNorm group");
static_assert(kGroupDims == 8, "a group is one 16-byte bf16 load");

// w_out[q_row] (f32 | bf16 [M, padded]) = value.
template <bool kBf16>
__device__ __forceinline__ void store_w_out(void* w_out, int64_t q_row, float value) {
  if constexpr (kBf16)
    static_cast<__nv_bfloat16*>(w_out)[q_row] = __float2bfloat16_rn(value);
  else
    static_cast<float*>(w_out)[q_row] = value;
}

// The lane's 8 bytes (dims 4 lane .. 4 lane + 3) of a head's q bf16[128].
__device__ __forceinline__ uint2 load_query(const uint16_t* q, int lane) {
  return __ldg(reinterpret_cast<const uint2*>(q) + lane);
}

// q row `q_row` of q_fp8 (e4m3[M, padded, 128] as 32 words per row) and w_out from the head's
// q (the lane's load_query words) and head weight w (used by lane 0). The whole warp must be
// converged.
template <bool kBf16>
__device__ __forceinline__ void query_row(uint2 q, float w, uint32_t* q_out, void* w_out,
                                          int64_t q_row, float scale, int lane) {
  float x[kPerLane];
  widen4(q, x);
  hadamard128(x, lane);
  const float q_scale = pow2_scale(scale_exponent(plain_scale(normalise_amax(x))));
  q_out[q_row * kWarp + lane] = quantise4(x, q_scale);
  if (lane == 0) store_w_out<kBf16>(w_out, q_row, __fmul_rn(__fmul_rn(w, q_scale), scale));
}

// A padding head's q row (SPEC 2d): zero bytes, w_out = 0.
template <bool kBf16>
__device__ __forceinline__ void zero_row(uint32_t* q_out, void* w_out, int64_t q_row, int lane) {
  q_out[q_row * kWarp + lane] = 0u;
  if (lane == 0) store_w_out<kBf16>(w_out, q_row, 0.0f);
}

// lo and hi as one word of two bf16 (lo in the low half), each rounded to nearest even.
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x = lo, low half
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The LayerNorm of a half-warp's token: `raw` = its group's 8 bf16 (lane % 16 = group g), the
// result the group's 8 bf16 outputs. All 32 lanes take part in the shuffles (width 16); a half
// without a token passes any raw value and ignores the result.
__device__ __forceinline__ uint4 layernorm_group(uint4 raw, const float* norm_weight,
                                                 const float* norm_bias, float eps, int lane) {
  const int g = lane % kHalf;
  float lo[kPerLane], hi[kPerLane], x[kGroupDims];
  widen4(make_uint2(raw.x, raw.y), lo);
  widen4(make_uint2(raw.z, raw.w), hi);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] = lo[i], x[kPerLane + i] = hi[i];

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
  for (int j = 1; j < kGroups; ++j)
    mean = __fadd_rn(mean, __shfl_sync(kFullMask, mean_g, j, kHalf));
  mean = __fmul_rn(mean, 1.0f / kGroups);
  const float dm = __fsub_rn(mean_g, mean);
  const float term = __fadd_rn(m2_g, __fmul_rn(static_cast<float>(kGroupDims), __fmul_rn(dm, dm)));
  float m2 = __shfl_sync(kFullMask, term, 0, kHalf);
#pragma unroll
  for (int j = 1; j < kGroups; ++j) m2 = __fadd_rn(m2, __shfl_sync(kFullMask, term, j, kHalf));
  const float rstd = rsqrtf(__fadd_rn(__fmul_rn(m2, 1.0f / kDim), eps));

  float wb[2][kGroupDims];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float4* p = reinterpret_cast<const float4*>((k == 0 ? norm_weight : norm_bias) +
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
    words[i / 2] = bf16_pair(y[0], y[1]);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Checks the LayerNorm parameters f32[128] and the results q_fp8 e4m3[M, padded >= H, 128]
// and w_out f32 | bf16 [M, padded] of M = `rows`; returns padded.
inline ffi::ErrorOr<int64_t> check_query_buffers(const Check& check,
                                                 ffi::BufferR1<ffi::F32>& norm_weight,
                                                 ffi::BufferR1<ffi::F32>& norm_bias,
                                                 ffi::Result<ffi::AnyBuffer>& q_out,
                                                 ffi::Result<ffi::AnyBuffer>& w_out, int64_t rows,
                                                 int64_t heads) {
  if (norm_weight.dimensions()[0] != kDim || norm_bias.dimensions()[0] != kDim)
    return ffi::Unexpected(check.fail("norm_weight and norm_bias must be f32[128]"));
  // e4m3 has no native C++ type in the FFI headers: q_fp8 is bound as an AnyBuffer.
  const auto od = q_out->dimensions();
  if (q_out->element_type() != ffi::DataType::F8E4M3FN || od.size() != 3 || od[0] != rows ||
      od[1] < heads || od[2] != kDim)
    return ffi::Unexpected(check.fail("q_fp8 result must be e4m3[M, padded >= H, 128]"));
  const int64_t padded = od[1];
  const auto wod = w_out->dimensions();
  const ffi::DataType wtype = w_out->element_type();
  if (wtype != ffi::DataType::F32 && wtype != ffi::DataType::BF16)
    return ffi::Unexpected(check.fail("w_out result must be f32 or bf16"));
  if (wod.size() != 2 || wod[0] != rows || wod[1] != padded)
    return ffi::Unexpected(check.fail("w_out result must have shape [M, padded]"));
  if (padded > kI32Max) return ffi::Unexpected(check.fail("too many heads"));
  return padded;
}


// indexer_query's launch (query.cu) as a checked plan and its stream work, so that
// glm5_indexer_query and glm5_indexer_update (update.cu) launch the kernel by one rule.
struct QueryArgs {
  const uint16_t* q;            // bf16[M, H, 128]
  const uint16_t* key_raw;      // bf16[M, 128]
  const float* head_w;          // f32[M, H]
  const float* norm_weight;     // f32[128]
  const float* norm_bias;       // f32[128]
  // update_epilogue: the projection's f32 sums [M, 256 + H] (key | head_w | gate columns),
  // read in place of key_raw, head_w and gate (null then), rounded to bf16 on load as XLA's
  // convert rounds them (RNE). Null everywhere else.
  const float* raw = nullptr;
  uint32_t* q_out;              // e4m3[M, padded, 128] as 32 words per row
  void* w_out;                  // f32 | bf16 [M, padded]
  uint16_t* key_out;            // bf16[M, 128]
  int64_t q_rows;               // M * padded
  int64_t rows;                 // M
  int32_t heads;                // H
  Divisor padded;               // padded >= H (1 where padded = 0: no q rows then)
  float scale;
  float eps;
};

struct QueryLaunch {
  QueryArgs args;
  void (*kernel)(QueryArgs) = nullptr;  // null: no rows, nothing to launch
  unsigned blocks = 0;
  bool bf16_w_out = false;              // w_out is bf16 (else f32)
};

// The kernels' work items over QueryArgs, shared by indexer_query's kernel (query.cu) and
// indexer_update's epilogue (kpool.cu), so that both write the same bits.

// Row t of the projection's sums (QueryArgs::raw): 256 + H floats.
__device__ __forceinline__ const float* raw_row(const QueryArgs& a, int64_t t) {
  return a.raw + t * (2 * kDim + a.heads);
}

// Four f32 sums as two bf16 words (bf16_pair), RNE: the bits of XLA's convert of the sums
// (indexer_projection's reference), which the kernels that read bf16 results see.
__device__ __forceinline__ uint2 bf16_quad(const float* p) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  return make_uint2(bf16_pair(v.x, v.y), bf16_pair(v.z, v.w));
}

// q_fp8 / w_out of q row `q_row` = (token t, head h). kRaw: the head weight from the
// projection's sums (QueryArgs::raw).
template <bool kBf16, bool kRaw = false>
__device__ __forceinline__ void head_row(const QueryArgs& a, int64_t q_row, int lane) {
  // (token, head) of the row, by the Divisor where the q rows fit int32 (any real batch): a
  // 64-bit `/` is a call, ~20 instructions on its 32-bit path, before the row's loads.
  const int64_t t = q_row <= kI32Max ? a.padded.div(static_cast<int32_t>(q_row))
                                     : q_row / a.padded.d;
  const int32_t h = static_cast<int32_t>(q_row - t * a.padded.d);
  if (h >= a.heads) {  // padding head
    zero_row<kBf16>(a.q_out, a.w_out, q_row, lane);
    return;
  }
  const int64_t src = t * a.heads + h;
  float w = 0.0f;
  if (lane == 0) w = kRaw ? __ldg(raw_row(a, t) + kDim + h) : __ldg(a.head_w + src);
  query_row<kBf16>(load_query(a.q + src * kDim, lane), w, a.q_out, a.w_out, q_row, a.scale, lane);
}

// Key LayerNorm of token row t by a half-warp (lane % 16 = group g; the whole warp calls it,
// one token per half): writes the group's 8 outputs to the key result and returns them. A half
// that is not `live` loads and stores nothing (its result is meaningless).
// kRaw: key_raw rounded from the projection's sums (QueryArgs::raw).
template <bool kRaw = false>
__device__ __forceinline__ uint4 key_norm(const QueryArgs& a, int64_t t, bool live, int lane) {
  const int g = lane % kHalf;
  uint4 raw = make_uint4(0u, 0u, 0u, 0u);
  if (live && kRaw) {
    const float* p = raw_row(a, t) + kGroupDims * g;
    const uint2 lo = bf16_quad(p), hi = bf16_quad(p + kPerLane);
    raw = make_uint4(lo.x, lo.y, hi.x, hi.y);
  } else if (live) {
    raw = __ldg(reinterpret_cast<const uint4*>(a.key_raw + t * kDim) + g);
  }
  const uint4 y = layernorm_group(raw, a.norm_weight, a.norm_bias, a.eps, lane);
  if (live) *(reinterpret_cast<uint4*>(a.key_out + t * kDim) + g) = y;
  return y;
}

// Validates the buffers; no stream work.
ffi::ErrorOr<QueryLaunch> prepare_query(const Check& check, ffi::BufferR3<ffi::BF16> q,
                                        ffi::BufferR2<ffi::BF16> key_raw,
                                        ffi::BufferR2<ffi::F32> head_w,
                                        ffi::BufferR1<ffi::F32> norm_weight,
                                        ffi::BufferR1<ffi::F32> norm_bias,
                                        ffi::Result<ffi::AnyBuffer> q_out,
                                        ffi::Result<ffi::AnyBuffer> w_out,
                                        ffi::ResultBufferR2<ffi::BF16> key_out, float scale,
                                        float eps);

cudaError_t launch_query(cudaStream_t stream, bool pdl, const QueryLaunch& plan);

}  // namespace glm5
