// indexer_update (issue 12): the update part of a decode step after the q GEMM, as one FFI
// call launching two kernels back to back on the stream:
//
//   indexer_projection   x @ w_cat^T -> key_raw, head_w, gate       (projection.cu)
//   the epilogue         one warp per request: key LayerNorm, tail stash + pool compression
//                        in place (kpool_update with indexer_query's key part folded in);
//                        one warp per q row: Hadamard + FP8 and w_out (indexer_query's q part)
//                                                                    (kpool.cu, query.cuh)
//
// Each part is planned by its op's own rule (prepare_* checks every buffer before the first
// launch), and the epilogue runs the two ops' own device code on the same arguments, so the
// results are bit for bit those of the three FFI calls with the same tactic and attributes;
// the epilogue saves the query kernel's launch and the key's round trip before kpool_update.
// With PDL the epilogue may start while the projection finishes: it reads nothing before its
// griddepcontrol.wait (which waits for the whole previous grid); the projection reads only its
// weights before its own. The intermediates key_raw, head_w, gate and key are results XLA
// allocates.
#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "common.h"
#include "constants.h"
#include "handlers.h"
#include "kpool.cuh"
#include "limits.h"
#include "projection.cuh"
#include "q_gemm.cuh"
#include "query.cuh"
#include "update_select.h"

namespace glm5 {
namespace {

// update_epilogue reads raw's rows of 256 + H floats four at a time (the op's kernel_supports
// rule).
constexpr int kRawHeadsMultiple = limits::kRawHeadsMultiple;

// A result's bytes seen with other dimensions of the same element count (XLA buffers are
// dense, row-major): the query epilogue writes key and the projection gate as [M, 128],
// kpool_update reads them as [B, N, 128]. The view owns the dims its Buffer points to, so it
// must outlive that Buffer (not copyable).
template <ffi::DataType kType, size_t kRank>
class Reshaped {
 public:
  Reshaped(void* data, std::array<int64_t, kRank> dims) : dims_(dims) {
    raw_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    raw_.extension_start = nullptr;
    raw_.dtype = static_cast<XLA_FFI_DataType>(kType);
    raw_.data = data;
    raw_.rank = static_cast<int64_t>(kRank);
    raw_.dims = dims_.data();
  }
  Reshaped(const Reshaped&) = delete;
  Reshaped& operator=(const Reshaped&) = delete;

  ffi::Buffer<kType, kRank> buffer() const { return ffi::Buffer<kType, kRank>(&raw_); }

