"""A Triton oracle of the SPEC §3 pool compression (and of the §2b/§2c q
Hadamard + FP8 and head weights, `query`), written for the GPU tests.

`compress(keys, scores, ape)` compresses pools of four tokens, one Triton program
per pool, and returns the fp8 bytes and the 4 scale bytes of each K-cache entry.
It is compress-only: the decode ring logic (which tokens form a pool) is done
around it in torch by `decode_expected`, so the CUDA kernel and this oracle get
the same pools.

Stock op order followed (SPEC §3 and §11.1; the stock Triton decode kernel does
this per pool over the 128 head dims, fp32 unless stated):
  1. z_s = f32(score_s) + ape_s                        (fadd, s = 0..3)
  2. mx = maximum(maximum(maximum(maximum(-inf, z_0), z_1), z_2), z_3)
                                                       (tl.maximum = fmax)
  3. for s = 0..3 in pool order, den = +0, acc = +0:
       p = tl.exp(z_s - mx)      -> Triton: sub, mul.f32 by 0x3FB8AA3B, ex2.approx.f32
       den = den + p             -> add.f32 (plain adds)
       acc = fma(p, f32(k_s), acc)
                                 -> tl.fma: fma.rn.f32, the FMA chain that stock's
                                    `acc += k * p` contracts to (first step with +0)
  4. y = f32(bf16(acc / den))    -> div.full.f32, cvt.rn.bf16.f32
  5. Hadamard: 7 butterfly stages, strides 1, 2, 4, .., 64 in this order; in each
     stage the pair (i, i + stride) becomes (a + b, a - b), fp32 adds. Stage
     `stride` views y as [128 / (2 stride), 2, stride]: a = [:, 0, :], b = [:, 1, :]
     (tl.reshape / tl.permute / tl.split / tl.join move values, no arithmetic).
  6. y = f32(bf16(y * fp32(1/sqrt(128))))              (mul, cvt.rn.bf16.f32)
  7. amax = maximum(max_i |y_i|, fp32(1e-4)); v = amax * fp32(1/448)
  8. E = ceil(tl.log2(v))         -> libdevice __nv_log2f polynomial
     scale = tl.exp2(E) (exact for integer E) when round_scale, else v
  9. q_i = e4m3(minimum(maximum(y_i / scale, -448), 448))
                                 -> div.full.f32, cvt.rn.satfinite.e4m3x2.f32
 10. scale word: fp32 bits of scale, or (E + 127) * 0x01010101 (UE8M0, MX path).

torch and triton exist on the GPU machine only; import this module through
`load()`, which returns None when they are missing.
"""
import os

import numpy as np

try:  # GPU machine only
  import torch
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
  torch = triton = tl = None

DIM = 128
POOL = 4
LOG2E_BITS = 0x3FB8AA3B
INV_SQRT_DIM = float(np.uint32(0x3DB504F3).view(np.float32))
INV_FP8_MAX = float(np.uint32(0x3B124925).view(np.float32))   # fp32(1/448)
AMAX_FLOOR = float(np.float32(1e-4))


def require():
  """load(), or skip the test (fail it under GLM5_JAX_REQUIRE_GPU=1) without the oracle."""
  import pytest
  oracle = load()
  if oracle is None:
    if os.environ.get("GLM5_JAX_REQUIRE_GPU") == "1":
      pytest.fail("GLM5_JAX_REQUIRE_GPU=1 but torch + triton with CUDA are not importable")
    pytest.skip("needs torch + triton with CUDA (the Triton oracle)")
  return oracle


def load():
  """This module when torch + triton (+ a CUDA device for torch, unless the
  Triton interpreter is on) are available, else None."""
  if triton is None:
    return None
  if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    return None
  import sys
  return sys.modules[__name__]


