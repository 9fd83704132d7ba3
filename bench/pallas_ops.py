"""What a JAX user could write with Pallas (Triton backend on the GPU, the
interpreter on the CPU), timed by the bench (bench/variants.py) next to the CUDA kernels.

A Pallas-Triton call is compiled by XLA into an ordinary kernel (on the H200 an
empty one costs what an empty XLA fusion does, 0.86 µs, against 1.5-1.75 µs for
an empty FFI call, both measured in the earlier device loop: BENCHMARKS.md
calibration); `empty` measures that per-call cost, `upcast_logits` a whole op
(docs/semantics.md §8: f32(logits) below each row end; the columns past it are 0
here, unspecified in the op).
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

TILE = 2048                     # columns per program


def _params(num_warps):
  """Triton on the GPU; the Pallas interpreter elsewhere (CPU smoke runs)."""
  if jax.default_backend() == "gpu":
    return dict(compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1))
  return dict(interpret=True)


def _add_one(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1


def empty(x):
  """x + 1 on a small f32[n] (n a power of two), one program."""
  return pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        **_params(1))(x)


def _upcast(ends_ref, x_ref, o_ref):
  cols = pl.program_id(1) * TILE + lax.broadcasted_iota(jnp.int32, (1, TILE), 1)
  o_ref[...] = jnp.where(cols < ends_ref[...][:, None], x_ref[...].astype(jnp.float32), 0.0)


def upcast_logits(logits, row_ends):
  """bf16[rows, P] (P % 2048 == 0), i32[rows] -> f32[rows, P]."""
  rows, width = logits.shape
  assert width % TILE == 0, "P must be a multiple of the tile"
  return pl.pallas_call(
      _upcast, grid=(rows, width // TILE),
      in_specs=[pl.BlockSpec((1,), lambda r, c: (r,)),
                pl.BlockSpec((1, TILE), lambda r, c: (r, c))],
      out_specs=pl.BlockSpec((1, TILE), lambda r, c: (r, c)),
      out_shape=jax.ShapeDtypeStruct((rows, width), jnp.float32),
      **_params(4))(row_ends, logits)
