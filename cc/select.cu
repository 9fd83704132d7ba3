// The select path of a decode step (SPEC §5b, §5c): MQA logits of each row's fp8 queries
// against its pools in the paged fp8 K cache, then the k best pools of each row.
//
//   glm5_mqa_logits    the logits kernel alone (op mqa_logits)
//   glm5_pool_topk     the top-k kernel alone (op pool_topk)
//   glm5_select_pools  both, back to back in one FFI call (op select_pools): rows whose
//                      pools all fit in k skip the logits and select every pool, so the
//                      stage needs no lax.cond.
//   glm5_select_slots  the same, its top-k writing each selected pool's sparse-MLA slots
//                      instead of its id (op select_slots, what indexer_stage runs: no
//                      expand_and_remap launch).
//
// The kernels are in select_logits.cuh, select_topk.cuh and select_topk_cluster.cuh, their
// shared device code in select.cuh: one translation unit.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common.h"
#include "constants.h"
#include "handlers.h"
#include "limits.h"
#include "remap.cuh"
#include "select.cuh"
#include "select_logits.cuh"
#include "select_topk_cluster.cuh"
#include "update_select.h"

namespace glm5 {
namespace {

// --------------------------------------------------------------------------- handlers

// Shapes shared by the logits handlers (the limits are decided in glm5_jax/limits.py, and
// the op routes other shapes to the reference; here they are only validated).
ffi::Error check_logits(const Check& check, ffi::AnyBuffer& q, ffi::BufferR2<ffi::F32>& w_out,
                        ffi::BufferR3<ffi::U8>& kv, int64_t rows, int64_t width) {
  const auto qd = q.dimensions();
  if (q.element_type() != ffi::DataType::F8E4M3FN || qd.size() != 3 || qd[0] != rows ||
      qd[2] != kDim)
    return check.fail("q_fp8 must be e4m3[rows, padded, 128]");
  if (qd[1] != limits::kLogitsHeads[0] && qd[1] != limits::kLogitsHeads[1])
    return check.fail("q_fp8 must have " + std::to_string(limits::kLogitsHeads[0]) + " or " +
                      std::to_string(limits::kLogitsHeads[1]) + " (padded) heads");
  if (w_out.dimensions()[0] != rows || w_out.dimensions()[1] != qd[1])
    return check.fail("w_out must be f32[rows, padded]");
  const auto cd = kv.dimensions();
  if (cd[2] != kEntryBytes || cd[1] % limits::kLogitsPageMultiple != 0 || cd[1] == 0)
    return check.fail("kv_cache must be u8[pages, PAGE, 132] with PAGE % " +
                      std::to_string(limits::kLogitsPageMultiple) + " == 0");
  if (rows > limits::kLogitsMaxRows)
    return check.fail("at most " + std::to_string(limits::kLogitsMaxRows) + " rows");
  if (rows * ((width + kItemPools - 1) / kItemPools) > kI32Max)
    return check.fail("rows * max_pools / " + std::to_string(kItemPools) +
                      " must fit in 32 bits");
  if (width > kI32Max / 2 ||
      cd[0] * cd[1] > kI32Max)
    return check.fail("logits width or cache too large for 32-bit pool ids");
  if (!aligned(q.untyped_data(), 16) || !aligned(kv.untyped_data(), 16))
    return check.fail("q_fp8 and kv_cache must be 16-byte aligned");
  return ffi::Error::Success();
}

LogitsArgs logits_args(ffi::AnyBuffer& q, ffi::BufferR2<ffi::F32>& w_out,
                       ffi::BufferR3<ffi::U8>& kv, ffi::BufferR2<ffi::S32>& page_table,
                       float* logits, int64_t rows, int64_t width, bool ue8m0) {
  LogitsArgs a{};
  a.q = static_cast<const uint8_t*>(q.untyped_data());
  a.w_out = w_out.typed_data();
  a.kv = kv.typed_data();
  a.page_table = page_table.typed_data();
  a.logits = logits;
  a.rows = static_cast<int32_t>(rows);
  a.tables = static_cast<int32_t>(page_table.dimensions()[0]);
  a.table_width = static_cast<int32_t>(page_table.dimensions()[1]);
  a.pages = static_cast<int32_t>(kv.dimensions()[0]);
  a.page = Divisor::extent(kv.dimensions()[1]);
  a.width = static_cast<int32_t>(width);
  a.skip_upto = -1;
  a.group = 1;
  a.ue8m0 = ue8m0;
  return a;
}

// The top-k arguments both handlers share (shapes already checked against the limits).
TopkArgs topk_args(const float* logits, const int32_t* lens, int32_t* out, int64_t rows,
                   int64_t width, int64_t k) {
  TopkArgs a{};
  a.logits = logits;
  a.lens = lens;
  a.out = out;
  a.rows = static_cast<int32_t>(rows);
  a.width = static_cast<int32_t>(width);
  a.k = static_cast<int32_t>(k);
  return a;
}

ffi::Error MqaLogitsImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::BufferR2<ffi::F32> w_out,
                         ffi::BufferR3<ffi::U8> kv, ffi::BufferR2<ffi::S32> page_table,
                         ffi::BufferR1<ffi::S32> pool_lens, ffi::ResultBufferR2<ffi::F32> logits,
                         bool ue8m0, bool pdl) {
  const Check check{targets::glm5_mqa_logits};
  const int64_t rows = logits->dimensions()[0], width = logits->dimensions()[1];
  if (ffi::Error err = check_logits(check, q, w_out, kv, rows, width); err.failure()) return err;
  if (page_table.dimensions()[0] != rows || pool_lens.dimensions()[0] != rows)
    return check.fail("page_table and pool_lens need `rows` rows");
  if (rows == 0 || width == 0) return ffi::Error::Success();
  LogitsArgs a = logits_args(q, w_out, kv, page_table, logits->typed_data(), rows, width, ue8m0);
  a.lens = pool_lens.typed_data();
  a.fill = true;
  return check.cuda(launch_logits(stream, pdl, a, q.dimensions()[1]));
}

ffi::Error PoolTopkImpl(cudaStream_t stream, ffi::BufferR2<ffi::F32> logits,
                        ffi::BufferR1<ffi::S32> pool_lens, ffi::ResultBufferR2<ffi::S32> ids,
                        bool pdl) {
  const Check check{targets::glm5_pool_topk};
  const int64_t rows = logits.dimensions()[0], width = logits.dimensions()[1];
  const int64_t k = ids->dimensions()[1];
  if (ids->dimensions()[0] != rows || pool_lens.dimensions()[0] != rows)
    return check.fail("pool_lens and the result need `rows` rows");
  if (width > kTopkMaxPools)
    return check.fail("logits wider than " + std::to_string(kTopkMaxPools) + " pools");
  if (rows > kI32Max || k > kI32Max) return check.fail("too many rows or k");
  if (rows == 0 || k == 0) return ffi::Error::Success();
  return check.cuda(launch_topk(stream, pdl, topk_args(logits.typed_data(), pool_lens.typed_data(),
                                                      ids->typed_data(), rows, width, k)));
}

// The select path's two kernels back to back (select_pools, select_slots): the logits of
// the rows with more than k pools, then the top-k writing pool ids (ids) or slots
// (slots.out). Shapes of the logits side are checked here; the caller checks its results.
ffi::Error launch_select(const Check& check, cudaStream_t stream, ffi::AnyBuffer& q,
                         ffi::BufferR2<ffi::F32>& w_out, ffi::BufferR3<ffi::U8>& kv,
                         ffi::BufferR2<ffi::S32>& page_table, ffi::BufferR1<ffi::S32>& req_ids,
                         ffi::BufferR1<ffi::S32>& positions, ffi::Result<ffi::BufferR2<ffi::F32>>& logits,
                         int32_t* ids, const SlotArgs& slots, int64_t k, int64_t next_n,
                         bool ue8m0, bool pdl) {
  const int64_t rows = logits->dimensions()[0], width = logits->dimensions()[1];
  if (ffi::Error err = check_logits(check, q, w_out, kv, rows, width); err.failure()) return err;
  if (req_ids.dimensions()[0] != rows || positions.dimensions()[0] != rows)
    return check.fail("req_ids and positions need `rows` rows");
  if (width > kTopkMaxPools)
    return check.fail("max_pools above " + std::to_string(kTopkMaxPools));
  if (k <= 0 || k > kI32Max) return check.fail("k must be in [1, 2^31)");
  if (next_n < 1) return check.fail("next_n must be >= 1");
  if (rows == 0) return ffi::Error::Success();
  LogitsArgs a = logits_args(q, w_out, kv, page_table, logits->typed_data(), rows, width, ue8m0);
  a.req_ids = req_ids.typed_data();
  a.lens = positions.typed_data();
  a.from_positions = true;
  a.skip_upto = static_cast<int32_t>(std::min<int64_t>(k, width));
  // Rows come as requests of next_n rows: units of up to LOGITS_GROUP_ROWS rows of one
  // request share each K tile's read (the pool spans need 28 bits: wider logits do not).
  a.group = width < (int64_t{1} << 28)
                ? static_cast<int32_t>(std::min<int64_t>(next_n, limits::kLogitsGroupRows))
                : 1;
  cudaError_t err = launch_logits(stream, pdl, a, q.dimensions()[1]);
  if (err != cudaSuccess) return check.cuda(err);
  TopkArgs b = topk_args(logits->typed_data(), positions.typed_data(), ids, rows, width, k);
  b.slots = slots;
  b.from_positions = true;
  b.early_rows = pdl;
  // Without PDL the top-k simply runs after the logits; with it, it overlaps their tail.
  return check.cuda(launch_topk(stream, pdl, b));
}

ffi::Error SelectPoolsImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::BufferR2<ffi::F32> w_out,
                           ffi::BufferR3<ffi::U8> kv, ffi::BufferR2<ffi::S32> page_table,
                           ffi::BufferR1<ffi::S32> req_ids, ffi::BufferR1<ffi::S32> positions,
                           ffi::ResultBufferR2<ffi::S32> ids,
                           ffi::ResultBufferR2<ffi::F32> logits, int64_t next_n, bool ue8m0,
                           bool pdl) {
  const Check check{targets::glm5_select_pools};
  if (ids->dimensions()[0] != logits->dimensions()[0])
    return check.fail("the ids need `rows` rows");
  const int64_t k = ids->dimensions()[1];
  if (k == 0) return ffi::Error::Success();
  return launch_select(check, stream, q, w_out, kv, page_table, req_ids, positions, logits,
                       ids->typed_data(), SlotArgs{}, k, next_n, ue8m0, pdl);
}

}  // namespace

