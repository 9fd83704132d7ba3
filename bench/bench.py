"""Benchmark every glm5_jax op at GLM-5.3-Flash decode shapes on one GPU.

  python bench/bench.py --out BENCHMARKS.json --md BENCHMARKS.md [--quick] [--ops a,b]
  python bench/bench.py --quick --out /tmp/b.json --md /tmp/b.md   # CPU: --cpu-smoke sizes

Variants per shape: "reference" = the public op with GLM5_JAX_KERNELS=0 (pure
JAX under jit) and "kernel" = the public op with its CUDA kernel, for every op
in glm5_jax.KERNEL_TARGETS (GPU with the CUDA module only). Method
(PERFORMANCE.md §8): one jitted function runs a device loop of `passes` passes
over R calls, each on its own rotated inputs (W_cat and logits rotated past
the 60 MB L2; caches >= 1 GB donated and threaded through the calls; stateless
calls ordered by optimization barriers on the previous call's outputs, or with
--data-dep by a run-time-zero scalar); passes grows until a run takes >= 4 ms
so host dispatch is amortised; device_us = median over N back-to-back runs of
the run time / (passes * R), nothing
subtracted (the calibration rows give the copy bandwidth and the per-call cost
of an empty XLA op and an empty FFI call). floor_us = max(minimum bytes /
measured copy bandwidth, FLOPs / 790 TFLOP/s) (PERFORMANCE.md §7). Each
variant is first checked bit for bit against the reference (`exact`).
Compilations go to a persistent cache (--cache-dir), so reruns are faster.
"""
import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
import warnings
import zlib
from typing import Callable, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

try:
  import glm5_jax
except ImportError:          # run from a checkout without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import glm5_jax
from glm5_jax import _ffi, synthetic
from glm5_jax._primitive import Op
from glm5_jax.indexer import projection_tactics, tile_k
from glm5_jax.reference.numerics import DIM, POOL

import pallas_ops  # noqa: E402  (bench/pallas_ops.py)

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

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


@dataclasses.dataclass
class Sizes:
  """What to run: shapes, buffer sizes and the timing loop."""
  rows: tuple = (1, 8, 16, 64)
  next_ns: tuple = (1, 4)
  upcast_pools: tuple = (8192, 32768, 262144)
  topk_pools: tuple = (8192, 32768)
  mqa_pools: int = 8192                        # 32K-token contexts
  cache_bytes: int = 1 << 30
  copy_bytes: int = 2 << 30
  r_max: int = 64                              # calls per chain (rotated input sets)
  r_min: int = 4
  chain_s: float = 0.02                        # most wall time of one chain run
  chain_lines: int = 12000                     # most lowered StableHLO lines of a chain
  reps: int = 20
  warmup: int = 2
  run_s: float = 0.004                         # least device time of one timed run
  max_passes: int = 4096
  empty_r: int = 100
  data_dep: bool = False                       # chain stateless calls by a scalar, not barriers


