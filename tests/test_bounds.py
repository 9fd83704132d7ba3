"""Every tolerance of the GPU tests earns its place (CPU, numpy): the plausible wrong kernels,
computed from the float64 / SPEC arithmetic, fed through the SAME check the GPU test runs
(oracle.check_projection / check_q, bounds.check_logits, bounds.check_cache_d2) fail it,
and the right arithmetic passes it. The GPU tests run the kernels through these checks."""
import functools
import pathlib

import numpy as np
import bounds
import jax
import jax.numpy as jnp
import pytest
from test_select_gpu import LOGITS_CASES, logits_case

from glm5_jax import reference as ref
from glm5_testing import oracle as O

F64 = np.float64


def _trunc_bf16(x):
  """Truncation toward zero to bf16 (instead of round to nearest), as bf16."""
  u = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
  return u.view(np.float32).astype(O.BF16)


def _fp16_sum(x, w, step=32):
  """x @ w.T with the accumulator held in fp16 (rounded after every `step` products)."""
  acc = np.zeros((x.shape[0], w.shape[0]), np.float16)
  for k in range(0, x.shape[1], step):
    acc = (acc.astype(F64) + x[:, k:k + step] @ w[:, k:k + step].T).astype(np.float16)
  return acc.astype(F64)


def _fp32_truncating_sum(x, w):
  """x @ w.T summed in order in fp32, every add truncated toward zero: the worst practical
  fp32 order (GEMM_SHARE's analysis)."""
  acc = np.zeros((x.shape[0], w.shape[0]), F64)
  for k in range(x.shape[1]):
    s = acc + x[:, k:k + 1] * w[None, :, k]
    f = s.astype(np.float32)
    away = np.abs(f.astype(F64)) > np.abs(s)
    f[away] = np.nextafter(f[away], np.float32(0))
    acc = f.astype(F64)
  return acc


def _projection_outputs(kind, x, w_cat, heads):
  """(key bf16, head_w f32, gate bf16) of a projection kernel of the given kind."""
  x64, w64 = x.astype(F64), w_cat.astype(F64)
  if kind == "fp16 accumulation":
    out = _fp16_sum(x64, w64)
  elif kind == "row one short":                # sums K - 1 products
    out = x64[:, :-1] @ w64[:, :-1].T
  elif kind == "fp32 truncating sum":
    out = _fp32_truncating_sum(x64, w64)
  else:
    out = x64 @ w64.T
  key, head_w, gate = out[:, :128], out[:, 128:128 + heads], out[:, 128 + heads:]
  to_bf16 = _trunc_bf16 if kind == "key and gate truncated" else O.to_bf16
  head_w = head_w.astype(np.float32)
  if kind == "head_w rounded to bf16":
    head_w = O.bf16r(head_w)
  return to_bf16(key.astype(np.float32)), head_w, to_bf16(gate.astype(np.float32))


WRONG_GEMMS = ["head_w rounded to bf16", "key and gate truncated", "fp16 accumulation",
               "row one short"]


@functools.cache
def _projection_inputs(k, m=16, heads=32):
  """test_projection_gpu's inputs: x ~ N(0, 1), w_cat ~ N(0, 0.02^2), bf16."""
  rng = np.random.default_rng([k, heads, m, 0])
  return O.random_bf16(rng, (m, k)), O.random_bf16(rng, (256 + heads, k), 0.02)


@pytest.mark.parametrize("k", [4096, 6144])
@pytest.mark.parametrize("kind", WRONG_GEMMS)
def test_projection_bound_rejects_wrong_kernels(k, kind):
  x, w_cat = _projection_inputs(k)
  got = _projection_outputs(kind, x, w_cat, 32)
  with pytest.raises(AssertionError):
    O.check_projection(x, w_cat, 32, got, kind)


