// Warp-level Hadamard-128 + FP8 (e4m3) quantisation of one 128-dim row (SPEC §2b, the tail of
// §3), shared by kpool.cu (pooled keys) and query.cuh (queries).
//
// A warp owns one row; lane l owns dims 4l .. 4l+3 (one 8-byte bf16 load, one 4-byte fp8
// store). The arithmetic is the stock Triton kernels' PTX (SPEC §11.1), pinned with
// explicit-rounding intrinsics and inline asm so nvcc cannot contract or reassociate it:
//   Hadamard: 7 stages of add.rn / sub.rn (strides 1, 2 in-lane, 4..64 by shuffles)
//   y   = bf16(mul.rn(y, fp32(1/sqrt(128))))       amax via fmax (NaN ignored), floor 1e-4
//   v   = mul.rn(amax, fp32(1/448))                E = ceil(libdevice log2f(v))
//   q   = cvt.rn.satfinite.e4m3(fmin(fmax(div.full(y, scale), -448), 448))   (NaN -> -448)
// Build without fast math: log2f must stay libdevice's polynomial (not lg2.approx) and the
// bf16/e4m3 conversions round to nearest even.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "constants.h"

namespace glm5 {

constexpr int kPerLane = kDim / kWarp;    // 4 dims per lane (one warp per row)
constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint32_t kInvSqrtDimBits = 0x3DB504F3u;  // fp32(1/sqrt(128))
constexpr uint32_t kInvFp8MaxBits = 0x3B124925u;   // fp32(1/448)
constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

static_assert(kPerLane == 4, "a lane owns 4 dims: one 8-byte bf16 load, one 4-byte fp8 store");

// Triton's fp32 `/`.
__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// cvt.rn.bf16.f32 and back (exact).
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// Two fp32 -> e4m3 bytes (RNE, saturating): `lo` in the low (first) byte.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// bf16 bits -> f32 (exact): bf16 is the high half of an f32. A 32-bit word holds two bf16,
// the lower-addressed one in the low half.
__device__ __forceinline__ void widen4(uint2 w, float (&v)[kPerLane]) {
  v[0] = __uint_as_float(w.x << 16);
  v[1] = __uint_as_float(w.x & 0xffff0000u);
  v[2] = __uint_as_float(w.y << 16);
  v[3] = __uint_as_float(w.y & 0xffff0000u);
}

// The unnormalised Sylvester WHT of the warp's row, strides 1, 2, .., 64 in this order; the
// lower index of a pair gets a + b, the upper a - b (each RN32). Lane `lane` holds dims
// 4 lane .. 4 lane + 3 in x. The whole warp must be converged.
__device__ __forceinline__ void hadamard128(float (&x)[kPerLane], int lane) {
  // Strides 1 and 2 inside the lane: (a, b) -> (a + b, a - b).
#pragma unroll
  for (int stride = 1; stride <= 2; stride *= 2) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (i & stride) continue;
      const float lo = x[i], hi = x[i + stride];
      x[i] = __fadd_rn(lo, hi);
      x[i + stride] = __fsub_rn(lo, hi);
    }
  }
  // Strides 4..64 pair lane l with l ^ (stride / 4): the lower lane holds a and gets a + b,
  // the upper holds b and gets a - b. Both are RN(other + (+-mine)): IEEE a - b is a + (-b)
  // (signed zeros included) and + commutes, so flipping the sign bit keeps the warp converged.
#pragma unroll
  for (int shift = 0; shift < 5; ++shift) {
    const uint32_t flip = ((static_cast<uint32_t>(lane) >> shift) & 1u) << 31;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], 1 << shift);
      x[i] = __fadd_rn(other, __uint_as_float(__float_as_uint(x[i]) ^ flip));
    }
  }
}

// x = bf16(RN32(x * fp32(1/sqrt(128)))) in place; returns the row's amax over the warp
// (fmaxf: NaN entries are ignored), floored at 1e-4.
__device__ __forceinline__ float normalise_amax(float (&x)[kPerLane]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = round_bf16(__fmul_rn(x[i], __uint_as_float(kInvSqrtDimBits)));
    amax = fmaxf(amax, fabsf(x[i]));
  }
#pragma unroll
  for (int shift = 0; shift < 5; ++shift)
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1 << shift));
  return fmaxf(amax, kAmaxFloor);
}

// v = RN32(amax * fp32(1/448)): the plain scale.
__device__ __forceinline__ float plain_scale(float amax) {
  return __fmul_rn(amax, __uint_as_float(kInvFp8MaxBits));
}

// E = ceil(log2f(v)) with libdevice log2f (accurate; no fast math). Clamped so that an
// infinite v gives E = 128 (2^E bits 0x7F800000, as the reference's bit arithmetic) instead
// of overflowing.
__device__ __forceinline__ int scale_exponent(float v) {
  return static_cast<int>(fminf(fmaxf(ceilf(log2f(v)), -127.0f), 128.0f));
}

// The fp32 2^E from its exponent (bits (E + 127) << 23).
__device__ __forceinline__ float pow2_scale(int exponent) {
  return __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
}

// The lane's 4 e4m3 codes of x / scale, clamped to +-448 (fmax first: NaN -> -448), in one
// little-endian word (dim 4 lane in the low byte).
__device__ __forceinline__ uint32_t quantise4(const float (&x)[kPerLane], float scale) {
  float q[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    q[i] = fminf(fmaxf(div_full(x[i], scale), -kFp8Max), kFp8Max);
  return e4m3x2(q[0], q[1]) | (e4m3x2(q[2], q[3]) << 16);
}

}  // namespace glm5
