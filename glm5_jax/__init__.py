"""glm5_jax: the GLM-5.3-Flash (GLM-5-Next) DSA kpool indexer decode ops for JAX.

Every op is a JAX primitive (jit, vmap, export) with a CUDA kernel where one is
built and the pure-JAX reference (`glm5_jax.reference`) everywhere else; a
`Routing` value chooses between them.
"""
from jax import export as _export

from . import reference
from ._primitive import Op as _Op
from ._primitive import Routing
# isort: off
# Import order = declaration order = OPS order (the data flow of a decode step); the ops
# are re-exported through __all__, which derives from OPS.
from .indexer import (indexer_projection, indexer_q, indexer_query,  # noqa: F401
                      indexer_projection_fused)
from .kpool import kpool_update, kpool_compress, kpool_seed_tail  # noqa: F401
from .update import (indexer_update, update_epilogue, update_epilogue_q,  # noqa: F401
                     indexer_update_q)
from .expand import expand_pools, expand_and_remap  # noqa: F401
from .logits import upcast_logits, mqa_logits, pool_topk, select_pools, select_slots  # noqa: F401
from .update_select import indexer_update_select  # noqa: F401
# isort: on
from .stage import (DecodeBatch, IndexerCache, IndexerConfig, IndexerOutput,
                    IndexerWeights, indexer_stage, prepare_weights)
from .prefill import PrefillBatch, indexer_prefill
from .checkpoint import load_indexer_weights  # safetensors: imported when it is called
from .checks import check_batch

__version__ = "0.1.0"

# Derived from the op declarations (glm5_jax._primitive.Op): never written out by hand.
OPS = tuple(_Op.registry)
KERNEL_TARGETS = {name: op.kernel for name, op in _Op.registry.items() if op.kernel}


def export_checks() -> list[_export.DisabledSafetyCheck]:
  """The `disabled_checks` jax.export needs for the glm5_ custom calls (FFI targets are
  not on jax's list of stable custom calls): pass them to
  jax.export.export(..., platforms=["cuda"], disabled_checks=glm5_jax.export_checks())."""
  return [_export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_TARGETS.values()]


__all__ = list(OPS) + [
    "DecodeBatch", "IndexerCache", "IndexerConfig", "IndexerOutput",
    "IndexerWeights", "KERNEL_TARGETS", "OPS", "PrefillBatch", "Routing", "check_batch",
    "export_checks", "indexer_prefill", "indexer_stage", "load_indexer_weights",
    "prepare_weights", "reference",
]
