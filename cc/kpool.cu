// kpool_update (SPEC §3): per request, in token order, stash each token's key and gate in
// the request's tail ring and, when a token completes a pool (pos % 4 == 3), softmax-pool the
// pool's four tokens, rotate (Hadamard-128), quantise to e4m3 and write the entry at `loc`.
//
// One warp per request (grid B, block 32); lane l owns head dims 4l .. 4l+3, so a lane only
// ever reads back tail words it wrote itself. The arithmetic is the stock Triton kernel's PTX
// (SPEC §11.1), pinned with explicit-rounding intrinsics and inline asm so nvcc cannot
// contract or reassociate it:
//   z   = add.rn(gate, ape)                        e = ex2.approx(mul.rn(sub.rn(z, max), LOG2E))
//   den = add.rn chain from 0                      acc = fma.rn chain from +0
//   y   = bf16(div.full(acc, den))
// then the Hadamard + FP8 quantisation of hadamard_quant.cuh (shared with query.cuh).
// Build without fast math: log2f must stay libdevice's polynomial (not lg2.approx) and the
// bf16/e4m3 conversions round to nearest even.
//
// Project decisions (glm5_jax.reference.kpool, SPEC D4): padding (pos < 0) touches nothing; a
// tail block >= the number of blocks makes the token a no-op; tslot < 0 pools block 0's rows
// and stashes nothing; slots outside the cache are never written; the ring row comes from
// pos % RING. Requests must own distinct tail blocks (warps run concurrently).
//
// kpool_compress (SPEC §4a, prefill): the same entry from four given tokens per candidate row,
// written where write_mask and 0 <= loc < capacity (glm5_jax.reference.kpool.write_entries).
// One warp per row (kCompressWarps rows per CTA), lane l again owns dims 4l .. 4l+3, and the
// pooling and store are kpool_update's own code (pool_and_write), so both kernels write the
// same bytes for the same tokens. Rows must target distinct slots (warps run concurrently; the
// reference's scatter leaves duplicate slots unspecified too).
#include <cuda_bf16.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common.h"
#include "constants.h"
#include "hadamard_quant.cuh"
#include "handlers.h"
#include "kpool.cuh"
#include "query.cuh"

