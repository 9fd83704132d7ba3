"""Independent numpy oracle for every glm5_jax op, written from SPEC.md alone.

Plain numpy + ml_dtypes, explicit Python loops over requests / tokens / rows /
pools; only the per-dimension math over the 128 head dims is a numpy vector op.
Nothing here imports or mirrors `glm5_jax.reference`.

Arithmetic (SPEC §11.1, D1):
  * bf16 rounding: ml_dtypes RNE (f32 -> bfloat16 -> f32);
  * e4m3: clamp to +-448, then ml_dtypes RNE;
  * fp32 FMA: exact product in float64, TwoSum, round-to-odd, cast to f32;
  * exp: correctly rounded fp32 of float64 exp2(t), t = RN32(RN32(z - max) * LOG2E);
  * division: IEEE fp32 (numpy float32 divide);
  * ceil(log2f(v)): the M(e) rule, M(e) from the closed formula of §11.1.
Floating sums whose order SPEC leaves open (GEMMs, LayerNorm, MQA logits) are
computed in float64 and compared with a tolerance by the tests.
"""
import math

import numpy as np
import ml_dtypes

F32 = np.float32
F64 = np.float64
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn

D = 128
P = 4
FP8_MAX = F32(448.0)
LOG2E = np.array([0x3FB8AA3B], np.uint32).view(F32)[0]
C_HAD = np.array([0x3DB504F3], np.uint32).view(F32)[0]       # fp32(0.08838834764831845)
INV448 = np.array([0x3B124925], np.uint32).view(F32)[0]      # fp32(1/448)
AMAX_FLOOR = F32(1e-4)
U32 = 2.0 ** -24                 # fp32 unit roundoff


# --------------------------------------------------------------------------- numerics

def bf16r(x):
  """RNE to bfloat16, returned as float32."""
  return np.asarray(x, F32).astype(BF16).astype(F32)


def to_bf16(x):
  return np.asarray(x, F32).astype(BF16)


def e4m3_bytes(x):
  """Saturating RNE fp32 -> e4m3fn, as uint8 codes; the clamp min(max(x, -448), 448) of
  SPEC §2b/§3 with fmax/fmin (SPEC §3: non-NaN propagating), so NaN -> -448."""
  x = np.fmin(np.fmax(np.asarray(x, F32), -FP8_MAX), FP8_MAX)
  return x.astype(E4M3).view(np.uint8)


def e4m3_value(codes):
  return np.asarray(codes, np.uint8).view(E4M3).astype(F64)


def fma32(a, b, c):
  """Single-rounding fp32 a*b + c (elementwise) via float64.

  The product of two fp32 values is exact in float64; the sum is done with
  TwoSum, rounded to odd in float64 (53 >= 24 + 2 bits), then rounded to fp32.
  """
  a = np.asarray(a, F32).astype(F64)
  b = np.asarray(b, F32).astype(F64)
  c = np.asarray(c, F32).astype(F64)
  p = a * b
  s = p + c
  bp = s - p
  ap = s - bp
  err = (p - ap) + (c - bp)
  s_arr = np.atleast_1d(s).copy()
  err = np.atleast_1d(err)
  even = (s_arr.view(np.int64) & 1) == 0
  fix = (err != 0) & even & np.isfinite(s_arr)
  if np.any(fix):
    toward = np.where(err[fix] > 0, np.inf, -np.inf)
    s_arr[fix] = np.nextafter(s_arr[fix], toward)
  out = s_arr.astype(F32)
  return out.reshape(np.shape(s))


def exp2_32(t):
  """Correctly rounded fp32 2**t of fp32 t (via float64)."""
  return np.exp2(np.asarray(t, F32).astype(F64)).astype(F32)


def log2f_slack(e):
  """M(e) of SPEC §11.1 from the formula floor(2^(b-1) * ln 2)."""
  if e in (-1, 0):
    return 0
  if e > 0:
    b = e.bit_length() - 1                 # floor(log2 e)
  else:
    b = (abs(e) - 1).bit_length() - 1      # floor(log2(|e| - 1))
  return math.floor(2.0 ** (b - 1) * math.log(2.0))


