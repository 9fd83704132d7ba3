"""Runs every CUDA kernel of glm5_jax once per case, for compute-sanitizer.

  compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
  ... scripts/sanitize_kernels.py mqa_logits select_pools select_slots   (only those cases)

The GPU runs only the kernels and the jit's glue (no reference programs there:
compute-sanitizer crashes on some of XLA's own kernels inside the test suite);
each output is checked against the reference run on the CPU backend. Inputs:
glm5_testing/cases.py (padding, negative and out-of-range indices, ragged rows) plus
kernel-sized variants, several seeds each. Exit status 1 on a mismatch (the K caches of
the kpool ops: beyond SPEC D2).
"""
import functools
import os
import sys
from pathlib import Path

os.environ["GLM5_JAX_KERNELS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the root: glm5_testing

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax import plan  # noqa: E402
from glm5_jax.indexer import GEMV_SPLIT  # noqa: E402
from glm5_testing import cases, oracle  # noqa: E402

SEEDS = 3


def _variants():
  """(name, fn, make, valid, exact) for every kernel op: the shared cases plus kernel-only
  shapes."""
  out = []
  for op in glm5_jax.KERNEL_TARGETS:
    case = cases.CASES[op]
    out.append((op, case.fn, case.make, case.valid, case.exact))
  remap = cases.CASES["expand_and_remap"]
  out.append(("expand_and_remap compact=False",
              functools.partial(remap.fn, compact=False), remap.make, None, True))
  query = cases.CASES["indexer_query"]
  out.append(("indexer_query padded=32",
              functools.partial(query.fn, padded=32), query.make, None, True))
  # kpool_compress: several CTAs (the last one partial), slots at and past the cache's end,
  # no rows; the other two scale formats.
  compress = cases.CASES["kpool_compress"]
  cap = cases.PAGES * cases.PAGE
  out.append(("kpool_compress n=37", compress.fn, functools.partial(
      cases.compress_args, n=37, out_of_range=(cap, -1, cap + 5, 2 ** 31 - 1)), None, True))
  out.append(("kpool_compress n=0", compress.fn,
              functools.partial(cases.compress_args, n=0, out_of_range=()), None, True))
  for params in (dict(scale_format="ue8m0"), dict(round_scale=False)):
    out.append((f"kpool_compress {params}", functools.partial(compress.fn, **params),
                compress.make, None, True))
  # indexer_projection's GEMV tactic (split GEMV_SPLIT): one token (plan.PROJECTION_TACTICS'
  # first row) and three tokens (its per-token loop, past the table's rows).
  projection = cases.CASES["indexer_projection"]
  for rows, warps in ((1, plan.PROJECTION_TACTICS[0].warps), (3, 2)):
    out.append((f"indexer_projection GEMV M={rows}",
                functools.partial(projection.fn, tactic=(warps, GEMV_SPLIT)),
                lambda rng, rows=rows: tuple(a[:rows] if i == 0 else a for i, a in
                                             enumerate(projection.make(rng))),
                None, False))
  # indexer_q's tactics: the case (M=3, the wgmma tactic's 16-token instantiation), mma,
  # and wgmma at 70 and 130 tokens (its 64-token instantiation; two and three grid rows, the
  # last of 6 and 2 tokens).
  q = cases.CASES["indexer_q"]
  for tactic, rows in (("mma", 3), ("wgmma", 70), ("wgmma", 130)):
    out.append((f"indexer_q {tactic} M={rows}", functools.partial(q.fn, tactic=tactic),
                lambda rng, rows=rows: (cases.bf16(rng, rows, 1536), q.make(rng)[1]),
                None, False))
  # mqa_logits with several times more work items than the persistent grid has CTAs (8
  # rows x 448 items): each CTA of the streamed kernel reuses every stage of its ring,
  # flips the barriers' parity and changes rows; short rows, a missing page and one past
  # the cache (SPEC D4).
  wide = 448 * 64
  lens = (wide, 30000, 0, 17, 9000, 20000, -3, wide)
  out.append(("mqa_logits ring", functools.partial(glm5_jax.mqa_logits, max_pools=wide),
              functools.partial(cases.mqa_args, lens=lens, slots=wide // cases.LOGITS_PAGE,
                                holes=True), None, False))
  # pool_topk on a cluster per row (few rows, wide logits): kept keys gathered into the
  # first CTA (normal rows), the one-CTA path there (equal logits: every key kept).
  def topk_parts_args(rng, rows=3, width=32768, equal=1):
    """Normal logits, row `equal` (None: none) all equal."""
    logits = rng.standard_normal((rows, width)).astype(np.float32)
    if equal is not None:
      logits[equal] = 3.0
    return jnp.asarray(logits), cases.i32(([width, width, 20001] * rows)[:rows])
  out.append(("pool_topk parts", functools.partial(glm5_jax.pool_topk, k=512),
              topk_parts_args, None, True))
  # Rows past one CTA (262,144 and 50,688 pools): the cluster holds the row; equal logits
  # keep every key, so every CTA runs the cluster's radix select (histograms and counts read
  # across the cluster's shared memory).
  out.append(("pool_topk cluster", functools.partial(glm5_jax.pool_topk, k=512),
              functools.partial(topk_parts_args, rows=2, width=262144), None, True))
  # One row of 262,144 pools (a cluster of 16, non-portable), its logits normal or all
  # equal; 16 rows of 50,688 (4 a row).
  for name, equal in (("", None), (" equal", 0)):
    out.append((f"pool_topk cluster of 16{name}", functools.partial(glm5_jax.pool_topk, k=512),
                functools.partial(topk_parts_args, rows=1, width=262144, equal=equal),
                None, True))
  out.append(("pool_topk cluster of 4", functools.partial(glm5_jax.pool_topk, k=512),
              functools.partial(topk_parts_args, rows=16, width=50688), None, True))
  # 40 rows of 50,688 pools: a pair of CTAs a row; 65 rows: chunks of one CTA's width
  # (plan.topk_row_pools past 16 and 64 rows).
  out.append(("pool_topk 40 rows", functools.partial(glm5_jax.pool_topk, k=512),
              functools.partial(topk_parts_args, rows=40, width=50688), None, True))
  out.append(("pool_topk 65 rows", functools.partial(glm5_jax.pool_topk, k=512),
              functools.partial(topk_parts_args, rows=65, width=40000), None, True))
  out.append(("select_slots cluster", functools.partial(
      glm5_jax.select_slots, k=512, max_pools=50688, block_size=128, width=2053,
      stride_rows=160), lambda rng: slots_wide_args(rng, rows=2, pools=50688),
      None, True))
  # select_slots: the case's small shape (k 5, 48 pools, a narrow block table), and a
  # cluster top-k per row (3 rows of 8192 pools, k 512) whose CTAs write the slots. Its
  # logits exact in fp32 (small-integer fp8, weights in eighths, power-of-two scales): the
  # kernel's equal the reference's, so do the slots.
  def exact_select(rng, rows, tables, pools, page=cases.LOGITS_PAGE):
    """(q, w, kv, page_table) of `rows` rows over `tables` requests of `pools` pools whose
    logits are exact in fp32."""
    pages = tables * pools // page
    data = np.asarray(jnp.asarray(rng.integers(-3, 4, (pages, page * 128)),
                                  jnp.float8_e4m3fn)).view(np.uint8)
    scales = np.exp2(rng.integers(-10, -2, (pages, page))).astype(np.float32)
    kv = np.concatenate([data, scales.view(np.uint8).reshape(pages, -1)], 1)
    q = jnp.asarray(rng.integers(-2, 3, (rows, cases.LOGITS_HEADS, 128)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.integers(-4, 5, (rows, cases.LOGITS_HEADS)) / 8, jnp.float32)
    return (q, w, jnp.asarray(kv.reshape(pages, page, 132)),
            cases.i32(rng.permutation(pages).reshape(tables, -1)))

  def slots_wide_args(rng, rows=3, pools=8192):
    positions = cases.i32([4 * pools - 1, 4 * pools - 3000, 1000][:rows])
    return exact_select(rng, rows, rows, pools) + (
        cases.i32(np.arange(rows)), positions,
        cases.i32(rng.integers(0, 10 ** 5, (rows, 3 * pools // 128))))
  out.append(("select_slots parts", functools.partial(
      glm5_jax.select_slots, k=512, max_pools=8192, block_size=128, width=2053, stride_rows=160),
      slots_wide_args, None, True))
  # MTP units: requests of next_n rows with consecutive positions (a pad and a row that fits
  # k among them), each unit's rows scored from one read of a K tile,
  # with exact logits as above.
  def mtp_args(rng, next_n, requests=3, pools=4096, page=cases.LOGITS_PAGE, holes=False):
    rows = requests * next_n
    base = np.repeat([4 * pools - next_n, 4 * pools - 3000, 2500], next_n)[:rows]
    positions = base + np.tile(np.arange(next_n), requests)
    positions[1], positions[next_n + 1] = -1, 4 * 100 - 1
    q, w, kv, table = exact_select(rng, rows, requests, pools, page)
    if holes:   # a missing page and one past the cache (SPEC D4)
      table = np.array(table)
      table[0, 1], table[-1, -1] = -1, kv.shape[0] + 3
      table = cases.i32(table)
    return (q, w, kv, table, cases.i32(np.repeat(np.arange(requests), next_n)),
            cases.i32(positions))
  # next_n 4 and 3; then pages of 64 entries (an item's four tiles in one page), alone
  # and in units, with holes in the page table.
  for next_n, page in ((4, cases.LOGITS_PAGE), (3, cases.LOGITS_PAGE), (1, 64), (4, 64)):
    out.append((f"select_pools MTP next_n={next_n} page={page}", functools.partial(
        glm5_jax.select_pools, k=512, max_pools=4096, next_n=next_n),
        functools.partial(mtp_args, next_n=next_n, page=page, holes=page == 64),
        cases.CASES["select_pools"].valid, True))
  # The same and expand_and_remap with block-table entries that name no block inside the
  # selection (SPEC §12.3: negative, or slots past int32): -1, not counted, holes closed.
  def holes(args, rng):
    table = np.array(args[-1])
    cells = rng.integers(0, table.size, max(3, table.size // 8))
    table.reshape(-1)[cells] = rng.choice([-7, -1, 2 ** 30, 2 ** 31 - 1], cells.size)
    return args[:-1] + (cases.i32(table),)
  out.append(("select_slots parts, bad block ids", functools.partial(
      glm5_jax.select_slots, k=512, max_pools=8192, block_size=128, width=2053, stride_rows=160),
      lambda rng: holes(slots_wide_args(rng), rng), None, True))
  out.append(("select_slots cluster, bad block ids", functools.partial(
      glm5_jax.select_slots, k=512, max_pools=50688, block_size=128, width=2053,
      stride_rows=160), lambda rng: holes(slots_wide_args(rng, rows=2, pools=50688), rng),
      None, True))
  out.append(("expand_and_remap bad block ids", remap.fn,
              lambda rng: holes(remap.make(rng), rng), None, True))
  return out


# The K cache (output index, operand index) of the ops that write one. The kernels follow
# the stock arithmetic, the reference IEEE exp and division, so written entries may differ
# within SPEC D2 (oracle.compare_cache); every other byte must be identical.
D2_CACHE = {"kpool_update": (0, 0), "kpool_compress": (0, 0), "indexer_update": (6, 5),
            "update_epilogue": (3, 4)}


def _cache_within_d2(got, want, before, plain_scales):
  """Whether K cache `got` equals `want` within SPEC D2, the entries that either changed
  from `before` counted as written (plain_scales: round_scale=False)."""
  pages, page, _ = before.shape
  def entries(kv):
    flat = np.asarray(kv).reshape(pages, -1)
    return np.concatenate([flat[:, :page * 128].reshape(pages * page, 128),
                           flat[:, page * 128:].reshape(pages * page, 4)], 1)
  old = entries(before)
  written = np.flatnonzero(np.any((entries(got) != old) | (entries(want) != old), axis=1))
  try:
    oracle.compare_cache(got, want, before, written, "sanitize", plain_scales=plain_scales)
  except AssertionError as e:
    print(f"  K cache beyond SPEC D2: {' '.join(str(e).split())[:300]}")
    return False
  return True


def _masked(valid, args, outs):
  return tuple(valid(args, outs)) if valid else outs


def main():
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]   # gpu is the CPU on a CPU-only smoke run
  print(f"kernels on {gpu.platform}, reference on cpu")
  bad = 0
  only = sys.argv[1:]     # op names: run only their cases
  for name, fn, make, valid, exact in _variants():
    if only and name.split()[0] not in only:
      continue
    for seed in range(SEEDS):
      args = make(np.random.default_rng(seed))
      got = jax.jit(fn)(*jax.device_put(args, gpu))
      want = jax.jit(fn)(*jax.device_put(args, cpu))
      got, want = (jax.tree.leaves(jax.device_get(t)) for t in (got, want))
      got, want = _masked(valid, args, got), _masked(valid, args, want)
      same = [np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
              if exact else   # GEMMs: summation order differs (SPEC D2)
              np.allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                          **cases.TOLERANCE)
              for g, w in zip(got, want)]
      out, operand = D2_CACHE.get(name.split()[0], (None, None))
      if out is not None and not same[out]:
        plain = getattr(fn, "keywords", {}).get("round_scale") is False
        same[out] = _cache_within_d2(got[out], want[out], np.asarray(args[operand]), plain)
      ok = all(same)
      bad += not ok
      how = "identical to" if exact else "close to"
      print(f"{name:32s} seed {seed}: outputs {how} the CPU reference {same}")
  print(f"sanitize_kernels: {'FAIL' if bad else 'ok'}")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
