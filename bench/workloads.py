"""What the bench times per op: a Workload (the public op at one bench shape on
rotated inputs) and its floor (the minimum bytes and FLOPs of one call).

WORKLOADS[op] = (builder(rand, sizes, **kwargs) -> Workload, shapes(sizes) -> [(label,
kwargs)]). Not glm5_testing.cases.Case (small example inputs for the correctness
tests): a Workload is sized like the model, with >= 1 GB caches and inputs rotated past L2.
"""
from typing import Callable, NamedTuple

import numpy as np
import jax.numpy as jnp

import glm5_jax
from glm5_jax import synthetic
from glm5_jax.reference.numerics import DIM, POOL

from .sizes import (
  BLOCK,
  CONFIG,
  CONTEXT,
  ENTRY,
  F32,
  GROUPS,
  HEADS,
  HIDDEN,
  PADDED,
  PAGE,
  PEAK_BF16,
  Q_LORA,
  W_CAT_COPIES,
  W_ROWS,
  WIDTH,
  WQ_B_COPIES,
  i32,
)

# ---------------------------------------------------------------- floors

def floor_us(nbytes, flops, bw):
  """max(bytes / measured copy bandwidth, FLOPs / bf16 peak), in µs."""
  return 1e6 * max(nbytes / bw, flops / PEAK_BF16)


def bytes_projection(m):
  """W_cat once + per row x (2K) in; key bf16, weights f32, gate bf16 out."""
  return W_ROWS * HIDDEN * 2 + m * (2 * HIDDEN + 2 * DIM + 4 * HEADS + 2 * DIM)


def bytes_q(m):
  """wq_b once + per row qr in; q bf16[heads * 128] out."""
  return HEADS * DIM * Q_LORA * 2 + m * (2 * Q_LORA + 2 * HEADS * DIM)


def bytes_query(m):
  """Per row q bf16[H,128], key_raw, weights f32 in; q_fp8, w_out f32, key out;
  the LayerNorm weight and bias once."""
  return 2 * DIM * 4 + m * (HEADS * DIM * 2 + 2 * DIM + 4 * HEADS
                            + PADDED * DIM + 4 * PADDED + 2 * DIM)


def bytes_fused(m):
  """With the query epilogue: W_cat + per row x, q in; q_fp8, w_out, key, gate out."""
  return (W_ROWS * HIDDEN * 2 + 2 * DIM * 4
          + m * (2 * HIDDEN + HEADS * DIM * 2 + PADDED * DIM + 4 * PADDED + 4 * DIM))


def bytes_update(tokens, completing):
  """1,036 B per token (key, gate, 3 indices in; ring row out) + 1,668 B per
  completing token (3 ring rows in, 128 fp8 + 4 scale bytes out) + ape."""
  return tokens * 1036 + completing * (3 * 2 * DIM * 2 + ENTRY) + POOL * DIM * 4


def bytes_compress(n, written):
  """Per pool 4 keys + 4 scores bf16, loc, mask in; written entries 132 B out; ape."""
  return n * (2 * POOL * DIM * 2 + 4 + 1) + written * ENTRY + POOL * DIM * 4


def bytes_seed(n, written):
  """Per token key + score bf16 and tslot in; written tokens a ring row (512 B) out."""
  return n * (2 * DIM * 2 + 4) + written * 2 * DIM * 2


def bytes_expand(m):
  """Without the remap: per row 512 pool ids + seq_len in, WIDTH ids out."""
  return m * (GROUPS * 4 + 4 + WIDTH * 4)


def bytes_remap(m, blocks_touched):
  """per row pool ids, position, request in; WIDTH slots + count out; plus
  4 B per distinct block-table entry touched (best case, no sector waste)."""
  return m * (GROUPS * 4 + 4 + 4 + WIDTH * 4 + 4) + 4 * blocks_touched


def bytes_upcast(row_ends):
  """2 B read + 4 B written per column below each row end, + row_ends."""
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


