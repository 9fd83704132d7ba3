"""Checks a CUDA build of glm5_jax without a GPU (CI runs it after the CUDA compile).

The module must import (static cudart), expose exactly the FFI targets that
glm5_jax.KERNEL_TARGETS (the op declarations) lists, register them for CUDA, and be built
against FFI headers no newer than the installed jaxlib's.
"""
import pathlib
import re
import sys


def fail(msg):
  print(f"check_cuda_module: FAIL: {msg}", file=sys.stderr)
  sys.exit(1)


def header_api_version(jax_ffi):
  text = (pathlib.Path(jax_ffi.include_dir()) / "xla/ffi/api/c_api.h").read_text()
  major, minor = (re.search(rf"#define XLA_FFI_API_{k} (\d+)", text) for k in ("MAJOR", "MINOR"))
  return int(major.group(1)), int(minor.group(1))


def main():
  # Lazy imports: a broken build should fail here with a message, not at module load.
  try:
    from glm5_jax import _glm5_cuda
  except ImportError as e:
    fail(f"cannot import glm5_jax._glm5_cuda (built with GLM5_JAX_ENABLE_CUDA=ON?): {e}")
  import jax
  import jax.ffi
  import jaxlib

  from glm5_jax import KERNEL_TARGETS

  targets = _glm5_cuda.registrations()
  declared = set(KERNEL_TARGETS.values())
  if set(targets) != declared:
    fail(f"registrations() {sorted(targets)} != KERNEL_TARGETS {sorted(declared)}; "
         f"missing in module: {sorted(declared - set(targets))}, "
         f"not declared by any Op: {sorted(set(targets) - declared)}")
  for name, capsule in targets.items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")

  built = tuple(_glm5_cuda.ffi_api_version())
  runtime = header_api_version(jax.ffi)
  print(f"glm5_jax._glm5_cuda: {_glm5_cuda.__file__}")
  print(f"FFI API built {built[0]}.{built[1]}, jaxlib {jaxlib.__version__} headers "
        f"{runtime[0]}.{runtime[1]} (jax {jax.__version__})")
  print(f"registered for CUDA: {', '.join(sorted(targets))}")
  if built[0] != runtime[0] or built[1] > runtime[1]:
    fail("module built against newer/different FFI headers than the installed jaxlib; "
         "rebuild with --no-build-isolation")
  print("check_cuda_module: OK")


if __name__ == "__main__":
  main()
