// indexer_q's launch (q_gemm.cu) as a checked plan and its stream work, so that glm5_indexer_q
// and glm5_update_epilogue_q (update.cu) launch the GEMM by one rule.
#pragma once

#include <cstdint>

#include "common.h"
#include "limits.h"

namespace glm5 {

// Tactics (the "tactic" attribute: its index in glm5_jax.limits.Q_TACTICS).
using limits::kQMma;
using limits::kQWgmma;

struct QGemmLaunch {
  const void* x = nullptr;   // qr bf16[M, K]
  const void* w = nullptr;   // wq_b bf16[N, K]
  void* q = nullptr;         // bf16[M, N]
  int64_t rows = 0, n = 0, k = 0;
  int32_t tactic = kQWgmma;
};

// Validates qr, wq_b and the q result (bf16[M, N]) for `tactic`; no stream work. M = 0
// plans a launch that does nothing.
ffi::ErrorOr<QGemmLaunch> prepare_q_gemm(const Check& check, ffi::BufferR2<ffi::BF16> qr,
                                         ffi::BufferR2<ffi::BF16> wq_b,
                                         ffi::ResultBufferR2<ffi::BF16> q, int32_t tactic);

cudaError_t launch_q_gemm(cudaStream_t stream, bool pdl, const QGemmLaunch& plan);

}  // namespace glm5
