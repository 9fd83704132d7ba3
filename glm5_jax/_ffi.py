"""The CUDA module, its FFI targets and the per-op kernel switch.

`GLM5_JAX_KERNELS` routes ops to their CUDA kernel or to the pure-JAX
reference on GPU: unset = every kernel on except those slower than XLA's own
code (KERNEL_DEFAULT_OFF; an op can also limit its default to the shapes where
its kernel is faster: Op.kernel_default), "1" = every kernel on wherever it
supports the shapes, "0" = all off, and
comma-separated "op=0" / "op=1" entries override (e.g. "0,kpool_update=1").
It is read when a function is lowered (first jit call), not per call.
"""
import functools
import os
import warnings

import jax

# Ops with a CUDA kernel -> FFI target. The module's registrations() must match.
KERNEL_TARGETS = {
    "expand_pools": "glm5_expand_pools",
    "expand_and_remap": "glm5_expand_and_remap",
    "kpool_update": "glm5_kpool_update",
    "indexer_projection": "glm5_indexer_projection",
    "indexer_query": "glm5_indexer_query",
    "indexer_projection_fused": "glm5_indexer_projection_fused",
    "upcast_logits": "glm5_upcast_logits",
    "mqa_logits": "glm5_mqa_logits",
    "pool_topk": "glm5_pool_topk",
    "select_pools": "glm5_select_pools",
}

# Kernels that lose to the jitted reference on the H200 (BENCHMARKS.md): built,
# tested, and used only when GLM5_JAX_KERNELS asks for them.
KERNEL_DEFAULT_OFF = {
    "upcast_logits": "XLA's fused convert is faster at most measured shapes",
    "expand_pools": "XLA's fusion is as fast or faster up to 64 rows",
    "indexer_projection_fused": ("slower than the indexer_projection and indexer_query "
                                 "kernels at every measured M (1-64)"),
}

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


def kernel_switch(op):
  """GLM5_JAX_KERNELS's word on `op`: True or False where an entry names it (or every
  op), None where none does (the op's default applies)."""
  from . import OPS
  switch = None
  for entry in filter(None, os.environ.get("GLM5_JAX_KERNELS", "").replace(" ", "").split(",")):
    name, _, value = entry.rpartition("=")
    if value not in ("0", "1") or name not in ("", "all", *OPS):
      _warn_once(f"GLM5_JAX_KERNELS: ignoring entry {entry!r} (want 0, 1 or <op>=0|1)")
    elif name in ("", "all", op):
      switch = value == "1"
  return switch


def kernels_enabled(op):
  """Whether GLM5_JAX_KERNELS lets `op` use its kernel (by default only at the shapes
  where it is faster: Op.kernel_default)."""
  switch = kernel_switch(op)
  return op not in KERNEL_DEFAULT_OFF if switch is None else switch


@functools.cache
def local_cuda():
  """Whether this process has a CUDA device."""
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


@functools.cache
def _warn_once(message):
  warnings.warn(message, RuntimeWarning, stacklevel=3)


def kernel_target(op):
  """The FFI target `op` lowers to on CUDA, or None for the reference.

  Without the built module the target is still used when lowering for a GPU
  this process does not have (jax.export); on a real GPU the op falls back to
  the reference with a warning.
  """
  target = KERNEL_TARGETS.get(op)
  if target is None or not kernels_enabled(op):
    return None
  if not register_targets() and local_cuda():
    _warn_once("glm5_jax: the CUDA module is not built (rebuild with "
               "GLM5_JAX_ENABLE_CUDA=ON); every op runs its pure-JAX reference")
    return None
  return target
