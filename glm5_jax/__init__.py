"""glm5_jax: the GLM-5.3-Flash (GLM-5-Next) DSA kpool indexer decode ops for JAX.

Every op is a JAX primitive (jit, vmap, export) with a CUDA kernel where one is
built and the pure-JAX reference (`glm5_jax.reference`) everywhere else.
"""
from . import reference
from ._ffi import KERNEL_TARGETS, kernels_enabled
from .expand import expand_and_remap, expand_pools
from .indexer import indexer_projection, indexer_projection_fused, indexer_query
from .kpool import kpool_compress, kpool_seed_tail, kpool_update
from .logits import mqa_logits, pool_topk, select_pools, upcast_logits
from .stage import (DecodeBatch, IndexerCache, IndexerConfig, IndexerOutput,
                    IndexerWeights, indexer_stage, prepare_weights)

__version__ = "0.1.0"

OPS = ("indexer_projection", "indexer_query", "indexer_projection_fused",
       "kpool_update", "kpool_compress", "kpool_seed_tail", "expand_pools",
       "expand_and_remap", "upcast_logits", "mqa_logits", "pool_topk", "select_pools")

__all__ = list(OPS) + [
    "DecodeBatch", "IndexerCache", "IndexerConfig", "IndexerOutput",
    "IndexerWeights", "KERNEL_TARGETS", "OPS", "indexer_stage",
    "kernels_enabled", "prepare_weights", "reference",
]