// select_slots' checks and launches under `check` (its own handler's, or indexer_update_select's,
// cc/update_select.h).
ffi::Error run_select_slots(const Check& check, cudaStream_t stream, ffi::AnyBuffer q,
                            ffi::BufferR2<ffi::F32> w_out, ffi::BufferR3<ffi::U8> kv,
                            ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> req_ids,
                            ffi::BufferR1<ffi::S32> positions, ffi::BufferR2<ffi::S32> block_table,
                            ffi::ResultBufferR2<ffi::S32> slots,
                            ffi::ResultBufferR1<ffi::S32> counts,
                            ffi::ResultBufferR2<ffi::F32> logits, int64_t k, int64_t block_size,
                            int64_t stride_rows, int64_t max_block, int64_t next_n, bool ue8m0,
                            bool pdl) {
  const int64_t rows = logits->dimensions()[0], width = slots->dimensions()[1];
  if (slots->dimensions()[0] != rows || counts->dimensions()[0] != rows)
    return check.fail("the slots and counts need `rows` rows");
  SlotArgs s{};
  s.requests = block_table.dimensions()[0];
  s.max_blocks = block_table.dimensions()[1];
  if (ffi::Error err = check_remap(check, s.requests, s.max_blocks, block_size, stride_rows,
                                   max_block, k, width);
      err.failure())
    return err;
  s.req_ids = req_ids.typed_data();
  s.block_table = block_table.typed_data();
  s.out = slots->typed_data();
  s.counts = counts->typed_data();
  s.block_size = Divisor(static_cast<int32_t>(block_size));
  s.stride_rows = static_cast<int32_t>(stride_rows);
  s.max_block = static_cast<int32_t>(max_block);
  s.width = static_cast<int32_t>(width);
  s.vector = width % kPool == 0 && aligned(s.out, 16);
  return launch_select(check, stream, q, w_out, kv, page_table, req_ids, positions, logits,
                       nullptr, s, k, next_n, ue8m0, pdl);
}

