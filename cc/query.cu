// indexer_query (SPEC §2): key LayerNorm (2a), q Hadamard + FP8 (2b), head-weight scaling
// (2c) and head padding (2d), in one launch.
//
// Work items, one warp each, CTAs of kWarps warps sized from the shapes only:
//   * warps [0, M * padded): the (token, head) row `q_row` of q_fp8 / w_out (query.cuh): real
//     heads (h < H) run the Hadamard + FP8 and the head-weight scaling, padded heads
//     (H <= h < padded) get zero bytes and w_out = 0.
//   * warps [M * padded, M * padded + ceil(M / 2)): the key LayerNorm of two token rows, one per
//     half-warp; lane g of a half owns LayerNorm group g (dims 8g..8g+7, one 16-byte load).
//
// Programmatic dependent launch: every input is read after pdl_wait().
#include <cuda_bf16.h>

#include <cstdint>

#include "common.h"
#include "handlers.h"
#include "query.cuh"

namespace glm5 {
namespace {

constexpr int kWarps = 4;                       // warps per CTA

template <bool kBf16>
__global__ void __launch_bounds__(kWarps * kWarp) indexer_query_kernel(const QueryArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion before reading
  if (warp < a.q_rows) {
    head_row<kBf16>(a, warp, lane);
  } else {
    const int64_t t = 2 * (warp - a.q_rows) + lane / kHalf;  // two tokens per warp
    if (t - lane / kHalf < a.rows) key_norm(a, t, t < a.rows, lane);
  }
}

}  // namespace

ffi::ErrorOr<QueryLaunch> prepare_query(const Check& check, ffi::BufferR3<ffi::BF16> q,
                                        ffi::BufferR2<ffi::BF16> key_raw,
                                        ffi::BufferR2<ffi::F32> head_w,
                                        ffi::BufferR1<ffi::F32> norm_weight,
                                        ffi::BufferR1<ffi::F32> norm_bias,
                                        ffi::Result<ffi::AnyBuffer> q_out,
                                        ffi::Result<ffi::AnyBuffer> w_out,
                                        ffi::ResultBufferR2<ffi::BF16> key_out, float scale,
                                        float eps) {
  const auto fail = [&](std::string_view what) { return ffi::Unexpected(check.fail(what)); };
  const auto qd = q.dimensions();
  const int64_t rows = qd[0], heads = qd[1];
  if (qd[2] != kDim) return fail("q must be bf16[M, H, 128]");
  const auto kd = key_raw.dimensions();
  if (kd[0] != rows || kd[1] != kDim) return fail("key_raw must be bf16[M, 128]");
  const auto wd = head_w.dimensions();
  if (wd[0] != rows || wd[1] != heads) return fail("head_w must be f32[M, H]");
  const ffi::ErrorOr<int64_t> padded =
      check_query_buffers(check, norm_weight, norm_bias, q_out, w_out, rows, heads);
  if (padded.has_error()) return ffi::Unexpected(padded.error());
  const bool bf16_w_out = w_out->element_type() == ffi::DataType::BF16;
  const auto kod = key_out->dimensions();
  if (kod[0] != rows || kod[1] != kDim) return fail("key result must be bf16[M, 128]");
  // Vector accesses (XLA buffers are at least 16 B aligned; checked so that a violation fails
  // here, not as a device fault).
  if (!aligned(q.untyped_data(), 8) || !aligned(key_raw.untyped_data(), 16) ||
      !aligned(norm_weight.untyped_data(), 16) || !aligned(norm_bias.untyped_data(), 16) ||
      !aligned(q_out->untyped_data(), 4) || !aligned(key_out->untyped_data(), 16))
    return fail(
        "operand buffers are not aligned (q 8 B; key_raw, norm params, key 16 B; q_fp8 4 B)");
  QueryLaunch plan;
  if (rows == 0) return plan;
  const int64_t q_rows = rows * *padded;
  const int64_t warps = q_rows + (rows + 1) / 2;
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  if (blocks > kI32Max) return fail("too many rows for one grid");

  QueryArgs& args = plan.args;
  args.q = reinterpret_cast<const uint16_t*>(q.untyped_data());
  args.key_raw = reinterpret_cast<const uint16_t*>(key_raw.untyped_data());
  args.head_w = head_w.typed_data();
  args.norm_weight = norm_weight.typed_data();
  args.norm_bias = norm_bias.typed_data();
  args.q_out = reinterpret_cast<uint32_t*>(q_out->untyped_data());
  args.w_out = w_out->untyped_data();
  args.key_out = reinterpret_cast<uint16_t*>(key_out->untyped_data());
  args.q_rows = q_rows;
  args.rows = rows;
  args.heads = static_cast<int32_t>(heads);
  args.padded = Divisor::extent(*padded);
  args.scale = scale;
  args.eps = eps;
  plan.kernel = bf16_w_out ? indexer_query_kernel<true> : indexer_query_kernel<false>;
  plan.blocks = static_cast<unsigned>(blocks);
  plan.bf16_w_out = bf16_w_out;
  return plan;
}

cudaError_t launch_query(cudaStream_t stream, bool pdl, const QueryLaunch& plan) {
  if (plan.kernel == nullptr) return cudaSuccess;
  return launch(plan.kernel, dim3(plan.blocks), dim3(kWarps * kWarp), 0, stream, pdl, plan.args);
}

namespace {

ffi::Error IndexerQueryImpl(cudaStream_t stream, ffi::BufferR3<ffi::BF16> q,
                            ffi::BufferR2<ffi::BF16> key_raw, ffi::BufferR2<ffi::F32> head_w,
                            ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
                            ffi::Result<ffi::AnyBuffer> q_out,
                            ffi::Result<ffi::AnyBuffer> w_out,
                            ffi::ResultBufferR2<ffi::BF16> key_out, float scale, float eps,
                            bool pdl) {
  const Check check{targets::glm5_indexer_query};
  const ffi::ErrorOr<QueryLaunch> plan = prepare_query(check, q, key_raw, head_w, norm_weight,
                                                       norm_bias, q_out, w_out, key_out, scale,
                                                       eps);
  if (plan.has_error()) return plan.error();
  return check.cuda(launch_query(stream, pdl, *plan));
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerQuery, glm5::IndexerQueryImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR3<ffi::BF16>>()        // q
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // key_raw
                                  .Arg<ffi::BufferR2<ffi::F32>>()         // head_w
                                  .Arg<ffi::BufferR1<ffi::F32>>()         // norm_weight
                                  .Arg<ffi::BufferR1<ffi::F32>>()         // norm_bias
                                  .Ret<ffi::AnyBuffer>()                  // q_fp8 (e4m3)
                                  .Ret<ffi::AnyBuffer>()                  // w_out (f32 | bf16)
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // key
                                  .Attr<float>("scale")
                                  .Attr<float>("eps")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
