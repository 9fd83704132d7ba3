// The module's FFI handlers, one X(target, symbol) line each: the only list of them. It
// declares the handler symbols and names the targets here and builds registrations() in
// module.cc, so a new kernel is one line here (and its XLA_FFI_DEFINE_HANDLER_SYMBOL in its .cu
// file). The target names must match the ops' declarations in glm5_jax
// (scripts/check_cuda_module.py checks it).
#pragma once

#include "xla/ffi/api/api.h"

#define GLM5_HANDLERS(X)                                                 \
  X(glm5_expand_pools, Glm5ExpandPools)                                  \
  X(glm5_expand_and_remap, Glm5ExpandAndRemap)                           \
  X(glm5_kpool_update, Glm5KpoolUpdate)                                  \
  X(glm5_kpool_compress, Glm5KpoolCompress)                              \
  X(glm5_indexer_update, Glm5IndexerUpdate)                              \
  X(glm5_indexer_update_q, Glm5IndexerUpdateQ)                           \
  X(glm5_indexer_update_select, Glm5IndexerUpdateSelect)                 \
  X(glm5_update_epilogue, Glm5UpdateEpilogue)                            \
  X(glm5_update_epilogue_q, Glm5UpdateEpilogueQ)                         \
  X(glm5_indexer_projection, Glm5IndexerProjection)                      \
  X(glm5_indexer_projection_fused, Glm5IndexerProjectionFused)           \
  X(glm5_indexer_q, Glm5IndexerQ)                                        \
  X(glm5_indexer_query, Glm5IndexerQuery)                                \
  X(glm5_upcast_logits, Glm5UpcastLogits)                                \
  X(glm5_mqa_logits, Glm5MqaLogits)                                      \
  X(glm5_pool_topk, Glm5PoolTopk)                                        \
  X(glm5_select_pools, Glm5SelectPools)                                  \
  X(glm5_select_slots, Glm5SelectSlots)

#define GLM5_DECLARE_HANDLER(target, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
GLM5_HANDLERS(GLM5_DECLARE_HANDLER)
#undef GLM5_DECLARE_HANDLER

// The target names as constants (targets::glm5_kpool_update), for the handlers' error messages.
namespace glm5::targets {
#define GLM5_TARGET_NAME(target, symbol) inline constexpr char target[] = #target;
GLM5_HANDLERS(GLM5_TARGET_NAME)
#undef GLM5_TARGET_NAME
}  // namespace glm5::targets
