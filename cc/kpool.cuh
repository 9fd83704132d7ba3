// kpool_update's launch (kpool.cu) as a checked plan and its stream work, so that
// glm5_kpool_update and glm5_indexer_update (update.cu) launch the kernel by one rule.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace glm5 {

struct UpdateArgs {
  uint8_t* cache;            // u8[pages, page, 132], dense
  uint16_t* tail;            // bf16[blocks, 2, ring, 128], dense; read and written
  // Read-only for the kernel's lifetime (never aliased with cache/tail): read via __ldg.
  const int32_t* tslot;      // [B, N]
  const uint16_t* key;       // bf16[B, N, 128]
  const uint16_t* gate;      // bf16[B, N, 128]
  const float* ape;          // f32[4, 128]
  const int32_t* loc;        // [B, N]
  const int32_t* pos;        // [B, N]
  int64_t capacity;          // pages * page: flat slots of the cache
  int64_t blocks;            // tail blocks
  int32_t next_n;            // N
  Divisor ring;              // RING
  Divisor page;              // PAGE (1 for an empty cache: nothing is written then)
};

struct UpdateLaunch {
  // A cache result XLA did not alias with its operand starts as a copy of it (kpool.cu).
  struct Copy {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
  };
  UpdateArgs args;
  void (*kernel)(UpdateArgs) = nullptr;  // null: no rows, only the copies (if any) to do
  unsigned requests = 0;
  size_t smem = 0;                       // per request warp
  bool ue8m0 = false, round_scale = true;  // the scale format (the kernel's instantiation)
  Copy copies[2];
};

struct QueryLaunch;  // query.cuh

// Validates the buffers; no stream work.
ffi::ErrorOr<UpdateLaunch> prepare_kpool_update(
    const Check& check, ffi::BufferR3<ffi::U8> kv_cache, ffi::BufferR4<ffi::BF16> tail,
    ffi::BufferR2<ffi::S32> tslot, ffi::BufferR3<ffi::BF16> key, ffi::BufferR3<ffi::BF16> gate,
    ffi::BufferR2<ffi::F32> ape, ffi::BufferR2<ffi::S32> loc, ffi::BufferR2<ffi::S32> pos,
    ffi::ResultBufferR3<ffi::U8> kv_out, ffi::ResultBufferR4<ffi::BF16> tail_out, bool ue8m0,
    bool round_scale);

// The copies of unaliased caches, then the kernel (with PDL only where nothing was copied).
cudaError_t launch_kpool_update(cudaStream_t stream, bool pdl, const UpdateLaunch& plan);

// indexer_update's epilogue: launch_kpool_update's copies, then one kernel that does what
// indexer_query's kernel and kpool_update's do one after the other (the same bits), the key
// LayerNorm folded into the request warps: `query` and `update` as prepare_query and
// prepare_kpool_update planned them (update's key is the query's key result). Where the query
// plan's args.raw is set (update_epilogue), key_raw, head_w and the gate are read from it.
// operands_ready: a kernel of the same FFI call runs before the epilogue and triggers its
// dependents only after its own PDL wait (q's GEMM, the projection), so that all the work
// before the call is complete when the epilogue starts: its request warps then load what no
// GEMM writes before their wait. False where the epilogue is the call's first kernel.
cudaError_t launch_update_epilogue(cudaStream_t stream, bool pdl, const QueryLaunch& query,
                                   const UpdateLaunch& update, bool operands_ready);

}  // namespace glm5
