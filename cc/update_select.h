// The parts of indexer_update_select (cc/update.cu): the select path's checks and launches, defined
// beside its kernels (cc/select.cu), so that one handler can launch the update part and the
// select path back to back in one FFI call.
#pragma once

#include <cstdint>

#include "common.h"

namespace glm5 {

ffi::Error run_select_slots(const Check& check, cudaStream_t stream, ffi::AnyBuffer q,
                            ffi::BufferR2<ffi::F32> w_out, ffi::BufferR3<ffi::U8> kv,
                            ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> req_ids,
                            ffi::BufferR1<ffi::S32> positions, ffi::BufferR2<ffi::S32> block_table,
                            ffi::ResultBufferR2<ffi::S32> slots,
                            ffi::ResultBufferR1<ffi::S32> counts,
                            ffi::ResultBufferR2<ffi::F32> logits, int64_t k, int64_t block_size,
                            int64_t stride_rows, int64_t max_block, int64_t next_n, bool ue8m0,
                            bool pdl);

}  // namespace glm5