def ceil_log2f(v):
  """ceil(log2f(v)) as libdevice computes it, for one positive normal fp32 v; +Inf's binade
  is 128 (SPEC §3's rule on v's bits: 2^128 is the fp32 +Inf)."""
  bits = int(np.array([v], F32).view(np.uint32)[0])
  e = ((bits >> 23) & 0xFF) - 127
  m = bits & 0x7FFFFF
  if e == 128 and m == 0:
    return 128
  assert -126 <= e <= 127, "normal numbers only"
  return e if m <= log2f_slack(e) else e + 1


def pow2_32(e):
  return F32(2.0 ** e)


_BUTTERFLY_LO = [np.array([i for i in range(D) if not i & (1 << s)]) for s in range(7)]


def wht128(x):
  """Unnormalised Sylvester WHT: 7 butterfly stages, strides 1..64, fp32 adds.

  Stage s pairs (i, i + 2^s) for every i with bit s clear; the lower index gets
  RN32(a + b), the upper RN32(a - b)."""
  x = np.array(x, F32).copy()
  assert x.shape == (D,)
  for s in range(7):
    h = 1 << s
    lo = _BUTTERFLY_LO[s]
    hi = lo + h
    a = x[lo].copy()
    b = x[hi].copy()
    x[lo] = a + b          # float32 + float32 -> RN32
    x[hi] = a - b
  return x


def rotate_quant_row(x, round_scale=True):
  """SPEC §2b on one row x f32[128] (bf16 values).

  Returns (codes u8[128], scale f32, exponent int)."""
  y = wht128(x)
  y = bf16r(y * C_HAD)
  amax = np.fmax(np.fmax.reduce(np.abs(y)), AMAX_FLOOR)   # fmax: NaN values ignored (SPEC §3)
  v = F32(amax * INV448)
  E = ceil_log2f(v)
  if round_scale:
    scale = pow2_32(E)
  else:
    scale = v
  q = e4m3_bytes(np.divide(y, scale, dtype=F32))
  return q, scale, E


def scale_bytes(scale, E, scale_format):
  if scale_format == "fp32":
    return np.array([scale], "<f4").view(np.uint8).copy()
  if scale_format == "ue8m0":
    return np.full(4, E + 127, np.uint8)
  raise ValueError(scale_format)


def compress_pool(k, g, ape, scale_format="fp32", round_scale=True):
  """SPEC §3 completion branch for one pool: k, g f32[4, 128], ape f32[4, 128].

  Returns (fp8 codes u8[128], scale bytes u8[4])."""
  z = [F32(0)] * 4
  for s in range(4):
    z[s] = np.asarray(g[s], F32) + np.asarray(ape[s], F32)
  mx = np.full(D, -np.inf, F32)
  for s in range(4):
    mx = np.fmax(mx, z[s])
  den = np.zeros(D, F32)
  acc = np.zeros(D, F32)
  for s in range(4):
    t = (z[s] - mx) * LOG2E
    e = exp2_32(t)
    den = den + e
    acc = fma32(e, np.asarray(k[s], F32), acc)
  y = bf16r(np.divide(acc, den, dtype=F32))
  q, scale, E = rotate_quant_row(y, round_scale)
  return q, scale_bytes(scale, E, scale_format)


def _write_entry(kv, loc, q, sb, written=None):
  pages, page, _ = kv.shape
  if loc < 0 or loc >= pages * page:
    return
  if written is not None:
    written.append(loc)
  flat = kv.reshape(pages, page * 132)
  pg, e = divmod(loc, page)
  flat[pg, e * D:(e + 1) * D] = q
  flat[pg, page * D + 4 * e:page * D + 4 * e + 4] = sb


def read_entry(kv, loc, scale_format="fp32"):
  """(fp8 values f64[128], scale f64) of entry loc."""
  pages, page, _ = kv.shape
  flat = kv.reshape(pages, page * 132)
  pg, e = divmod(loc, page)
  vals = e4m3_value(flat[pg, e * D:(e + 1) * D])
  sb = flat[pg, page * D + 4 * e:page * D + 4 * e + 4]
  if scale_format == "fp32":
    scale = float(np.array(sb, np.uint8).view("<f4")[0])
  else:
    scale = 2.0 ** (int(sb[0]) - 127)
  return vals, scale


# --------------------------------------------------------------------------- kpool

