"""Pure-JAX reference of every glm5_jax op: the executable spec (SPEC.md).

Jit-able with static shapes and no XLA flags. Each op is the CPU lowering of
its primitive, the GPU fallback (GLM5_JAX_KERNELS) and the oracle the CUDA
kernels are tested against.
"""
from .expand import expand_and_remap, expand_pools
from .indexer import (
    indexer_projection,
    indexer_projection_fused,
    indexer_q,
    indexer_query,
    key_layernorm,
    projection_sums,
    split_projection,
)
from .kpool import kpool_compress, kpool_seed_tail, kpool_update, prefill_windows
from .logits import (
  mqa_logits,
  pool_counts,
  pool_topk,
  row_pages,
  select_pools,
  select_slots,
  upcast_logits,
)
from .update import (
  indexer_update,
  indexer_update_q,
  indexer_update_select,
  update_epilogue,
  update_epilogue_q,
)

__all__ = [
    "expand_and_remap", "expand_pools", "indexer_projection",
    "indexer_projection_fused", "indexer_q", "indexer_query", "indexer_update",
    "indexer_update_q", "indexer_update_select", "key_layernorm",
    "kpool_compress", "kpool_seed_tail", "kpool_update", "mqa_logits",
    "pool_counts", "pool_topk", "prefill_windows", "projection_sums", "row_pages", "select_pools",
    "select_slots", "split_projection", "update_epilogue", "update_epilogue_q", "upcast_logits",
]
