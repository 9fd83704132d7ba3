"""The select-path kernels (cc/select.cu) on the GPU: pool_topk equal to the reference
top-k exactly on the same logits, mqa_logits within a documented fp32 bound of a float64
evaluation, select_pools = logits + top-k with the causal fill decided per row, vmap,
out-of-range page/request ids (SPEC D4), select_slots equal to the reference bit for bit
(on logits exact in fp32) and to select_pools + expand_and_remap's kernels, and a stage
with no conditional."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from bounds import EXACT_DOTS_BOUND, LOGITS_BOUND, check_logits

import glm5_jax
from glm5_jax import reference as ref
from glm5_jax.logits import LOGITS_MAX_ROWS
from glm5_testing import oracle as O

from graphs import run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]
I32 = np.int32

def _topk(k):
  return jax.jit(functools.partial(glm5_jax.pool_topk, k=k))


def _ref_topk(k):
  return jax.jit(functools.partial(ref.pool_topk, k=k), backend="cpu")


def _logit_rows(rng, rows, width, kind):
  if kind == "normal":
    return (rng.standard_normal((rows, width)) * 10).astype(np.float32)
  if kind == "ties":       # few distinct values: ties at the threshold
    return np.round(rng.standard_normal((rows, width)) * 2).astype(np.float32)
  if kind == "rising":     # the k best at the end (worst case for the candidate bound)
    return np.tile(np.arange(width, dtype=np.float32), (rows, 1))
  if kind == "falling":
    return np.tile(-np.arange(width, dtype=np.float32), (rows, 1))
  if kind == "equal":
    return np.full((rows, width), 3.0, np.float32)
  if kind == "special":
    vals = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0,
                     3e38, -3e38], np.float32)
    return rng.choice(vals, (rows, width)).astype(np.float32)
  raise ValueError(kind)


# Widths cover every launch shape of the kernel (threads x keys per thread by width: 2048,
# 4096, 8192, 16384, 32768), the vector and scalar loads (width % 4) and a partial chunk;
# rows every split of a row over a cluster (launch_topk: 8, 4 or 2 CTAs per row at up to 8,
# 16 and 64 rows, one CTA past that, and one CTA at any rows of up to 8,192 pools: 1, 16, 40
# x 8192); "equal" rows keep every key (the one-CTA path inside the cluster).
@pytest.mark.parametrize("rows,width", [(1, 2048), (16, 8192), (64, 32768), (3, 8195),
                                        (5, 700), (2, 32768), (4, 4096), (3, 12002),
                                        (12, 32768), (20, 16384), (70, 8190), (66, 32768),
                                        (40, 8192), (1, 8192)])
@pytest.mark.parametrize("kind", ["normal", "ties", "rising", "falling", "equal", "special"])
def test_topk_kernel_equals_reference(rows, width, kind):
  rng = np.random.default_rng(rows * 7 + width)
  logits = _logit_rows(rng, rows, width, kind)
  lens = rng.integers(0, width + 10, rows).astype(I32)
  edge = [width, 0, 512, 513, -3, width + 100, 511, 1]
  lens[:min(rows, len(edge))] = edge[:rows]
  for k in (512, 1, 37):
    args = (jnp.asarray(logits), jnp.asarray(lens))
    # the kernel ran (a shape limit falling back would compare the reference with itself)
    assert 'custom_call_target="glm5_pool_topk"' in _topk(k).lower(*args).compile().as_text()
    got = np.asarray(_topk(k)(*args))
    want = np.asarray(_ref_topk(k)(logits, lens))
    np.testing.assert_array_equal(got, want, err_msg=f"k={k}")


def test_topk_kernel_k_above_1024_and_wider_than_rows():
  rng = np.random.default_rng(1)
  logits = _logit_rows(rng, 4, 5000, "ties")
  lens = np.array([5000, 1500, 2000, 2001], I32)
  for k in (2000, 4096):
    np.testing.assert_array_equal(np.asarray(_topk(k)(jnp.asarray(logits), jnp.asarray(lens))),
                                  np.asarray(_ref_topk(k)(logits, lens)))


def _cache(rng, requests, pools, page, scale_format, spare=3,
           values=lambda rng, shape: rng.standard_normal(shape) * 40):
  """(K cache, page table of each request's pages); the fp8 data `values(rng, shape)`."""
  pages_per = -(-pools // page) + 1
  pages = requests * pages_per + spare
  data = np.asarray(jnp.asarray(values(rng, (pages, page * 128)),
                                jnp.float8_e4m3fn)).view(np.uint8)
  exps = rng.integers(-12, -4, (pages, page))
  if scale_format == "fp32":
    scales = np.exp2(exps).astype(np.float32).view(np.uint8).reshape(pages, -1)
  else:
    scales = np.repeat((exps + 127).astype(np.uint8), 4, axis=1)
  kv = np.concatenate([data, scales], 1).reshape(pages, page, 132)
  table = rng.permutation(pages)[:requests * pages_per].reshape(requests, pages_per)
  return kv, table.astype(I32)


def _queries(rng, rows, padded, heads):
  q = np.array(jnp.asarray(rng.standard_normal((rows, padded, 128)) * 3,
                           jnp.float8_e4m3fn)).view(np.uint8)   # a writable copy
  q[:, heads:] = 0
  w = (rng.standard_normal((rows, padded)) * 0.05).astype(np.float32)
  w[:, heads:] = 0
  return q, w


LOGITS_CASES = [
    (1, 2048, 64, 32, "fp32"), (16, 8192, 64, 32, "fp32"), (4, 3000, 32, 16, "ue8m0"),
    (3, 1000, 16, 64, "fp32"), (64, 2048, 64, 32, "ue8m0"),
    # ~9 work items per CTA of the persistent grid: the streamed kernel's ring turns over
    (8, 30000, 32, 32, "fp32"),
    # pages of 128 entries: two items a page (the second at entry 64)
    (5, 6000, 128, 32, "ue8m0")]


# The fp8 codes of 0, 0.5, 1, 1.5 and 2: products of two are multiples of 1/4 up to 4.
SMALL_CODES = np.array([0x00, 0x30, 0x38, 0x3C, 0x40], np.uint8)


def logits_case(rows, pools, page, heads, scale_format, terms="mixed"):
  """mqa_logits' operands (q u8[rows, padded, 128], w f32[rows, padded], K cache, page table,
  pool counts i32[rows]) and its width: a missing page, a page id past the cache (D4), a row
  of no pools, one of negative count. terms: "mixed" random fp8 of both signs; "positive"
  every q and K value >= 0 (each dot its abs-sum: the tensor cores' truncating sums at
  their worst); "exact" q and K codes of 0..2 in halves, so that every dot is exact on the
  tensor cores and the kernel's only error is its fp32 head sum. Outside "mixed" the head
  weights sit 0.4 of a bf16 ulp above a bf16 value (a bf16 read of them moves every logit
  by >= 2^-9.3 of its bound, one way)."""
  rng = np.random.default_rng(rows + pools)
  padded = max(heads, 32)
  values = ((lambda rng, shape: np.abs(rng.standard_normal(shape)) * 40) if terms != "mixed"
            else (lambda rng, shape: rng.standard_normal(shape) * 40))
  kv, table = _cache(rng, rows, pools, page, scale_format, values=values)
  table[0, 1] = -1                       # a missing page
  table[-1, -1] = kv.shape[0] + 7        # a page id past the cache (D4: not read)
  q, w = _queries(rng, rows, padded, heads)
  if terms != "mixed":
    q &= 0x7F
    w = O.bf16r(rng.uniform(0.02, 0.06, w.shape))
    w = (w + 0.4 * O.bf16_ulp(w)).astype(np.float32)
    w[:, heads:] = 0
  if terms == "exact":
    flat = kv.reshape(kv.shape[0], -1)
    flat[:, :page * 128] = SMALL_CODES[rng.integers(0, 5, (kv.shape[0], page * 128))]
    q[:, :heads] = SMALL_CODES[rng.integers(0, 5, q[:, :heads].shape)]
  lens = rng.integers(0, pools + 1, rows).astype(I32)
  lens[0] = pools
  if rows > 2:
    lens[1:3] = [0, -4]
  return (q, w, kv, table, lens), pools + 64


def _logits_within(rows, pools, page, heads, scale_format, terms, limit):
  """The kernel (asserted in the compiled program) on logits_case within limit of the
  float64 bound; -inf from each row's pool count on."""
  (q, w, kv, table, lens), width = logits_case(rows, pools, page, heads, scale_format, terms)
  fn = jax.jit(functools.partial(glm5_jax.mqa_logits, max_pools=width,
                                 scale_format=scale_format))
  args = (jnp.asarray(q).view(jnp.float8_e4m3fn), jnp.asarray(w), jnp.asarray(kv),
          jnp.asarray(table), jnp.asarray(lens))
  assert 'custom_call_target="glm5_mqa_logits"' in fn.lower(*args).compile().as_text()
  got = np.asarray(fn(*args))
  want, bound = O.mqa_logits_vectorized(q.view(jnp.float8_e4m3fn), w, kv, table, lens,
                                        max_pools=width, scale_format=scale_format)
  n = np.clip(lens, 0, width)
  worst = check_logits(got, want, bound, n, limit)
  for r in range(rows):     # the op's contract: -inf from the row's pool count on
    assert np.all(np.isneginf(got[r, n[r]:]))
  return worst


@pytest.mark.parametrize("terms", ["mixed", "positive"])
@pytest.mark.parametrize("rows,pools,page,heads,scale_format", LOGITS_CASES)
def test_logits_kernel_within_bound(rows, pools, page, heads, scale_format, terms):
  """The kernel within bounds.LOGITS_BOUND of float64 (the tensor cores' fp8 sums)."""
  worst = _logits_within(rows, pools, page, heads, scale_format, terms, LOGITS_BOUND)
  print(f"worst |logit - f64| / bound: {worst:.3g} ({terms})")


@pytest.mark.parametrize("rows,pools,page,heads,scale_format", LOGITS_CASES)
def test_logits_kernel_on_exact_dots(rows, pools, page, heads, scale_format):
  """Where every dot is exact the kernel is within bounds.EXACT_DOTS_BOUND (its fp32 head
  FMAs): a bf16 read of the weights, bf16 logits, a dimension dropped or scales read
  row-wise all fail that check (tests/test_bounds.py)."""
  worst = _logits_within(rows, pools, page, heads, scale_format, "exact", EXACT_DOTS_BOUND)
  print(f"worst |logit - f64| / bound on exact dots: {worst:.3g}")


@pytest.mark.long
@pytest.mark.parametrize("rows", [LOGITS_MAX_ROWS, LOGITS_MAX_ROWS + 1])
def test_logits_at_the_rows_limit(rows):
  """8192 rows run the kernel, 8193 the reference (glm5_jax.logits.LOGITS_MAX_ROWS): both
  within the bound (every 61st row and the last checked against float64)."""
  rng = np.random.default_rng(rows)
  pools, page = 256, 64
  kv, table = _cache(rng, 8, pools, page, "fp32")
  table = table[np.arange(rows) % 8]
  q, w = _queries(rng, rows, 32, 32)
  lens = rng.integers(0, pools + 1, rows).astype(I32)
  fn = jax.jit(functools.partial(glm5_jax.mqa_logits, max_pools=pools))
  args = (jnp.asarray(q).view(jnp.float8_e4m3fn), jnp.asarray(w), jnp.asarray(kv),
          jnp.asarray(table), jnp.asarray(lens))
  kernel = 'custom_call_target="glm5_mqa_logits"' in fn.lower(*args).compile().as_text()
  assert kernel == (rows <= LOGITS_MAX_ROWS)
  got = np.asarray(fn(*args))
  sel = np.r_[np.arange(0, rows, 61), rows - 1]
  want, bound = O.mqa_logits_vectorized(q[sel].view(jnp.float8_e4m3fn), w[sel], kv,
                                        table[sel], lens[sel], max_pools=pools)
  check_logits(got[sel], want, bound, np.clip(lens[sel], 0, pools))


def _select_inputs(rng, contexts, next_n, *, heads=32, page=64, scale_format="fp32",
                   max_pools=None):
  requests = len(contexts)
  positions = (np.asarray(contexts)[:, None] + np.arange(next_n)).reshape(-1).astype(I32)
  pools = int(max(contexts)) // 4 + next_n + 1
  max_pools = max_pools or -(-pools // 64) * 64
  kv, table = _cache(rng, requests, max_pools, page, scale_format)
  rows = positions.size
  q, w = _queries(rng, rows, max(heads, 32), heads)
  req = np.repeat(np.arange(requests), next_n).astype(I32)
  return (jnp.asarray(q).view(jnp.float8_e4m3fn), jnp.asarray(w), jnp.asarray(kv),
          jnp.asarray(table), jnp.asarray(req), jnp.asarray(positions)), max_pools


@pytest.mark.parametrize("contexts,next_n", [([30000], 1), ([8000] * 16, 1),
                                             ([100, 3000, 2047, 9000, 20000, 5], 2),
                                             ([2100, 400, 7000], 4), ([500, 1000], 1)])
def test_select_kernel(contexts, next_n):
  rng = np.random.default_rng(len(contexts) * 10 + next_n)
  args, max_pools = _select_inputs(rng, contexts, next_n)
  k = 512
  fn = jax.jit(functools.partial(glm5_jax.select_pools, k=k, max_pools=max_pools))
  assert 'custom_call_target="glm5_select_pools"' in fn.lower(*args).compile().as_text()
  ids, logits = (np.asarray(a) for a in fn(*args))
  q, w, kv, table, req, pos = (np.asarray(a) for a in args)
  n = np.minimum(np.where(pos >= 0, (pos.astype(np.int64) + 1) // 4, 0), max_pools)
  big = n > k
  if big.any():
    want, bound = O.mqa_logits_vectorized(q[big], w[big], kv, table[req[big]], n[big],
                                          max_pools=max_pools)
    check_logits(logits[big], want, bound, n[big])
  # The selection is exactly the reference top-k of the logits the kernel computed; rows
  # that fit select every pool (the causal fill).
  np.testing.assert_array_equal(ids, np.asarray(_ref_topk(k)(np.where(
      big[:, None], logits, 0).astype(np.float32), n.astype(I32))))
  for r in np.flatnonzero(~big):
    assert ids[r].tolist() == list(range(n[r])) + [-1] * (k - n[r])


@pytest.mark.parametrize("next_n,heads", [(1, 32), (1, 64), (4, 32), (3, 64)])
def test_logits_keep_a_nan_dot(next_n, heads):
  """A NaN in one row's queries (e4m3 0x7F, one head) makes every logit of that row NaN up
  to its pool count, as the reference's maximum(dot, 0) keeps it, and moves no bit of any
  other row (next_n > 1: the row shares its unit's K tiles and its wgmma chain's N with
  the request's other rows); its top-k ranks the NaN as -inf (the lowest ids)."""
  rng = np.random.default_rng(31 + next_n + heads)
  args, max_pools = _select_inputs(rng, [3000, 2500, 900], next_n, heads=heads)
  fn = jax.jit(functools.partial(glm5_jax.select_pools, k=512, max_pools=max_pools))
  assert 'custom_call_target="glm5_select_pools"' in fn.lower(*args).compile().as_text()
  nan_row = next_n // 2  # inside the first request's unit where next_n > 1
  q = np.asarray(args[0]).view(np.uint8).copy()
  q[nan_row, 2, 5] = 0x7F
  poisoned = (jnp.asarray(q).view(jnp.float8_e4m3fn),) + args[1:]
  ids, logits = (np.asarray(a) for a in fn(*poisoned))
  _, clean = (np.asarray(a) for a in fn(*args))
  want_ids, want = (np.asarray(a) for a in jax.jit(functools.partial(
      ref.select_pools, k=512, max_pools=max_pools), backend="cpu")(
          *(np.asarray(a) for a in poisoned)))
  pos = np.asarray(args[5])
  n = np.minimum((pos.astype(np.int64) + 1) // 4, max_pools)
  assert n[nan_row] > 512
  assert np.all(np.isnan(logits[nan_row, :n[nan_row]]))
  assert np.all(np.isnan(want[nan_row, :n[nan_row]]))
  np.testing.assert_array_equal(ids[nan_row], np.arange(512))
  np.testing.assert_array_equal(want_ids[nan_row], np.arange(512))
  others = [r for r in range(len(pos)) if r != nan_row and n[r] > 512]  # rows it scores
  assert len(others) >= next_n
  for r in others:
    assert not np.isnan(logits[r, :n[r]]).any()
    np.testing.assert_array_equal(logits[r, :n[r]].view(np.uint32),
                                  clean[r, :n[r]].view(np.uint32))


def test_select_kernel_out_of_range_ids():
  """Unknown requests and page ids past the cache score -inf and are never read (D4);
  pads (pos < 0) and positions past max_pools * 4 are clamped as the reference does."""
  rng = np.random.default_rng(9)
  args, max_pools = _select_inputs(rng, [9000, 9000, 9000, 9000], 1)
  q, w, kv, table, req, pos = args
  req = jnp.asarray([0, 5, -1, 1], I32)
  pos = jnp.asarray([9000, 9000, -1, 2 ** 31 - 1], I32)
  table = table.at[0, 3].set(10 ** 6).at[0, 4].set(-2)
  fn = jax.jit(functools.partial(glm5_jax.select_pools, k=512, max_pools=max_pools))
  ids, logits = (np.asarray(a) for a in fn(q, w, kv, table, req, pos))
  want_ids, want_logits = (np.asarray(a) for a in jax.jit(functools.partial(
      ref.select_pools, k=512, max_pools=max_pools), backend="cpu")(
          *(np.asarray(a) for a in (q, w, kv, table, req, pos))))
  assert np.all(np.isneginf(logits[0, 192:320])) and np.all(np.isneginf(logits[1, :2250]))
  np.testing.assert_array_equal(ids[1], np.arange(512))     # all -inf: lowest ids
  assert ids[2].tolist() == [-1] * 512
  np.testing.assert_array_equal(ids, np.asarray(_ref_topk(512)(
      np.where(np.arange(4)[:, None] != 2, logits, 0), np.asarray(ref.pool_counts(
          np.asarray(pos))).clip(0, max_pools))))
  overlap = np.mean([len(set(ids[r]) & set(want_ids[r])) / 512 for r in (0, 3)])
  assert overlap >= 0.99


def test_select_kernel_under_vmap_folds_rows():
  rng = np.random.default_rng(4)
  args, max_pools = _select_inputs(rng, [5000, 7000, 100], 2)
  stacked = tuple(jnp.stack([a, a]) if a.ndim and i in (0, 1, 4, 5) else a
                  for i, a in enumerate(args))
  fn = functools.partial(glm5_jax.select_pools, k=512, max_pools=max_pools)
  batched = jax.jit(jax.vmap(fn, in_axes=(0, 0, None, None, 0, 0)))(*stacked)
  single = jax.jit(fn)(*args)
  np.testing.assert_array_equal(np.asarray(batched[0][1]), np.asarray(single[0]))
  text = jax.jit(jax.vmap(fn, in_axes=(0, 0, None, None, 0, 0))).lower(*stacked).as_text()
  assert text.count("glm5_select_pools") == 1 and "while" not in text


def test_stage_is_one_command_buffer_without_branches(tmp_path):
  """indexer_stage compiles to straight-line work: no conditional or while in the
  optimised HLO, and every thunk of a six-layer step inside one command buffer."""
  # Six layers: at M = 2 a layer is one thunk (indexer_update_select's call: the update part and the
  # select path in one FFI call), and a program of fewer than five thunks is under XLA's
  # minimum command-buffer size (xla_gpu_graph_min_graph_size), so XLA would launch them
  # one by one (the H200, jaxlib 0.11.2); a model's step has many more.
  script = (
      "import numpy as np, jax, glm5_jax\n"
      "from glm5_jax import synthetic\n"
      # The default routing, whatever GLM5_JAX_KERNELS says (all_kernels sets it to 1).
      "cfg = glm5_jax.IndexerConfig(max_pools=2048, routing=glm5_jax.Routing())\n"
      "rng = np.random.default_rng(0)\n"
      "w = [synthetic.layer(rng, cfg) for _ in range(6)]\n"
      "cache, pt, bt = synthetic.decode_cache(rng, 2, 8000)\n"
      "batch = synthetic.decode_batch(np.array([[7000], [300]]), cache, pt, bt)\n"
      "x, qr = synthetic.inputs(rng, 2)\n"
      "def layers(w, caches, x, qr, batch):\n"
      "  outs = [glm5_jax.indexer_stage(wl, c, x, qr, batch, config=cfg)\n"
      "          for wl, c in zip(w, caches)]\n"
      "  return [o for o, _ in outs], [c for _, c in outs]\n"
      "caches = [cache] + [jax.tree.map(jax.numpy.copy, cache) for _ in range(5)]\n"
      "outs, caches = jax.jit(layers, donate_argnums=1)(w, caches, x, qr, batch)\n"
      "print(int(outs[1].counts[0]), int(outs[1].counts[1]))\n")
  # By default at M = 2 the stage is indexer_update_select's one call (plan.one_call: the update
  # part's indexer_update_q and the select path's select_slots, both chosen here).
  out = run_and_check_graphed(script, [glm5_jax.KERNEL_TARGETS["indexer_update_select"]], tmp_path)
  assert out.split() == ["2049", "301"]   # 512 pools + the 1-token tail; causal
  hlo = "".join(p.read_text() for p in tmp_path.glob("*after_optimizations.txt"))
  assert " conditional(" not in hlo and " while(" not in hlo


# ---------------------------------------------------------------- select_slots

def _exact_inputs(rng, contexts, next_n, *, max_pools, page=64, heads=32, scale_format):
  """select_slots' select operands whose logits are exact in fp32 in any summation order
  (small-integer fp8 q and K, weights in eighths, power-of-two scales: every partial sum
  a multiple of the smallest term below 2^24 of it), so the kernel's logits are the CPU
  reference's and its slots must be too; few distinct values: ties at the threshold.
  Rows = requests x next_n, request-major, at contexts[r] + 0..next_n-1. Besides: the last
  row of >= 3 rows names an unknown request; a pad (request 0's last row, or row 2 of
  >= 4 rows of one token each); a row scoring every pool 0 (q = 0: ties everywhere, the
  lowest ids win): request 1's second row, or row 3."""
  requests = len(contexts)
  positions = (np.asarray(contexts)[:, None] + np.arange(next_n)).reshape(-1).astype(I32)
  req = np.repeat(np.arange(requests), next_n).astype(I32)
  rows = positions.size
  pad = next_n - 1 if next_n > 1 else 2 if rows >= 4 else None
  if pad is not None:
    positions[pad] = -1
  if rows >= 3:
    req[-1] = requests + 5
  kv, table = _cache(rng, requests, max_pools, page, scale_format,
                     values=lambda rng, shape: rng.integers(-3, 4, shape))
  padded = max(heads, 32)
  q = rng.integers(-2, 3, (rows, padded, 128)).astype(np.float32)
  w = (rng.integers(-4, 5, (rows, padded)) / 8).astype(np.float32)
  q[:, heads:], w[:, heads:] = 0, 0
  flat = next_n + 1 if next_n > 1 and requests > 1 else 3 if rows >= 4 else None
  if flat is not None:
    q[flat] = 0
  return (jnp.asarray(q, jnp.float8_e4m3fn), jnp.asarray(w), jnp.asarray(kv),
          jnp.asarray(table), jnp.asarray(req), jnp.asarray(positions))


def _block_table(rng, contexts, next_n, block_size):
  """Every request's blocks at random physical blocks, the table a quarter narrower than
  the longest context: the tokens of the longest rows past it are dropped (fewer slots)."""
  longest = max(contexts) + next_n
  blocks = max(1, -(-longest * 3 // 4 // block_size))
  return jnp.asarray(rng.integers(0, 50000, (len(contexts), blocks)).astype(I32))


def _slots_params(k, max_pools, block_size, stride_rows, extra, scale_format):
  return dict(k=k, max_pools=max_pools, block_size=block_size, width=4 * k + 3 + extra,
              stride_rows=stride_rows, scale_format=scale_format)


def _contexts(rng, requests, k, max_pools):
  """Random contexts up to max_pools pools, the first one fitting in k pools (the causal
  fill), the second one the longest (every pool); one request: the longest."""
  ctx = rng.integers(min(4 * k + 8, 4 * max_pools - 1), 4 * max_pools, requests)
  ctx[0] = min(4 * k - 9, 4 * max_pools - 1) if k > 3 else 2
  ctx[min(1, requests - 1)] = 4 * max_pools - 1
  return [int(c) for c in ctx]


# (requests, next_n, k, max_pools, block_size, stride_rows, width past 4k + 3, scale
# format): rows 1, 3, 4, 16, 64 and 130; 512 to 32768 pools (few rows of >= 8192: the
# top-k's cluster per row); k 512 and small; width odd, a multiple of 4 and neither; block
# sizes 16 to 128, one not a power of two (the kernel divides by a Divisor, cc/common.h).
SLOTS_CASES = [
    (1, 1, 512, 512, 64, None, 0, "fp32"),          # one row, causal fill
    (1, 1, 512, 8192, 128, None, 1, "ue8m0"),
    (3, 1, 512, 32768, 128, 96, 5, "fp32"),
    (3, 1, 5, 4096, 16, None, 2, "fp32"),
    (2, 2, 64, 32768, 64, 80, 3, "ue8m0"),
    (16, 1, 512, 8192, 64, 80, 3, "ue8m0"),
    (8, 2, 64, 2048, 32, None, 0, "fp32"),
    (16, 4, 512, 8192, 128, None, 4, "fp32"),
    (64, 1, 512, 2048, 128, 256, 1, "ue8m0"),
    (65, 2, 512, 2048, 64, None, 7, "fp32"),
    (5, 4, 37, 1024, 16, 20, 6, "ue8m0"),
    (4, 1, 512, 4096, 48, None, 2, "fp32"),         # a block size not a power of two
]


@pytest.mark.parametrize("requests,next_n,k,max_pools,block_size,stride_rows,extra,scale_format",
                         SLOTS_CASES)
def test_slots_kernel_equals_reference(requests, next_n, k, max_pools, block_size,
                                       stride_rows, extra, scale_format):
  """select_slots' kernel (the default routing: its one FFI call) gives the CPU
  reference's slots and counts bit for bit."""
  rng = np.random.default_rng(requests * 1000 + max_pools + k)
  contexts = _contexts(rng, requests, k, max_pools)
  args = _exact_inputs(rng, contexts, next_n, max_pools=max_pools, scale_format=scale_format)
  args += (_block_table(rng, contexts, next_n, block_size),)
  params = _slots_params(k, max_pools, block_size, stride_rows, extra, scale_format)
  assert glm5_jax.plan.chooses_kernel(glm5_jax.select_slots, *args,
                                      routing=glm5_jax.Routing.from_env(), **params)
  fn = jax.jit(functools.partial(glm5_jax.select_slots, **params))
  got = [np.asarray(a) for a in fn(*args)]
  want = jax.jit(functools.partial(ref.select_slots, **params), backend="cpu")(
      *(np.asarray(a) for a in args))
  np.testing.assert_array_equal(got[1], np.asarray(want[1]), err_msg="counts")
  np.testing.assert_array_equal(got[0], np.asarray(want[0]), err_msg="slots")
  # What the case claims to cover: a row selecting, a row dropping tokens past the table.
  pos = np.asarray(args[5]).astype(np.int64)
  n = np.minimum(np.where(pos >= 0, (pos + 1) // 4, 0), max_pools)
  tokens = np.minimum(4 * np.minimum(n, k) + np.where(pos >= 0, (pos + 1) % 4, 0), 4 * k + 3)
  known = np.asarray(args[4]) < requests
  assert np.any(n > k) or max_pools <= k
  assert requests * next_n < 3 or np.any(known & (got[1] < tokens))


@pytest.mark.parametrize("contexts,next_n,scale_format", [
    ([30000], 1, "fp32"), ([8000] * 16, 1, "ue8m0"), ([100, 3000, 2047, 9000, 20000, 5], 2, "fp32"),
    ([2100, 400, 7000], 4, "ue8m0"), ([500, 1000] * 32, 1, "fp32")])
def test_slots_kernel_equals_two_kernels(contexts, next_n, scale_format):
  """On logits that round (random fp8), select_slots' kernel equals select_pools' kernel
  then expand_and_remap's (the two ops indexer_stage runs with select_slots off) bit for
  bit: the same logits kernel, then a top-k that writes the remap's slots."""
  rng = np.random.default_rng(len(contexts) * 10 + next_n)
  args, max_pools = _select_inputs(rng, contexts, next_n, scale_format=scale_format)
  bt = _block_table(rng, contexts, next_n, 64)
  params = _slots_params(512, max_pools, 64, None, 1, scale_format)
  one = jax.jit(functools.partial(glm5_jax.select_slots, **params))(*args, bt)

  @jax.jit
  def two(*a):
    ids, _ = glm5_jax.select_pools(*a[:6], k=params["k"], max_pools=max_pools,
                                   scale_format=scale_format)
    return glm5_jax.expand_and_remap(ids, a[5], a[4], a[6], block_size=64,
                                     width=params["width"])

  text = two.lower(*args, bt).as_text()
  assert "glm5_select_pools" in text and "glm5_expand_and_remap" in text
  for g, w in zip(one, two(*args, bt)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_slots_is_one_custom_call():
  """select_slots under jit compiles to exactly one glm5_select_slots call: no
  glm5_expand_and_remap (nor select_pools') launch; under vmap the rows fold."""
  rng = np.random.default_rng(2)
  contexts = [9000, 300, 5000]
  args, max_pools = _select_inputs(rng, contexts, 2)
  args += (_block_table(rng, contexts, 2, 64),)
  fn = functools.partial(glm5_jax.select_slots, k=512, max_pools=max_pools, block_size=64,
                         width=2052)
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  assert hlo.count('custom_call_target="glm5_select_slots"') == 1, hlo[:2000]
  assert "glm5_expand_and_remap" not in hlo and "glm5_select_pools" not in hlo
  stacked = tuple(jnp.stack([a, a]) if i in (0, 1, 4, 5) else a for i, a in enumerate(args))
  axes = (0, 0, None, None, 0, 0, None)
  batched = jax.jit(jax.vmap(fn, in_axes=axes))
  text = batched.lower(*stacked).compile().as_text()
  assert text.count('custom_call_target="glm5_select_slots"') == 1 and " while(" not in text
  single = jax.jit(fn)(*args)
  for b, s in zip(batched(*stacked), single):
    np.testing.assert_array_equal(np.asarray(b[1]), np.asarray(s))


# MTP rows: (contexts of the requests, next_n, req_ids layout, heads, scale format). "runs":
# request-major rows as DecodeBatch lays them out; "odd": runs of 5 and 3 rows under a hint
# of 4 (units split at the run's 4th row, and where the request changes); "mixed": requests
# interleaved (no two neighbours share one: units of one row).
MTP_CASES = [
    ([30000] * 16, 4, "runs", 32, "fp32"),
    ([8000, 2100, 500, 20000, 16000], 4, "runs", 64, "ue8m0"),
    ([9000, 3000, 12000], 2, "runs", 32, "fp32"),
    ([6000, 7000, 2050], 4, "odd", 32, "fp32"),
    ([6000, 7000, 9000, 4000], 4, "mixed", 32, "ue8m0"),
    # Units of 3 rows, 64 heads at every unit size, and odd runs under hints of 3 and 4
    # (units narrower than the hint).
    ([7000, 5000, 3000], 3, "runs", 32, "fp32"),
    ([7000, 5000, 3000], 3, "runs", 64, "ue8m0"),
    ([6000, 7000, 2050], 3, "odd", 32, "fp32"),
    ([6000, 7000, 2050], 4, "odd", 64, "fp32"),
    ([9000, 4000, 6000], 2, "runs", 64, "fp32"),
]


@pytest.mark.parametrize("contexts,next_n,layout,heads,scale_format", MTP_CASES)
def test_mtp_rows_equal_the_row_by_row_kernel(contexts, next_n, layout, heads, scale_format):
  """select_pools and select_slots with next_n rows a request (the logits kernel scores a
  unit of a request's rows from one read of its K tiles) give the same bits as with next_n
  = 1 (every row alone): the ids, the slots and counts, and every specified logit."""
  rng = np.random.default_rng(len(contexts) * 31 + next_n)
  args, max_pools = _select_inputs(rng, contexts, next_n, heads=heads, page=64,
                                   scale_format=scale_format)
  q, w, kv, table, req, pos = args
  req = np.asarray(req).copy()
  pos = np.asarray(pos).copy()
  if layout == "odd":       # runs of 5, 3 and the rest: rows of one request past the hint
    req = np.repeat(np.arange(3), [5, 3, req.size - 8]).astype(I32)
  elif layout == "mixed":
    req = (np.arange(req.size) % len(contexts)).astype(I32)
  pos[1] = -1                        # a pad inside a unit
  req[-1] = len(contexts) + 7        # an unknown request
  pos[2] = 4 * 100 - 1               # a row that fits k (the causal fill) inside a unit
  args = (q, w, kv, table, jnp.asarray(req), jnp.asarray(pos))
  k = 512
  n = np.minimum(np.where(pos >= 0, (pos.astype(np.int64) + 1) // 4, 0), max_pools)
  scored = n > k
  block_table = _block_table(rng, contexts, next_n, 128)
  results = {}
  for hint in (1, next_n):
    fn = jax.jit(functools.partial(glm5_jax.select_pools, k=k, max_pools=max_pools,
                                   scale_format=scale_format, next_n=hint))
    assert 'custom_call_target="glm5_select_pools"' in fn.lower(*args).compile().as_text()
    ids, logits = (np.asarray(a) for a in fn(*args))
    slots = jax.jit(functools.partial(glm5_jax.select_slots, k=k, max_pools=max_pools,
                                      block_size=128, width=4 * k + 3,
                                      scale_format=scale_format, next_n=hint))(
        *args, block_table)
    results[hint] = ids, logits, *(np.asarray(a) for a in slots)
  (ids1, logits1, slots1, counts1), (ids, logits, slots, counts) = results[1], results[next_n]
  np.testing.assert_array_equal(ids, ids1)
  np.testing.assert_array_equal(slots, slots1)
  np.testing.assert_array_equal(counts, counts1)
  cols = np.arange(max_pools)[None, :] < n[:, None]
  both = scored[:, None] & cols
  assert np.array_equal(logits[both].view(np.uint32), logits1[both].view(np.uint32))
  # the case scores rows, and not the pad (1) nor the row that fits k (2)
  assert scored.sum() >= 3 and not scored[1] and not scored[2]
