// The only nanobind translation unit: hands the FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include <type_traits>

#include "handlers.h"

namespace nb = nanobind;

namespace {

// A capsule is an untyped pointer to XLA: only an FFI handler may go in, checked here at
// compile time rather than found out as a crash at the first call.
template <typename Fn>
nb::capsule capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "a registered capsule must hold an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_glm5_cuda, m) {
  m.doc() = "glm5_jax CUDA kernels as XLA FFI handlers";
  m.def("registrations", [] {
    nb::dict targets;
#define GLM5_REGISTER_HANDLER(target, symbol) targets[#target] = capsule(symbol);
    GLM5_HANDLERS(GLM5_REGISTER_HANDLER)
#undef GLM5_REGISTER_HANDLER
    return targets;
  });
  // The XLA FFI API version the handlers were compiled against (compare with the runtime jaxlib).
  m.def("ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); });
}
