"""kpool_compress as the CUDA kernel (glm5_kpool_compress) on the GPU (SPEC §4a).

(1) K-cache bytes bit-identical to the Triton oracle (glm5_testing/triton_oracle.py
    `compress`, the stock op order) on random pools at random distinct slots, every
    scale mode, at a 32K-token prompt's 8192 pools and with wide inputs; every entry no
    row writes unchanged.
(2) Against jax.jit(glm5_jax.reference.kpool_compress) within SPEC D2
    (oracle.compare_cache; the mismatch rate is printed).
(3) SPEC D4: rows with write_mask false, or a slot < 0 or >= pages * PAGE (the cache's
    end itself included), write nothing in the cache (a write outside the buffer is
    compute-sanitizer's to see: scripts/sanitize_kernels.py runs those slots).
(4) A donated call updates the cache in place (no copy in the optimised HLO) and a
    second call continues from the first.
(5) No rows; one row.
(6) The FFI call runs inside a command buffer.
indexer_prefill with the kernel against use_reference=True (same tail bytes, K cache
within SPEC D2): tests/test_prefill.py, test_prefill_matches_reference_composition.
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from bounds import check_cache_d2
from test_reference_kpool import special_pools

import glm5_jax
from glm5_jax import reference as ref
from glm5_testing import oracle as O
from glm5_testing import triton_oracle

from graphs import copied_shapes, run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]

MODES = [("fp32", True), ("ue8m0", True), ("fp32", False)]
MODE_IDS = ["fp32", "ue8m0", "fp32-plain"]
CALLS = 6                               # calls per jit (>= XLA's minimum command-buffer size)
STATS = {"multi": 0, "bad": 0, "pools": 0}


# --------------------------------------------------------------------------- inputs

def _pools(rng, n, wide=False):
  """Keys and gates bf16[n, 4, 128] (~N(0, 1) and N(0, 4); wide: keys * 8, gates * 6,
  as the kpool_update Triton batches) and the APE f32[4, 128]."""
  ks, gs = (8.0, 12.0) if wide else (1.0, 2.0)
  keys = O.random_bf16(rng, (n, 4, 128), ks)
  gates = O.random_bf16(rng, (n, 4, 128), gs)
  ape = (rng.standard_normal((4, 128)) * 0.5).astype(np.float32)
  return keys, gates, ape


def _rows(rng, n, pages, page, masked=0.125):
  """loc i64[n] at distinct random slots of the cache, write_mask bool[n] with a
  `masked` fraction of the rows off."""
  loc = rng.permutation(pages * page)[:n].astype(np.int64)
  return loc, rng.random(n) >= masked


def _live(kv, loc, mask):
  """The rows that write (SPEC D4: mask set, 0 <= loc < pages * PAGE)."""
  return np.asarray(mask, bool) & (loc >= 0) & (loc < kv.shape[0] * kv.shape[1])


@functools.cache
def _op(kernel, scale_format, round_scale, donate=False):
  op = glm5_jax.kpool_compress if kernel else ref.kpool_compress
  return jax.jit(functools.partial(op, scale_format=scale_format, round_scale=round_scale),
                 donate_argnums=(0,) if donate else ())


def _device(kv, keys, gates, ape, loc, mask):
  return (jnp.asarray(kv), jnp.asarray(keys), jnp.asarray(gates), jnp.asarray(ape),
          jnp.asarray(np.asarray(loc, np.int64), jnp.int32), jnp.asarray(mask, bool))


def _run(kernel, mode, *args):
  """The K cache after one call, as numpy: the kernel (GLM5_JAX_KERNELS=1) or the
  reference. args: (kv, keys, gates, ape, loc, mask), numpy."""
  return np.asarray(_op(kernel, *mode)(*_device(*args)))


def _with_entries(kv, loc, data, scales):
  """kv (numpy) with entry loc[i] set to the fp8 bytes data[i] and the scale bytes
  scales[i]; slots distinct and in range."""
  kv = np.array(kv, np.uint8)
  pages, page, _ = kv.shape
  flat = kv.reshape(pages, page * 132)
  pg, e = np.divmod(np.asarray(loc, np.int64), page)
  flat[pg[:, None], e[:, None] * 128 + np.arange(128)] = data
  flat[pg[:, None], page * 128 + e[:, None] * 4 + np.arange(4)] = scales
  return kv


def _triton_cache(T, mode, kv, keys, gates, ape, loc, mask):
  """The cache the Triton oracle's entries give: each live row's pool compressed by
  the stock op order, written at its slot; every other byte as in kv."""
  live = _live(kv, loc, mask)
  q, sb = T.compress(T.to_torch(keys[live]), T.to_torch(gates[live]), T.to_torch(ape),
                     scale_format=mode[0], round_scale=mode[1])
  return _with_entries(kv, loc[live], T.to_numpy(q), T.to_numpy(sb))


def _assert_same_entries(got, want, label):
  diff = O.differing_entries(got, want)
  assert diff.size == 0, f"{label}: {diff.size} entries differ, e.g. slots {diff[:20]}"


def test_lowers_to_the_kernel():
  rng = np.random.default_rng(0)
  keys, gates, ape = _pools(rng, 4)
  loc, mask = _rows(rng, 4, 2, 32)
  text = _op(True, "fp32", True).lower(
      *_device(O.poison_cache(rng, 2, 32), keys, gates, ape, loc, mask)).as_text()
  assert "glm5_kpool_compress" in text


# --------------------------------------------------------------------------- (1)

# (rows, PAGE, wide): a 32K-token prompt's pools; a partial last CTA, PAGE 32, wide inputs.
TRITON_SHAPES = [(8192, 64, False), (1001, 32, True)]


@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=["n8192", "n1001-wide"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_bit_identical_to_triton(mode, shape):
  """Every byte of the cache equals the Triton oracle's entries written at the live
  rows' slots over the poisoned cache (so no other entry changed); 1/8 of the rows
  masked off, the cache twice the rows' size."""
  T = triton_oracle.require()
  n, page, wide = shape
  rng = np.random.default_rng(n + 10 * MODES.index(mode))
  pages = 2 * n // page + 3
  kv0 = O.poison_cache(rng, pages, page)
  keys, gates, ape = _pools(rng, n, wide)
  loc, mask = _rows(rng, n, pages, page)
  got = _run(True, mode, kv0, keys, gates, ape, loc, mask)
  want = _triton_cache(T, mode, kv0, keys, gates, ape, loc, mask)
  _assert_same_entries(got, want, f"n {n} PAGE {page} wide {wide} {mode}")
  assert O.differing_entries(got, kv0).size > 0.8 * n