if triton is not None:

  @triton.jit
  def _butterfly(x, STRIDE: tl.constexpr):
    """One Hadamard stage on a [128] vector: (x[i], x[i+STRIDE]) -> (a + b, a - b)
    for every i with bit STRIDE clear."""
    GROUPS: tl.constexpr = 128 // (2 * STRIDE)
    v = tl.reshape(x, (GROUPS, 2, STRIDE))
    v = tl.permute(v, (0, 2, 1))              # [G, STRIDE, 2]: last axis = (a, b)
    a, b = tl.split(v)
    v = tl.join(a + b, a - b)                 # [G, STRIDE, 2]
    v = tl.permute(v, (0, 2, 1))              # [G, 2, STRIDE]
    return tl.reshape(v, (128,))

  @triton.jit
  def _rotate(y):
    """The 7 Hadamard stages (strides 1..64 in order), * fp32(1/sqrt(128)), bf16."""
    y = _butterfly(y, 1)
    y = _butterfly(y, 2)
    y = _butterfly(y, 4)
    y = _butterfly(y, 8)
    y = _butterfly(y, 16)
    y = _butterfly(y, 32)
    y = _butterfly(y, 64)
    return (y * 0.08838834764831845).to(tl.bfloat16).to(tl.float32)   # fp32 0x3DB504F3

  @triton.jit
  def _compress_kernel(key_ptr, score_ptr, ape_ptr, q_ptr, scale_ptr,
                       ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr):
    pool = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, 128)
    base = pool * (4 * 128)
    mx = tl.full((128,), float("-inf"), tl.float32)
    for s in tl.static_range(4):
      z = tl.load(score_ptr + base + s * 128 + d).to(tl.float32) + tl.load(ape_ptr + s * 128 + d)
      mx = tl.maximum(mx, z)
    den = tl.zeros((128,), tl.float32)
    acc = tl.zeros((128,), tl.float32)
    for s in tl.static_range(4):
      z = tl.load(score_ptr + base + s * 128 + d).to(tl.float32) + tl.load(ape_ptr + s * 128 + d)
      k = tl.load(key_ptr + base + s * 128 + d).to(tl.float32)
      p = tl.exp(z - mx)
      den = den + p
      acc = tl.fma(p, k, acc)
    y = (acc / den).to(tl.bfloat16).to(tl.float32)
    y = _rotate(y)
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-4)
    v = amax * 0.002232142857142857                                  # fp32 0x3B124925
    e = tl.ceil(tl.log2(v))
    if ROUND_SCALE:
      scale = tl.exp2(e)
    else:
      scale = v
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(q_ptr + pool * 128 + d, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    if UE8M0:
      word = ((e.to(tl.int32) + 127).to(tl.uint32) * 0x01010101).to(tl.int32, bitcast=True)
    else:
      word = scale.to(tl.int32, bitcast=True)
    tl.store(scale_ptr + pool, word)


  @triton.jit
  def _query_kernel(q_ptr, w_ptr, codes_ptr, w_out_ptr, scale):
    """SPEC §2b/§2c for one (token, head) row, stock op order: steps 5-9 of the
    pool compression above on f32(q), then w_out = (w * 2^E) * scale (two fp32
    multiplies; no add, so nothing to contract)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, 128)
    y = tl.load(q_ptr + row * 128 + d).to(tl.float32)
    y = _rotate(y)
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-4)
    v = amax * 0.002232142857142857                                  # fp32 0x3B124925
    q_scale = tl.exp2(tl.ceil(tl.log2(v)))
    q = tl.minimum(tl.maximum(y / q_scale, -448.0), 448.0)
    tl.store(codes_ptr + row * 128 + d, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    tl.store(w_out_ptr + row, tl.load(w_ptr + row) * q_scale * scale)


def query(q, weights, scale):
  """q Hadamard + FP8 and head weights of SPEC §2b/§2c (no padding, fp32 w_out).

  q: torch bf16[M, H, 128]; weights: torch f32[M, H]; scale: a Python float
  (rounded to fp32 by Triton's fp32 scalar argument). Returns (codes torch
  u8[M, H, 128], w_out torch f32[M, H]) on the inputs' device.
  """
  assert q.dtype == torch.bfloat16 and weights.dtype == torch.float32
  M, H, _ = q.shape
  assert q.shape == (M, H, DIM) and weights.shape == (M, H)
  q, weights = q.contiguous(), weights.contiguous()
  codes = torch.empty((M, H, DIM), dtype=torch.uint8, device=q.device)
  w_out = torch.empty((M, H), dtype=torch.float32, device=q.device)
  if M * H:
    _query_kernel[(M * H,)](q, weights, codes, w_out, float(np.float32(scale)), num_warps=1)
  return codes, w_out


def _device():
  return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def compress(keys, scores, ape, *, scale_format="fp32", round_scale=True):
  """Pools -> K-cache entries.

  keys, scores: torch bf16[n, 4, 128] (pool order); ape: torch f32[4, 128].
  Returns (fp8 bytes torch u8[n, 128], scale bytes torch u8[n, 4]) on the inputs' device.
  """
  assert keys.dtype == scores.dtype == torch.bfloat16 and ape.dtype == torch.float32
  n = keys.shape[0]
  assert keys.shape == scores.shape == (n, POOL, DIM) and ape.shape == (POOL, DIM)
  assert scale_format in ("fp32", "ue8m0") and (round_scale or scale_format == "fp32")
  keys, scores, ape = keys.contiguous(), scores.contiguous(), ape.contiguous()
  q = torch.empty((n, DIM), dtype=torch.uint8, device=keys.device)
  words = torch.empty((n,), dtype=torch.int32, device=keys.device)
  if n:
    _compress_kernel[(n,)](keys, scores, ape, q, words, ROUND_SCALE=bool(round_scale),
                           UE8M0=scale_format == "ue8m0", num_warps=1)
  return q, words.view(torch.uint8).view(n, 4)


def decode_expected(kv_cache, tail, tslot, key, score, ape, loc, pos, *,
                    scale_format="fp32", round_scale=True):
  """SPEC §3 decode update with the project's decisions, as torch tensor ops
  around `compress`. All arguments torch tensors on one device (the layouts of
  glm5_jax.kpool_update); returns new (kv_cache, tail, pools) without touching
  the inputs, pools = number of entries written.

  Requests are processed token by token (vectorised over requests): a
  completion pools ring rows as they are after the earlier tokens' stashes.
  Requests must own distinct tail blocks and completions distinct slots."""
  kv = kv_cache.clone()
  tl_ = tail.clone()
  pages, page, _ = kv.shape
  blocks, _, ring, _ = tl_.shape
  cap = pages * page
  B, N = pos.shape
  pos, tslot, loc = pos.long(), tslot.long(), loc.long()
  pool_keys, pool_scores, slots = [], [], []
  for t in range(N):
    p, ts, slot = pos[:, t], tslot[:, t], loc[:, t]
    sp = p.clamp(min=0)
    blk = ts.clamp(min=0) // ring
    live = (p >= 0) & (blk < blocks)
    done = live & (slot >= 0) & (slot < cap) & (sp % POOL == POOL - 1)
    r = done.nonzero().flatten()
    if r.numel():
      rows = (sp[r, None] - (POOL - 1) + torch.arange(POOL - 1, device=kv.device)) % ring
      b = blk[r, None]
      pool_keys.append(torch.cat([tl_[b, 0, rows], key[r, t].unsqueeze(1)], 1))
      pool_scores.append(torch.cat([tl_[b, 1, rows], score[r, t].unsqueeze(1)], 1))
      slots.append(slot[r])
    st = (live & (ts >= 0)).nonzero().flatten()
    tl_[blk[st], 0, sp[st] % ring] = key[st, t]
    tl_[blk[st], 1, sp[st] % ring] = score[st, t]
  n = 0
  if slots:
    slots = torch.cat(slots)
    n = int(slots.numel())
    assert int(torch.unique(slots).numel()) == n, "completions must target distinct slots"
    q, sb = compress(torch.cat(pool_keys), torch.cat(pool_scores), ape,
                     scale_format=scale_format, round_scale=round_scale)
    flat = kv.view(pages, page * (DIM + 4))
    pg, e = slots // page, slots % page
    cols = e[:, None] * DIM + torch.arange(DIM, device=kv.device)
    flat[pg[:, None], cols] = q
    scols = page * DIM + e[:, None] * 4 + torch.arange(4, device=kv.device)
    flat[pg[:, None], scols] = sb
  return kv, tl_, n
