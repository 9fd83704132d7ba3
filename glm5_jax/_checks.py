"""Trace-time argument checks: errors name the op and the argument."""
import numpy as np
import jax.numpy as jnp

from .reference.numerics import DIM, POOL, SCALE_FORMATS


def fail(op, arg, message, error=ValueError):
  raise error(f"glm5_jax.{op}: {arg} {message}")


def expect(op, arg, aval, dtype, shape):
  """Checks an argument's dtype (one or a tuple) and shape (ints, None = any)."""
  dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
  if not any(aval.dtype == np.dtype(d) for d in dtypes):
    names = " or ".join(np.dtype(d).name for d in dtypes)
    fail(op, arg, f"must be {names}, got {aval.dtype}", TypeError)
  if len(aval.shape) != len(shape) or any(
      s is not None and s != d for s, d in zip(shape, aval.shape)):
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    fail(op, arg, f"must have shape {want}, got {tuple(aval.shape)}")


def check_cache(op, kv_cache):
  expect(op, "kv_cache", kv_cache, np.uint8, (None, None, DIM + 4))


def check_scale_format(op, scale_format, round_scale=True):
  if scale_format not in SCALE_FORMATS:
    fail(op, "scale_format", f"must be one of {SCALE_FORMATS}, got {scale_format!r}")
  if not round_scale and scale_format != "fp32":
    fail(op, "round_scale", "=False needs scale_format='fp32'")


def check_tail(op, tail):
  expect(op, "tail", tail, jnp.bfloat16, (None, 2, None, DIM))
  ring = tail.shape[2]
  if ring < POOL or ring % POOL:
    fail(op, "tail", f"ring size (dim 2) must be a multiple of 4, got {ring}")