def kpool_update(kv_cache, tail, tslot, key, gate, ape, loc, pos, *,
                 scale_format="fp32", round_scale=True, written=None):
  """SPEC §3, sequential per request and token. Returns (kv_cache, tail) copies.

  `written` (a list) collects the slots written, in order."""
  kv = np.array(kv_cache, np.uint8).copy()
  tl = np.array(tail).astype(BF16).copy()
  pages, page, _ = kv.shape
  blocks, _, ring, _ = tl.shape
  tslot = np.asarray(tslot)
  loc = np.asarray(loc)
  pos = np.asarray(pos)
  key = np.asarray(key).astype(BF16)
  gate = np.asarray(gate).astype(BF16)
  ape = np.asarray(ape, F32)
  B, N = pos.shape
  for r in range(B):
    for t in range(N):
      L, p, ts = int(loc[r, t]), int(pos[r, t]), int(tslot[r, t])
      if p < 0:
        continue                       # padding touches nothing
      j = p % 4
      ring_row = p % ring
      blk = max(ts, 0) // ring
      if blk >= blocks:
        continue                       # project decision: tail block past buffer -> no-op
      kc = key[r, t].astype(F32)
      gc = gate[r, t].astype(F32)
      if L >= 0 and j == 3:
        start = p - 3
        ks = np.zeros((4, D), F32)
        gs = np.zeros((4, D), F32)
        for s in range(4):
          if s == 3:
            ks[s], gs[s] = kc, gc
          else:
            row = (start + s) % ring
            ks[s] = tl[blk, 0, row].astype(F32)
            gs[s] = tl[blk, 1, row].astype(F32)
        q, sb = compress_pool(ks, gs, ape, scale_format, round_scale)
        _write_entry(kv, L, q, sb, written)
      if ts >= 0:
        tl[blk, 0, ring_row] = key[r, t]
        tl[blk, 1, ring_row] = gate[r, t]
  return kv, tl


def kpool_compress(kv_cache, slot_key, slot_gate, ape, loc, write_mask, *,
                   scale_format="fp32", round_scale=True, written=None):
  """SPEC §4a."""
  kv = np.array(kv_cache, np.uint8).copy()
  slot_key = np.asarray(slot_key).astype(BF16)
  slot_gate = np.asarray(slot_gate).astype(BF16)
  ape = np.asarray(ape, F32)
  for i in range(len(loc)):
    L = int(loc[i])
    if not bool(write_mask[i]) or L < 0:
      continue
    if L >= kv.shape[0] * kv.shape[1]:
      continue
    q, sb = compress_pool(slot_key[i].astype(F32), slot_gate[i].astype(F32), ape,
                          scale_format, round_scale)
    _write_entry(kv, L, q, sb, written)
  return kv


def kpool_seed_tail(tail, key, gate, tslot):
  """SPEC §4b."""
  tl = np.array(tail).astype(BF16).copy()
  blocks, _, ring, _ = tl.shape
  key = np.asarray(key).astype(BF16)
  gate = np.asarray(gate).astype(BF16)
  n = len(tslot)
  for i in range(n):
    ts = int(tslot[i])
    if ts < 0:
      continue
    blk = ts // ring
    a = int(tslot[i + 4]) if i + 4 < n else -1
    if a >= 0 and a // ring == blk:
      continue
    if blk >= blocks:
      continue
    tl[blk, 0, ts % ring] = key[i]
    tl[blk, 1, ts % ring] = gate[i]
  return tl


# --------------------------------------------------------------------------- expand

def _wrap32(v):
  return int(np.array([v], np.int64).astype(np.int32)[0])


def expand_pools(pool_ids, seq_lens, *, seq_offset=0, width=None):
  """SPEC §6."""
  pool_ids = np.asarray(pool_ids)
  rows, G = pool_ids.shape
  C = 4 * G + 3
  width = C if width is None else width
  assert width >= C
  out = np.full((rows, width), -1, np.int32)
  for r in range(rows):
    n = int(seq_lens[r]) + seq_offset
    for g in range(G):
      pid = int(pool_ids[r, g])
      if pid >= 0:
        for o in range(4):
          out[r, 4 * g + o] = _wrap32(pid * 4 + o)
    if n >= 0:
      pl = n // 4
      ts = pl * 4
      tc = n - ts
      for j in range(3):
        if j < tc:
          out[r, 4 * G + j] = ts + j
  return out