@pytest.mark.parametrize("k", [4096, 6144])
def test_projection_bound_passes_fp32_sums(k):
  """Round to nearest of the exact product, an fp32 sum truncating every add, and XLA's
  GEMM (the reference) pass."""
  x, w_cat = _projection_inputs(k)
  for kind in ("exact", "fp32 truncating sum"):
    assert O.check_projection(x, w_cat, 32, _projection_outputs(kind, x, w_cat, 32), kind) < 1
  got = jax.jit(functools.partial(ref.indexer_projection, heads=32))(x, w_cat)
  assert O.check_projection(x, w_cat, 32, got, "reference") <= 1


def _q_outputs(kind, qr, wq_b):
  x, w = qr.astype(F64), wq_b.astype(F64)
  if kind == "fp16 accumulation":
    return O.to_bf16(_fp16_sum(x, w).astype(np.float32))
  if kind == "row one short":
    return O.to_bf16((x[:, :-1] @ w[:, :-1].T).astype(np.float32))
  if kind == "fp32 truncating sum":
    return O.to_bf16(_fp32_truncating_sum(x, w).astype(np.float32))
  if kind == "truncated":
    return _trunc_bf16((x @ w.T).astype(np.float32))
  return O.to_bf16((x @ w.T).astype(np.float32))


@pytest.mark.parametrize("kind", ["truncated", "fp16 accumulation", "row one short"])
def test_q_bound_rejects_wrong_kernels(kind):
  """test_q_gpu's shapes: K 1536 (q_lora), N 256 and 4096."""
  for n in (256, 4096):
    rng = np.random.default_rng([n, 7])
    qr, wq_b = O.random_bf16(rng, (7, 1536)), O.random_bf16(rng, (n, 1536), 0.02)
    with pytest.raises(AssertionError):
      O.check_q(qr, wq_b, _q_outputs(kind, qr, wq_b), kind)


def test_q_bound_passes_fp32_sums():
  rng = np.random.default_rng(3)
  qr, wq_b = O.random_bf16(rng, (7, 1536)), O.random_bf16(rng, (256, 1536), 0.02)
  for kind in ("exact", "fp32 truncating sum"):
    assert O.check_q(qr, wq_b, _q_outputs(kind, qr, wq_b), kind) < 1
  assert O.check_q(qr, wq_b, jax.jit(ref.indexer_q)(qr, wq_b), "reference") <= 1


# --------------------------------------------------------------------------- logits

def _row_wise_scales(kv):
  """The K cache a kernel reading entry e's scale at bytes [132 e + 128, + 4) of its page
  (codes then scale per row, not SPEC §0.1's layout) sees: those bytes moved to the scale
  slots."""
  pages, page, _ = kv.shape
  flat = kv.reshape(pages, -1).copy()
  for e in range(page):
    flat[:, page * 128 + 4 * e:page * 128 + 4 * e + 4] = flat[:, 132 * e + 128:132 * e + 132]
  return flat.reshape(kv.shape)


def _wrong_logits(kind, q, w, kv, table, lens, width, scale_format):
  """The logits f64[rows, width] of a kernel of the given kind."""
  q8 = q.view(jnp.float8_e4m3fn)
  run = functools.partial(O.mqa_logits_vectorized, max_pools=width, scale_format=scale_format)
  if kind == "bf16 head weights":
    return run(q8, O.bf16r(w), kv, table, lens)[0]
  if kind == "bf16 logits":
    want = run(q8, w, kv, table, lens)[0]
    return np.where(np.isneginf(want), -np.inf, O.bf16r(want.astype(np.float32)))
  if kind == "scales read row-wise":
    return run(q8, w, _row_wise_scales(kv), table, lens)[0]
  if kind == "row one short":                  # 127 of the 128 dims
    short = q.copy()
    short[..., 127] = 0
    return run(short.view(jnp.float8_e4m3fn), w, kv, table, lens)[0]
  raise ValueError(kind)


WRONG_LOGITS = ["bf16 head weights", "bf16 logits", "scales read row-wise", "row one short"]
# What LOGITS_BOUND (the tensor cores' fp8 sums) still rejects on random terms; the exact
# dots reject every wrong kernel at EXACT_DOTS_BOUND.
WRONG_LAYOUTS = ["scales read row-wise", "row one short"]


