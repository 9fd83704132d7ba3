"""Trace-time argument checks: errors name the op and the argument (fail: reference.checks)."""
import numpy as np
import jax.numpy as jnp

from .reference.checks import fail
from .reference.numerics import DIM, POOL, SCALE_FORMATS


def expect(op, arg, aval, dtype, shape):
  """Checks an argument's dtype (one or a tuple) and shape (ints, None = any)."""
  dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
  if not any(aval.dtype == np.dtype(d) for d in dtypes):
    names = " or ".join(np.dtype(d).name for d in dtypes)
    fail(op, arg, f"must be {names}, got {aval.dtype}", TypeError)
  if len(aval.shape) != len(shape) or any(
      s is not None and s != d for s, d in zip(shape, aval.shape)):
    dims = ["*" if s is None else str(s) for s in shape]
    want = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"   # as tuples print
    fail(op, arg, f"must have shape {want}, got {tuple(aval.shape)}")


def check_cache(op, kv_cache, arg="kv_cache"):
  expect(op, arg, kv_cache, np.uint8, (None, None, DIM + 4))


def check_scale_format(op, scale_format, round_scale=True):
  if scale_format not in SCALE_FORMATS:
    fail(op, "scale_format", f"must be one of {SCALE_FORMATS}, got {scale_format!r}")
  if not round_scale and scale_format != "fp32":
    fail(op, "round_scale", "=False needs scale_format='fp32'")


def check_tail(op, tail, arg="tail"):
  expect(op, arg, tail, jnp.bfloat16, (None, 2, None, DIM))
  ring = tail.shape[2]
  if ring < POOL or ring % POOL:
    fail(op, arg, f"ring size (dim 2) must be a multiple of 4, got {ring}")




def positive_int(op, arg, value, multiple=1):
  """value is an int > 0 (and a multiple of `multiple`)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    fail(op, arg, f"must be an int, got {value!r}", TypeError)
  if value <= 0 or value % multiple:
    what = "> 0" if multiple == 1 else f"a positive multiple of {multiple}"
    fail(op, arg, f"must be {what}, got {value}")


def finite(op, arg, value, minimum=None):
  """value is a finite real number (>= minimum)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    fail(op, arg, f"must be a number, got {value!r}", TypeError)
  if not np.isfinite(value) or (minimum is not None and value < minimum):
    bound = "" if minimum is None else f" and >= {minimum}"
    fail(op, arg, f"must be finite{bound}, got {value}")
