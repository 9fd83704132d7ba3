"""The CUDA module: loading it, registering its FFI targets with XLA, and whether this
process has a GPU the kernels are built for. Which op lowers to which target, and when,
is declared with each op (`glm5_jax._primitive.Op`) and decided by the `Routing`."""
import functools
import warnings

import jax

try:
  from . import _glm5_cuda
except ImportError:
  _glm5_cuda = None

# The kernels are built for sm_90a only (CMakeLists.txt): other GPUs run the reference.
SUPPORTED_CAPABILITY = "9.0"


@functools.cache
def _supported_gpu():
  """Whether every local CUDA device has compute capability SUPPORTED_CAPABILITY;
  warns once (naming the devices' capabilities) when one does not."""
  caps = {str(getattr(d, "compute_capability", "unknown")) for d in jax.devices("cuda")}
  if caps == {SUPPORTED_CAPABILITY}:
    return True
  warn_once(f"glm5_jax: the CUDA kernels need compute capability {SUPPORTED_CAPABILITY} "
            f"(Hopper, sm_90a), this machine has {', '.join(sorted(caps))}; every op runs its "
            "pure-JAX reference")
  return False


@functools.cache
def register_targets():
  """Registers the module's CUDA handlers with XLA once; False without the module or
  on a GPU the kernels are not built for (_supported_gpu)."""
  if _glm5_cuda is None or (local_cuda() and not _supported_gpu()):
    return False
  for name, capsule in _glm5_cuda.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return True


def ffi_api_version():
  """(major, minor) of the XLA FFI headers the module was built with, or None."""
  return None if _glm5_cuda is None else tuple(_glm5_cuda.ffi_api_version())


@functools.cache
def local_cuda():
  """Whether this process has a CUDA device."""
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


@functools.cache
def warn_once(message):
  warnings.warn(message, RuntimeWarning, stacklevel=4)