@pytest.mark.parametrize("terms,limit,wrong", [
    ("mixed", bounds.LOGITS_BOUND, WRONG_LAYOUTS), ("positive", bounds.LOGITS_BOUND, WRONG_LAYOUTS),
    ("exact", bounds.EXACT_DOTS_BOUND, WRONG_LOGITS)])
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c[0] * c[1] >= 2 ** 17
                                               else []) for c in LOGITS_CASES])
def test_logits_bound_rejects_wrong_kernels(case, terms, limit, wrong):
  """Every case of test_logits_kernel_within_bound (random terms) and of
  test_logits_kernel_on_exact_dots rejects each wrong kernel of its list and passes the
  float64 logits rounded to f32."""
  (q, w, kv, table, lens), width = logits_case(*case, terms=terms)
  want, bound = O.mqa_logits_vectorized(q.view(jnp.float8_e4m3fn), w, kv, table, lens,
                                        max_pools=width, scale_format=case[-1])
  n = np.clip(lens, 0, width)
  assert bounds.check_logits(want.astype(np.float32), want, bound, n, limit) < 2.0 ** -20
  for kind in wrong:
    got = _wrong_logits(kind, q, w, kv, table, lens, width, case[-1])
    with np.errstate(invalid="ignore"), pytest.raises(AssertionError):
      bounds.check_logits(got.astype(np.float32), want, bound, n, limit)


# --------------------------------------------------------------------------- pool rate

def _compress_inputs(n=1024, pages=20, page=64):
  rng = np.random.default_rng(0)
  kv0 = O.poison_cache(rng, pages, page)
  keys = O.random_bf16(rng, (n, 4, 128), 1.0)
  gates = O.random_bf16(rng, (n, 4, 128), 2.0)
  ape = (rng.standard_normal((4, 128)) * 0.5).astype(np.float32)
  loc = rng.permutation(pages * page)[:n].astype(np.int64)
  return kv0, keys, gates, ape, loc, np.ones(n, bool)


def _e4m3_truncated(x):
  """fp32 -> e4m3 codes truncated toward zero (instead of RNE), saturating."""
  x = np.clip(np.asarray(x, np.float32), -448, 448)
  codes = x.astype(O.E4M3).view(np.uint8).copy()
  away = np.abs(codes.view(O.E4M3).astype(np.float32)) > np.abs(x)
  codes[away] -= 1
  return codes


@pytest.fixture(scope="module")
def compress_reference():
  args = _compress_inputs()
  kv = jax.jit(ref.kpool_compress)(*(jnp.asarray(a) for a in args[:4]),
                                   jnp.asarray(args[4], jnp.int32), jnp.asarray(args[5]))
  return args, np.asarray(kv)


def _oracle_cache(args, monkeypatch=None, **patch):
  for name, fn in patch.items():
    monkeypatch.setattr(O, name, fn)
  written = []
  kv = O.kpool_compress(*args, written=written)
  return kv, written


def test_pool_rate_passes_the_spec_arithmetic(compress_reference):
  """The oracle's SPEC arithmetic (correctly rounded exp) against the reference (XLA's exp):
  D2's exp/div differences only, within the rate."""
  args, want = compress_reference
  got, written = _oracle_cache(args)
  bad, total = bounds.check_cache_d2(got, want, args[0], written, "oracle")
  assert total == 1024 and bad <= 4


def test_pool_rate_rejects_truncating_fp8(compress_reference, monkeypatch):
  """fp8 codes truncated instead of rounded: each entry within one code (compare_cache alone
  passes it), nearly every pool differs."""
  args, want = compress_reference
  got, written = _oracle_cache(args, monkeypatch, e4m3_bytes=_e4m3_truncated)
  O.compare_cache(got, want, args[0], written)
  with pytest.raises(AssertionError, match="pools differ"):
    bounds.check_cache_d2(got, want, args[0], written)