 private:
  std::array<int64_t, kRank> dims_;
  XLA_FFI_Buffer raw_{};
};

// The epilogue's two plans (indexer_query's and kpool_update's) on the projection's results
// key_raw, head_w, gate and q bf16[M, H, 128] (indexer_update's and indexer_update_q's).
struct EpiloguePlans {
  QueryLaunch query;
  UpdateLaunch update;
};

ffi::ErrorOr<EpiloguePlans> prepare_after_projection(
    const Check& check, ffi::BufferR3<ffi::BF16> q, ffi::ResultBufferR2<ffi::BF16> key_raw,
    ffi::ResultBufferR2<ffi::F32> head_w, ffi::ResultBufferR2<ffi::BF16> gate,
    ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
    ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, float scale, float eps, bool ue8m0,
    bool round_scale) {
  const auto td = tslot.dimensions();
  const int64_t requests = td[0], next_n = td[1];
  ffi::ErrorOr<QueryLaunch> query = prepare_query(
      check, q, *key_raw, *head_w, norm_weight, norm_bias, q_out, w_out, key, scale, eps);
  if (query.has_error()) return ffi::Unexpected(query.error());
  // key and gate are [M = B * N, 128] (checked by the projection's plan and the query's).
  const Reshaped<ffi::DataType::BF16, 3> key3(key->untyped_data(), {requests, next_n, kDim});
  const Reshaped<ffi::DataType::BF16, 3> gate3(gate->untyped_data(), {requests, next_n, kDim});
  ffi::ErrorOr<UpdateLaunch> update =
      prepare_kpool_update(check, kv_cache, tail, tslot, key3.buffer(), gate3.buffer(), ape, loc,
                           pos, kv_out, tail_out, ue8m0, round_scale);
  if (update.has_error()) return ffi::Unexpected(update.error());
  return EpiloguePlans{*query, *update};
}

ffi::Error IndexerUpdateImpl(
    cudaStream_t stream, ffi::BufferR2<ffi::BF16> x, ffi::BufferR2<ffi::BF16> w_cat,
    ffi::BufferR3<ffi::BF16> q, ffi::BufferR1<ffi::F32> norm_weight,
    ffi::BufferR1<ffi::F32> norm_bias, ffi::BufferR3<ffi::U8> kv_cache,
    ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot, ffi::BufferR2<ffi::F32> ape,
    ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::ResultBufferR2<ffi::BF16> key_raw, ffi::ResultBufferR2<ffi::F32> head_w,
    ffi::ResultBufferR2<ffi::BF16> gate, ffi::Result<ffi::AnyBuffer> q_out,
    ffi::Result<ffi::AnyBuffer> w_out, ffi::ResultBufferR2<ffi::BF16> key,
    ffi::ResultBufferR3<ffi::U8> kv_out, ffi::ResultBufferR4<ffi::BF16> tail_out, int32_t warps,
    int32_t split, float scale, float eps, bool ue8m0, bool round_scale, bool pdl) {
  const Check check{targets::glm5_indexer_update};
  const auto td = tslot.dimensions();
  if (x.dimensions()[0] != td[0] * td[1])
    return check.fail("x must have requests x next_n rows (tslot is s32[B, N])");
  const ffi::ErrorOr<ProjectionLaunch> projection =
      prepare_projection(check, x, w_cat, key_raw, head_w, gate, warps, split);
  if (projection.has_error()) return projection.error();
  const ffi::ErrorOr<EpiloguePlans> plans = prepare_after_projection(
      check, q, key_raw, head_w, gate, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
      pos, q_out, w_out, key, kv_out, tail_out, scale, eps, ue8m0, round_scale);
  if (plans.has_error()) return plans.error();

  if (cudaError_t err = launch_projection(stream, pdl, *projection); err != cudaSuccess)
    return check.cuda(err);
  return check.cuda(
      launch_update_epilogue(stream, pdl, plans->query, plans->update, /*operands_ready=*/true));
}

// indexer_update_q: indexer_q's GEMM and indexer_update's kernels in one FFI call, three
// launches with PDL between them: q's GEMM, the projection, the epilogue. q's GEMM (the
// longer, 12.6 MB of wq_b) goes first; its CTAs call launch_dependents right after their own
// PDL wait, so the projection starts beside it with x complete (gemm::Gemm::inputs_ready):
// it reads w_cat and x while q's GEMM runs and waits for it only after its last read, so that
// the epilogue's wait (on the projection) covers both GEMMs. The two GEMMs' 15 MB of weights
// then stream together, not one after the other. Bit for bit indexer_q's kernel (the same
// tactic) and indexer_update's: the same device code on the same arguments; only the order of
// launches and of the projection's wait change, and no kernel reads another's results before
// its wait.
ffi::Error run_update_q(
    const Check& check, cudaStream_t stream, ffi::BufferR2<ffi::BF16> x,
    ffi::BufferR2<ffi::BF16> w_cat, ffi::BufferR2<ffi::BF16> qr, ffi::BufferR2<ffi::BF16> wq_b,
    ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
    ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::ResultBufferR2<ffi::BF16> key_raw, ffi::ResultBufferR2<ffi::F32> head_w,
    ffi::ResultBufferR2<ffi::BF16> gate, ffi::ResultBufferR2<ffi::BF16> q,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, int32_t warps, int32_t split, int32_t tactic,
    float scale, float eps, bool ue8m0, bool round_scale, bool pdl) {
  const auto td = tslot.dimensions();
  if (x.dimensions()[0] != td[0] * td[1])
    return check.fail("x must have requests x next_n rows (tslot is s32[B, N])");
  ffi::ErrorOr<ProjectionLaunch> projection =
      prepare_projection(check, x, w_cat, key_raw, head_w, gate, warps, split);
  if (projection.has_error()) return projection.error();
  const ffi::ErrorOr<QGemmLaunch> gemm = prepare_q_gemm(check, qr, wq_b, q, tactic);
  if (gemm.has_error()) return gemm.error();
  const int64_t rows = q->dimensions()[0], heads = head_w->dimensions()[1];
  if (rows != x.dimensions()[0] || q->dimensions()[1] != heads * kDim)
    return check.fail("q must be bf16[M, H * 128] with x's M and H = w_cat's rows - 256");
  const Reshaped<ffi::DataType::BF16, 3> q3(q->untyped_data(), {rows, heads, kDim});
  const ffi::ErrorOr<EpiloguePlans> plans = prepare_after_projection(
      check, q3.buffer(), key_raw, head_w, gate, norm_weight, norm_bias, kv_cache, tail, tslot,
      ape, loc, pos, q_out, w_out, key, kv_out, tail_out, scale, eps, ue8m0, round_scale);
  if (plans.has_error()) return plans.error();
  // Only right behind a q grid (M = 0 launches none, and the projection nothing either).
  projection->args.gemm.inputs_ready = gemm->rows > 0;

  if (cudaError_t err = launch_q_gemm(stream, pdl, *gemm); err != cudaSuccess)
    return check.cuda(err);
  if (cudaError_t err = launch_projection(stream, pdl, *projection); err != cudaSuccess)
    return check.cuda(err);
  return check.cuda(
      launch_update_epilogue(stream, pdl, plans->query, plans->update, /*operands_ready=*/true));
}

ffi::Error IndexerUpdateQImpl(
    cudaStream_t stream, ffi::BufferR2<ffi::BF16> x, ffi::BufferR2<ffi::BF16> w_cat,
    ffi::BufferR2<ffi::BF16> qr, ffi::BufferR2<ffi::BF16> wq_b,
    ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
    ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::ResultBufferR2<ffi::BF16> key_raw, ffi::ResultBufferR2<ffi::F32> head_w,
    ffi::ResultBufferR2<ffi::BF16> gate, ffi::ResultBufferR2<ffi::BF16> q,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, int32_t warps, int32_t split, int32_t tactic,
    float scale, float eps, bool ue8m0, bool round_scale, bool pdl) {
  return run_update_q(Check{targets::glm5_indexer_update_q}, stream, x, w_cat, qr, wq_b,
                      norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc, pos, key_raw,
                      head_w, gate, q, q_out, w_out, key, kv_out, tail_out, warps, split, tactic,
                      scale, eps, ue8m0, round_scale, pdl);
}

// indexer_update_select: indexer_update_q's three launches, then select_slots' two, in one FFI call
// with PDL between all five. Across two FFI calls the logits kernel could start only once the
// epilogue's child graph had completed; in one, its row tables and first page lookups (only
// indices, before its PDL wait) overlap the epilogue. The select path reads the update's
// q_fp8, w_out (f32) and updated cache in place; bit for bit the two calls' results.
ffi::Error IndexerUpdateSelectImpl(
    cudaStream_t stream, ffi::BufferR2<ffi::BF16> x, ffi::BufferR2<ffi::BF16> w_cat,
    ffi::BufferR2<ffi::BF16> qr, ffi::BufferR2<ffi::BF16> wq_b,
    ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
    ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> req_ids,
    ffi::BufferR2<ffi::S32> block_table,
    ffi::ResultBufferR2<ffi::BF16> key_raw, ffi::ResultBufferR2<ffi::F32> head_w,
    ffi::ResultBufferR2<ffi::BF16> gate, ffi::ResultBufferR2<ffi::BF16> q,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, ffi::ResultBufferR2<ffi::S32> slots,
    ffi::ResultBufferR1<ffi::S32> counts, ffi::ResultBufferR2<ffi::F32> logits, int64_t k,
    int64_t block_size, int64_t stride_rows, int64_t max_block, int64_t next_n, int32_t warps,
    int32_t split, int32_t tactic, float scale, float eps, bool ue8m0, bool round_scale,
    bool pdl) {
  const Check check{targets::glm5_indexer_update_select};
  const auto wd = w_out->dimensions();
  if (w_out->element_type() != ffi::DataType::F32 || wd.size() != 2)
    return check.fail("w_out must be f32 (the select path reads it)");
  const int64_t rows = wd[0];
  if (pos.dimensions()[0] * pos.dimensions()[1] != rows)
    return check.fail("positions must have the rows' requests x next_n entries");
  if (next_n != pos.dimensions()[1]) return check.fail("next_n must be positions' columns");
  if (ffi::Error err = run_update_q(check, stream, x, w_cat, qr, wq_b, norm_weight, norm_bias,
                                    kv_cache, tail, tslot, ape, loc, pos, key_raw, head_w, gate,
                                    q, q_out, w_out, key, kv_out, tail_out, warps, split, tactic,
                                    scale, eps, ue8m0, round_scale, pdl);
      err.failure())
    return err;
  const Reshaped<ffi::DataType::F32, 2> w(w_out->untyped_data(), {wd[0], wd[1]});
  const Reshaped<ffi::DataType::S32, 1> flat(pos.untyped_data(), {rows});
  return run_select_slots(check, stream, *q_out, w.buffer(), *kv_out, page_table, req_ids,
                          flat.buffer(), block_table, slots, counts, logits, k, block_size,
                          stride_rows, max_block, next_n, ue8m0, pdl);
}

// The epilogue's two plans on the projection's f32 sums raw[M, 256 + H] and q bf16[M, H, 128]
// (update_epilogue's and update_epilogue_q's), reading raw in place of key_raw, head_w and
// gate.
ffi::ErrorOr<EpiloguePlans> prepare_epilogue(
    const Check& check, ffi::BufferR2<ffi::F32> raw, ffi::BufferR3<ffi::BF16> q,
    ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
    ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, float scale, float eps, bool ue8m0,
    bool round_scale) {
  const auto fail = [&](std::string_view what) { return ffi::Unexpected(check.fail(what)); };
  const auto td = tslot.dimensions(), qd = q.dimensions(), rd = raw.dimensions();
  const int64_t requests = td[0], next_n = td[1], rows = qd[0], heads = qd[1];
  if (rows != requests * next_n)
    return fail("q must have requests x next_n rows (tslot is s32[B, N])");
  if (rd[0] != rows || rd[1] != 2 * kDim + heads)
    return fail("raw must be f32[M, 256 + H] (q is bf16[M, H, 128])");
  // 16-byte loads at every row's key, head and gate columns.
  if (heads % kRawHeadsMultiple != 0 || !aligned(raw.untyped_data(), 16))
    return fail("raw needs H % " + std::to_string(kRawHeadsMultiple) +
                " == 0 and a 16 B aligned buffer");
  // The plans check every other buffer by their ops' rules. Their key_raw, head_w and gate
  // operands are views that only carry the shapes (over the key result and raw); the kernel
  // reads raw instead, and the views' pointers are cleared below so that nothing reads them.
  const Reshaped<ffi::DataType::BF16, 2> key_raw(key->untyped_data(), {rows, kDim});
  const Reshaped<ffi::DataType::F32, 2> head_w(raw.untyped_data(), {rows, heads});
  ffi::ErrorOr<QueryLaunch> query =
      prepare_query(check, q, key_raw.buffer(), head_w.buffer(), norm_weight, norm_bias, q_out,
                    w_out, key, scale, eps);
  if (query.has_error()) return ffi::Unexpected(query.error());
  const Reshaped<ffi::DataType::BF16, 3> key3(key->untyped_data(), {requests, next_n, kDim});
  ffi::ErrorOr<UpdateLaunch> update =
      prepare_kpool_update(check, kv_cache, tail, tslot, key3.buffer(), key3.buffer(), ape, loc,
                           pos, kv_out, tail_out, ue8m0, round_scale);
  if (update.has_error()) return ffi::Unexpected(update.error());
  query->args.key_raw = nullptr;
  query->args.head_w = nullptr;
  query->args.raw = raw.typed_data();
  update->args.gate = nullptr;
  return EpiloguePlans{*query, *update};
}

// update_epilogue: indexer_update's epilogue alone, after a projection GEMM of XLA's (the
// stage's default update part: XLA's GEMM beats the projection kernel at every M). It reads the
// GEMM's f32 sums raw[M, 256 + H] in place of key_raw, head_w and gate, so that XLA does not
// copy the three slices out before the kernels; rounded to bf16 on load as XLA's convert
// rounds them, so the results are bit for bit indexer_query's and kpool_update's on the
// reference projection's results.
ffi::Error UpdateEpilogueImpl(
    cudaStream_t stream, ffi::BufferR2<ffi::F32> raw, ffi::BufferR3<ffi::BF16> q,
    ffi::BufferR1<ffi::F32> norm_weight, ffi::BufferR1<ffi::F32> norm_bias,
    ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, float scale, float eps, bool ue8m0, bool round_scale,
    bool pdl) {
  const Check check{targets::glm5_update_epilogue};
  const ffi::ErrorOr<EpiloguePlans> plans =
      prepare_epilogue(check, raw, q, norm_weight, norm_bias, kv_cache, tail, tslot, ape, loc,
                       pos, q_out, w_out, key, kv_out, tail_out, scale, eps, ue8m0, round_scale);
  if (plans.has_error()) return plans.error();
  return check.cuda(
      launch_update_epilogue(stream, pdl, plans->query, plans->update, /*operands_ready=*/false));
}

// update_epilogue_q: indexer_q's GEMM, then update_epilogue's kernel on its q, launched by one
// handler so that XLA records both kernels in the one child graph of a single FFI call (a
// separate indexer_q call costs a child-graph launch of its own per layer),
// with PDL between them: the epilogue reads q only after its griddepcontrol.wait. The GEMM
// writes the q result bf16[M, H * 128]; the epilogue reads it as [M, H, 128] (H from raw's
// columns). Bit for bit indexer_q's kernel (the same tactic) followed by update_epilogue's.
ffi::Error UpdateEpilogueQImpl(
    cudaStream_t stream, ffi::BufferR2<ffi::F32> raw, ffi::BufferR2<ffi::BF16> qr,
    ffi::BufferR2<ffi::BF16> wq_b, ffi::BufferR1<ffi::F32> norm_weight,
    ffi::BufferR1<ffi::F32> norm_bias, ffi::BufferR3<ffi::U8> kv_cache,
    ffi::BufferR4<ffi::BF16> tail, ffi::BufferR2<ffi::S32> tslot, ffi::BufferR2<ffi::F32> ape,
    ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos, ffi::ResultBufferR2<ffi::BF16> q,
    ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> w_out,
    ffi::ResultBufferR2<ffi::BF16> key, ffi::ResultBufferR3<ffi::U8> kv_out,
    ffi::ResultBufferR4<ffi::BF16> tail_out, int32_t tactic, float scale, float eps, bool ue8m0,
    bool round_scale, bool pdl) {
  const Check check{targets::glm5_update_epilogue_q};
  const ffi::ErrorOr<QGemmLaunch> gemm = prepare_q_gemm(check, qr, wq_b, q, tactic);
  if (gemm.has_error()) return gemm.error();
  const int64_t rows = q->dimensions()[0], width = q->dimensions()[1];
  const int64_t heads = raw.dimensions()[1] - 2 * kDim;
  if (heads <= 0 || width != heads * kDim)
    return check.fail("wq_b must have H * 128 rows, H = raw's columns - 256");
  const Reshaped<ffi::DataType::BF16, 3> q3(q->untyped_data(), {rows, heads, kDim});
  const ffi::ErrorOr<EpiloguePlans> plans =
      prepare_epilogue(check, raw, q3.buffer(), norm_weight, norm_bias, kv_cache, tail, tslot,
                       ape, loc, pos, q_out, w_out, key, kv_out, tail_out, scale, eps, ue8m0,
                       round_scale);
  if (plans.has_error()) return plans.error();
  if (cudaError_t err = launch_q_gemm(stream, pdl, *gemm); err != cudaSuccess)
    return check.cuda(err);
  return check.cuda(
      launch_update_epilogue(stream, pdl, plans->query, plans->update, /*operands_ready=*/true));
}

// The three update handlers' shared bindings, in their order: after the projection's inputs
// (x and w_cat, or raw) and q's (q, or qr and wq_b) the epilogue's operands, after the
// projection's or q's results the epilogue's, after a GEMM's tactic the epilogue's attributes.
template <typename Binding>
auto bind_epilogue_args(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::BufferR1<ffi::F32>>()   // norm_weight
      .template Arg<ffi::BufferR1<ffi::F32>>()   // norm_bias
      .template Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
      .template Arg<ffi::BufferR4<ffi::BF16>>()  // tail
      .template Arg<ffi::BufferR2<ffi::S32>>()   // tslot
      .template Arg<ffi::BufferR2<ffi::F32>>()   // ape
      .template Arg<ffi::BufferR2<ffi::S32>>()   // loc
      .template Arg<ffi::BufferR2<ffi::S32>>();  // pos
}

template <typename Binding>
auto bind_epilogue_results(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()            // q_fp8 (e4m3)
      .template Ret<ffi::AnyBuffer>()            // w_out (f32 | bf16)
      .template Ret<ffi::BufferR2<ffi::BF16>>()  // key
      .template Ret<ffi::BufferR3<ffi::U8>>()    // kv_cache (aliased)
      .template Ret<ffi::BufferR4<ffi::BF16>>();  // tail (aliased)
}

template <typename Binding>
auto bind_epilogue_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<float>("eps")
      .template Attr<bool>("ue8m0")
      .template Attr<bool>("round_scale")
      .template Attr<bool>("pdl");
}

// indexer_update_q's operands (x, w_cat, qr, wq_b, then the epilogue's) and results
// (key_raw, head_w, gate, q, then the epilogue's): indexer_update_select's first ones too.
template <typename Binding>
auto bind_update_q_args(Binding binding) {
  return bind_epilogue_args(std::move(binding)
                                .template Arg<ffi::BufferR2<ffi::BF16>>()    // x
                                .template Arg<ffi::BufferR2<ffi::BF16>>()    // w_cat
                                .template Arg<ffi::BufferR2<ffi::BF16>>()    // qr
                                .template Arg<ffi::BufferR2<ffi::BF16>>());  // wq_b
}

template <typename Binding>
auto bind_update_q_results(Binding binding) {
  return bind_epilogue_results(std::move(binding)
                                   .template Ret<ffi::BufferR2<ffi::BF16>>()    // key_raw
                                   .template Ret<ffi::BufferR2<ffi::F32>>()     // head_w
                                   .template Ret<ffi::BufferR2<ffi::BF16>>()    // gate
                                   .template Ret<ffi::BufferR2<ffi::BF16>>());  // q
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Glm5UpdateEpilogue, glm5::UpdateEpilogueImpl,
    glm5::bind_epilogue_attrs(glm5::bind_epilogue_results(glm5::bind_epilogue_args(
        ffi::Ffi::Bind()
            .Ctx<ffi::PlatformStream<cudaStream_t>>()
            .Arg<ffi::BufferR2<ffi::F32>>()       // raw
            .Arg<ffi::BufferR3<ffi::BF16>>()))),  // q
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Glm5UpdateEpilogueQ, glm5::UpdateEpilogueQImpl,
    glm5::bind_epilogue_attrs(
        glm5::bind_epilogue_results(
            glm5::bind_epilogue_args(ffi::Ffi::Bind()
                                         .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                         .Arg<ffi::BufferR2<ffi::F32>>()    // raw
                                         .Arg<ffi::BufferR2<ffi::BF16>>()   // qr
                                         .Arg<ffi::BufferR2<ffi::BF16>>())  // wq_b
                .Ret<ffi::BufferR2<ffi::BF16>>())                           // q
            .Attr<int32_t>("tactic")),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Glm5IndexerUpdateQ, glm5::IndexerUpdateQImpl,
    glm5::bind_epilogue_attrs(
        glm5::bind_update_q_results(
            glm5::bind_update_q_args(
                ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()))
            .Attr<int32_t>("warps")
            .Attr<int32_t>("split")
            .Attr<int32_t>("tactic")),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Glm5IndexerUpdate, glm5::IndexerUpdateImpl,
    glm5::bind_epilogue_attrs(
        glm5::bind_epilogue_results(
            glm5::bind_epilogue_args(ffi::Ffi::Bind()
                                         .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                         .Arg<ffi::BufferR2<ffi::BF16>>()   // x
                                         .Arg<ffi::BufferR2<ffi::BF16>>()   // w_cat
                                         .Arg<ffi::BufferR3<ffi::BF16>>())  // q
                .Ret<ffi::BufferR2<ffi::BF16>>()                            // key_raw
                .Ret<ffi::BufferR2<ffi::F32>>()                             // head_w
                .Ret<ffi::BufferR2<ffi::BF16>>())                           // gate
            .Attr<int32_t>("warps")
            .Attr<int32_t>("split")),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Glm5IndexerUpdateSelect, glm5::IndexerUpdateSelectImpl,
    glm5::bind_epilogue_attrs(
        glm5::bind_update_q_results(
            glm5::bind_update_q_args(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                .Arg<ffi::BufferR2<ffi::S32>>()   // page_table
                .Arg<ffi::BufferR1<ffi::S32>>()   // req_ids
                .Arg<ffi::BufferR2<ffi::S32>>())  // block_table
            .Ret<ffi::BufferR2<ffi::S32>>()       // slots
            .Ret<ffi::BufferR1<ffi::S32>>()       // counts
            .Ret<ffi::BufferR2<ffi::F32>>()       // logits
            .Attr<int64_t>("k")
            .Attr<int64_t>("block_size")
            .Attr<int64_t>("stride_rows")
            .Attr<int64_t>("max_block")
            .Attr<int64_t>("next_n")
            .Attr<int32_t>("warps")
            .Attr<int32_t>("split")
            .Attr<int32_t>("tactic")),
    {ffi::Traits::kCmdBufferCompatible});