# --------------------------------------------------------------------------- (2)

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_matches_reference_within_d2(mode):
  """4096 pools (1/8 masked off), kernel vs the reference: scale bytes equal (plain
  scales: within the amax flip compare_cache allows), fp8 codes within D2's allowance,
  every entry no row writes unchanged; at most bounds.POOL_RATE of the pools differ."""
  rng = np.random.default_rng(20 + MODES.index(mode))
  n, pages, page = 4096, 100, 64
  kv0 = O.poison_cache(rng, pages, page)
  keys, gates, ape = _pools(rng, n)
  loc, mask = _rows(rng, n, pages, page)
  args = (kv0, keys, gates, ape, loc, mask)
  got, want = _run(True, mode, *args), _run(False, mode, *args)
  written = loc[_live(kv0, loc, mask)]
  bad, total = check_cache_d2(got, want, kv0, written, f"compress {mode}", STATS,
                              plain_scales=not mode[1])
  assert total == len(written) > 3000
  STATS["bad"] += bad
  STATS["pools"] += total
  print(f"\n[kernel vs reference, {mode}] fp8 mismatch {bad}/{total} pools (module so far "
        f"{STATS['bad']}/{STATS['pools']}; entries > 1 code apart: {STATS['multi']})")


# --------------------------------------------------------------------------- (3)

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_masked_and_out_of_range_rows_never_write(mode):
  """Rows in random order: 16 live (slots 0 and pages * PAGE - 1 among them), 8 masked
  off at other in-range slots, the mask set with slots -1, -2, INT32_MIN, pages * PAGE,
  pages * PAGE + 1, one page past the end, 10^6 and INT32_MAX, and masked-off rows with
  such slots. The cache equals the kernel's run on the 16 live rows alone, bit for bit,
  and the reference's within D2 with every other entry unchanged."""
  rng = np.random.default_rng(30 + MODES.index(mode))
  pages, page = 6, 16
  cap = pages * page
  slots = rng.permutation(np.arange(1, cap - 1))
  live_loc = np.concatenate([[0, cap - 1], slots[:14]])
  off_loc = slots[14:22]
  bad_loc = np.array([-1, -2, -2 ** 31, cap, cap + 1, cap + page, 10 ** 6, 2 ** 31 - 1])
  loc = np.concatenate([live_loc, off_loc, bad_loc, bad_loc[:4]]).astype(np.int64)
  mask = np.concatenate([np.ones(16, bool), np.zeros(8, bool), np.ones(8, bool),
                         np.zeros(4, bool)])
  order = rng.permutation(loc.size)
  loc, mask = loc[order], mask[order]
  kv0 = O.poison_cache(rng, pages, page)
  keys, gates, ape = _pools(rng, loc.size)
  got = _run(True, mode, kv0, keys, gates, ape, loc, mask)
  live = _live(kv0, loc, mask)
  assert live.sum() == 16
  alone = _run(True, mode, kv0, keys[live], gates[live], ape, loc[live], mask[live])
  np.testing.assert_array_equal(got, alone, err_msg=f"{mode}: a non-live row wrote")
  want = _run(False, mode, kv0, keys, gates, ape, loc, mask)
  bad, total = O.compare_cache(got, want, kv0, live_loc, f"D4 {mode}", STATS,
                               plain_scales=not mode[1])
  assert total == 16 and bad <= 1, (bad, total)
  assert set(O.differing_entries(got, kv0).tolist()) <= set(live_loc.tolist())


