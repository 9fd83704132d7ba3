"""Diagnostics: `python -m glm5_jax.info` prints versions, platforms, the routing and
which ops run a CUDA kernel, all derived from the op declarations."""
import jax
import jaxlib

import glm5_jax
from glm5_jax import _ffi
from glm5_jax._primitive import KERNELS_ENV, Op, Routing


def describe(op: Op, routing: Routing, built: bool) -> str:
  """Where `op` runs on CUDA under `routing`, in words."""
  if op.kernel is None:
    return "reference (no kernel; the README's op table says why)"
  if not built:
    return "reference (CUDA module not built)"
  word = routing.word(op.name)
  if not op.kernel_on(routing):
    why = f"off in {KERNELS_ENV}/Routing" if word is not None else op.kernel_off
    return f"{op.otherwise} ({why}; kernel {op.kernel} with {KERNELS_ENV}={op.name}=1)"
  where = [op.kernel_limits] + ([op.kernel_default_note] if word is None else [])
  where = "; ".join(filter(None, where))
  return f"kernel {op.kernel}" + (f" ({where}; otherwise {op.otherwise})" if where else "")


def report() -> list[str]:
  """The diagnostics as lines of text."""
  built = _ffi.register_targets()
  routing = Routing.from_env()
  lines = [
      f"glm5_jax {glm5_jax.__version__}",
      f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
      f"CUDA module: {'built, FFI API %d.%d' % _ffi.ffi_api_version() if built else 'not built'}",
      f"platforms: {', '.join(sorted({d.platform for d in jax.devices()}))}",
      f"routing: {routing}",
      "ops (on CUDA):",
  ]
  lines += [f"  {name:26s} {describe(op, routing, built)}" for name, op in Op.registry.items()]
  return lines


if __name__ == "__main__":
  print("\n".join(report()))