def bytes_select(pool_lens, k):
  """mqa_logits' reads (entries, page-table entries, q_fp8 + w_out), no logits round
  trip through memory, k ids per row out: what a fused select path must move."""
  pages = int(np.sum(-(-np.asarray(pool_lens) // PAGE)))
  m = len(pool_lens)
  return ENTRY * int(np.sum(pool_lens)) + 4 * pages + m * (HEADS * DIM + 4 * HEADS + 8 + 4 * k)


def bytes_slots(pool_lens, k):
  """select_pools' floor without its ids out; per row WIDTH slots and the count out and
  the block-table entries of its selected tokens (best case: the fewest blocks, plus the
  tail's)."""
  n = np.minimum(np.asarray(pool_lens), k)
  blocks = int(np.sum(-(-n * POOL // BLOCK) + 1))
  return bytes_select(pool_lens, k) - 4 * k * len(pool_lens) + 4 * (
      len(pool_lens) * (WIDTH + 1) + blocks)


# -------------------------------------------------------------- workloads

class Workload(NamedTuple):
  """One op at one bench shape (the label comes from WORKLOADS). call(state, fixed,
  args) -> (state, outs): the public op on state (threaded caches, or None), fixed
  (shared) and one rotated argument tuple. dep: index of the (small) argument that takes
  the run-time dependency under --data-dep (stateless ops). nbytes, flops: the floor's
  minimum bytes and FLOPs per call. mask(args, outs) -> outs hides outputs the op
  leaves unspecified."""
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
  r_min: int = 0            # fewest rotated input sets per chain, e.g. of W_cat


def projection(r, s, m, tactic=None):
  rot = [(r.normal((m, HIDDEN)), r.normal((W_ROWS, HIDDEN), scale=HIDDEN ** -0.5))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, glm5_jax.indexer_projection(*a, heads=HEADS, tactic=tactic))
  return Workload("indexer_projection", "", call, None, (), rot, 0,
                  bytes_projection(m), 2 * m * W_ROWS * HIDDEN, r_min=W_CAT_COPIES)


def q(r, s, m, tactic=None):
  rot = [(r.normal((m, Q_LORA)), r.normal((HEADS * DIM, Q_LORA), scale=Q_LORA ** -0.5))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, (glm5_jax.indexer_q(*a, tactic=tactic),))
  return Workload("indexer_q", "", call, None, (), rot, 0, bytes_q(m),
                  2 * m * HEADS * DIM * Q_LORA, r_min=WQ_B_COPIES)


def _norm(r):
  return (jnp.asarray(1 + 0.1 * r.np.standard_normal(DIM), F32),
          jnp.asarray(0.1 * r.np.standard_normal(DIM), F32))


def query(r, s, m):
  rot = [(r.normal((m, HEADS, DIM)), r.normal((m, DIM)), r.normal((m, HEADS), F32))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, glm5_jax.indexer_query(*a, *f, scale=CONFIG.scale,
                                                      padded=PADDED))
  return Workload("indexer_query", "", call, None, _norm(r), rot, 2, bytes_query(m))


def fused(r, s, m):
  rot = [(r.normal((m, HIDDEN)), r.normal((W_ROWS, HIDDEN), scale=HIDDEN ** -0.5),
          r.normal((m, HEADS, DIM))) for _ in range(s.r_max)]
  call = lambda st, f, a: (st, glm5_jax.indexer_projection_fused(
      *a, *f, heads=HEADS, scale=CONFIG.scale, padded=PADDED))
  return Workload("indexer_projection_fused", "", call, None, _norm(r), rot, 0,
                  bytes_fused(m), 2 * m * W_ROWS * HIDDEN, r_min=W_CAT_COPIES)


def _ape(r):
  return jnp.asarray(0.5 * r.np.standard_normal((POOL, DIM)), F32)


def update(r, s, b, next_n):
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
  return Workload("kpool_update", "", call, (kv, tail), (_ape(r),),
                  rot, None, bytes_update(b * next_n, np.mean(completing)))


def indexer_update(r, s, b, next_n):
  """kpool_update's workload (B requests, next_n each) with the projection and query
  inputs of its M = B * next_n rows: the key and gate come from the projection. Floor: the
  three ops' floors summed (the intermediates still go through memory)."""
  upd = update(r, s, b, next_n)
  m = b * next_n
  rot = [(r.normal((m, HIDDEN)), r.normal((W_ROWS, HIDDEN), scale=HIDDEN ** -0.5),
          r.normal((m, HEADS, DIM)), tslot, loc, pos)
         for tslot, _, _, loc, pos in upd.rotated]

  def call(st, f, a):
    x, w_cat, q, tslot, loc, pos = a
    outs = glm5_jax.indexer_update(x, w_cat, q, f[0], f[1], st[0], st[1], tslot, f[2], loc,
                                   pos, heads=HEADS, scale=CONFIG.scale, padded=PADDED)
    return outs[6:], outs[:6]

  return Workload("indexer_update", "", call, upd.state, _norm(r) + upd.fixed, rot, None,
                  bytes_projection(m) + bytes_query(m) + upd.nbytes, 2 * m * W_ROWS * HIDDEN,
                  r_min=W_CAT_COPIES)


def update_epilogue(r, s, b, next_n):
  """kpool_update's workload (B requests, next_n each) with the query inputs and the
  projection's f32 sums of its M = B * next_n rows (what XLA's GEMM hands the op). Floor:
  the sums read once, the query's and kpool_update's other bytes."""
  upd = update(r, s, b, next_n)
  m = b * next_n
  rot = [(r.normal((m, W_ROWS), F32), r.normal((m, HEADS, DIM)), tslot, loc, pos)
         for tslot, _, _, loc, pos in upd.rotated]

  def call(st, f, a):
    raw, q, tslot, loc, pos = a
    outs = glm5_jax.update_epilogue(raw, q, f[0], f[1], st[0], st[1], tslot, f[2], loc, pos,
                                    scale=CONFIG.scale, padded=PADDED)
    return outs[3:], outs[:3]

  return Workload("update_epilogue", "", call, upd.state, _norm(r) + upd.fixed, rot, None,
                  m * W_ROWS * 4 + bytes_query(m) + upd.nbytes)


def update_epilogue_q(r, s, b, next_n):
  """update_epilogue's workload with qr and wq_b for q (each rotation its own wq_b, as
  indexer_q's). Floor: indexer_q's bytes plus update_epilogue's (q goes through memory)."""
  upd = update(r, s, b, next_n)
  m = b * next_n
  rot = [(r.normal((m, W_ROWS), F32), r.normal((m, Q_LORA)),
          r.normal((HEADS * DIM, Q_LORA), scale=Q_LORA ** -0.5), tslot, loc, pos)
         for tslot, _, _, loc, pos in upd.rotated]

  def call(st, f, a):
    raw, qr, wq_b, tslot, loc, pos = a
    outs = glm5_jax.update_epilogue_q(raw, qr, wq_b, f[0], f[1], st[0], st[1], tslot, f[2],
                                      loc, pos, scale=CONFIG.scale, padded=PADDED)
    return outs[4:], outs[:4]

  return Workload("update_epilogue_q", "", call, upd.state, _norm(r) + upd.fixed, rot, None,
                  bytes_q(m) + m * W_ROWS * 4 + bytes_query(m) + upd.nbytes,
                  2 * m * HEADS * DIM * Q_LORA, r_min=WQ_B_COPIES)


def indexer_update_q(r, s, b, next_n):
  """indexer_update's workload with qr and wq_b for q (each rotation its own w_cat and wq_b).
  Floor: indexer_q's bytes plus indexer_update's (q goes through memory)."""
  upd = update(r, s, b, next_n)
  m = b * next_n
  rot = [(r.normal((m, HIDDEN)), r.normal((W_ROWS, HIDDEN), scale=HIDDEN ** -0.5),
          r.normal((m, Q_LORA)), r.normal((HEADS * DIM, Q_LORA), scale=Q_LORA ** -0.5),
          tslot, loc, pos)
         for tslot, _, _, loc, pos in upd.rotated]

  def call(st, f, a):
    x, w_cat, qr, wq_b, tslot, loc, pos = a
    outs = glm5_jax.indexer_update_q(x, w_cat, qr, wq_b, f[0], f[1], st[0], st[1], tslot,
                                     f[2], loc, pos, scale=CONFIG.scale, padded=PADDED)
    return outs[7:], outs[:7]

  return Workload("indexer_update_q", "", call, upd.state, _norm(r) + upd.fixed, rot, None,
                  bytes_q(m) + bytes_projection(m) + bytes_query(m) + upd.nbytes,
                  2 * m * (HEADS * DIM * Q_LORA + W_ROWS * HIDDEN),
                  r_min=max(W_CAT_COPIES, WQ_B_COPIES))


def compress(r, s, n):
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
  return Workload("kpool_compress", "", call, kv, (_ape(r),), rot, None,
                  bytes_compress(n, np.mean(written)))


def seed(r, s, n):
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
  return Workload("kpool_seed_tail", "", call, tail, (), rot, None, bytes_seed(n, n))


def _positions(r, m):
  return CONTEXT - 1 - r.np.integers(0, POOL, m)


def expand(r, s, m):
  rot = [(i32(r.pool_ids(m, CONTEXT // POOL - 1)), i32(_positions(r, m)))
         for _ in range(s.r_max)]
  call = lambda st, f, a: (st, (glm5_jax.expand_pools(*a, seq_offset=1, width=WIDTH),))
  return Workload("expand_pools", "", call, None, (), rot, 1, bytes_expand(m))


def remap(r, s, m):
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
  return Workload("expand_and_remap", "", call, None, (i32(np.arange(m)),), rot, 1,
                  bytes_remap(m, np.mean(touched)))


def _upcast_mask(args, outs):
  (logits, ends), (out,) = args, outs
  return (jnp.where(jnp.arange(logits.shape[1]) < ends[:, None], out, 0),)


def upcast(r, s, m, p):
  ends = [r.ragged(m, p) for _ in range(s.r_max)]
  rot = [(r.normal((m, p), scale=30.0), i32(e)) for e in ends]
  call = lambda st, f, a: (st, (glm5_jax.upcast_logits(*a),))
  return Workload("upcast_logits", "", call, None, (), rot, 1,
                  np.mean([bytes_upcast(e) for e in ends]), mask=_upcast_mask)


def _select_rows(r, s, m, p):
  """Rows of p pools (32K tokens at 8,192), every 4th shorter, each row's pages at
  random in a >= 1 GB cache (the cache cold, as in the stock measurement): rotated
  (q_fp8, w_out, page_table, pool counts)."""
  kv = r.kv_cache(s.cache_bytes)
  per_row = -(-p // PAGE)
  rot = []
  for _ in range(s.r_max):
    n = r.ragged(m, p)
    q = jnp.clip(r.normal((m, HEADS, DIM), scale=8.0, dtype=F32), -448, 448)
    table = r.np.choice(kv.shape[0], m * per_row, replace=m * per_row > kv.shape[0])
    rot.append((q.astype(jnp.float8_e4m3fn), jnp.asarray(r.np.random((m, HEADS)), F32),
                i32(table.reshape(m, per_row)), n))
  return kv, rot


def mqa(r, s, m, p):
  kv, rot = _select_rows(r, s, m, p)
  call = lambda st, f, a: (st, (glm5_jax.mqa_logits(a[0], a[1], f[0], a[2], a[3],
                                                    max_pools=p),))
  lens = [n for *_, n in rot]
  return Workload("mqa_logits", "", call, None, (kv,), [(*a[:3], i32(n)) for *a, n in rot], 1,
                  np.mean([bytes_mqa(n, p) for n in lens]), np.mean([flops_mqa(n) for n in lens]))


def topk(r, s, m, p):
  lens = [r.ragged(m, p) for _ in range(s.r_max)]
  rot = [(r.normal((m, p), F32), i32(n)) for n in lens]
  call = lambda st, f, a: (st, (glm5_jax.pool_topk(*a, k=GROUPS),))
  return Workload("pool_topk", "", call, None, (), rot, 1,
                  np.mean([bytes_topk(n, GROUPS) for n in lens]))


def _select_mask(args, outs):
  """The logits are workspace (specified only for rows with more than k pools)."""
  return outs[:1]


def select(r, s, m, p):
  """select_pools as indexer_stage runs it: the rows' page tables by request, pool
  counts from positions (4n - 1: n pools), top-512."""
  kv, rot = _select_rows(r, s, m, p)
  req = i32(np.arange(m))
  call = lambda st, f, a: (st, glm5_jax.select_pools(a[0], a[1], f[0], a[2], f[1], a[3],
                                                     k=GROUPS, max_pools=p))
  lens = [n for *_, n in rot]
  return Workload("select_pools", "", call, None, (kv, req),
                  [(*a[:3], i32(4 * n - 1)) for *a, n in rot], 1,
                  np.mean([bytes_select(n, GROUPS) for n in lens]),
                  np.mean([flops_mqa(n) for n in lens]), mask=_select_mask)


def slots(r, s, m, p):
  """select_slots as indexer_stage runs it: select_pools' workload, each request's blocks
  (4p + 1 tokens, BLOCK each) at random physical blocks, the stage's width."""
  work = select(r, s, m, p)
  blocks = -(-(4 * p + 1) // BLOCK)
  rot = [(*a, i32(r.np.permutation(m * blocks).reshape(m, blocks))) for a in work.rotated]
  call = lambda st, f, a: (st, glm5_jax.select_slots(
      a[0], a[1], f[0], a[2], f[1], a[3], a[4], k=GROUPS, max_pools=p, block_size=BLOCK,
      width=WIDTH))
  lens = [(np.asarray(a[3]) + 1) // POOL for a in work.rotated]
  return work._replace(op="select_slots", call=call, rotated=rot, mask=None,
                       nbytes=np.mean([bytes_slots(n, GROUPS) for n in lens]))


def _select_shapes(s):
  return [(f"rows={m},P={p}", dict(m=m, p=p)) for p in s.select_pools for m in s.select_rows]


def _rows(s, key="m", fmt="M={}"):
  return [(fmt.format(m), {key: m}) for m in s.rows]


def _requests(s):
  return [(f"B={b},next_n={n}", dict(b=b, next_n=n)) for n in s.next_ns for b in s.rows]


# op -> (builder(rand, sizes, **kwargs) -> Workload, shapes(sizes) -> [(label, kwargs)])
WORKLOADS = {
    "indexer_projection": (projection, _rows),
    "indexer_q": (q, _rows),
    "indexer_query": (query, _rows),
    "indexer_projection_fused": (fused, _rows),
    "kpool_update": (update, _requests),
    "indexer_update": (indexer_update, _requests),
    "update_epilogue": (update_epilogue, _requests),
    "update_epilogue_q": (update_epilogue_q, _requests),
    "indexer_update_q": (indexer_update_q, _requests),
    "kpool_compress": (compress, lambda s: _rows(s, "n", "n={}") + [
        (f"n={n}", {"n": n}) for n in s.compress_rows]),
    "kpool_seed_tail": (seed, lambda s: _rows(s, "n", "n={}")),
    "expand_pools": (expand, lambda s: _rows(s, fmt="rows={}")),
    "expand_and_remap": (remap, lambda s: _rows(s, fmt="rows={}")),
    "upcast_logits": (upcast, lambda s: [(f"rows={m},P={p}", dict(m=m, p=p))
                                        for p in s.upcast_pools for m in s.rows]),
    "mqa_logits": (mqa, _select_shapes),
    "pool_topk": (topk, _select_shapes),
    "select_pools": (select, _select_shapes),
    "select_slots": (slots, _select_shapes),
    # indexer_update_q and select_slots in one call: what the stage group times.
    "indexer_update_select": (None, lambda s: []),
}
assert set(WORKLOADS) == set(glm5_jax.OPS), "every op in glm5_jax.OPS needs a bench workload"