# --------------------------------------------------------------------------- (4)

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_donated_call_updates_in_place_and_continues(mode):
  """jit with the cache donated: no copy of the cache in the optimised HLO, the
  result in the donated buffer; a second call on other slots continues from the first.
  Bytes equal to the same two calls without donation."""
  rng = np.random.default_rng(40 + MODES.index(mode))
  pages, page, n = 8, 64, 96
  kv0 = O.poison_cache(rng, pages, page)
  order = rng.permutation(pages * page)
  calls = []
  for c in range(2):
    keys, gates, ape = _pools(rng, n)
    calls.append((keys, gates, ape, order[c * n:(c + 1) * n].astype(np.int64),
                  rng.random(n) >= 0.125))
  step = _op(True, *mode, donate=True)
  kv = jnp.asarray(kv0)
  ptr = kv.unsafe_buffer_pointer()
  hlo = step.lower(*_device(kv0, *calls[0])).compile().as_text()
  assert 'custom_call_target="glm5_kpool_compress"' in hlo
  copies = copied_shapes(hlo, [kv0.shape])
  assert not copies, copies
  want = kv0
  for call in calls:
    new = step(kv, *_device(kv0, *call)[1:])
    assert kv.is_deleted() and new.unsafe_buffer_pointer() == ptr
    kv = new
    want = _run(True, mode, want, *call)
  np.testing.assert_array_equal(np.asarray(kv), want)
  assert O.differing_entries(want, kv0).size > 0.8 * 2 * n


# --------------------------------------------------------------------------- (5)

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_no_rows_and_one_row(mode):
  """n = 0 leaves every byte; n = 1 writes its one entry (bit-identical to the Triton
  oracle where it is installed, within D2 of the reference), or nothing when masked off
  or at slot pages * PAGE."""
  rng = np.random.default_rng(50 + MODES.index(mode))
  pages, page = 3, 32
  kv0 = O.poison_cache(rng, pages, page)
  keys, gates, ape = _pools(rng, 1)
  none = np.zeros((0, 4, 128), keys.dtype)
  got = _run(True, mode, kv0, none, none, ape, np.zeros(0, np.int64), np.zeros(0, bool))
  np.testing.assert_array_equal(got, kv0, err_msg="n = 0")
  for loc, mask in (([pages * page], [True]), ([37], [False])):
    got = _run(True, mode, kv0, keys, gates, ape, np.array(loc), np.array(mask))
    np.testing.assert_array_equal(got, kv0, err_msg=f"n = 1, loc {loc}, mask {mask}")
  args = (kv0, keys, gates, ape, np.array([37]), np.array([True]))
  got = _run(True, mode, *args)
  bad, total = O.compare_cache(got, _run(False, mode, *args), kv0, [37], f"n = 1 {mode}",
                               STATS, plain_scales=not mode[1])
  assert total == 1 and bad <= 1
  assert O.differing_entries(got, kv0).tolist() == [37]
  T = triton_oracle.optional()
  if T is not None:
    _assert_same_entries(got, _triton_cache(T, mode, *args), f"n = 1 {mode}")


# --------------------------------------------------------------------------- (6)

def test_kernel_runs_inside_a_command_buffer(tmp_path):
  """With XLA's default flags the chained FFI calls are captured in a CUDA graph."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      "kv = jnp.zeros((2, 8, 132), jnp.uint8); k = jnp.ones((2, 4, 128), jnp.bfloat16)\n"
      "ape = jnp.zeros((4, 128), jnp.float32); loc = jnp.array([0, 1], jnp.int32)\n"
      "mask = jnp.array([True, True])\n"
      "def f(kv):\n"
      f"  for i in range({CALLS}):\n"
      "    kv = glm5_jax.kpool_compress(kv, k * (i + 1), k, ape, loc + 2 * i, mask)\n"
      "  return kv\n"
      "kv = jax.jit(f)(kv)\n"
      "print(int((kv != 0).any()))\n")
  out = run_and_check_graphed(script, ["glm5_kpool_compress"], tmp_path)
  assert out.split()[-1] == "1", out


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_special_values(mode):
  """NaN and +-Inf keys and gates (test_reference_kpool.special_pools, SPEC §3): kpool_compress's
  kernel writes the numpy oracle's bytes for every pool whose pooled values are not finite,
  the others within D2."""
  rng = np.random.default_rng(47)
  keys, gates, ape = special_pools(rng)
  n = len(keys)
  kv0 = O.poison_cache(rng, 4, 16)
  loc = rng.permutation(64)[:n].astype(np.int64)
  args = (kv0, keys, gates, ape, loc, np.ones(n, bool))
  assert "glm5_kpool_compress" in _op(True, *mode).lower(*_device(*args)).compile().as_text()
  got = _run(True, mode, *args)
  written = []
  want = O.kpool_compress(*args, scale_format=mode[0], round_scale=mode[1], written=written)
  check_cache_d2(got, want, kv0, written, f"special {mode}", plain_scales=not mode[1])
  special = loc[[0, 1, 2, 3, 4, 6, 8, 9]]
  assert not set(O.differing_entries(got, want).tolist()) & set(special.tolist())