namespace glm5 {
namespace {


// Scale slot format (SPEC §0.1, D3).
enum class ScaleMode { kPow2Fp32, kPow2Ue8m0, kPlainFp32 };

// pick(std::integral_constant<ScaleMode, mode>{}) for the mode of the ops' attributes
// round_scale and ue8m0 (SPEC §0.1): how kpool_update and kpool_compress choose their
// kernel instantiation.
template <typename Pick>
auto by_scale_mode(bool round_scale, bool ue8m0, Pick pick) {
  using Plain = std::integral_constant<ScaleMode, ScaleMode::kPlainFp32>;
  using Ue8m0 = std::integral_constant<ScaleMode, ScaleMode::kPow2Ue8m0>;
  using Pow2 = std::integral_constant<ScaleMode, ScaleMode::kPow2Fp32>;
  return !round_scale ? pick(Plain{}) : ue8m0 ? pick(Ue8m0{}) : pick(Pow2{});
}

// In place: the lowerings alias each cache result with its operand. Where XLA does not
// honour the alias, the result starts as a copy of the operand (stream-ordered,
// graph-capturable), also when there is no row to write; `copied` is set when it does, and
// the kernel, which only touches the result, then runs without PDL.
cudaError_t copy_unaliased(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                           bool& copied) {
  if (dst == src || bytes == 0) return cudaSuccess;
  copied = true;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

// ---------------------------------------------------------------------------------------------
// Arithmetic with pinned PTX.

// Triton's fp32 tl.exp(z - max): the difference and the product with log2(e) each rounded,
// then ex2.approx (non-ftz).
__device__ __forceinline__ float exp_shifted(float z, float peak) {
  float r;
  asm("{\n\t.reg .f32 d;\n\t"
      "sub.rn.f32 d, %1, %2;\n\t"
      "mul.rn.f32 d, d, 0f3FB8AA3B;\n\t"
      "ex2.approx.f32 %0, d;\n\t}"
      : "=f"(r)
      : "f"(z), "f"(peak));
  return r;
}

// Single-rounding a*b + c; asm so that fma(e, k, +0) is not folded into a multiply
// (a -0 product must give +0, as the stock fma chain from 0 does).
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}

// ---------------------------------------------------------------------------------------------
// The four APE rows of the lane's dims (one 16-byte load per pool slot).
// kEarly: for before the PDL wait (load_before_wait).
template <bool kEarly = false>
__device__ __forceinline__ void load_bias(const float* ape, int dim,
                                          float (&bias)[kPool][kPerLane]) {
#pragma unroll
  for (int p = 0; p < kPool; ++p) {
    const float4* const row = reinterpret_cast<const float4*>(ape + p * kDim + dim);
    const float4 b = kEarly ? load_before_wait(row) : __ldg(row);
    bias[p][0] = b.x, bias[p][1] = b.y, bias[p][2] = b.z, bias[p][3] = b.w;
  }
}

// The pooling, Hadamard, quantisation and store of one K-cache entry (SPEC §3's completion
// branch, §4a), shared by kpool_update and kpool_compress so that both write the same bytes
// for the same four tokens: the warp's keys k and gates z (pool order, the lane's dims; z is
// overwritten) with the APE `bias`, written at flat slot `loc` of a cache of `page_entries`
// entries per page.
template <ScaleMode kMode>
__device__ __forceinline__ void pool_and_write(uint8_t* cache, const Divisor& page_entries,
                                               const float (&k)[kPool][kPerLane],
                                               float (&z)[kPool][kPerLane],
                                               const float (&bias)[kPool][kPerLane],
                                               int32_t loc, int lane) {
  float x[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    float peak = -INFINITY;
#pragma unroll
    for (int p = 0; p < kPool; ++p) {
      z[p][e] = __fadd_rn(z[p][e], bias[p][e]);
      peak = fmaxf(peak, z[p][e]);
    }
    float den = 0.0f, acc = 0.0f;
#pragma unroll
    for (int p = 0; p < kPool; ++p) {  // pool order
      const float prob = exp_shifted(z[p][e], peak);
      den = __fadd_rn(den, prob);
      acc = fma_rn(prob, k[p][e], acc);
    }
    x[e] = round_bf16(div_full(acc, den));
  }

  hadamard128(x, lane);
  const float v = plain_scale(normalise_amax(x));
  const int exponent = scale_exponent(v);
  const float scale = kMode == ScaleMode::kPlainFp32 ? v : pow2_scale(exponent);
  const uint32_t packed = quantise4(x, scale);

  // Flat slot -> (page, entry) (0 <= loc < capacity); byte offsets in 64 bits.
  const int64_t page = page_entries.d;
  uint8_t* const page_base =
      cache + static_cast<int64_t>(page_entries.div(loc)) * (page * kEntryBytes);
  const int64_t entry = page_entries.mod(loc);
  *reinterpret_cast<uint32_t*>(page_base + entry * kDim + kPerLane * lane) = packed;
  if (lane == 0) {
    const uint32_t bits = kMode == ScaleMode::kPow2Ue8m0
                              ? static_cast<uint32_t>(exponent + 127) * 0x01010101u
                              : __float_as_uint(scale);
    *reinterpret_cast<uint32_t*>(page_base + page * kDim + entry * 4) = bits;
  }
}

// SPEC §3's completion branch in two halves, so that a caller can overlap the ring loads
// with other work (update_request's LayerNorm): the three ring rows start .. start + 2 of the
// tail block at `block` (the lane's dims; stashed by earlier tokens), then their pooling with
// the current token (kw, gw) into entry `loc`.
struct RingRows {
  uint2 key[kPool - 1], gate[kPool - 1];
};

__device__ __forceinline__ RingRows load_ring(const UpdateArgs& a, const uint16_t* block,
                                              int32_t start) {
  const int64_t half = static_cast<int64_t>(a.ring.d) * kDim;  // key rows -> gate rows
  RingRows r;
#pragma unroll
  for (int p = 0; p < kPool - 1; ++p) {
    const int64_t row = static_cast<int64_t>(a.ring.mod(start + p)) * kDim;
    r.key[p] = *reinterpret_cast<const uint2*>(block + row);
    r.gate[p] = *reinterpret_cast<const uint2*>(block + half + row);
  }
  return r;
}

template <ScaleMode kMode>
__device__ __forceinline__ void pool_ring(const UpdateArgs& a, const RingRows& r, uint2 kw,
                                          uint2 gw, const float (&bias)[kPool][kPerLane],
                                          int32_t loc, int lane) {
  float k[kPool][kPerLane], z[kPool][kPerLane];
#pragma unroll
  for (int p = 0; p < kPool - 1; ++p) {  // slots 0..2 from the ring
    widen4(r.key[p], k[p]);
    widen4(r.gate[p], z[p]);
  }
  widen4(kw, k[kPool - 1]);  // slot 3: the current token, from registers
  widen4(gw, z[kPool - 1]);
  pool_and_write<kMode>(a.cache, a.page, k, z, bias, loc, lane);
}

// What one token of the warp's request does (SPEC §3's token body), from its warp-uniform pos,
// loc and tslot: pool (completes) and stash (stashes; after the completion's ring reads) in
// the tail block at `block` (the lane's dims). Padding and a tail block past the buffer do
// neither. Predicates, not an early return: after a return ptxas issued the loads of loc, key
// and gate only once pos and tslot had arrived (SASS), one more load latency at next_n = 1.
struct TokenPlan {
  uint16_t* block;
  bool completes, stashes;
};

__device__ __forceinline__ TokenPlan plan_token(const UpdateArgs& a, int32_t pos, int32_t loc,
                                                int32_t tslot, int lane) {
  const int64_t blk = a.ring.div(max(tslot, 0));
  const bool live = pos >= 0 && blk < a.blocks;
  return {a.tail + blk * 2 * static_cast<int64_t>(a.ring.d) * kDim + kPerLane * lane,
          live && loc >= 0 && loc < a.capacity && pos % kPool == kPool - 1,
          live && tslot >= 0};
}

// The token's stash: its key and gate quads into ring row pos % RING.
__device__ __forceinline__ void stash(const UpdateArgs& a, const TokenPlan& t, int32_t pos,
                                      uint2 kw, uint2 gw) {
  const int64_t row = static_cast<int64_t>(a.ring.mod(pos)) * kDim;
  *reinterpret_cast<uint2*>(t.block + row) = kw;
  *reinterpret_cast<uint2*>(t.block + static_cast<int64_t>(a.ring.d) * kDim + row) = gw;
}

// Whether a request warp takes the single-token path (decode without speculative tokens,
// kpool_update's and the epilogue's): key and gate stay in registers, nothing is staged.
__host__ __device__ constexpr bool single_token(int64_t next_n) { return next_n == 1; }

// Dynamic shared memory of a request's warp: the key/gate quads of up to 32 of its tokens
// (none on the single-token path).
__host__ __device__ constexpr size_t stage_bytes(int64_t next_n) {
  if (single_token(next_n)) return 0;
  return 2 * static_cast<size_t>(next_n < kWarp ? next_n : kWarp) * kWarp * sizeof(uint2);
}

// The lane's key quad of [B, N] row `row` (dims `dim` .. dim + 3), from the key operand
// (kpool_update's; the epilogue computes its key instead).
__device__ __forceinline__ uint2 key_quad(const UpdateArgs& a, int64_t row, int dim) {
  return __ldg(reinterpret_cast<const uint2*>(a.key + row * kDim + dim));
}

// The lane's gate quad of row `row`: from the gate operand, or with kRaw rounded from the
// projection's sums (update_epilogue: QueryArgs::raw's gate columns).
template <bool kRaw>
__device__ __forceinline__ uint2 gate_quad(const UpdateArgs& a, const QueryArgs* norm,
                                           int64_t row, int dim) {
  if constexpr (kRaw) return bf16_quad(raw_row(*norm, row) + kDim + norm->heads + dim);
  return __ldg(reinterpret_cast<const uint2*>(a.gate + row * kDim + dim));
}

// One token of the warp's request: its indices, and its key and gate quads kw, gw.
template <ScaleMode kMode>
__device__ __forceinline__ void update_token(const UpdateArgs& a,
                                             const float (&bias)[kPool][kPerLane], int32_t pos,
                                             int32_t loc, int32_t tslot, uint2 kw, uint2 gw,
                                             int lane) {
  const TokenPlan t = plan_token(a, pos, loc, tslot, lane);
  if (t.completes)
    pool_ring<kMode>(a, load_ring(a, t.block, pos - (kPool - 1)), kw, gw, bias, loc, lane);
  if (t.stashes) stash(a, t, pos, kw, gw);
}

// A single-token request's operands that none of the GEMMs writes: its APE rows, its plan
// (from pos, loc and tslot) and, when the token completes a pool, the three ring rows it pools
// with (weak loads: they stay before a PDL wait). kEarly: loaded before the wait.
struct TokenOperands {
  int32_t pos, loc;
  TokenPlan t;
  RingRows ring;
  float bias[kPool][kPerLane];
};

template <bool kEarly>
__device__ __forceinline__ TokenOperands token_operands(const UpdateArgs& a, int32_t pos,
                                                        int32_t loc, int32_t tslot, int lane) {
  TokenOperands o;
  o.pos = pos;
  o.loc = loc;
  load_bias<kEarly>(a.ape, kPerLane * lane, o.bias);
  o.t = plan_token(a, pos, loc, tslot, lane);
  o.ring = {};
  if (o.t.completes) o.ring = load_ring(a, o.t.block, pos - (kPool - 1));
  return o;
}

// Request `req`'s indices, then token_operands: every load of a single-token request that
// does not read a GEMM's result, for before the PDL wait.
__device__ __forceinline__ TokenOperands request_operands(const UpdateArgs& a, int64_t req,
                                                          int lane) {
  const int32_t pos = load_before_wait(a.pos + req), loc = load_before_wait(a.loc + req);
  return token_operands<true>(a, pos, loc, load_before_wait(a.tslot + req), lane);
}

// The single-token request `req` from its operands o and its key and gate quads kw, gw (with
// kNorm the key from the key LayerNorm of `norm`'s key_raw row instead: kw unused).
template <ScaleMode kMode, bool kNorm, bool kRaw>
__device__ __forceinline__ void update_single(const UpdateArgs& a, const QueryArgs* norm,
                                              int64_t req, int lane, const TokenOperands& o,
                                              uint2 kw, uint2 gw) {
  if constexpr (kNorm) {
    const uint4 y = key_norm<kRaw>(*norm, req, lane < kHalf, lane);
    const int src = lane / 2;
    const uint32_t x0 = __shfl_sync(kFullMask, y.x, src), x1 = __shfl_sync(kFullMask, y.y, src);
    const uint32_t x2 = __shfl_sync(kFullMask, y.z, src), x3 = __shfl_sync(kFullMask, y.w, src);
    kw = lane % 2 == 0 ? make_uint2(x0, x1) : make_uint2(x2, x3);
  }
  if (o.t.completes) pool_ring<kMode>(a, o.ring, kw, gw, o.bias, o.loc, lane);
  if (o.t.stashes) stash(a, o.t, o.pos, kw, gw);
}

// Request `req`'s tokens in t order, by one warp (`staged`: its stage_bytes(next_n) of shared
// memory). The key quads come from the key operand (kpool_update), or with kNorm from the key
// LayerNorm of `norm`'s key_raw rows, also written to its key result (indexer_update's
// epilogue: query.cuh's key_norm, the bits indexer_query writes). With kRaw (update_epilogue,
// kNorm too) key_raw and the gate are rounded from `norm`'s projection sums (QueryArgs::raw).
template <ScaleMode kMode, bool kNorm, bool kRaw = false>
__device__ __forceinline__ void update_request(const UpdateArgs& a, const QueryArgs* norm,
                                               int64_t req, int lane, uint2* staged) {
  const int dim = kPerLane * lane;
  if (single_token(a.next_n)) {
    // Decode without speculative tokens: one token, so nothing is staged. Every lane loads the
    // indices itself (a broadcast each), its gate (and key) quads and the APE rows, all in
    // flight before the first use, then a completion's ring rows. With kNorm those load during
    // the key LayerNorm (half-warp 0, key_norm: indexer_query's bits), whose shuffle chains
    // hide their latency; lane l then takes dims 4l .. 4l + 3 from group l / 2's lane.
    const int32_t pos = __ldg(a.pos + req), loc = __ldg(a.loc + req);
    const int32_t tslot = __ldg(a.tslot + req);
    uint2 kw = make_uint2(0u, 0u);
    if constexpr (!kNorm) kw = key_quad(a, req, dim);
    const uint2 gw = gate_quad<kRaw>(a, norm, req, dim);
    update_single<kMode, kNorm, kRaw>(a, norm, req, lane,
                                      token_operands<false>(a, pos, loc, tslot, lane), kw, gw);
    return;
  }
  const int64_t first = req * a.next_n;  // [B, N] row of req
  float bias[kPool][kPerLane];
  load_bias(a.ape, dim, bias);
  // [key | gate][token of the chunk][lane]: 2 * chunk * 32 quads (stage_bytes()).
  const int chunk = min(kWarp, a.next_n);

  for (int32_t t0 = 0; t0 < a.next_n; t0 += kWarp) {
    // Lane u fetches token t0 + u's indices; the token loop broadcasts them.
    int32_t my_pos = -1, my_loc = -1, my_tslot = -1;
    if (t0 + lane < a.next_n) {
      my_pos = __ldg(a.pos + first + t0 + lane);
      my_loc = __ldg(a.loc + first + t0 + lane);
      my_tslot = __ldg(a.tslot + first + t0 + lane);
    }
    const int count = min(kWarp, a.next_n - t0);
    // Stage the chunk's key/gate quads in shared memory with all loads in flight at once;
    // the token loop then waits on global memory only for the ring rows of completions.
#pragma unroll 4
    for (int u = 0; u < count; ++u) {
      if constexpr (!kNorm) staged[u * kWarp + lane] = key_quad(a, first + t0 + u, dim);
      staged[(chunk + u) * kWarp + lane] = gate_quad<kRaw>(a, norm, first + t0 + u, dim);
    }
    if constexpr (kNorm) {
      // Two tokens a step, a half-warp each: group g (dims 8g .. 8g + 7) is the quads of
      // lanes 2g and 2g + 1, so other lanes read them back: __syncwarp orders the writes.
      const int g = lane % kHalf;
      for (int u = 0; u < count; u += 2) {
        const int v = u + lane / kHalf;
        const uint4 y = key_norm<kRaw>(*norm, first + t0 + v, v < count, lane);
        if (v < count) {
          staged[v * kWarp + 2 * g] = make_uint2(y.x, y.y);
          staged[v * kWarp + 2 * g + 1] = make_uint2(y.z, y.w);
        }
      }
      __syncwarp();
    }
    // Without kNorm each lane reads back only its own slots (program order; no barrier).
#pragma unroll 1
    for (int u = 0; u < count; ++u) {
      update_token<kMode>(a, bias, __shfl_sync(kFullMask, my_pos, u),
                          __shfl_sync(kFullMask, my_loc, u), __shfl_sync(kFullMask, my_tslot, u),
                          staged[u * kWarp + lane], staged[(chunk + u) * kWarp + lane], lane);
      // Each lane reads back only its own tail words, so program order already orders this
      // token's stash before the next token's ring reads; the barrier keeps the warp's
      // memory operations of consecutive tokens ordered as a whole (and, with kNorm, the
      // next chunk's staging after this chunk's reads).
      __syncwarp();
    }
  }
}

// Block `req` = request req.
template <ScaleMode kMode>
__global__ void __launch_bounds__(kWarp) kpool_update_kernel(const UpdateArgs a) {
  // Unlike the seed (APE read before the wait, as a model weight), APE here is an ordinary
  // operand that the previous kernel may have produced, so every input is read after the wait.
  pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion before reading
  extern __shared__ uint2 staged[];
  update_request<kMode, false>(a, nullptr, blockIdx.x, threadIdx.x, staged);
}

// indexer_update's epilogue (after its projection): warp w < `requests` runs request w's
// kpool update with its key LayerNorm (kNorm), the warps after it the q rows of indexer_query
// (query.cuh's head_row). Both only read the projection's results and their own operands, so
// one launch does what indexer_query's and kpool_update's kernels do one after the other, with
// the same bits. Request warps come first: theirs is the longest dependent chain.
constexpr int kEpilogueWarps = 4;

//
// `early` (launch_update_epilogue's operands_ready): a single-token request warp loads what no
// GEMM of its FFI call writes (request_operands: indices, APE, the ring rows of a completion)
// before its PDL wait, so that after the wait only the GEMMs' results remain to load: one
// dependent load chain (indices, then the ring rows) off the path behind the GEMMs.
//
// One CTA per SM is enough (the grids are small): without the 1, ptxas held the kRaw
// variants to 72 registers and spilled 8 bytes in the staging loop; with it, 87-102, none.
template <ScaleMode kMode, bool kBf16, bool kRaw>
__global__ void __launch_bounds__(kEpilogueWarps * kWarp, 1)
    update_epilogue_kernel(const UpdateArgs a, const QueryArgs q, const int64_t requests,
                           const bool early) {
  const int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kEpilogueWarps + w;
  if (early && warp < requests && single_token(a.next_n)) {
    const TokenOperands o = request_operands(a, warp, lane);
    pdl_wait();  // the GEMMs' results
    pdl_launch_dependents();
    const uint2 gw = gate_quad<kRaw>(a, &q, warp, kPerLane * lane);
    update_single<kMode, true, kRaw>(a, &q, warp, lane, o, make_uint2(0u, 0u), gw);
    return;
  }
  pdl_wait();  // every input may be the projection's
  pdl_launch_dependents();
  extern __shared__ uint2 staged[];
  if (warp < requests)
    update_request<kMode, true, kRaw>(a, &q, warp, lane,
                                      staged + w * (stage_bytes(a.next_n) / sizeof(uint2)));
  else if (warp - requests < q.q_rows)
    head_row<kBf16, kRaw>(q, warp - requests, lane);
}


// ---------------------------------------------------------------------------------------------
// kpool_compress.

// Rows (warps) per CTA: a 32K-token prompt has 8192 pools, so large grids keep every SM busy
// with several CTAs; at a few rows a CTA per 4 rows still spreads them over SMs.
constexpr int kCompressWarps = 4;

struct CompressArgs {
  uint8_t* cache;              // u8[pages, page, 132], dense; written only
  // Read-only for the kernel's lifetime (never aliased with cache): read via __ldg.
  const uint16_t* slot_key;    // bf16[n, 4, 128]
  const uint16_t* slot_gate;   // bf16[n, 4, 128]
  const float* ape;            // f32[4, 128]
  const int32_t* loc;          // [n]
  const uint8_t* write_mask;   // PRED[n]: one byte per row (XLA stores 0 or 1)
  int64_t capacity;            // pages * page: flat slots of the cache
  int64_t rows;                // n
  Divisor page;                // PAGE (1 for an empty cache: nothing is written then)
};

// Warp threadIdx.y of CTA blockIdx.x = row blockIdx.x * kCompressWarps + threadIdx.y.
template <ScaleMode kMode>
__global__ void __launch_bounds__(kCompressWarps * kWarp)
    kpool_compress_kernel(const CompressArgs a) {
  const int lane = threadIdx.x;
  const int dim = kPerLane * lane;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCompressWarps + threadIdx.y;
  // Every input (and the cache) may belong to the previous kernel: nothing before the wait.
  pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion before reading
  if (row >= a.rows) return;
  // Every lane reads the same row's mask and slot, so a row that writes nothing leaves as a
  // whole warp (the Hadamard and amax shuffles below need all 32 lanes). Both loads are
  // issued before either is tested.
  const uint8_t write = __ldg(a.write_mask + row);
  const int32_t loc = __ldg(a.loc + row);
  if (write == 0 || loc < 0 || loc >= a.capacity) return;  // SPEC D4: never out of the cache

  float bias[kPool][kPerLane], k[kPool][kPerLane], z[kPool][kPerLane];
  load_bias(a.ape, dim, bias);
  const int64_t first = row * (kPool * kDim) + dim;  // slot 0 of the row, the lane's quad
#pragma unroll
  for (int p = 0; p < kPool; ++p) {
    widen4(__ldg(reinterpret_cast<const uint2*>(a.slot_key + first + p * kDim)), k[p]);
    widen4(__ldg(reinterpret_cast<const uint2*>(a.slot_gate + first + p * kDim)), z[p]);
  }
  pool_and_write<kMode>(a.cache, a.page, k, z, bias, loc, lane);
}

}  // namespace

ffi::ErrorOr<UpdateLaunch> prepare_kpool_update(
    const Check& check, ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail,
    ffi::BufferR2<ffi::S32> tslot, ffi::BufferR3<ffi::BF16> key, ffi::BufferR3<ffi::BF16> gate,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::ResultBufferR3<ffi::U8> kv_out, ffi::ResultBufferR4<ffi::BF16> tail_out, bool ue8m0,
    bool round_scale) {
  const auto fail = [&](std::string_view what) { return ffi::Unexpected(check.fail(what)); };
  const auto cd = kv_cache.dimensions();
  const auto td = tail.dimensions();
  const auto kd = key.dimensions();
  const int64_t pages = cd[0], page = cd[1], blocks = td[0], ring = td[2];
  const int64_t requests = kd[0], next_n = kd[1];
  if (cd[2] != kEntryBytes) return fail("kv_cache must be u8[pages, PAGE, 132]");
  if (td[1] != 2 || td[3] != kDim) return fail("tail must be bf16[blocks, 2, RING, 128]");
  if (ring < kPool || ring % kPool != 0 || ring > kI32Max)
    return fail("tail ring size (dim 2) must be a positive multiple of 4");
  if (page > kI32Max) return fail("PAGE too large");
  if (kd[2] != kDim) return fail("key must be bf16[B, N, 128]");
  const auto gd = gate.dimensions();
  if (gd[0] != requests || gd[1] != next_n || gd[2] != kDim)
    return fail("gate must have key's shape [B, N, 128]");
  const auto ad = ape.dimensions();
  if (ad[0] != kPool || ad[1] != kDim) return fail("ape must be f32[4, 128]");
  for (const auto* idx : {&tslot, &loc, &pos}) {
    const auto d = idx->dimensions();
    if (d[0] != requests || d[1] != next_n) return fail("tslot, loc and pos must be s32[B, N]");
  }
  const auto od = kv_out->dimensions();
  const auto ud = tail_out->dimensions();
  for (int i = 0; i < 3; ++i)
    if (od[i] != cd[i]) return fail("kv_cache result shape differs from the operand");
  for (int i = 0; i < 4; ++i)
    if (ud[i] != td[i]) return fail("tail result shape differs from the operand");
  if (!round_scale && ue8m0) return fail("round_scale=false needs the fp32 scale format");
  // Vector accesses: 16 B APE rows, 8 B bf16 quads, 4 B fp8/scale words (XLA buffers are
  // at least 16 B aligned; checked so that a violation fails here, not as a device fault).
  if (!aligned(ape.untyped_data(), 16) || !aligned(key.untyped_data(), 8) ||
      !aligned(gate.untyped_data(), 8) || !aligned(tail_out->untyped_data(), 8) ||
      !aligned(kv_out->untyped_data(), 4))
    return fail("operand buffers are not aligned (ape 16 B; key, gate, tail 8 B; kv_cache 4 B)");
  if (requests > kI32Max || next_n > kI32Max)
    return fail("too many requests or next_n for one grid");
  UpdateLaunch plan;
  // Results 0/1 alias operands 0/1, and a donated step gets the same buffers; XLA does not
  // always honour the alias (seen inside the loop of a vmapped call on jax 0.11.2), so
  // launch_kpool_update copies where it did not (copy_unaliased). The copies are planned
  // before the empty-batch return: with no row to write, an unaliased result must still
  // equal its operand.
  plan.copies[0] = {kv_out->untyped_data(), kv_cache.untyped_data(), kv_cache.size_bytes()};
  plan.copies[1] = {tail_out->untyped_data(), tail.untyped_data(), tail.size_bytes()};
  if (requests == 0 || next_n == 0) return plan;

  UpdateArgs& args = plan.args;
  args.cache = kv_out->typed_data();
  args.tail = reinterpret_cast<uint16_t*>(tail_out->typed_data());
  args.tslot = tslot.typed_data();
  args.key = reinterpret_cast<const uint16_t*>(key.typed_data());
  args.gate = reinterpret_cast<const uint16_t*>(gate.typed_data());
  args.ape = ape.typed_data();
  args.loc = loc.typed_data();
  args.pos = pos.typed_data();
  args.capacity = pages * page;
  args.blocks = blocks;
  args.next_n = static_cast<int32_t>(next_n);
  args.ring = Divisor(static_cast<int32_t>(ring));
  args.page = Divisor::extent(page);
  plan.kernel = by_scale_mode(round_scale, ue8m0, [](auto mode) {
    return kpool_update_kernel<decltype(mode)::value>;
  });
  plan.requests = static_cast<unsigned>(requests);
  plan.smem = stage_bytes(next_n);
  plan.ue8m0 = ue8m0;
  plan.round_scale = round_scale;
  return plan;
}

namespace {

// The plan's cache copies where XLA did not alias a cache result with its operand
// (copy_unaliased each); `copied` is set when one ran.
cudaError_t copy_unaliased_caches(const UpdateLaunch& plan, cudaStream_t stream, bool& copied) {
  for (const UpdateLaunch::Copy& copy : plan.copies) {
    const cudaError_t err = copy_unaliased(copy.dst, copy.src, copy.bytes, stream, copied);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_kpool_update(cudaStream_t stream, bool pdl, const UpdateLaunch& plan) {
  bool copied = false;
  if (cudaError_t err = copy_unaliased_caches(plan, stream, copied); err != cudaSuccess)
    return err;
  if (plan.kernel == nullptr) return cudaSuccess;  // no row: the copies were all to do
  return launch(plan.kernel, dim3(plan.requests), dim3(kWarp), plan.smem, stream,
                pdl && !copied, plan.args);
}

cudaError_t launch_update_epilogue(cudaStream_t stream, bool pdl, const QueryLaunch& query,
                                   const UpdateLaunch& update, bool operands_ready) {
  bool copied = false;
  if (cudaError_t err = copy_unaliased_caches(update, stream, copied); err != cudaSuccess)
    return err;
  // No request rows means M = 0: the query has no rows either.
  if (update.kernel == nullptr || query.kernel == nullptr) return cudaSuccess;
  const int64_t warps = static_cast<int64_t>(update.requests) + query.args.q_rows;
  const int64_t blocks = (warps + kEpilogueWarps - 1) / kEpilogueWarps;
  if (blocks > kI32Max) return cudaErrorInvalidConfiguration;
  const size_t smem = kEpilogueWarps * update.smem;
  void (*const kernel)(UpdateArgs, QueryArgs, int64_t, bool) =
      by_scale_mode(update.round_scale, update.ue8m0, [&](auto mode) {
        constexpr ScaleMode kMode = decltype(mode)::value;
        if (query.args.raw != nullptr)
          return query.bf16_w_out ? update_epilogue_kernel<kMode, true, true>
                                  : update_epilogue_kernel<kMode, false, true>;
        return query.bf16_w_out ? update_epilogue_kernel<kMode, true, false>
                                : update_epilogue_kernel<kMode, false, false>;
      });
  if (cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess) return err;
  return launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kEpilogueWarps * kWarp), smem,
                stream, pdl && !copied, update.args, query.args,
                static_cast<int64_t>(update.requests), operands_ready);
}

namespace {

ffi::Error KpoolUpdateImpl(cudaStream_t stream, ffi::BufferR3<ffi::U8> kv_cache,
                           ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
                           ffi::BufferR3<ffi::BF16> key, ffi::BufferR3<ffi::BF16> gate,
                           ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc,
                           ffi::BufferR2<ffi::S32> pos, ffi::ResultBufferR3<ffi::U8> kv_out,
                           ffi::ResultBufferR4<ffi::BF16> tail_out, bool ue8m0, bool round_scale,
                           bool pdl) {
  const Check check{targets::glm5_kpool_update};
  const ffi::ErrorOr<UpdateLaunch> plan =
      prepare_kpool_update(check, kv_cache, tail, tslot, key, gate, ape, loc, pos, kv_out,
                           tail_out, ue8m0, round_scale);
  if (plan.has_error()) return plan.error();
  return check.cuda(launch_kpool_update(stream, pdl, *plan));
}

ffi::Error KpoolCompressImpl(cudaStream_t stream, ffi::BufferR3<ffi::U8> kv_cache,
                             ffi::BufferR3<ffi::BF16> slot_key, ffi::BufferR3<ffi::BF16> slot_gate,
                             ffi::BufferR2<ffi::F32> ape, ffi::BufferR1<ffi::S32> loc,
                             ffi::BufferR1<ffi::PRED> write_mask,
                             ffi::ResultBufferR3<ffi::U8> kv_out, bool ue8m0, bool round_scale,
                             bool pdl) {
  const Check check{targets::glm5_kpool_compress};
  const auto cd = kv_cache.dimensions();
  const auto kd = slot_key.dimensions();
  const int64_t pages = cd[0], page = cd[1], rows = kd[0];
  if (cd[2] != kEntryBytes) return check.fail("kv_cache must be u8[pages, PAGE, 132]");
  if (page > kI32Max) return check.fail("PAGE too large");
  if (kd[1] != kPool || kd[2] != kDim) return check.fail("slot_key must be bf16[n, 4, 128]");
  const auto gd = slot_gate.dimensions();
  if (gd[0] != rows || gd[1] != kPool || gd[2] != kDim)
    return check.fail("slot_gate must have slot_key's shape [n, 4, 128]");
  const auto ad = ape.dimensions();
  if (ad[0] != kPool || ad[1] != kDim) return check.fail("ape must be f32[4, 128]");
  if (loc.dimensions()[0] != rows) return check.fail("loc must be s32[n]");
  if (write_mask.dimensions()[0] != rows) return check.fail("write_mask must be pred[n]");
  const auto od = kv_out->dimensions();
  for (int i = 0; i < 3; ++i)
    if (od[i] != cd[i]) return check.fail("kv_cache result shape differs from the operand");
  if (!round_scale && ue8m0) return check.fail("round_scale=false needs the fp32 scale format");
  // Vector accesses: 16 B APE rows, 8 B bf16 quads, 4 B fp8/scale words (XLA buffers are
  // at least 16 B aligned; checked so that a violation fails here, not as a device fault).
  if (!aligned(ape.untyped_data(), 16) || !aligned(slot_key.untyped_data(), 8) ||
      !aligned(slot_gate.untyped_data(), 8) || !aligned(kv_out->untyped_data(), 4))
    return check.fail("operand buffers are not aligned (ape 16 B; slot_key, slot_gate 8 B; "
                      "kv_cache 4 B)");
  const int64_t blocks = (rows + kCompressWarps - 1) / kCompressWarps;
  if (blocks > kI32Max) return check.fail("too many rows for one grid");
  bool copied = false;
  if (cudaError_t err = copy_unaliased(kv_out->untyped_data(), kv_cache.untyped_data(),
                                       kv_cache.size_bytes(), stream, copied);
      err != cudaSuccess)
    return check.cuda(err);
  if (rows == 0) return check.cuda();

  CompressArgs args;
  args.cache = kv_out->typed_data();
  args.slot_key = reinterpret_cast<const uint16_t*>(slot_key.typed_data());
  args.slot_gate = reinterpret_cast<const uint16_t*>(slot_gate.typed_data());
  args.ape = ape.typed_data();
  args.loc = loc.typed_data();
  args.write_mask = static_cast<const uint8_t*>(write_mask.untyped_data());
  args.capacity = pages * page;
  args.rows = rows;
  args.page = Divisor::extent(page);
  void (*const kernel)(CompressArgs) = by_scale_mode(round_scale, ue8m0, [](auto mode) {
    return kpool_compress_kernel<decltype(mode)::value>;
  });
  return check.cuda(launch(kernel, dim3(static_cast<unsigned>(blocks)),
                           dim3(kWarp, kCompressWarps), 0, stream, pdl && !copied, args));
}

}  // namespace
}  // namespace glm5

// BufferR<n> aliases: a comma inside <> would split the macro argument.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5KpoolUpdate, glm5::KpoolUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
                                  .Arg<ffi::BufferR4<ffi::BF16>>()  // tail
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // tslot
                                  .Arg<ffi::BufferR3<ffi::BF16>>()  // key
                                  .Arg<ffi::BufferR3<ffi::BF16>>()  // gate
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // ape
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // loc
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // pos
                                  .Ret<ffi::BufferR3<ffi::U8>>()    // kv_cache (aliased)
                                  .Ret<ffi::BufferR4<ffi::BF16>>()  // tail (aliased)
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("round_scale")        // round_scale
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5KpoolCompress, glm5::KpoolCompressImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
                                  .Arg<ffi::BufferR3<ffi::BF16>>()  // slot_key
                                  .Arg<ffi::BufferR3<ffi::BF16>>()  // slot_gate
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // ape
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // loc
                                  .Arg<ffi::BufferR1<ffi::PRED>>()  // write_mask
                                  .Ret<ffi::BufferR3<ffi::U8>>()    // kv_cache (aliased)
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("round_scale")        // round_scale
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
