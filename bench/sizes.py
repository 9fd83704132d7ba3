"""The benchmark's model constants, run sizes and seeded input data."""
import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp

import glm5_jax
from glm5_jax import synthetic
from glm5_jax.reference.numerics import DIM, POOL

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
CONFIG = glm5_jax.IndexerConfig()              # GLM-5.3-Flash: 32 heads, topk 2048, block 128
HIDDEN = synthetic.HIDDEN                      # 4096
HEADS, PADDED = CONFIG.heads, CONFIG.padded    # 32, 32
W_ROWS = 2 * DIM + HEADS                       # w_cat rows: [wk; weights_proj; gate] = 288
GROUPS = CONFIG.topk_tokens // POOL            # 512 selected pools
WIDTH = CONFIG.width                           # 2176
BLOCK = CONFIG.block_size                      # 128
PAGE = 64                                      # K-cache entries per page
ENTRY = DIM + 4                                # K-cache bytes per entry
CONTEXT = 128 * 1024                           # tokens, expand/remap/kpool_update
PEAK_BF16 = 790e12                             # dense bf16 FLOP/s (H200)
BW_FALLBACK = 4.3e12                           # B/s when the copy calibration fails
W_CAT_COPIES = 56                              # >= 54 rotated W_cat (>= 128 MB, past L2)
Q_LORA = synthetic.Q_LORA                      # 1536: qr's width, wq_b's K
WQ_B_COPIES = 11                               # rotated wq_b (12.6 MB each: 138 MB, past L2)


@dataclasses.dataclass
class Sizes:
  """What to run: shapes, buffer sizes and the timing method (bench/harness.py)."""
  rows: tuple = (1, 8, 16, 64)
  compress_rows: tuple = (8192,)               # kpool_compress's n besides rows: a 32K prompt
  next_ns: tuple = (1, 4)
  upcast_pools: tuple = (8192, 32768, 262144)
  select_rows: tuple = (1, 16, 64)             # mqa_logits, pool_topk, select_pools
  # 8K, 32K and 128K-token contexts, GLM-5's window (202,752), 1M tokens
  select_pools: tuple = (2048, 8192, 32768, 50688, 262144)
  stage_rows: tuple = (1, 16, 64)              # the stage group (11 layers per step)
  stage_contexts: tuple = (1024, 8192, 32768, 131072)
  # The serving shapes past that grid (PERFORMANCE.md §13), as (context, M, next_n): GLM-5's
  # window at M 1/16/64, 1M tokens at one row, 16 requests x next_n 4 (MTP) at 32K.
  stage_envelope: tuple = ((202752, 1, 1), (202752, 16, 1), (202752, 64, 1),
                           (1048576, 1, 1), (32768, 64, 4))
  stage_layers: int = 11
  serving_rows: tuple = (1, 16, 64)            # the serving group (stage_layers per step)
  serving_contexts: tuple = (1024, 32768)
  serving_steps: int = 200                     # timed decode steps per serving row
  prefill_prompts: tuple = (300, 5000, 32768)  # the prefill group (and all as one batch)
  cache_bytes: int = 1 << 30
  copy_bytes: int = 2 << 30
  r_max: int = 64                              # rotated input sets of a chain
  r_min: int = 4
  chain_s: float = 0.02                        # most wall time of one cycle of the R sets
  chain_lines: int = 30000                     # most lowered StableHLO lines of a chain
  max_calls: int = 1024                        # most calls unrolled in one chain
  reps: int = 20
  warmup: int = 2
  run_s: float = 0.001                         # least device time of one timed run
  max_passes: int = 4096                       # Triton: most graph replays per timed run
  empty_r: int = 100
  data_dep: bool = True                        # chain stateless calls by a run-time scalar
  # XLA compiler options of every timed executable, ((name, value), ...): e.g. the
  # command buffers' update mode (--xla-option xla_gpu_command_buffer_update_mode=...).
  compiler_options: tuple = ()


def sizes_for(quick, cpu_smoke):
  s = Sizes()
  if quick:
    s = dataclasses.replace(s, rows=(1, 64), next_ns=(1,), upcast_pools=(32768,),
                            stage_envelope=(),
                            select_rows=(1, 64), select_pools=s.select_pools[:1])
  if cpu_smoke:
    s = dataclasses.replace(
        s, upcast_pools=tuple(p // 16 for p in s.upcast_pools),
        select_rows=(1, 4), select_pools=(512, 1024), stage_rows=(1, 2),
        stage_contexts=(1024, 4096), stage_envelope=((4096, 2, 2),), stage_layers=2,
        serving_rows=(1, 2), serving_contexts=(1024,), serving_steps=5,
        prefill_prompts=(300, 1200), compress_rows=(256,),
        cache_bytes=8 << 20, copy_bytes=16 << 20, r_max=4, r_min=2, reps=3,
        warmup=1, empty_r=20, run_s=0.001, max_calls=8, max_passes=8)
  return s


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _normal(key, n, shape, dtype, scale):
  return (jax.random.normal(jax.random.fold_in(key, n), shape, F32) * scale).astype(dtype)


class Rand:
  """Seeded random data: small index data from numpy, big arrays on device."""

  def __init__(self, seed):
    self.np = np.random.default_rng(seed)
    self._key, self._n = jax.random.key(seed), 0

  def _next(self):
    self._n += 1
    return self._n

  def key(self):
    return jax.random.fold_in(self._key, self._next())

  def normal(self, shape, dtype=BF16, scale=1.0):
    return _normal(self._key, self._next(), tuple(shape), jnp.dtype(dtype), float(scale))

  def kv_cache(self, nbytes):
    """u8[pages, PAGE, 132] of about nbytes: fp8 data with |v| < 2 (the exponent's
    top bit cleared, never NaN), then PAGE fp32 scales 2**-8 per page."""
    pages = max(1, nbytes // (PAGE * ENTRY))
    data = jax.random.bits(self.key(), (pages, PAGE * DIM), jnp.uint8) & 0xBF
    scale = np.tile(np.float32(2.0 ** -8).reshape(1).view(np.uint8), PAGE)
    scales = jnp.broadcast_to(jnp.asarray(scale), (pages, PAGE * 4))
    return jnp.concatenate([data, scales], 1).reshape(pages, PAGE, ENTRY)

  def ragged(self, m, full):
    """Row lengths: full, except every 4th row (3, 7, ..) in [full/2, full)."""
    ends = np.full(m, full)
    short = np.arange(m) % 4 == 3
    ends[short] = self.np.integers(full // 2, full, short.sum())
    return ends

  def pool_ids(self, m, pools):
    """i32[m, 512] distinct pool ids spread over [0, pools) (one per stratum),
    in random order per row."""
    stride = pools // GROUPS
    ids = np.arange(GROUPS) * stride + self.np.integers(0, stride, (m, GROUPS))
    order = np.argsort(self.np.random((m, GROUPS)), 1)
    return np.take_along_axis(ids, order, 1)


def i32(a):
  return jnp.asarray(a, I32)


def size_text(n):
  return f"{n / 2 ** 30:.3g} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.3g} MiB"
