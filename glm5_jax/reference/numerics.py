"""Rounding points and arithmetic shared by the reference ops (SPEC §2b, §3, §11.1).

Every bf16 rounding point is a `reduce_precision`, which XLA keeps even with its
default excess-precision rewrites (a plain f32->bf16->f32 round trip may be
deleted). The FMA of the pooled accumulator is emulated exactly with fp32
error-free transformations, so the reference gives the same bits on CPU and GPU
whether or not XLA contracts multiply-adds.
"""
import numpy as np
import jax.numpy as jnp
from jax import lax

DIM = 128                     # head dim = Hadamard size
POOL = 4                      # tokens per kpool entry
FP8_MAX = 448.0
LOG2E = np.uint32(0x3FB8AA3B).view(np.float32)          # fp32(log2 e)
INV_SQRT_DIM = np.uint32(0x3DB504F3).view(np.float32)   # fp32(1/sqrt(128))
INV_FP8_MAX = np.uint32(0x3B124925).view(np.float32)    # fp32(1/448)
AMAX_FLOOR = np.float32(1e-4)
SCALE_FORMATS = ("fp32", "ue8m0")


def round_bf16(x):
  """f32 -> nearest-even bf16 value, kept as f32."""
  return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def _two_sum(a, b):
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.int32)


def _round_to_odd_sum(a, b):
  """a + b rounded to odd (the neighbour with an odd last bit when inexact)."""
  s, e = _two_sum(a, b)
  bits = _bits(s)
  toward = jnp.where((e > 0) == (s > 0), 1, -1)
  fix = (e != 0) & ((bits & 1) == 0)
  return lax.bitcast_convert_type(jnp.where(fix, bits + toward, bits), jnp.float32)


def fma_bf16(a, b, c):
  """Single-rounding fp32 a*b + c for any fp32 a and a bf16-valued b.

  a splits into 16 + 8 significant bits, so both partial products are exact;
  the three-term sum is rounded once (Boldo-Melquiond: TwoSum, TwoSum, round
  to odd, round to nearest).
  """
  a_hi = lax.bitcast_convert_type(_bits(a) & jnp.int32(-256), jnp.float32)
  p_hi, p_lo = a_hi * b, (a - a_hi) * b
  uh, ul = _two_sum(p_lo, c)
  th, tl = _two_sum(p_hi, uh)
  # An Inf operand or result is IEEE fma's (Inf, or NaN for Inf - Inf): the split's 0 * Inf
  # and TwoSum's Inf - Inf would make every Inf a NaN (SPEC §3: Inf/NaN propagate).
  plain = a * b + c
  return jnp.where(jnp.isfinite(plain), th + _round_to_odd_sum(tl, ul), plain)


def exp2(t):
  """2**t for fp32 t <= 0: 2**n times 2**f, |f| <= 1/2, within XLA's exp error
  (1 ulp on CPU, 2 on GPU). Results below 2**-126 are 0 on every platform
  (XLA's CPU runtime flushes subnormals; scores apart by > 87 only)."""
  n = jnp.round(t)
  return jnp.where(t < -126, 0.0, jnp.ldexp(jnp.exp2(t - n), n.astype(jnp.int32)))


def hadamard(x):
  """Unnormalised Sylvester WHT over the last axis (128): strides 1, 2, .., 64
  in this order; the lower index gets a + b, the upper a - b."""
  shape = x.shape
  stride = 1
  while stride < shape[-1]:
    y = x.reshape(shape[:-1] + (shape[-1] // (2 * stride), 2, stride))
    a, b = y[..., 0, :], y[..., 1, :]
    x = jnp.stack([a + b, a - b], axis=-2).reshape(shape)
    stride *= 2
  return x


# M(e) of SPEC §11.1: libdevice log2f returns e (not e + 1) for mantissas
# 1..M(e) of the binade 2**e. Ranges of e (inclusive) -> M(e).
_LOG2F_SLACK = ((-126, -65, 22), (-64, -33, 11), (-32, -17, 5), (-16, -9, 2),
                (-8, -5, 1), (-4, 3, 0), (4, 7, 1), (8, 15, 2), (16, 31, 5),
                (32, 63, 11), (64, 127, 22))
_SLACK_TABLE = np.zeros(254, np.int32)
for _lo, _hi, _m in _LOG2F_SLACK:
  _SLACK_TABLE[_lo + 126:_hi + 127] = _m


def ceil_log2f(v):
  """ceil(log2f(v)) as libdevice computes it, for positive normal fp32 v (int32)."""
  bits = _bits(v)
  e = ((bits >> 23) & 0xFF) - 127
  mant = bits & 0x7FFFFF
  slack = jnp.asarray(_SLACK_TABLE)[jnp.clip(e + 126, 0, 253)]
  return jnp.where(mant <= slack, e, e + 1)


def pow2(e):
  """The fp32 2**e for int32 e in [-126, 127]."""
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def to_e4m3(x):
  """Saturating RNE fp32 -> float8_e4m3fn. The clamp is fmax/fmin, as stock's:
  a NaN becomes -448."""
  return jnp.fmin(jnp.fmax(x, -FP8_MAX), FP8_MAX).astype(jnp.float8_e4m3fn)


def e4m3_to_f32(bits):
  """float8_e4m3fn bit patterns u8[...] -> their exact f32 values.

  Decoded with integer ops on purpose: XLA's GPU compiler turns a dot of
  converted fp8 operands into an FP8 tensor-core GEMM, whose accumulation is
  less precise than fp32.
  """
  b = bits.astype(jnp.uint32)
  sign = (b >> 7) << 31
  exp, mant = (b >> 3) & 0xF, b & 0x7
  normal = lax.bitcast_convert_type(sign | ((exp + 120) << 23) | (mant << 20), jnp.float32)
  subnormal = mant.astype(jnp.float32) * np.float32(2.0 ** -9)
  subnormal = jnp.where(sign != 0, -subnormal, subnormal)
  value = jnp.where(exp == 0, subnormal, normal)
  return jnp.where((b & 0x7F) == 0x7F, jnp.nan, value)


def rotate_quant(x, *, round_scale=True):
  """Hadamard + FP8 of rows (SPEC §2b, the tail of §3).

  x: f32[..., 128] (bf16 values). Returns (q e4m3[..., 128], scale f32[...],
  exponent i32[...]); scale = 2**exponent, or amax/448 when not round_scale
  (exponent is then that of 2**ceil, unused by fp32 writers).
  """
  y = round_bf16(hadamard(x) * INV_SQRT_DIM)
  # fmax semantics, as stock's reduction: NaN entries are ignored.
  amax = jnp.fmax(jnp.max(jnp.where(jnp.isnan(y), 0, jnp.abs(y)), axis=-1), AMAX_FLOOR)
  v = amax * INV_FP8_MAX
  exponent = ceil_log2f(v)
  scale = pow2(exponent) if round_scale else v
  return to_e4m3(y / scale[..., None]), scale, exponent


def scale_bytes(scale, exponent, scale_format):
  """The 4 scale bytes of a K-cache entry (SPEC §0.1): u8[..., 4]."""
  if scale_format == "fp32":
    return lax.bitcast_convert_type(scale, jnp.uint8)
  byte = (exponent + 127).astype(jnp.uint8)
  return jnp.broadcast_to(byte[..., None], byte.shape + (4,))
