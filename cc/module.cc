// The only nanobind translation unit: hands the FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_glm5_cuda, m) {
  m.doc() = "glm5_jax CUDA kernels as XLA FFI handlers";
  m.def("registrations", [] {
    nb::dict targets;
    targets["glm5_expand_pools"] = capsule(Glm5ExpandPools);
    targets["glm5_expand_and_remap"] = capsule(Glm5ExpandAndRemap);
    targets["glm5_kpool_update"] = capsule(Glm5KpoolUpdate);
    targets["glm5_indexer_projection"] = capsule(Glm5IndexerProjection);
    targets["glm5_indexer_projection_fused"] = capsule(Glm5IndexerProjectionFused);
    targets["glm5_indexer_query"] = capsule(Glm5IndexerQuery);
    targets["glm5_upcast_logits"] = capsule(Glm5UpcastLogits);
    targets["glm5_mqa_logits"] = capsule(Glm5MqaLogits);
    targets["glm5_pool_topk"] = capsule(Glm5PoolTopk);
    targets["glm5_select_pools"] = capsule(Glm5SelectPools);
    return targets;
  });
  // The XLA FFI API version the handlers were compiled against (compare with the runtime jaxlib).
  m.def("ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); });
}