def expand_and_remap(pool_ids, positions, req_ids, block_table, *, block_size, width,
                     stride_rows=None, seq_offset=1, compact=True):
  """SPEC §6 + §7. Returns (out i32[rows, width], counts i32[rows])."""
  pool_ids = np.asarray(pool_ids)
  block_table = np.asarray(block_table)
  expanded = pool_ids.shape[0]
  rows = len(req_ids)
  R, MB = block_table.shape
  stride = block_size if stride_rows is None else stride_rows
  tok = expand_pools(pool_ids, positions, seq_offset=seq_offset, width=width)
  out = np.full((rows, width), -1, np.int32)
  counts = np.zeros(rows, np.int32)
  for t in range(rows):
    if t >= expanded:
      continue
    req = int(req_ids[t])
    if req < 0 or req >= R:
      continue
    n_valid = 0
    for c in range(width):
      tk = int(tok[t, c])
      if tk < 0:
        continue
      blk, off = tk // block_size, tk % block_size
      if blk >= MB:
        continue
      entry = int(block_table[req, blk])
      if entry < 0 or entry * stride + block_size - 1 > 2 ** 31 - 1:
        continue                       # SPEC §12: the entry names no block
      v = entry * stride + off
      if compact:
        out[t, n_valid] = v
      else:
        out[t, c] = v
      n_valid += 1
    counts[t] = n_valid
  return out, counts


# --------------------------------------------------------------------------- logits

def upcast_logits(logits, row_ends):
  """SPEC §8: returns (out f32[rows, width], valid bool[rows, width])."""
  logits = np.asarray(logits).astype(BF16)
  rows, width = logits.shape
  out = np.zeros((rows, width), F32)
  valid = np.zeros((rows, width), bool)
  for r in range(rows):
    for c in range(width):
      if c < int(row_ends[r]):
        out[r, c] = F32(logits[r, c])
        valid[r, c] = True
  return out, valid


