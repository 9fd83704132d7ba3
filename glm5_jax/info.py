"""Diagnostics: `python -m glm5_jax.info` prints versions, platforms and which
ops run a CUDA kernel."""
import jax
import jaxlib

import glm5_jax
from glm5_jax import _ffi
from glm5_jax._primitive import Op


def report():
  """The diagnostics as lines of text."""
  built = _ffi.register_targets()
  lines = [
      f"glm5_jax {glm5_jax.__version__}",
      f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
      f"CUDA module: {'built, FFI API %d.%d' % _ffi.ffi_api_version() if built else 'not built'}",
      f"platforms: {', '.join(sorted({d.platform for d in jax.devices()}))}",
      "ops (on CUDA):",
  ]
  for op in glm5_jax.OPS:
    target = _ffi.KERNEL_TARGETS.get(op)
    if target is None:
      how = "reference (no kernel yet)"
    elif not built:
      how = "reference (CUDA module not built)"
    elif not _ffi.kernels_enabled(op):
      why = ("GLM5_JAX_KERNELS" if _ffi.kernel_switch(op) is not None
             else _ffi.KERNEL_DEFAULT_OFF[op])
      how = f"reference ({why}; kernel {target} with GLM5_JAX_KERNELS={op}=1)"
    else:
      spec = Op.registry[op]
      where = [spec.kernel_limits] + (
          [spec.kernel_default_note] if _ffi.kernel_switch(op) is None else [])
      where = "; ".join(filter(None, where))
      how = f"kernel {target}" + (f" ({where}; otherwise reference)" if where else "")
    lines.append(f"  {op:26s} {how}")
  return lines


if __name__ == "__main__":
  print("\n".join(report()))