namespace {

ffi::Error SelectSlotsImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::BufferR2<ffi::F32> w_out,
                           ffi::BufferR3<ffi::U8> kv, ffi::BufferR2<ffi::S32> page_table,
                           ffi::BufferR1<ffi::S32> req_ids, ffi::BufferR1<ffi::S32> positions,
                           ffi::BufferR2<ffi::S32> block_table,
                           ffi::ResultBufferR2<ffi::S32> slots,
                           ffi::ResultBufferR1<ffi::S32> counts,
                           ffi::ResultBufferR2<ffi::F32> logits, int64_t k, int64_t block_size,
                           int64_t stride_rows, int64_t max_block, int64_t next_n, bool ue8m0,
                           bool pdl) {
  return run_select_slots(Check{targets::glm5_select_slots}, stream, q, w_out, kv, page_table,
                          req_ids, positions, block_table, slots, counts, logits, k, block_size,
                          stride_rows, max_block, next_n, ue8m0, pdl);
}

// The stream and the operands both select handlers take first, in launch_select's order.
auto bind_select() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()            // q_fp8 (e4m3)
      .Arg<ffi::BufferR2<ffi::F32>>()   // w_out
      .Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
      .Arg<ffi::BufferR2<ffi::S32>>()   // page_table
      .Arg<ffi::BufferR1<ffi::S32>>()   // req_ids
      .Arg<ffi::BufferR1<ffi::S32>>();  // positions
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5MqaLogits, glm5::MqaLogitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // q_fp8 (e4m3)
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // w_out
                                  .Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // page_table
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // pool_lens
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5PoolTopk, glm5::PoolTopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // pool_lens
                                  .Ret<ffi::BufferR2<ffi::S32>>()   // pool_ids
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5SelectPools, glm5::SelectPoolsImpl,
                              glm5::bind_select()
                                  .Ret<ffi::BufferR2<ffi::S32>>()   // pool_ids
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Attr<int64_t>("next_n")          // next_n
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5SelectSlots, glm5::SelectSlotsImpl,
                              glm5::bind_select()
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // block_table
                                  .Ret<ffi::BufferR2<ffi::S32>>()   // slots
                                  .Ret<ffi::BufferR1<ffi::S32>>()   // counts
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Attr<int64_t>("k")               // k
                                  .Attr<int64_t>("block_size")      // block_size
                                  .Attr<int64_t>("stride_rows")     // stride_rows
                                  .Attr<int64_t>("max_block")       // max_block
                                  .Attr<int64_t>("next_n")          // next_n
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});