def mqa_logits(q_fp8, w_out, kv_cache, page_table, pool_lens, *, max_pools,
               scale_format="fp32"):
  """SPEC §5b in float64. Returns (logits f64[rows, max_pools] with -inf where no
  pool, bound f64[rows, max_pools] = sum_h |w| * sum_d |q k| * kscale)."""
  q = e4m3_value(np.asarray(q_fp8).view(np.uint8))           # [rows, H, 128]
  w = np.asarray(w_out).astype(F64)
  kv = np.asarray(kv_cache, np.uint8)
  pages, page, _ = kv.shape
  page_table = np.asarray(page_table)
  rows = q.shape[0]
  out = np.full((rows, max_pools), -np.inf, F64)
  bound = np.zeros((rows, max_pools), F64)
  for r in range(rows):
    n = int(pool_lens[r])
    for p in range(max_pools):
      if p >= n:
        continue
      pg = int(page_table[r, p // page])
      if pg < 0 or pg >= pages:
        continue
      k, ks = read_entry(kv, pg * page + p % page, scale_format)
      dots = q[r] @ k                                        # exact in f64
      absdots = np.abs(q[r]) @ np.abs(k)
      out[r, p] = float(np.sum(w[r] * np.maximum(dots, 0.0)) * ks)
      bound[r, p] = float(np.sum(np.abs(w[r]) * absdots) * ks)
  return out, bound


def mqa_logits_vectorized(q_fp8, weights, kv_cache, page_table, pool_lens, *, max_pools,
                          scale_format="fp32"):
  """mqa_logits above, vectorised over rows and pools (float64 einsum): the same
  values (each dot of e4m3 products is exact in float64), for GPU-sized tests."""
  q = e4m3_value(np.asarray(q_fp8).view(np.uint8))
  w = np.asarray(weights).astype(F64)
  kv = np.asarray(kv_cache, np.uint8)
  pages, page, _ = kv.shape
  table = np.asarray(page_table).astype(np.int64)
  lens = np.asarray(pool_lens).astype(np.int64)
  p = np.arange(max_pools)
  slot = p // page
  in_table = slot < table.shape[1]
  pg = np.where(in_table, table[:, np.minimum(slot, table.shape[1] - 1)], -1)
  ok = (p < lens[:, None]) & (pg >= 0) & (pg < pages)
  flat = kv.reshape(pages, page * 132)
  pgc, e = np.where(ok, pg, 0), p % page
  data = e4m3_value(flat[pgc[..., None], (e * D)[None, :, None] + np.arange(D)])
  sbytes = flat[pgc[..., None], (page * D + 4 * e)[None, :, None] + np.arange(4)]
  if scale_format == "fp32":
    ks = np.ascontiguousarray(sbytes).view("<f4")[..., 0].astype(F64)
  else:
    ks = np.exp2(sbytes[..., 0].astype(F64) - 127)
  dots = np.einsum("rhd,rpd->rhp", q, data)
  absdots = np.einsum("rhd,rpd->rhp", np.abs(q), np.abs(data))
  out = np.einsum("rh,rhp->rp", w, np.maximum(dots, 0.0)) * ks
  bound = np.einsum("rh,rhp->rp", np.abs(w), absdots) * ks
  return np.where(ok, out, -np.inf), np.where(ok, bound, 0.0)


def pool_topk(logits, pool_lens, *, k):
  """SPEC §5c with the project rules: the k best by descending logit (NaN as
  -inf, subnormals as 0), ties by ascending id, only p < pool_lens[r] eligible;
  listed in ascending pool id, then -1."""
  logits = np.asarray(logits, F32)
  rows, P_ = logits.shape
  out = np.full((rows, k), -1, np.int32)
  for r in range(rows):
    n = max(0, min(int(pool_lens[r]), P_))
    cand = []
    for p in range(n):
      x = float(logits[r, p])
      if math.isnan(x):
        x = -math.inf
      if abs(x) < 2.0 ** -126:
        x = 0.0
      cand.append((-x, p))
    cand.sort()
    for i, p in enumerate(sorted(p for _, p in cand[:k])):
      out[r, i] = p
  return out


def select_pools(q_fp8, w_out, kv_cache, page_table, req_ids, positions, *, k, max_pools,
                 scale_format="fp32"):
  """SPEC §5 as one decode row's select path, in float64 for the logits.

  Returns (pool_ids i32[rows, k], logits f64[rows, max_pools], bound, n): pool
  counts n = (pos + 1) // 4 (0 for pos < 0) capped at max_pools; a row with n <= k
  selects 0..n-1; otherwise the top-k of the f64 logits (ties by id). A req_id
  outside the page table has no pages (logits -inf)."""
  positions = np.asarray(positions, np.int64)
  n = np.minimum(np.where(positions >= 0, (positions + 1) // 4, 0), max_pools)
  page_table = np.asarray(page_table)
  req_ids = np.asarray(req_ids)
  table = np.full((len(req_ids), page_table.shape[1]), -1, np.int64)
  for r, req in enumerate(req_ids):
    if 0 <= req < page_table.shape[0]:
      table[r] = page_table[req]
  logits, bound = mqa_logits(q_fp8, w_out, kv_cache, table, n, max_pools=max_pools,
                             scale_format=scale_format)
  ids = pool_topk(logits.astype(F32), n, k=k)
  return ids, logits, bound, n


# --------------------------------------------------------------------------- indexer

def layernorm_f64(key_raw, weight, bias, eps, *, terms=False):
  """Key LayerNorm in float64 (not rounded): f64[M, 128]. With terms=True also
  returns |xhat * w| + |b| (the magnitude an fp32 evaluation rounds against)."""
  x = np.asarray(key_raw).astype(F64)
  w = np.asarray(weight).astype(F64)
  b = np.asarray(bias).astype(F64)
  out = np.zeros_like(x)
  mag = np.zeros_like(x)
  for m in range(x.shape[0]):
    mean = np.sum(x[m]) / D
    var = np.sum((x[m] - mean) ** 2) / D
    xw = (x[m] - mean) / math.sqrt(var + eps) * w
    out[m] = xw + b
    mag[m] = np.abs(xw) + np.abs(b)
  return (out, mag) if terms else out


def indexer_query(q, key_raw, head_w, norm_weight, norm_bias, *, scale, eps=1e-6,
                  padded=None, w_out_dtype="float32"):
  """SPEC §2a-2d. Returns (q codes u8[M, padded, 128], w_out f32[M, padded] (bf16
  values when w_out_dtype is bf16), (key f64[M, 128] un-rounded LayerNorm, its
  term magnitudes f64[M, 128]))."""
  q = np.asarray(q).astype(BF16)
  w = np.asarray(head_w, F32)
  M, H, _ = q.shape
  padded = H if padded is None else padded
  scale = F32(scale)
  q_out = np.zeros((M, padded, D), np.uint8)
  w_out = np.zeros((M, padded), F32)
  for m in range(M):
    for h in range(H):
      codes, qs, _ = rotate_quant_row(q[m, h].astype(F32), True)
      q_out[m, h] = codes
      wo = F32(F32(w[m, h] * qs) * scale)
      if w_out_dtype in ("bfloat16", "bf16"):
        wo = bf16r(wo)
      w_out[m, h] = wo
  key = layernorm_f64(key_raw, norm_weight, norm_bias, eps, terms=True)
  return q_out, w_out, key


def indexer_projection(x, w_cat, *, heads):
  """SPEC §1 in float64. Returns (key f64, head_w f64, gate f64, abs-sum bound f64
  [M, 256 + heads] = sum_k |x w|)."""
  x = np.asarray(x).astype(F64)
  wc = np.asarray(w_cat).astype(F64)
  assert wc.shape[0] == 2 * D + heads
  out = x @ wc.T
  bound = np.abs(x) @ np.abs(wc).T
  return out[:, :D], out[:, D:D + heads], out[:, D + heads:], bound


# The share of the worst-case fp32 GEMM bound (K - 1) u sum|x w| a kernel may use: an fp32
# sum truncating every add (the worst practical order) reaches <= 0.018 of it at K = 256 and
# < 0.012 at K >= 1536 (numpy, tests/test_bounds.py); 2^-4 leaves 3.5x that and rejects
# bf16-rounded f32 outputs and truncated bf16 ones (to confirm against the kernels on the GPU).
GEMM_SHARE = 2.0 ** -4


def bf16_ulp(x):
  """The spacing of bf16 values at |x| (f64; the subnormal spacing below 2^-126)."""
  e = np.floor(np.log2(np.maximum(np.abs(np.asarray(x, F64)), 2.0 ** -126)))
  return 2.0 ** (e - 7)


def check_projection(x, w_cat, heads, got, label):
  """Asserts the GEMM bound (_check_gemm_part) on got = (key bf16, head_w f32, gate bf16);
  returns the largest err / bound."""
  key, head_w, gate, bound = indexer_projection(x, w_cat, heads=heads)
  K = x.shape[1]
  gk, gw, gg = (np.asarray(a) for a in got)
  M = x.shape[0]
  assert gk.dtype == BF16 and gg.dtype == BF16 and gw.dtype == np.float32
  assert gk.shape == (M, D) and gw.shape == (M, heads) and gg.shape == (M, D)
  return max(_check_gemm_part(label, name, g, want, b, K, is_bf16)
             for name, g, want, b, is_bf16 in (
                 ("key", gk, key, bound[:, :D], True),
                 ("head_w", gw, head_w, bound[:, D:D + heads], False),
                 ("gate", gg, gate, bound[:, D + heads:], True)))


def _check_gemm_part(label, name, g, want, b, K, is_bf16):
  """SPEC D2's GEMM bound on one output part g against the float64 product `want` with
  abs-sum bound b: |g - want| <= GEMM_SHARE (K - 1) u b (the fp32 sum in any order; u =
  2^-24), plus half a bf16 ulp of g for the bf16 parts (g = RN(v) with v the fp32 sum: the
  rounding adds at most half an ulp of v, and ulp(v) <= ulp(g)). Returns the largest
  err / bound."""
  g = g.astype(F64)
  tol = GEMM_SHARE * (K - 1) * U32 * b + 1e-300
  if is_bf16:
    tol = tol + 0.5 * bf16_ulp(g)
  err = np.abs(g - want)
  ratio = float(np.max(err / tol)) if err.size else 0.0
  assert np.all(err <= tol), (label, name, ratio)
  return ratio


def check_q(qr, wq_b, got, label):
  """SPEC D2's GEMM bound (as check_projection) on got = q bf16[M, N] of qr bf16[M, K]
  and wq_b bf16[N, K], against the float64 product; returns the largest err / bound."""
  x, w = np.asarray(qr).astype(F64), np.asarray(wq_b).astype(F64)
  g = np.asarray(got)
  assert g.dtype == BF16 and g.shape == (x.shape[0], w.shape[0]), (label, g.dtype, g.shape)
  return _check_gemm_part(label, "q", g, x @ w.T, np.abs(x) @ np.abs(w).T, x.shape[1], True)


# --------------------------------------------------------------------------- test helpers

def bits(x):
  """An array's bit patterns (unsigned ints of its item size): exact comparison that
  tells NaN payloads and -0 apart."""
  a = np.asarray(x)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def bits_any_nan(x):
  """bits() with every NaN one pattern (the dtype's largest code): a NaN's sign and
  payload are the hardware's (docs/semantics.md §12.8); -0 and every other value are
  still told apart."""
  a = np.asarray(x)
  b = bits(a).copy()
  b[np.isnan(a.astype(np.float32))] = np.iinfo(b.dtype).max
  return b


def assert_same_bits(got, want, names, label):
  """Each output of `got` bit-equal (same shape and dtype) to the same output of `want`."""
  for g, w, name in zip(got, want, names, strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype, (label, name, g.shape, w.shape)
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{label}: {name} bits")


def compare_key(got, want, label):
  """SPEC D2's key LayerNorm rule: got within 1 bf16 ulp of want, NaN where want is NaN;
  returns (mismatches, total)."""
  g, w = np.asarray(got), np.asarray(want)
  gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
  np.testing.assert_array_equal(gn, wn, err_msg=f"{label}: key NaN positions")
  diff = np.abs(bf16_rank(g[~gn]) - bf16_rank(w[~wn]))
  assert diff.size == 0 or diff.max() <= 1, f"{label}: key off by {diff.max()} bf16 ulp"
  return int(np.count_nonzero(diff)), int(diff.size)


def e4m3_rank(codes):
  """Signed ordinal of e4m3 codes: adjacent values differ by 1, +0 and -0 are 0."""
  c = np.asarray(codes, np.uint8).astype(np.int32)
  mag = c & 0x7F
  return np.where(c & 0x80, -mag, mag)


def bf16_rank(x):
  """Signed ordinal of bf16 values (as int), adjacent values differ by 1."""
  u = np.asarray(x).astype(BF16).view(np.uint16).astype(np.int64)
  mag = u & 0x7FFF
  return np.where(u & 0x8000, -mag, mag)


def _e4m3_spacing(v):
  """Gap between adjacent e4m3 values around |v| (2^-9 in the subnormal range)."""
  a = np.abs(np.asarray(v, F64))
  e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))
  return 2.0 ** (e - 3)


def compare_cache(ref_kv, orc_kv, orig_kv, written, label="", stats=None,
                  plain_scales=False):
  """Compare a reference K cache with the oracle's (SPEC D2 rules).

  Every scale byte equal (with `plain_scales`, for round_scale=False fp32 scales
  v = RN(amax / 448): a flipped pooled value can move amax by one bf16 ulp and v
  with it, so written entries' scales may differ by <= 2^-7 relative; such entries
  are compared as dequantised values with the allowance below and counted as
  differing); every byte of an entry not written equal to the original;
  fp8 codes of written entries equal or one e4m3 code apart -- except in an entry
  where a ~1 ulp exp difference flipped one pooled bf16 value y_i: the Hadamard then
  moves every output by c * ulp_bf16(y_i) <= c * 2^-7 * ||out||_2 (||y||_2 =
  ||out||_2 since c * sqrt(128) = 1), which near zero spans several e4m3 codes.
  Such entries must stay within two such flips plus two e4m3 gaps per value; they
  are counted in `stats['multi']`. Returns (number of written entries with a
  differing fp8 byte, number written)."""
  ref_kv = np.asarray(ref_kv, np.uint8)
  orc_kv = np.asarray(orc_kv, np.uint8)
  orig_kv = np.asarray(orig_kv, np.uint8)
  assert ref_kv.shape == orc_kv.shape == orig_kv.shape
  pages, page, _ = ref_kv.shape
  rf = ref_kv.reshape(pages, page * 132)
  of = orc_kv.reshape(pages, page * 132)
  gf = orig_kv.reshape(pages, page * 132)
  wset = set(int(w) for w in written)
  rscale = rf[:, page * D:].reshape(pages * page, 4)
  oscale = of[:, page * D:].reshape(pages * page, 4)
  moved = np.zeros(pages * page, bool)
  if plain_scales:
    moved = np.any(rscale != oscale, axis=1)
    moved &= np.isin(np.arange(pages * page), np.fromiter(wset, np.int64, len(wset)))
    rs, os_ = rscale[moved].copy().view("<f4")[:, 0], oscale[moved].copy().view("<f4")[:, 0]
    assert np.all(np.abs(rs - os_) <= 2.0 ** -7 * np.maximum(rs, os_)), (
        f"{label}: plain scales differ by more than one bf16 ulp of amax")
  np.testing.assert_array_equal(rscale[~moved], oscale[~moved],
                                err_msg=f"{label}: scale bytes differ")
  rdata = rf[:, :page * D].reshape(pages * page, D)
  odata = of[:, :page * D].reshape(pages * page, D)
  gdata = gf[:, :page * D].reshape(pages * page, D)
  unwritten = np.array([i not in wset for i in range(pages * page)], bool)
  np.testing.assert_array_equal(rdata[unwritten], gdata[unwritten],
                                err_msg=f"{label}: unwritten entries changed")
  np.testing.assert_array_equal(odata[unwritten], gdata[unwritten])
  wl = sorted(wset)
  if not wl:
    return 0, 0
  dr = np.abs(e4m3_rank(rdata[wl]) - e4m3_rank(odata[wl]))
  wmoved = moved[wl]
  multi = 0
  for i in np.nonzero((dr.max(axis=1) > 1) | wmoved)[0]:
    sa = sb = 1.0
    if wmoved[i]:
      sa = float(rscale[wl[i]].copy().view("<f4")[0])
      sb = float(oscale[wl[i]].copy().view("<f4")[0])
    a = e4m3_value(rdata[wl[i]])
    b = e4m3_value(odata[wl[i]])
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), label
    allowed = 2 * float(C_HAD) * 2.0 ** -7 * np.linalg.norm(b * sb) + 2 * _e4m3_spacing(
        np.maximum(np.abs(a), np.abs(b))) * max(sa, sb)
    assert np.all(np.abs(a * sa - b * sb) <= allowed), (
        f"{label}: entry {wl[i]} fp8 values off by more than a pooled bf16 flip explains")
    multi += int(dr[i].max() > 1)
  if stats is not None:
    stats["multi"] = stats.get("multi", 0) + multi
  bad = int(np.sum(np.any(dr != 0, axis=1) | wmoved))
  return bad, len(wl)


def differing_entries(got, want):
  """Flat slots whose 132 bytes (128 fp8 bytes and the 4 scale bytes) differ between
  two K caches u8[pages, PAGE, 132]."""
  got, want = np.asarray(got, np.uint8), np.asarray(want, np.uint8)
  assert got.shape == want.shape, (got.shape, want.shape)
  pages, page, _ = got.shape
  g = got.reshape(pages, -1)
  w = want.reshape(pages, -1)
  data = np.any((g[:, :page * D] != w[:, :page * D]).reshape(pages, page, D), axis=2)
  scales = np.any((g[:, page * D:] != w[:, page * D:]).reshape(pages, page, 4), axis=2)
  return np.nonzero((data | scales).reshape(-1))[0]


def random_bf16(rng, shape, scale=1.0):
  return (rng.standard_normal(shape) * scale).astype(F32).astype(BF16)


def poison_cache(rng, pages, page):
  return rng.integers(0, 256, (pages, page, 132), dtype=np.uint8)


def poison_tail(rng, blocks, ring):
  """Random bytes for the bf16 tail, with Inf/NaN patterns replaced (these rows can
  legitimately be read as stale data by a completion)."""
  u = rng.integers(0, 1 << 16, (blocks, 2, ring, D), dtype=np.uint16)
  # keep the exponent in a moderate range: clear the top exponent bit, set bit 13..
  u = (u & 0x807F) | (rng.integers(0x78, 0x84, u.shape, dtype=np.uint16) << 7)
  return u.view(BF16)


def round_to_f32_exact(fr):
  """Correctly rounded (RNE) fp32 of an exact Fraction (for checking fma32)."""
  from fractions import Fraction
  if fr == 0:
    return F32(0.0)
  sign = -1 if fr < 0 else 1
  a = abs(fr)
  e = a.numerator.bit_length() - a.denominator.bit_length()
  if Fraction(2) ** e > a:
    e -= 1
  while Fraction(2) ** (e + 1) <= a:
    e += 1
  e = max(e, -126)
  q = a / Fraction(2) ** (e - 23)          # in [2^23, 2^24) for normals
  n, rem = divmod(q.numerator, q.denominator)
  twice = 2 * rem
  if twice > q.denominator or (twice == q.denominator and n & 1):
    n += 1
  return F32(sign * float(Fraction(n) * Fraction(2) ** (e - 23)))