@pytest.mark.parametrize("patch", ["bf16r", "exp2_32"])
def test_cache_check_rejects_wrong_rounding(compress_reference, monkeypatch, patch):
  """Pooled values truncated to bf16, or exp rounded to bf16: entries off by more than D2."""
  args, want = compress_reference
  wrong = {"bf16r": lambda x: _trunc_bf16(x).astype(np.float32),
           "exp2_32": lambda t: O.bf16r(np.exp2(np.asarray(t, np.float32).astype(F64)))}
  got, written = _oracle_cache(args, monkeypatch, **{patch: wrong[patch]})
  with pytest.raises(AssertionError):
    bounds.check_cache_d2(got, want, args[0], written)


def test_pool_rate_rejects_one_wrong_pool_in_200():
  """A kernel wrong in one pool of 200 (one code off: an edge case it mishandles) passed the
  old 1% rate; it fails POOL_RATE (4096 pools: the rate, not the Poisson margin, decides)."""
  args = _compress_inputs(4096, 80)
  want = np.asarray(jax.jit(ref.kpool_compress)(*(jnp.asarray(a) for a in args[:4]),
                                                jnp.asarray(args[4], jnp.int32),
                                                jnp.asarray(args[5])))
  got = want.copy()
  page = got.shape[1]
  flat = got.reshape(got.shape[0], -1)
  for slot in args[4][::200]:
    pg, e = divmod(int(slot), page)
    code = flat[pg, e * 128 + 5]
    flat[pg, e * 128 + 5] = code + 1 if (code & 0x7F) < 0x7E else code - 1
  bad, total = O.compare_cache(got, want, args[0], args[4])
  assert bad == 21 and bad <= 0.01 * total
  with pytest.raises(AssertionError, match="pools differ"):
    bounds.check_cache_d2(got, want, args[0], args[4])


# --------------------------------------------------------------------------- skips

def test_no_silent_skip_under_require_gpu():
  """Every skip of a test goes through conftest (gpu, cuda_build: failures under
  GLM5_JAX_REQUIRE_GPU=1), triton_oracle.require / optional, or test_export's flatbuffers
  check, all of which fail under GLM5_JAX_REQUIRE_GPU=1: no test calls pytest.skip,
  importorskip or triton_oracle.load() itself."""
  tests = pathlib.Path(__file__).parent
  allowed = {"conftest.py", "test_export.py", "test_bounds.py"}
  for path in sorted(set(tests.glob("*.py")) - {pathlib.Path(__file__)}):
    text = path.read_text()
    if path.name not in allowed:
      assert "pytest.skip(" not in text and "importorskip" not in text, path.name
    assert "triton_oracle.load()" not in text, path.name


def test_require_gpu_fails_a_missing_triton_oracle(monkeypatch):
  from glm5_testing import triton_oracle
  if triton_oracle.load() is not None:            # a GPU machine with torch + triton
    assert triton_oracle.optional() is triton_oracle.load()
    return
  assert triton_oracle.optional() is None
  monkeypatch.setenv("GLM5_JAX_REQUIRE_GPU", "1")
  with pytest.raises(pytest.fail.Exception, match="GLM5_JAX_REQUIRE_GPU"):
    triton_oracle.optional()


# --------------------------------------------------------------------------- key LayerNorm

def test_key_rate_rejects_truncated_layernorm():
  """A key LayerNorm rounded by truncation instead of to nearest: every value within one
  ulp (compare_key alone passes it), far more than KEY_RATE of them off; the reference
  passes both."""
  rng = np.random.default_rng(5)
  key_raw = O.to_bf16(rng.standard_normal((64, 128)) * 3)
  nw = (1 + 0.2 * rng.standard_normal(128)).astype(np.float32)
  nb = (0.3 * rng.standard_normal(128)).astype(np.float32)
  exact = O.layernorm_f64(key_raw, nw, nb, 1e-6).astype(np.float32)
  got = jax.jit(functools.partial(ref.key_layernorm, eps=1e-6))(key_raw, nw, nb)
  right = O.to_bf16(exact)
  bounds.check_key(got, right, "reference")
  wrong = _trunc_bf16(exact)
  bad, total = O.compare_key(wrong, right, "truncated")
  assert bad > 0.2 * total
  with pytest.raises(AssertionError, match="one ulp off"):
    bounds.check_key(wrong, right, "truncated")