def sizes_for(quick, cpu_smoke):
  s = Sizes()
  if quick:
    s = dataclasses.replace(s, rows=(1, 64), next_ns=(1,), upcast_pools=(32768,),
                            topk_pools=(8192,))
  if cpu_smoke:
    s = dataclasses.replace(
        s, upcast_pools=tuple(p // 16 for p in s.upcast_pools),
        topk_pools=tuple(p // 16 for p in s.topk_pools), mqa_pools=512,
        cache_bytes=8 << 20, copy_bytes=16 << 20, r_max=4, r_min=2, reps=3,
        warmup=1, empty_r=20, run_s=0.001, max_passes=8)
  return s


# ---------------------------------------------------------------- floors (§7)

def floor_us(nbytes, flops, bw):
  """max(bytes / measured copy bandwidth, FLOPs / bf16 peak), in µs."""
  return 1e6 * max(nbytes / bw, flops / PEAK_BF16)


def bytes_projection(m):
  """§7a: W_cat once + per row x (2K) in; key bf16, weights f32, gate bf16 out."""
  return W_ROWS * HIDDEN * 2 + m * (2 * HIDDEN + 2 * DIM + 4 * HEADS + 2 * DIM)


def bytes_query(m):
  """Per row q bf16[H,128], key_raw, weights f32 in; q_fp8, w_out f32, key out;
  the LayerNorm weight and bias once."""
  return 2 * DIM * 4 + m * (HEADS * DIM * 2 + 2 * DIM + 4 * HEADS
                            + PADDED * DIM + 4 * PADDED + 2 * DIM)


def bytes_fused(m):
  """§7a with the query epilogue: W_cat + per row x, q in; q_fp8, w_out, key, gate out."""
  return (W_ROWS * HIDDEN * 2 + 2 * DIM * 4
          + m * (2 * HIDDEN + HEADS * DIM * 2 + PADDED * DIM + 4 * PADDED + 4 * DIM))


def bytes_update(tokens, completing):
  """§7b: 1,036 B per token (key, gate, 3 indices in; ring row out) + 1,668 B per
  completing token (3 ring rows in, 128 fp8 + 4 scale bytes out) + ape."""
  return tokens * 1036 + completing * (3 * 2 * DIM * 2 + ENTRY) + POOL * DIM * 4


def bytes_compress(n, written):
  """Per pool 4 keys + 4 scores bf16, loc, mask in; written entries 132 B out; ape."""
  return n * (2 * POOL * DIM * 2 + 4 + 1) + written * ENTRY + POOL * DIM * 4


def bytes_seed(n, written):
  """Per token key + score bf16 and tslot in; written tokens a ring row (512 B) out."""
  return n * (2 * DIM * 2 + 4) + written * 2 * DIM * 2


def bytes_expand(m):
  """§7c without the remap: per row 512 pool ids + seq_len in, WIDTH ids out."""
  return m * (GROUPS * 4 + 4 + WIDTH * 4)


def bytes_remap(m, blocks_touched):
  """§7c: per row pool ids, position, request in; WIDTH slots + count out; plus
  4 B per distinct block-table entry touched (best case, no sector waste)."""
  return m * (GROUPS * 4 + 4 + 4 + WIDTH * 4 + 4) + 4 * blocks_touched


def bytes_upcast(row_ends):
  """§7d: 2 B read + 4 B written per column below each row end, + row_ends."""
  return 6 * int(np.sum(row_ends)) + 4 * len(row_ends)


def bytes_mqa(pool_lens, max_pools):
  """Every valid pool's entry (132 B) and its page-table entry once per page,
  q_fp8 + weights in, the full f32[rows, max_pools] out."""
  pages = int(np.sum(-(-np.asarray(pool_lens) // PAGE)))
  m = len(pool_lens)
  return (ENTRY * int(np.sum(pool_lens)) + 4 * pages
          + m * (HEADS * DIM + 4 * HEADS + 4) + 4 * m * max_pools)


def flops_mqa(pool_lens):
  """2·H·128 per (row, valid pool): the q·k dots."""
  return 2 * HEADS * DIM * int(np.sum(pool_lens))


def bytes_topk(pool_lens, k):
  """Valid f32 logits and pool_lens in, k ids per row out."""
  return 4 * int(np.sum(pool_lens)) + 4 * len(pool_lens) * (1 + k)


# ----------------------------------------------------------------- inputs

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


# ------------------------------------------------------------------ cases

class Case(NamedTuple):
  """One op at one shape (its label comes from CASES). call(state, fixed, args) -> (state, outs): the public
  op on state (threaded caches, or None), fixed (shared) and one rotated
  argument tuple. dep: index of the (small) argument that takes the run-time
  dependency under --data-dep (stateless ops). nbytes, flops: the floor's
  minimum bytes and FLOPs per call. mask(args, outs) -> outs hides outputs the
  op leaves unspecified."""
  op: str
  shape: str
  call: Callable
  state: object
  fixed: tuple
  rotated: list
  dep: int | None
  nbytes: int
  flops: int = 0
  mask: Callable | None = None
  r_min: int = 0            # fewest calls per chain (rotated copies), e.g. of W_cat


def case_projection(r, s, m, tactic=None):
  rot = [(r.normal((m, HIDDEN)), r.normal((W_ROWS, HIDDEN), scale=HIDDEN ** -0.5))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, glm5_jax.indexer_projection(*a, heads=HEADS, tactic=tactic))
  return Case("indexer_projection", "", call, None, (), rot, 0,
              bytes_projection(m), 2 * m * W_ROWS * HIDDEN, r_min=W_CAT_COPIES)


def _norm(r):
  return (jnp.asarray(1 + 0.1 * r.np.standard_normal(DIM), F32),
          jnp.asarray(0.1 * r.np.standard_normal(DIM), F32))


def case_query(r, s, m):
  rot = [(r.normal((m, HEADS, DIM)), r.normal((m, DIM)), r.normal((m, HEADS), F32))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, glm5_jax.indexer_query(*a, *f, scale=CONFIG.scale,
                                                      padded=PADDED))
  return Case("indexer_query", "", call, None, _norm(r), rot, 2, bytes_query(m))


def case_fused(r, s, m):
  rot = [(r.normal((m, HIDDEN)), r.normal((W_ROWS, HIDDEN), scale=HIDDEN ** -0.5),
          r.normal((m, HEADS, DIM))) for _ in range(s.r_max)]
  call = lambda st, f, a: (st, glm5_jax.indexer_projection_fused(
      *a, *f, heads=HEADS, scale=CONFIG.scale, padded=PADDED))
  return Case("indexer_projection_fused", "", call, None, _norm(r), rot, 0,
              bytes_fused(m), 2 * m * W_ROWS * HIDDEN, r_min=W_CAT_COPIES)


def _ape(r):
  return jnp.asarray(0.5 * r.np.standard_normal((POOL, DIM)), F32)


def case_update(r, s, b, next_n):
  """B requests x next_n tokens; each call advances every request by next_n
  positions (random starts: completing and non-completing tokens mix), the
  pools of a request on its own random pages of a >= 1 GB cache."""
  kv = r.kv_cache(s.cache_bytes)
  pages = kv.shape[0]
  tail = r.normal((b, 2, synthetic.ring_size(next_n), DIM))
  per_req = max(1, min(CONTEXT // POOL // PAGE, pages // b))
  table = r.np.permutation(pages)[:b * per_req].reshape(b, per_req)
  span = per_req * PAGE * POOL
  start = r.np.integers(0, max(1, span - s.r_max * next_n), b)
  like = glm5_jax.IndexerCache(kv, tail)
  rot, completing = [], []
  for i in range(s.r_max):
    pos = (start[:, None] + i * next_n + np.arange(next_n)) % span
    batch = synthetic.decode_batch(pos, like, table, table)
    completing.append(int(np.sum((pos + 1) % POOL == 0)))
    rot.append((batch.tslot, r.normal((b, next_n, DIM)), r.normal((b, next_n, DIM)),
                batch.loc, batch.positions))
  call = lambda st, f, a: (glm5_jax.kpool_update(st[0], st[1], a[0], a[1], a[2], f[0],
                                                 a[3], a[4]), ())
  return Case("kpool_update", "", call, (kv, tail), (_ape(r),),
              rot, None, bytes_update(b * next_n, np.mean(completing)))


def case_compress(r, s, n):
  """n pools to slots on distinct random pages of a >= 1 GB cache, 7/8 written."""
  kv = r.kv_cache(s.cache_bytes)
  rot, written = [], []
  for _ in range(s.r_max):
    mask = r.np.random(n) < 0.875
    written.append(int(mask.sum()))
    loc = r.np.choice(kv.shape[0], n, replace=False) * PAGE + r.np.integers(0, PAGE, n)
    rot.append((r.normal((n, POOL, DIM)), r.normal((n, POOL, DIM)), i32(loc),
                jnp.asarray(mask)))
  call = lambda st, f, a: (glm5_jax.kpool_compress(st, a[0], a[1], f[0], a[2], a[3]), ())
  return Case("kpool_compress", "", call, kv, (_ape(r),), rot, None,
              bytes_compress(n, np.mean(written)))


def case_seed(r, s, n):
  """n tokens, 4 consecutive positions per request, each request its own random
  block of a >= 1 GB tail (RING 4): every token is written."""
  ring = synthetic.ring_size(1)
  blocks = max(1, s.cache_bytes // (2 * ring * DIM * 2))
  tail = r.normal((blocks, 2, ring, DIM))
  reqs = -(-n // POOL)
  rot = []
  for _ in range(s.r_max):
    blk = r.np.choice(blocks, reqs, replace=False)
    pos = r.np.integers(0, 1 << 20, reqs)[:, None] + np.arange(POOL)
    tslot = (blk[:, None] * ring + pos % ring).reshape(-1)[:n]
    rot.append((r.normal((n, DIM)), r.normal((n, DIM)), i32(tslot)))
  call = lambda st, f, a: (glm5_jax.kpool_seed_tail(st, *a), ())
  return Case("kpool_seed_tail", "", call, tail, (), rot, None, bytes_seed(n, n))


def _positions(r, m):
  return CONTEXT - 1 - r.np.integers(0, POOL, m)


def case_expand(r, s, m):
  rot = [(i32(r.pool_ids(m, CONTEXT // POOL - 1)), i32(_positions(r, m)))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, (glm5_jax.expand_pools(*a, seq_offset=1, width=WIDTH),))
  return Case("expand_pools", "", call, None, (), rot, 1, bytes_expand(m))


def case_remap(r, s, m):
  """Rows = requests; 128K contexts, each request's 1,025 blocks at random
  physical blocks."""
  per_req = -(-(CONTEXT + 1) // BLOCK)
  rot, touched = [], []
  for _ in range(s.r_max):
    ids = r.pool_ids(m, CONTEXT // POOL - 1)
    touched.append(sum(len(np.unique(row // (BLOCK // POOL))) + 1 for row in ids))
    table = r.np.permutation(m * per_req).reshape(m, per_req)
    rot.append((i32(ids), i32(_positions(r, m)), i32(table)))
  call = lambda st, f, a: (st, glm5_jax.expand_and_remap(
      a[0], a[1], f[0], a[2], block_size=BLOCK, width=WIDTH))
  return Case("expand_and_remap", "", call, None, (i32(np.arange(m)),), rot, 1,
              bytes_remap(m, np.mean(touched)))


def _upcast_mask(args, outs):
  (logits, ends), (out,) = args, outs
  return (jnp.where(jnp.arange(logits.shape[1]) < ends[:, None], out, 0),)


def case_upcast(r, s, m, p):
  ends = [r.ragged(m, p) for _ in range(s.r_max)]
  rot = [(r.normal((m, p), scale=30.0), i32(e)) for e in ends]
  call = lambda st, f, a: (st, (glm5_jax.upcast_logits(*a),))
  return Case("upcast_logits", "", call, None, (), rot, 1,
              np.mean([bytes_upcast(e) for e in ends]), mask=_upcast_mask)


def case_mqa(r, s, m):
  """Rows over 32K-token contexts (8,192 pools, max_pools 8,192), each row's
  pages at random in a >= 1 GB cache; every 4th row shorter."""
  p = s.mqa_pools
  kv = r.kv_cache(s.cache_bytes)
  per_row = -(-p // PAGE)
  rot, lens = [], []
  for _ in range(s.r_max):
    n = r.ragged(m, p)
    lens.append(n)
    q = jnp.clip(r.normal((m, HEADS, DIM), scale=8.0, dtype=F32), -448, 448)
    table = r.np.choice(kv.shape[0], m * per_row, replace=m * per_row > kv.shape[0])
    table = table.reshape(m, per_row)
    rot.append((q.astype(jnp.float8_e4m3fn), jnp.asarray(r.np.random((m, HEADS)), F32),
                i32(table), i32(n)))
  call = lambda st, f, a: (st, (glm5_jax.mqa_logits(a[0], a[1], f[0], a[2], a[3],
                                                    max_pools=p),))
  return Case("mqa_logits", "", call, None, (kv,), rot, 1,
              np.mean([bytes_mqa(n, p) for n in lens]), np.mean([flops_mqa(n) for n in lens]))


def case_topk(r, s, m, p):
  lens = [r.ragged(m, p) for _ in range(s.r_max)]
  rot = [(r.normal((m, p), F32), i32(n)) for n in lens]
  call = lambda st, f, a: (st, (glm5_jax.pool_topk(*a, k=GROUPS),))
  return Case("pool_topk", "", call, None, (), rot, 1,
              np.mean([bytes_topk(n, GROUPS) for n in lens]))


def _rows(s, key="m", fmt="M={}"):
  return [(fmt.format(m), {key: m}) for m in s.rows]


# op -> (builder(rand, sizes, **kwargs) -> Case, shapes(sizes) -> [(label, kwargs)])
CASES = {
    "indexer_projection": (case_projection, _rows),
    "indexer_query": (case_query, _rows),
    "indexer_projection_fused": (case_fused, _rows),
    "kpool_update": (case_update, lambda s: [(f"B={b},next_n={n}", dict(b=b, next_n=n))
                                             for n in s.next_ns for b in s.rows]),
    "kpool_compress": (case_compress, lambda s: _rows(s, "n", "n={}")),
    "kpool_seed_tail": (case_seed, lambda s: _rows(s, "n", "n={}")),
    "expand_pools": (case_expand, lambda s: _rows(s, fmt="rows={}")),
    "expand_and_remap": (case_remap, lambda s: _rows(s, fmt="rows={}")),
    "upcast_logits": (case_upcast, lambda s: [(f"rows={m},P={p}", dict(m=m, p=p))
                                              for p in s.upcast_pools for m in s.rows]),
    "mqa_logits": (case_mqa, lambda s: _rows(s, fmt=f"rows={{}},P={s.mqa_pools}")),
    "pool_topk": (case_topk, lambda s: [(f"rows={m},P={p}", dict(m=m, p=p))
                                        for p in s.topk_pools for m in s.rows]),
}
assert set(CASES) == set(glm5_jax.OPS), "every op in glm5_jax.OPS needs a bench case"


# ------------------------------------------------- stock-order Triton variant

@functools.cache
def triton_oracle():
  """glm5_jax/testing/triton_oracle.py (stock-op-order Triton kernels) when torch + triton
  with CUDA are importable, else None."""
  try:
    from glm5_jax.testing import triton_oracle as t
  except ImportError:
    return None
  return t.load()


def _compact(out, counts):
  """The column-preserving remap layout -> the compacted one (valid slots are >= 0)."""
  order = jnp.argsort(out < 0, axis=1, stable=True)
  return jnp.take_along_axis(out, order, 1), counts


# op -> call(state, fixed, args) on torch tensors -> (state, outs), as Case.call;
# the ops' stock kernels: one decode-update kernel, expand, expand + convert
# (column-preserving, compacted for the check), the bf16 -> f32 convert.
TRITON_CALLS = {
    "kpool_update": lambda T, st, f, a: (T.decode_update(
        st[0], st[1], a[0], a[1], a[2], f[0], a[3], a[4]), ()),
    "expand_pools": lambda T, st, f, a: (st, (T.expand(*a, seq_offset=1, width=WIDTH),)),
    "expand_and_remap": lambda T, st, f, a: (st, T.convert(
        f[0], a[2], T.expand(a[0], a[1], seq_offset=1, width=WIDTH), block_size=BLOCK,
        stride_rows=BLOCK)),
    "upcast_logits": lambda T, st, f, a: (st, (T.upcast(*a),)),
    "indexer_query": lambda T, st, f, a: (st, stock_query(T, *a, *f)),
    "indexer_projection_fused": lambda T, st, f, a: (st, stock_prologue(T, *a, *f)),
}
TRITON_CHECK = {"expand_and_remap": _compact}     # outputs -> the kernel's layout


def stock_query(T, q, key_raw, weights, norm_weight, norm_bias):
  """The stock order of indexer_query (H = padded): torch's LayerNorm of the key,
  the Triton oracle's Hadamard + FP8 (the stock op's own kernel takes 4.9-5.9 µs, SPEC D6)."""
  import torch.nn.functional as F
  codes, w_out = T.query(q, weights, CONFIG.scale)
  key = F.layer_norm(key_raw.float(), (DIM,), norm_weight, norm_bias, CONFIG.eps)
  return codes, w_out, key.to(key_raw.dtype)


def stock_prologue(T, x, w_cat, q, norm_weight, norm_bias):
  """The stock order of indexer_projection_fused: one cuBLAS GEMM of the concatenated
  weights (bf16 out, as the stock linear layers), then stock_query."""
  y = x @ w_cat.T
  key_raw, weights, gate = y[:, :DIM], y[:, DIM:DIM + HEADS].float(), y[:, DIM + HEADS:]
  return (*stock_query(T, q, key_raw.contiguous(), weights.contiguous(), norm_weight,
                       norm_bias), gate.contiguous())


# ------------------------------------------------- other ways to write an op in JAX

def three_dots(x, w_cat):
  """indexer_projection as a JAX user would write it from the model: three dots."""
  dot = lambda w: jnp.dot(x, w.T, preferred_element_type=F32)
  key, weights, gate = (dot(w_cat[:DIM]), dot(w_cat[DIM:DIM + HEADS]),
                        dot(w_cat[DIM + HEADS:]))
  return key.astype(BF16), weights, gate.astype(BF16)


def unfused(x, w_cat, q, norm_weight, norm_bias, projection=None, query=None):
  """indexer_projection_fused as indexer_projection then indexer_query (the public ops
  unless given)."""
  projection = projection or functools.partial(glm5_jax.indexer_projection, heads=HEADS)
  query = query or glm5_jax.indexer_query
  key_raw, weights, gate = projection(x, w_cat)
  return (*query(q, key_raw, weights, norm_weight, norm_bias, scale=CONFIG.scale,
                 padded=PADDED), gate)


class Alternative(NamedTuple):
  """The op written another way: lowered with GLM5_JAX_KERNELS=`kernels`, it must call
  exactly the FFI targets `targets`; call as Case.call."""
  kernels: str
  targets: tuple
  call: Callable


PALLAS = "pallas"
THREE_DOTS = "reference, three dots"
TWO_KERNELS = "projection + query kernels"
GEMM_QUERY = "XLA GEMM + query kernel"
_QUERY = glm5_jax.KERNEL_TARGETS["indexer_query"]

# op -> {variant: Alternative}
ALTERNATIVES = {
    "upcast_logits": {
        PALLAS: Alternative("0", (), lambda st, f, a: (st, (pallas_ops.upcast_logits(*a),)))},
    "indexer_projection": {
        THREE_DOTS: Alternative("0", (), lambda st, f, a: (st, three_dots(*a)))},
    "indexer_projection_fused": {
        THREE_DOTS: Alternative("0", (), lambda st, f, a: (st, unfused(
            *a, *f, projection=three_dots, query=glm5_jax.reference.indexer_query))),
        TWO_KERNELS: Alternative(
            "0,indexer_projection=1,indexer_query=1",
            (glm5_jax.KERNEL_TARGETS["indexer_projection"], _QUERY),
            lambda st, f, a: (st, unfused(*a, *f))),
        GEMM_QUERY: Alternative("0,indexer_query=1", (_QUERY,),
                                lambda st, f, a: (st, unfused(*a, *f)))},
}


def alternative(op, variant):
  """The Alternative that `variant` of `op` runs, or None (the public op itself)."""
  return ALTERNATIVES.get(op, {}).get(variant)


def _torch(tree, clone=False):
  import torch
  return jax.tree.map(lambda a: (torch.from_dlpack(a).clone() if clone
                                 else torch.from_dlpack(a)), tree)


def triton_single_call(case, state):
  """Result leaves (as jax arrays) of one Triton call from a copy of `state`."""
  T = triton_oracle()
  st, outs = TRITON_CALLS[case.op](T, _torch(state, clone=True), _torch(case.fixed),
                                   _torch(case.rotated[0]))
  outs = tuple(jnp.array(jnp.from_dlpack(o)) for o in outs)
  outs = TRITON_CHECK.get(case.op, lambda *o: o)(*outs)
  if case.mask is not None:
    outs = case.mask(case.rotated[0], outs)
  return [jnp.array(jnp.from_dlpack(t)) for t in jax.tree.leaves(st)] + list(outs)


def triton_amortised(case, state, r, sizes):
  """Seconds per call of the Triton variant: a torch CUDA graph of r calls on the
  rotated inputs (state: a copy, updated in place), replayed `passes` times per
  run (passes grows until a run takes >= sizes.run_s); median run over reps.
  Returns (s, info) as amortised()."""
  import torch
  T, call = triton_oracle(), TRITON_CALLS[case.op]
  st, fixed = _torch(state, clone=True), _torch(case.fixed)
  rotated = [_torch(a) for a in case.rotated[:r]]
  t0 = time.perf_counter()
  for a in rotated:                                     # compile + warm up
    st, _ = call(T, st, fixed, a)
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for a in rotated:
      st, _ = call(T, st, fixed, a)
  compile_s = time.perf_counter() - t0
  start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))

  def run(n):
    start.record()
    for _ in range(n):
      graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

  n = grow_passes(run, sizes)
  times = [run(n) for _ in range(sizes.warmup + sizes.reps)][sizes.warmup:]
  del graph, st
  return statistics.median(times) / (n * r), dict(compile_s=compile_s, temp=None, passes=n)


# ----------------------------------------------------------------- timing

KERNEL, NO_PDL, TRITON = "kernel", "kernel, PDL off", "triton"
VARIANTS = ("reference", KERNEL, NO_PDL, TRITON, PALLAS, THREE_DOTS, TWO_KERNELS, GEMM_QUERY)


@contextlib.contextmanager
def variant_env(variant, op=None):
  """GLM5_JAX_KERNELS and GLM5_JAX_PDL (both read when the op is traced: the
  Routing) for one JAX variant of `op`."""
  alt = alternative(op, variant)
  kernels = alt.kernels if alt else "0" if variant == "reference" else "1"
  want = {"GLM5_JAX_KERNELS": kernels,
          "GLM5_JAX_PDL": "0" if variant == NO_PDL else None}
  old = {k: os.environ.get(k) for k in want}

  def apply(env):
    for k, v in env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  apply(want)
  try:
    yield
  finally:
    apply(old)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_NAN_BITS = {2: 0x7FED, 4: 0x7FEDCBA9}      # NaN payloads / ints no op produces


def _sentinel(outs):
  """A bool scalar that is False at run time but cannot be folded: does the first
  element of a >= 2-byte output hold a bit pattern no op produces?"""
  hits = [lax.bitcast_convert_type(o.reshape(-1)[0], _UINT[o.dtype.itemsize])
          == _NAN_BITS[o.dtype.itemsize]
          for o in outs if o.dtype.itemsize in _NAN_BITS and o.size]
  return functools.reduce(jnp.logical_or, hits)


def _token(tree):
  """A scalar read from the first leaf of `tree`."""
  return jax.tree.leaves(tree)[0].reshape(-1)[0]


def _chain(call, dep, data_dep):
  """chain(state, fixed, flag, rotated, passes): `passes` (a run-time count)
  passes of one call per rotated argument tuple, in order, in a device loop, so
  one dispatch covers many calls. Stateful calls are chained by their state
  (donated, updated in place). A stateless call's arguments pass through an
  optimization barrier together with the previous call's outputs: an HLO
  dependency that XLA keeps through fusion and scheduling (no overlap, no
  horizontal fusion, no CSE) and that costs nothing at run time. With data_dep
  they also take a run-time dependency: argument `dep` of call i+1 gets + flag,
  which call i's outputs decide (always False), at the cost of one tiny fusion
  per call. The last pass's outputs are the loop's result, so no call is dropped."""
  def one_pass(state, fixed, flag, prev, rotated):
    kept = []
    for args in rotated:
      if state is None:
        if data_dep and dep is not None:
          args = args[:dep] + (args[dep] + flag.astype(args[dep].dtype),) + args[dep + 1:]
        prev, args = lax.optimization_barrier((prev, args))
      state, outs = call(state, fixed, args)
      if data_dep and dep is not None:
        flag = _sentinel(outs)
      prev = outs
      kept.append(outs)
    return state, flag, kept

  def chain(state, fixed, flag, rotated, passes):
    shapes = jax.eval_shape(lambda *a: one_pass(*a)[2], state, fixed, flag, flag, rotated)
    kept = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    def body(_, carry):
      state, flag, kept = carry
      return one_pass(state, fixed, flag, kept[-1], rotated)

    state, flag, kept = lax.fori_loop(0, passes, body, (state, flag, kept))
    # Something to wait on (all outputs of a run are ready together). Not a read
    # of the state: XLA would copy a state that is read besides being updated.
    done = ~flag if state is not None else _token(kept[-1])
    return state, flag, (done, kept)
  return chain


def compile_fn(fn, *args):
  """(compiled, lowered text, seconds): jit with argument 0 (the state) donated."""
  t0 = time.perf_counter()
  lowered = jax.jit(fn, donate_argnums=0).lower(*args)
  compiled = lowered.compile()
  return compiled, lowered.as_text(), time.perf_counter() - t0


def temp_bytes(compiled):
  """The executable's temporary buffer bytes (None where XLA does not say)."""
  try:
    return compiled.memory_analysis().temp_size_in_bytes
  except Exception:                                        # noqa: BLE001
    return None


def grow_passes(probe, sizes):
  """Passes per timed run: from 1 until probe(passes) (seconds of one run) takes
  >= sizes.run_s, in a few probes (run time is linear in passes)."""
  n = 1
  for _ in range(4):
    t = probe(n)
    if t >= sizes.run_s or n >= sizes.max_passes:
      break
    n = int(min(sizes.max_passes, np.ceil(n * 1.5 * sizes.run_s / t)))
  return n


def amortised(call, state, fixed, rotated, dep, sizes):
  """Seconds per call: one jitted device loop of `passes` passes over a chain
  of len(rotated) calls. passes grows until one run takes >= sizes.run_s, so
  host dispatch (which overlaps: the next run is dispatched before waiting for
  the previous one) is amortised away; the median interval between run
  completions over reps runs, divided by passes * len(rotated).
  Returns (s, state, info)."""
  flag = jnp.zeros((), jnp.bool_)
  passes = jnp.int32(1)
  fn, _, seconds = compile_fn(_chain(call, dep, sizes.data_dep), state, fixed, flag,
                              rotated, passes)

  def timed(state, n, reps):
    n = jnp.int32(n)
    state, _, (done, _) = fn(state, fixed, flag, rotated, n)
    done.block_until_ready()
    stamps = [time.perf_counter()]
    for _ in range(reps):
      state, _, (nxt, _) = fn(state, fixed, flag, rotated, n)
      done.block_until_ready()          # a run's outputs are all ready together
      stamps.append(time.perf_counter())
      done = nxt
    done.block_until_ready()
    stamps.append(time.perf_counter())
    return state, statistics.median(np.diff(stamps)[2:])

  def probe(n):
    nonlocal state
    state, run = timed(state, n, 3)
    return run

  n = grow_passes(probe, sizes)
  state, run = timed(state, n, sizes.warmup + sizes.reps)
  info = dict(compile_s=seconds, temp=temp_bytes(fn), passes=n)
  return run / (n * len(rotated)), state, info


def _bits(a):
  """Floats as their bit patterns (NaN == NaN, -0 != 0); other dtypes as they are."""
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return lax.bitcast_convert_type(a, _UINT[a.dtype.itemsize])
  return a


@jax.jit
def _same_bits(a, b):
  return jnp.array_equal(_bits(a), _bits(b))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def single_call(case, state):
  """(lowered text, result leaves, wall s per call) of one call from `state`."""
  fn = lambda st, f, a: case.call(st, f, a)
  compiled, text, _ = compile_fn(fn, state, case.fixed, case.rotated[0])
  st, outs = compiled(_copy(state), case.fixed, case.rotated[0])
  if case.mask is not None:
    outs = case.mask(case.rotated[0], outs)
  result = jax.tree.leaves(st) + list(outs)
  jax.block_until_ready(result)
  st, times = _copy(state), []
  for _ in range(3):
    t0 = time.perf_counter()
    st, outs = compiled(st, case.fixed, case.rotated[0])
    jax.block_until_ready((st, outs))
    times.append(time.perf_counter() - t0)
  return text, result, min(times)


def not_in_place(temp, state):
  """A note when the chain needs temporaries the size of a state buffer (a cache
  copied instead of updated in place), else None."""
  big = max((a.nbytes for a in jax.tree.leaves(state)), default=0)
  if temp is None or big < 1 << 20 or temp < big // 2:
    return None
  return f"not in place: {_size(temp)} of temporaries for a {_size(big)} state"


# ----------------------------------------------------------------- driver

class Bench:
  """Collects result rows; measures the calibration and the op cases."""

  def __init__(self, sizes, args):
    self.s, self.args = sizes, args
    self.rows, self.t0 = [], time.monotonic()
    self.bw, self.empty_us = BW_FALLBACK, None
    dev = jax.devices()[0]
    self.meta = dict(gpu=dev.device_kind, jax_version=jax.__version__,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds"))
    self.gpu = jax.default_backend() == "gpu"
    self.module = self.gpu and _ffi.register_targets()
    self.kernels = [op for op in glm5_jax.KERNEL_TARGETS if self.has_kernel(op)]
    self.kernel_targets = {glm5_jax.KERNEL_TARGETS[op] for op in self.kernels}

  def log(self, msg):
    print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

  def row(self, op, shape, variant, device_us, floor, exact, **extra):
    row = dict(op=op, shape=shape, variant=variant, device_us=device_us, floor_us=floor,
               exact=exact, **self.meta, **{k: v for k, v in extra.items() if v is not None})
    self.rows.append(row)
    return row

  def has_kernel(self, op):
    return self.module and op in glm5_jax.KERNEL_TARGETS

  def over_budget(self):
    return time.monotonic() - self.t0 > self.args.budget_s

  # calibration ---------------------------------------------------------------
  def calibrate(self):
    """Copy bandwidth (the floors' denominator) and the per-op cost of an empty
    XLA fusion and, with the CUDA module, of an (almost) empty FFI call."""
    s = dataclasses.replace(self.s, data_dep=False)
    try:
      # One call per run (R = 1: a chain of elementwise ops would fuse), in place.
      x = jnp.zeros(s.copy_bytes // 4, jnp.uint32)
      call = lambda st, f, a: (st + f[0], ())
      sec, x, _ = amortised(call, x, (jnp.zeros((), jnp.uint32),), [()], None, s)
      del x
      self.bw = 2 * s.copy_bytes / sec
      self.row("calibration", f"copy {_size(s.copy_bytes)}", "calibration", sec * 1e6,
               None, True, gbps=self.bw / 1e9,
               notes="x = x + s on u32 in place, one kernel; GB/s counts read + write")
      self.log(f"calibration: copy {self.bw / 1e9:.0f} GB/s (read + write), "
               f"{sec * 1e6:.1f} us per copy")
    except Exception as e:                                 # noqa: BLE001
      self.error_row("calibration", "copy", "calibration", e)
    try:
      call = lambda st, f, a: (st, (a[0] + 1,))
      rot = [(jnp.full(8, i, F32),) for i in range(s.empty_r)]
      sec, _, _ = amortised(call, None, (), rot, None, s)
      self.empty_us = sec * 1e6
      self.row("calibration", f"empty XLA op x{s.empty_r}", "calibration", self.empty_us,
               None, True, notes="y = x + 1 on f32[8], one fusion per call")
      self.log(f"calibration: empty XLA op {self.empty_us:.2f} us")
    except Exception as e:                                 # noqa: BLE001
      self.error_row("calibration", "empty XLA op", "calibration", e)
    try:
      call = lambda st, f, a: (st, (pallas_ops.empty(a[0]),))
      rot = [(jnp.full(128, i, F32),) for i in range(s.empty_r)]
      sec, _, _ = amortised(call, None, (), rot, None, s)
      self.row("calibration", f"empty Pallas call x{s.empty_r}", "calibration", sec * 1e6,
               None, True, notes="y = x + 1 on f32[128], one Pallas (Triton) kernel per call")
      self.log(f"calibration: empty Pallas call {sec * 1e6:.2f} us")
    except Exception as e:                                 # noqa: BLE001
      self.error_row("calibration", "empty Pallas call", "calibration", e)
    if self.has_kernel("upcast_logits"):
      for variant in (KERNEL, NO_PDL):
        try:
          call = lambda st, f, a: (st, (glm5_jax.upcast_logits(f[0], a[0]),))
          rot = [(i32([8]),) for _ in range(s.empty_r)]
          with variant_env(variant):
            sec, _, _ = amortised(call, None, (jnp.ones((1, 8), BF16),), rot, 0, s)
          us = sec * 1e6
          name = "empty FFI call" + (", PDL off" if variant == NO_PDL else "")
          self.row("calibration", f"{name} x{s.empty_r}", "calibration", us, None, True,
                   notes="upcast_logits kernel on 1x8" + (
                       " + the dependency fusion" if s.data_dep else ""))
          self.log(f"calibration: {name} (upcast_logits 1x8) {us:.2f} us")
        except Exception as e:                             # noqa: BLE001
          self.error_row("calibration", "empty FFI call", "calibration", e)

  def error_row(self, op, shape, variant, e):
    note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    self.log(f"{op} {shape} {variant}: {note}")
    if self.args.verbose:
      traceback.print_exc()
    self.row(op, shape, variant, None, None, False, notes=note)

  # ops -----------------------------------------------------------------------
  def variants(self, op):
    return [v for v in self.all_variants(op) if v not in self.args.skip_variants]

  def all_variants(self, op):
    return (["reference"] + ([KERNEL, NO_PDL] if self.has_kernel(op) else [])
            + ([TRITON] if self.gpu and op in TRITON_CALLS and triton_oracle() else [])
            + [v for v, alt in ALTERNATIVES.get(op, {}).items()
               if set(alt.targets) <= self.kernel_targets])

  def run_op(self, op, labels):
    """Measures `op` at the shapes of CASES[op] named in `labels`."""
    builder, shapes = CASES[op]
    variants = self.variants(op)
    for shape, kw in shapes(self.s):
      if shape not in labels:
        continue
      if self.over_budget():
        for v in variants:
          self.row(op, shape, v, None, None, False, notes="skipped: over the time budget")
        self.log(f"{op} {shape}: skipped (over the time budget)")
        continue
      try:
        case = builder(Rand(zlib.crc32(f"{op} {shape}".encode())), self.s, **kw)
        case = case._replace(shape=shape)
      except Exception as e:                               # noqa: BLE001
        for v in variants:
          self.error_row(op, shape, v, e)
        continue
      self.run_case(case, variants)
      del case
      gc.collect()
      self.write_json()

  def chain_length(self, case, wall, lines):
    """R: <= r_max calls, a run of <= chain_s (one call's wall time) and of
    <= chain_lines lowered lines (compile time); >= r_min and case.r_min."""
    s = self.s
    r = min(s.r_max, int(s.chain_s / wall), s.chain_lines // max(1, lines))
    return min(len(case.rotated), max(r, s.r_min, case.r_min))

  def check(self, case, state, variant, results):
    """(result leaves, R) of one call of `variant` from `state`."""
    if variant == TRITON:
      got = triton_single_call(case, state)
      return got, results["chain_r"]
    alt = alternative(case.op, variant)
    with variant_env(variant, case.op):
      text, got, wall = single_call(self.with_call(case, variant), state)
    called = set(re.findall(r"custom_call @(glm5_\w+)", text))
    want = (set(alt.targets) if alt else
            {glm5_jax.KERNEL_TARGETS[case.op]} if variant in (KERNEL, NO_PDL) else set())
    if called != want:
      raise RuntimeError(f"the {variant} variant calls {sorted(called)}, not {sorted(want)}")
    r = self.chain_length(case, wall, text.count("\n"))
    results.setdefault("chain_r", r)
    return got, r

  @staticmethod
  def with_call(case, variant):
    """The case with its op written another way for an alternative variant."""
    alt = alternative(case.op, variant)
    return case._replace(call=alt.call) if alt else case

  def run_case(self, case, variants):
    """Checks every variant once (from the same initial state): the JAX variants
    against the reference, the Triton one against the kernel (its stock op order;
    the reference where there is no kernel). Then times each; the state is
    threaded from run to run (the Triton variant times on its own copy)."""
    s, state = self.s, case.state
    floor = floor_us(case.nbytes, case.flops, self.bw)
    results, checked = {}, {}                              # variant -> (exact, R)
    for variant in variants:
      try:
        got, r = self.check(case, state, variant, results)
        if variant == "reference":
          exact = True
        else:
          want = results.get(KERNEL if variant == TRITON else "reference",
                             results.get("reference"))
          exact = want is not None and all(bool(_same_bits(a, b)) for a, b in zip(got, want))
        if variant in ("reference", KERNEL):
          results[variant] = got
        checked[variant] = exact, r
        del got
      except Exception as e:                               # noqa: BLE001
        self.error_row(case.op, case.shape, variant, e)
    results.clear()
    for variant, (exact, r) in checked.items():
      try:
        if variant == TRITON:
          sec, info = triton_amortised(case, state, r, s)
        else:
          with variant_env(variant, case.op):
            sec, state, info = amortised(self.with_call(case, variant).call, state,
                                         case.fixed, case.rotated[:r], case.dep, s)
        us = sec * 1e6
        self.row(case.op, case.shape, variant, us, floor, exact,
                 gbps=case.nbytes / sec / 1e9, R=r, passes=info["passes"], reps=s.reps,
                 compile_s=round(info["compile_s"], 2), min_bytes=int(case.nbytes),
                 flops=int(case.flops) or None,
                 notes=not_in_place(info["temp"], state))
        self.log(f"{case.op} {case.shape} {variant}: {us:.2f} us (floor {floor:.3f}, "
                 f"R={r} x {info['passes']} passes, "
                 f"exact={exact}, compile {info['compile_s']:.1f}s)")
      except Exception as e:                               # noqa: BLE001
        self.error_row(case.op, case.shape, variant, e)
        if any(a.is_deleted() for a in jax.tree.leaves(state)):
          return                                           # the state was donated away

  def sweep_projection(self):
    """indexer_projection's kernel at every (warps, split) that tiles K = HIDDEN in
    <= 8 blocks per warp, every M: rows with variant "kernel <warps>x<split>"."""
    tactics = [t for t in projection_tactics(HIDDEN) if tile_k(HIDDEN, *t)[1] == 1]
    for shape, kw in _rows(self.s):
      for w, sp in tactics:
        if self.over_budget():
          return
        variant = f"{KERNEL} {w}x{sp}"
        case = case_projection(Rand(zlib.crc32(f"indexer_projection {shape}".encode())),
                               self.s, tactic=(w, sp), **kw)
        try:
          with variant_env(KERNEL):
            sec, _, info = amortised(case.call, None, (), case.rotated, case.dep, self.s)
          floor = floor_us(case.nbytes, case.flops, self.bw)
          self.row("indexer_projection", shape, variant, sec * 1e6, floor, None,
                   R=len(case.rotated), passes=info["passes"])
          self.log(f"indexer_projection {shape} {variant}: {sec * 1e6:.2f} us")
        except Exception as e:                             # noqa: BLE001
          self.error_row("indexer_projection", shape, variant, e)
      self.write_json()

  def sort_rows(self, ops):
    """Calibration first, then ops in `ops` order, shapes in CASES order."""
    order = {(op, shape): (i, j) for i, op in enumerate(ops)
             for j, (shape, _) in enumerate(CASES[op][1](self.s))}
    self.rows.sort(key=lambda r: (r["op"] != "calibration",
                                  order.get((r["op"], r["shape"]), (-1, -1))))

  def write_json(self):
    with open(self.args.out, "w") as f:
      json.dump(self.rows, f, indent=1, default=float)


# ----------------------------------------------------------------- reports

def _size(n):
  return f"{n / 2 ** 30:.3g} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.3g} MiB"


def _fmt(v):
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return "—"
  return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _lookup(rows):
  return {(r["op"], r["shape"], r["variant"]): r for r in rows}


def _ratio(num, den):
  return f"{num / den:.2f}×" if num and den else "—"


def tables(rows):
  """Markdown tables, one per op: shape | µs per variant | floor | speedups | exact."""
  by = _lookup(rows)
  out = []
  for op in dict.fromkeys(r["op"] for r in rows if r["op"] != "calibration"):
    present = dict.fromkeys(r["variant"] for r in rows if r["op"] == op)
    variants = [v for v in VARIANTS if v in present] + [
        v for v in present if v not in VARIANTS]
    cols = [f"{v} µs" for v in variants] + ["floor µs"] + (
        ["reference / kernel"] if KERNEL in variants else []) + (
        [f"{TRITON} / kernel"] if {KERNEL, TRITON} <= set(variants) else []) + ["exact"]
    out += [f"### {op}", "", "| shape | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|"]
    notes = []
    for shape in dict.fromkeys(r["shape"] for r in rows if r["op"] == op):
      got = {v: by.get((op, shape, v)) for v in variants}
      us = {v: got[v] and got[v]["device_us"] for v in variants}
      floor = next((x["floor_us"] for x in got.values() if x and x["floor_us"]), None)
      cells = [_fmt(us[v]) for v in variants] + [_fmt(floor)]
      if KERNEL in variants:
        cells.append(_ratio(us["reference"], us[KERNEL]))
      if {KERNEL, TRITON} <= set(variants):
        cells.append(_ratio(us[TRITON], us[KERNEL]))
      cells.append(", ".join(f"{v}: {'yes' if got[v]['exact'] else 'no'}"
                             for v in variants[1:] if us[v] and got[v]["exact"] is not None)
                   or "—")
      out.append(f"| {shape} | " + " | ".join(cells) + " |")
      notes += [f"- {shape} {x['variant']}: {x['notes']}" for x in got.values()
                if x and x.get("notes")]
    out += [""] + notes + ([""] if notes else [])
  return out


def markdown(rows, meta, sizes, plot_ref):
  calib = {r["shape"].split(" x")[0]: r for r in rows if r["op"] == "calibration"}
  copy = next((r for k, r in calib.items() if k.startswith("copy")), None)
  parts = [f"copy {copy['gbps']:.0f} GB/s read + write over {copy['shape'][5:]} "
           f"({copy['device_us']:.0f} µs)" if copy and copy.get("gbps") else
           f"copy: not measured, floors use {BW_FALLBACK / 1e12:.1f} TB/s"]
  if calib.get("empty XLA op", {}).get("device_us"):
    parts.append(f"empty XLA op {calib['empty XLA op']['device_us']:.2f} µs")
  for name in ("empty Pallas call", "empty FFI call", "empty FFI call, PDL off"):
    if calib.get(name, {}).get("device_us"):
      what = "f32[128] + 1" if "Pallas" in name else "upcast_logits kernel on 1x8"
      parts.append(f"{name} ({what}) {calib[name]['device_us']:.2f} µs")
  lines = [
      "# glm5_jax benchmarks", "",
      f"GPU: {meta['gpu']} · jax {meta['jax_version']} · glm5_jax {glm5_jax.__version__} · "
      f"{meta['date']} · kernel variants: {', '.join(meta['kernels']) or 'none'}", "",
      "Method (`bench/bench.py`, PERFORMANCE.md §8):", "",
      f"- one jitted function runs a device loop of `passes` passes over R calls of the public "
      f"op (R ≤ {sizes.r_max}; passes grows until a run takes ≥ {sizes.run_s * 1e3:g} ms, so "
      "host dispatch is amortised; both per row in the JSON), each call on its own inputs: W_cat and logits rotated past the 60 MB L2, ≥ 1 GB "
      "caches donated and threaded through the calls, stateless calls ordered by "
      "optimization barriers on the previous call's outputs" + (
          " and a run-time-zero scalar (+1 tiny fusion per call)" if sizes.data_dep else "")
      + "; XLA command buffers at their defaults;",
      f"- µs = median over {sizes.reps} back-to-back runs of the run time / (passes × R), nothing "
      "subtracted (see the calibration); reference = the op with GLM5_JAX_KERNELS=0 (pure "
      "JAX under jit), kernel = its CUDA FFI kernel, `kernel, PDL off` = the same with "
      "GLM5_JAX_PDL=0; triton = the stock op order as Triton kernels (glm5_jax/testing/triton_oracle.py: "
      "one decode-update kernel, expand, expand + column-preserving convert, convert) in a "
      "torch CUDA graph of R calls replayed `passes` times (indexer_query: torch's LayerNorm "
      "+ the Triton Hadamard + FP8; indexer_projection_fused: a cuBLAS GEMM of W_cat, bf16 "
      "out, then the same); pallas = the op written with Pallas (Triton backend; "
      "bench/pallas_ops.py), what a JAX user could write; `reference, three dots` = the "
      "projection as three jitted dots (wk, weights_proj, gate) instead of one of W_cat; "
      f"`{TWO_KERNELS}` and `{GEMM_QUERY}` = indexer_projection then indexer_query, both "
      "kernels or XLA's GEMM and the query kernel;",
      "- floor = max(minimum bytes / measured copy bandwidth, FLOPs / 790 TFLOP/s) "
      "(PERFORMANCE.md §7); exact = kernel outputs bit-equal to the reference, triton "
      "outputs bit-equal to the kernel's (the remap compacted first; upcast: columns below "
      "row_ends); the GEMMs (projection kernels, cuBLAS, three dots) sum in another order "
      "than XLA's one dot, and torch's LayerNorm rounds differently, so those variants are "
      "not bit-equal: the kernels' SPEC D2 bounds are checked by the GPU tests.", "",
      "Calibration: " + "; ".join(parts) + ".", ""]
  runs = {}
  for r in rows:
    runs.setdefault(r["date"], dict.fromkeys([]))[r["op"]] = None
  if len(runs) > 1:
    lines += ["Rows from several runs (same machine and method): " + "; ".join(
        f"{d}: {', '.join(ops)}" for d, ops in sorted(runs.items())) + ".", ""]
  if plot_ref:
    lines += [f"![µs per call vs shape]({plot_ref})", ""]
  return "\n".join(lines + routing(rows) + tables(rows)) + "\n"


def routing(rows):
  """Where each kernel loses to the jitted reference, and what the op runs by
  default (Op.kernel_off)."""
  by = _lookup(rows)
  lines = ["Routing (kernel vs jitted reference, same run):", ""]
  for op in dict.fromkeys(r["op"] for r in rows if r["variant"] == "kernel"):
    pairs = [(sh, by.get((op, sh, "reference")), k) for (o, sh, v), k in by.items()
             if o == op and v == "kernel"]
    def slower(other):
      return [sh for sh, _, k in pairs if (o := by.get((op, sh, other))) and
              o.get("device_us") and k.get("device_us") and k["device_us"] > o["device_us"]]
    note = Op.registry[op].kernel_default_note
    default = (f"reference by default ({Op.registry[op].kernel_off})"
               if Op.registry[op].kernel_off else
               f"kernel by default at {note}, reference elsewhere" if note else
               "kernel by default")
    vs_ref, vs_triton = slower("reference"), slower(TRITON)
    lines.append(f"- `{op}`: kernel slower than the reference at {len(vs_ref)} of "
                 f"{len(pairs)} shapes" + (f" ({', '.join(vs_ref)})" if vs_ref else "")
                 + (f", than Triton at {len(vs_triton)}" + (
                     f" ({', '.join(vs_triton)})" if vs_triton else "")
                    if any(by.get((op, sh, TRITON)) for sh, _, _ in pairs) else "")
                 + f"; {default}.")
  return lines + [""]


def plot(rows, path):
  """One panel per op: µs per call vs shape (log y), every variant, floor."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  by = _lookup(rows)
  ops = list(dict.fromkeys(r["op"] for r in rows if r["op"] != "calibration"))
  cols, rows_ = 3, -(-len(ops) // 3)
  fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.3 * rows_), squeeze=False)
  for ax, op in zip(axes.flat, ops):
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["op"] == op))
    x = np.arange(len(shapes))

    def series(variant, key="device_us"):
      vals = [(by.get((op, sh, variant)) or {}).get(key) for sh in shapes]
      return np.array([v if v else np.nan for v in vals], float)

    for variant, style in zip(VARIANTS, ("o-", "s-", "x:", "^-", "v-", "d--", "P-", "*-")):
      y = series(variant)
      if np.isfinite(y).any():
        ax.plot(x, y, style, label=variant)
    floor = series("reference", "floor_us")
    if np.isfinite(floor).any():
      ax.plot(x, floor, "k--", label="floor")
    ax.set_yscale("log")
    ax.set_title(op, fontsize=10)
    ax.set_ylabel("µs per call", fontsize=8)
    ax.set_xticks(x, shapes, rotation=30, ha="right", fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(ops):]:
    ax.set_visible(False)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------- main

def main():
  here = os.path.dirname(os.path.abspath(__file__))
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="BENCHMARKS.json", help="JSON rows")
  p.add_argument("--md", default="BENCHMARKS.md", help="markdown report")
  p.add_argument("--plot", default=os.path.join(here, "benchmarks.png"), help="PNG plot")
  p.add_argument("--quick", action="store_true",
                 help="M (B, n, rows) in {1, 64} and the first of the other sizes")
  p.add_argument("--ops", default="", help="comma-separated ops (default: all)")
  p.add_argument("--rows", default="",
                 help="comma-separated M (B, n, rows) instead of 1,8,16,64")
  p.add_argument("--skip-variants", nargs="+", default=[], metavar="VARIANT",
                 help=f"variants not to run, each one argument (of: {'; '.join(VARIANTS[1:])})")
  p.add_argument("--cpu-smoke", action=argparse.BooleanOptionalAction, default=None,
                 help="tiny caches, contexts, R and N (default: on for the CPU backend)")
  p.add_argument("--budget-s", type=float, default=230,
                 help="skip the remaining shapes after this many seconds")
  p.add_argument("--cache-dir", default=os.path.join(here, ".jax_cache"),
                 help="persistent XLA compilation cache ('' = off); reruns skip "
                      "the unchanged compiles")
  p.add_argument("--data-dep", action="store_true",
                 help="also chain stateless calls through a run-time-zero scalar "
                      "(one extra tiny fusion per call)")
  p.add_argument("--sweep-projection", action="store_true",
                 help="also time indexer_projection's kernel at every (warps, split) tactic")
  p.add_argument("--verbose", action="store_true", help="print tracebacks")
  p.add_argument("--render", metavar="JSON",
                 help="measure nothing: rebuild --md and --plot from these JSON rows")
  args = p.parse_args()
  if args.render:
    render(args)
    return
  if args.cpu_smoke is None:
    args.cpu_smoke = jax.default_backend() == "cpu"
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  ops = [o for o in args.ops.replace(" ", "").split(",") if o] or list(glm5_jax.OPS)
  unknown = set(ops) - set(glm5_jax.OPS)
  if unknown:
    p.error(f"unknown ops {sorted(unknown)}; choose from {', '.join(glm5_jax.OPS)}")
  # Ops with a kernel first: they matter most if the budget runs out.
  ops = sorted(ops, key=lambda o: (o not in glm5_jax.KERNEL_TARGETS, glm5_jax.OPS.index(o)))

  for path in (args.out, args.md):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  sizes = dataclasses.replace(sizes_for(args.quick, args.cpu_smoke), data_dep=args.data_dep)
  if args.rows:
    sizes = dataclasses.replace(sizes, rows=tuple(int(m) for m in args.rows.split(",")))
  bench = Bench(sizes, args)
  bench.log(f"{bench.meta['gpu']} ({jax.default_backend()}), jax {jax.__version__}, "
            f"CUDA module {'built' if bench.module else 'absent'}, kernel variants: "
            f"{bench.kernels}, compilation cache: {args.cache_dir or 'off'}"
            + (", --cpu-smoke sizes" if args.cpu_smoke else ""))
  bench.calibrate()
  # Two passes, so a run cut short by --budget-s still has every op's extreme
  # shapes: first the --quick subset (M in {1, 64}), then the rest.
  first = {op: {label for label, _ in CASES[op][1](sizes_for(True, args.cpu_smoke))}
           for op in ops}
  for op in ops:
    bench.run_op(op, first[op])
  for op in ops:
    bench.run_op(op, {label for label, _ in CASES[op][1](sizes)} - first[op])
  if args.sweep_projection and bench.has_kernel("indexer_projection"):
    bench.sweep_projection()
  bench.sort_rows(ops)
  bench.write_json()

  plot_ref = plot_or_none(bench.rows, args)
  text = markdown(bench.rows, dict(bench.meta, kernels=bench.kernels), sizes, plot_ref)
  with open(args.md, "w") as f:
    f.write(text)
  compile_s = sum(r.get("compile_s", 0) for r in bench.rows)
  bench.log(f"wrote {args.out}, {args.md}" + (f", {args.plot}" if plot_ref else "")
            + f"; chain compiles took {compile_s:.0f}s")
  print("\n".join(line for line in text.splitlines() if not line.startswith("![")), flush=True)


def plot_or_none(rows, args):
  """Writes args.plot; its path relative to args.md, or None when plotting fails
  (e.g. no matplotlib: the report is written without the plot)."""
  try:
    plot(rows, args.plot)
  except Exception as e:                                   # noqa: BLE001
    print(f"plot failed: {type(e).__name__}: {e}", flush=True)
    return None
  return os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.md)))


def render(args):
  """BENCHMARKS.md and the plot from the rows of an earlier run."""
  with open(args.render) as f:
    rows = json.load(f)
  meta = {k: rows[0][k] for k in ("gpu", "jax_version", "date")}
  meta["kernels"] = list(dict.fromkeys(r["op"] for r in rows if r["variant"] == "kernel"))
  with open(args.md, "w") as f:
    f.write(markdown(rows, meta, sizes_for(False, False), plot_or_none(rows, args)))


if __name__ == "__main__":
  main()
