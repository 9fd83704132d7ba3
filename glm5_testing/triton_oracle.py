"""A Triton oracle of the SPEC §3 pool compression (and of the §2b/§2c q
Hadamard + FP8 and head weights, `query`), written for the GPU tests.

`compress(keys, gates, ape)` compresses pools of four tokens, one Triton program
per pool, and returns the fp8 bytes and the 4 scale bytes of each K-cache entry.
It is compress-only: the decode ring logic (which tokens form a pool) is done
around it in torch by `decode_expected`, so the CUDA kernel and this oracle get
the same pools.

Stock op order followed (SPEC §3 and §11.1; the stock Triton decode kernel does
this per pool over the 128 head dims, fp32 unless stated):
  1. z_s = f32(gate_s) + ape_s                        (fadd, s = 0..3)
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
import ml_dtypes

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


def optional():
  """load() for a comparison that is one part of a test: None without the oracle, but the
  test fails under GLM5_JAX_REQUIRE_GPU=1 (no silent skip on the GPU run)."""
  oracle = load()
  if oracle is None and os.environ.get("GLM5_JAX_REQUIRE_GPU") == "1":
    import pytest
    pytest.fail("GLM5_JAX_REQUIRE_GPU=1 but torch + triton with CUDA are not importable")
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
  def _pool_value(k0, k1, k2, k3, s0, s1, s2, s3, ape_ptr):
    """Steps 1-5 on the pool's 4 key/gate rows (bf16[128] pointers, pool order):
    softmax over the 4 gates (+ APE), FMA chain in pool order, / den, bf16."""
    d = tl.arange(0, 128)
    mx = tl.full((128,), float("-inf"), tl.float32)
    for s in tl.static_range(4):
      sp = s0 if s == 0 else s1 if s == 1 else s2 if s == 2 else s3
      mx = tl.maximum(mx, tl.load(sp + d).to(tl.float32) + tl.load(ape_ptr + s * 128 + d))
    den = tl.zeros((128,), tl.float32)
    acc = tl.zeros((128,), tl.float32)
    for s in tl.static_range(4):
      sp = s0 if s == 0 else s1 if s == 1 else s2 if s == 2 else s3
      kp = k0 if s == 0 else k1 if s == 1 else k2 if s == 2 else k3
      z = tl.load(sp + d).to(tl.float32) + tl.load(ape_ptr + s * 128 + d)
      p = tl.exp(z - mx)
      den = den + p
      acc = tl.fma(p, tl.load(kp + d).to(tl.float32), acc)
    return (acc / den).to(tl.bfloat16).to(tl.float32)

  @triton.jit
  def _quantize_store(y, q_ptr, word_ptr, ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr):
    """Steps 6-10: Hadamard, amax, scale, fp8 codes -> q_ptr[0:128] (u8), the
    scale word -> word_ptr[0] (i32)."""
    d = tl.arange(0, 128)
    y = _rotate(y)
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-4)
    v = amax * 0.002232142857142857                                  # fp32 0x3B124925
    e = tl.ceil(tl.log2(v))
    if ROUND_SCALE:
      scale = tl.exp2(e)
    else:
      scale = v
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(q_ptr + d, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    if UE8M0:
      word = ((e.to(tl.int32) + 127).to(tl.uint32) * 0x01010101).to(tl.int32, bitcast=True)
    else:
      word = scale.to(tl.int32, bitcast=True)
    tl.store(word_ptr, word)

  @triton.jit
  def _compress_kernel(key_ptr, gate_ptr, ape_ptr, q_ptr, scale_ptr,
                       ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr):
    pool = tl.program_id(0).to(tl.int64)
    k, sc = key_ptr + pool * 512, gate_ptr + pool * 512
    y = _pool_value(k, k + 128, k + 256, k + 384, sc, sc + 128, sc + 256, sc + 384, ape_ptr)
    _quantize_store(y, q_ptr + pool * 128, scale_ptr + pool, ROUND_SCALE, UE8M0)

  @triton.jit
  def _decode_update_kernel(kv_ptr, tail_ptr, tslot_ptr, key_ptr, gate_ptr, ape_ptr,
                            loc_ptr, pos_ptr, cap, blocks, PAGE: tl.constexpr,
                            RING: tl.constexpr, NEXT_N: tl.constexpr,
                            ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr):
    """SPEC §3 for one request (a program), its tokens in order, as one kernel like
    the stock decode update: a completing token pools the 3 ring rows before it and
    itself; every live token with tslot >= 0 is stashed in the ring; a CTA barrier
    makes the stash visible to the request's next token."""
    req = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, 128)
    for t in tl.static_range(NEXT_N):
      i = req * NEXT_N + t
      p, ts, slot = tl.load(pos_ptr + i), tl.load(tslot_ptr + i), tl.load(loc_ptr + i)
      sp = tl.maximum(p, 0).to(tl.int64)
      blk = (tl.maximum(ts, 0) // RING).to(tl.int64)
      live = (p >= 0) & (blk < blocks)
      key, gate = key_ptr + i * 128, gate_ptr + i * 128
      if live & (slot >= 0) & (slot < cap) & (sp % 4 == 3):
        kr = tail_ptr + blk * (2 * RING * 128)
        sr = kr + RING * 128
        r0, r1, r2 = (sp - 3) % RING * 128, (sp - 2) % RING * 128, (sp - 1) % RING * 128
        y = _pool_value(kr + r0, kr + r1, kr + r2, key, sr + r0, sr + r1, sr + r2, gate,
                        ape_ptr)
        page = kv_ptr + slot.to(tl.int64) // PAGE * (PAGE * 132)
        e = slot.to(tl.int64) % PAGE
        _quantize_store(y, page + e * 128,
                        (page + PAGE * 128 + e * 4).to(tl.pointer_type(tl.int32)),
                        ROUND_SCALE, UE8M0)
      if live & (ts >= 0):
        row = tail_ptr + blk * (2 * RING * 128) + sp % RING * 128
        tl.store(row + d, tl.load(key + d))
        tl.store(row + RING * 128 + d, tl.load(gate + d))
      tl.debug_barrier()

  @triton.jit
  def _expand_kernel(ids_ptr, lens_ptr, out_ptr, groups, width, seq_offset,
                     TILE: tl.constexpr):
    """SPEC §6 on one row x TILE columns: pools in rank order, the tail, -1 after."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    hist = c < 4 * groups
    pid = tl.load(ids_ptr + r * groups + c // 4, mask=hist, other=-1)
    n = tl.maximum(tl.load(lens_ptr + r) + seq_offset, 0)
    start = n // 4 * 4
    j = c - 4 * groups
    tail = tl.where((j >= 0) & (j < n - start), start + j, -1)
    out = tl.where(hist, tl.where(pid >= 0, pid * 4 + c % 4, -1), tail)
    tl.store(out_ptr + r * width + c, out, mask=c < width)

  @triton.jit
  def _convert_kernel(req_ptr, table_ptr, tok_ptr, out_ptr, counts_ptr, n_req, max_blocks,
                      width, BLOCK_SIZE: tl.constexpr, STRIDE: tl.constexpr,
                      TILE: tl.constexpr):
    """SPEC §7, column-preserving layout with counts (the stored stock): one row x
    TILE columns, the tile's valid count added atomically."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    req = tl.load(req_ptr + t)
    tok = tl.load(tok_ptr + t * width + c, mask=c < width, other=-1)
    blk = tok // BLOCK_SIZE
    valid = (tok >= 0) & (blk < max_blocks) & (req >= 0) & (req < n_req)
    base = tl.load(table_ptr + req.to(tl.int64) * max_blocks + blk, mask=valid, other=0)
    tl.store(out_ptr + t * width + c, tl.where(valid, base * STRIDE + tok % BLOCK_SIZE, -1),
             mask=c < width)
    tl.atomic_add(counts_ptr + t, tl.sum(valid.to(tl.int32), axis=0))

  @triton.jit
  def _upcast_kernel(x_ptr, ends_ptr, out_ptr, width, TILE: tl.constexpr):
    """SPEC §8: f32(x[r, c]) for c < row_ends[r]; the rest left unwritten."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    keep = c < tl.minimum(tl.load(ends_ptr + r), width)
    x = tl.load(x_ptr + r * width + c, mask=keep)
    tl.store(out_ptr + r * width + c, x.to(tl.float32), mask=keep)

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


def device():
  """Where the oracle runs: "cuda", or "cpu" under the Triton interpreter."""
  return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def to_torch(a):
  """An array (numpy or jax; bf16 included) as a torch tensor on device()."""
  a = np.asarray(a)
  if a.dtype == ml_dtypes.bfloat16:
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device())
  return torch.from_numpy(np.ascontiguousarray(a)).to(device())


def to_numpy(t):
  """A torch tensor as a numpy array (bf16 as ml_dtypes.bfloat16)."""
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
  return t.cpu().numpy()


def compress(keys, gates, ape, *, scale_format="fp32", round_scale=True):
  """Pools -> K-cache entries.

  keys, gates: torch bf16[n, 4, 128] (pool order); ape: torch f32[4, 128].
  Returns (fp8 bytes torch u8[n, 128], scale bytes torch u8[n, 4]) on the inputs' device.
  """
  assert keys.dtype == gates.dtype == torch.bfloat16 and ape.dtype == torch.float32
  n = keys.shape[0]
  assert keys.shape == gates.shape == (n, POOL, DIM) and ape.shape == (POOL, DIM)
  assert scale_format in ("fp32", "ue8m0") and (round_scale or scale_format == "fp32")
  keys, gates, ape = keys.contiguous(), gates.contiguous(), ape.contiguous()
  q = torch.empty((n, DIM), dtype=torch.uint8, device=keys.device)
  words = torch.empty((n,), dtype=torch.int32, device=keys.device)
  if n:
    _compress_kernel[(n,)](keys, gates, ape, q, words, ROUND_SCALE=bool(round_scale),
                           UE8M0=scale_format == "ue8m0", num_warps=1)
  return q, words.view(torch.uint8).view(n, 4)


def decode_update(kv_cache, tail, tslot, key, gate, ape, loc, pos, *,
                  scale_format="fp32", round_scale=True):
  """SPEC §3 as one Triton kernel (a program per request), in place on kv_cache
  and tail; the same arguments and results as `decode_expected`, which checks it."""
  B, N = pos.shape
  pages, page, _ = kv_cache.shape
  blocks, _, ring, _ = tail.shape
  if B * N:
    _decode_update_kernel[(B,)](kv_cache, tail, tslot, key, gate, ape, loc, pos,
                                pages * page, blocks, PAGE=page, RING=ring, NEXT_N=N,
                                ROUND_SCALE=bool(round_scale), UE8M0=scale_format == "ue8m0",
                                num_warps=1)
  return kv_cache, tail


_TILE = 1024


def expand(pool_ids, seq_lens, *, seq_offset, width):
  """SPEC §6: torch i32[rows, G], i32[rows] -> i32[rows, width]."""
  rows, groups = pool_ids.shape
  out = torch.empty((rows, width), dtype=torch.int32, device=pool_ids.device)
  if rows:
    _expand_kernel[(rows, triton.cdiv(width, _TILE))](pool_ids, seq_lens, out, groups, width,
                                                      seq_offset, TILE=_TILE, num_warps=4)
  return out


def convert(req_ids, block_table, tokens, *, block_size, stride_rows):
  """SPEC §7 column-preserving with counts: (out i32[T, W], counts i32[T])."""
  rows, width = tokens.shape
  out = torch.empty_like(tokens)
  counts = torch.zeros((rows,), dtype=torch.int32, device=tokens.device)
  if rows:
    _convert_kernel[(rows, triton.cdiv(width, 128))](
        req_ids, block_table, tokens, out, counts, block_table.shape[0], block_table.shape[1],
        width, BLOCK_SIZE=block_size, STRIDE=stride_rows, TILE=128, num_warps=4)
  return out, counts


def upcast(logits, row_ends):
  """SPEC §8: torch bf16[rows, P] -> f32[rows, P], columns >= row_ends unwritten."""
  rows, width = logits.shape
  out = torch.empty((rows, width), dtype=torch.float32, device=logits.device)
  if rows:
    _upcast_kernel[(rows, triton.cdiv(width, _TILE))](logits, row_ends, out, width,
                                                      TILE=_TILE, num_warps=4)
  return out


def decode_expected(kv_cache, tail, tslot, key, gate, ape, loc, pos, *,
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
  pool_keys, pool_gates, slots = [], [], []
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
      pool_gates.append(torch.cat([tl_[b, 1, rows], gate[r, t].unsqueeze(1)], 1))
      slots.append(slot[r])
    st = (live & (ts >= 0)).nonzero().flatten()
    tl_[blk[st], 0, sp[st] % ring] = key[st, t]
    tl_[blk[st], 1, sp[st] % ring] = gate[st, t]
  n = 0
  if slots:
    slots = torch.cat(slots)
    n = int(slots.numel())
    assert int(torch.unique(slots).numel()) == n, "completions must target distinct slots"
    q, sb = compress(torch.cat(pool_keys), torch.cat(pool_gates), ape,
                     scale_format=scale_format, round_scale=round_scale)
    flat = kv.view(pages, page * (DIM + 4))
    pg, e = slots // page, slots % page
    cols = e[:, None] * DIM + torch.arange(DIM, device=kv.device)
    flat[pg[:, None], cols] = q
    scols = page * DIM + e[:, None] * 4 + torch.arange(4, device=kv.device)
    flat[pg[:, None], scols] = sb
  return kv, tl_, n
