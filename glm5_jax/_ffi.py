"""The CUDA module: loading it, registering its FFI targets with XLA, and whether this
process has a GPU. Which op lowers to which target, and when, is declared with each
op (`glm5_jax._primitive.Op`) and decided by the `Routing`."""
import functools
import warnings

import jax

try:
  from . import _glm5_cuda
except ImportError:
  _glm5_cuda = None


@functools.cache
def register_targets():
  """Registers the module's CUDA handlers with XLA once; False without the module."""
  if _glm5_cuda is None:
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
