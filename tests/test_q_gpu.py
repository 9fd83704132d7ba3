"""indexer_q as the CUDA kernel (glm5_indexer_q) on the GPU.

Every test runs both tactics ("wgmma", "mma") where it concerns the kernel's arithmetic.
(a) q within SPEC D2's GEMM bound of a float64 GEMM (oracle.check_q: |err| <= GEMM_SHARE
    (K - 1) u sum|qr w| + half a bf16 ulp of q; truncation, fp16 accumulation and a row one
    short fail it: tests/test_bounds.py), as is the jitted reference; rerun bit-identical.
(b) Every K the mma tactic tiles (256 * blocks, blocks 1..8: one kernel each) and K = 128 *
    boxes for wgmma (a run-time count through a ring of 6 slots: 1, 3, 6, 7, 12, 18 and 32
    boxes, i.e. no refill, one, and up to five trips round the ring) is within the bound and
    deterministic.
(c) M = 0, rows independent of the batch (mma: 64-row CTA chunks; wgmma: its 16-, 32- and
    64-token instantiations and 64-row grid chunks), vmap folded into rows, a K no tactic
    tiles (lowered to the reference), wq_b produced in the same jit (PDL), and the FFI call
    inside a command buffer.
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import reference as ref
from glm5_jax.indexer import (
  BLOCK_K,
  Q_MAX_BLOCKS,
  Q_TACTICS,
  Q_WARPS,
  Q_WGMMA_SPLIT,
  WGMMA_BOX_K,
  q_kernel_tiles,
)
from glm5_testing import oracle as O

from graphs import run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]

TARGET = "glm5_indexer_q"
K = 1536                      # GLM-5.3-Flash's q_lora
NS = [4096, 256]              # 32 heads (the model), 2 heads
ROWS = [1, 2, 7, 16, 33, 64, 128, 300]
CALLS = 6                     # calls per jit (>= XLA's minimum command-buffer size)


def _inputs(rng, m, n, k=K):
  """qr bf16[M, K] ~ N(0, 1); wq_b bf16[N, K] ~ N(0, 0.02^2)."""
  return (jnp.asarray(O.random_bf16(rng, (m, k))),
          jnp.asarray(O.random_bf16(rng, (n, k), 0.02)))


_kernel_fn = jax.jit(glm5_jax.indexer_q)
_tactic_fns = {t: jax.jit(functools.partial(glm5_jax.indexer_q, tactic=t)) for t in Q_TACTICS}
# The K each tactic is tested at: every mma instantiation; wgmma's box count is a run-time
# value (cc/q_gemm.cu's ring holds 6 boxes: fewer, exactly, one more, and several trips).
KS = {"mma": [BLOCK_K * Q_WARPS * b for b in range(1, Q_MAX_BLOCKS + 1)],
      "wgmma": [Q_WGMMA_SPLIT * WGMMA_BOX_K * b for b in (1, 3, 6, 7, 12, 18, 32)]}


def _check(qr, wq_b, got, label):
  return O.check_q(np.asarray(qr), np.asarray(wq_b), got, label)


def _same(got, want, label):
  O.assert_same_bits([got], [want], ["q"], label)


# --------------------------------------------------------------------------- (a)

@pytest.mark.parametrize("tactic", Q_TACTICS)
def test_lowers_to_the_kernel(tactic):
  qr, wq_b = _inputs(np.random.default_rng(0), 3, 4096)
  text = _tactic_fns[tactic].lower(qr, wq_b).compile().as_text()
  assert f'custom_call_target="{TARGET}"' in text
  assert f"tactic = {Q_TACTICS.index(tactic)} : i32" in text


@pytest.mark.parametrize("tactic", Q_TACTICS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", NS)
def test_kernel_within_the_gemm_bound(n, m, tactic):
  fn = _tactic_fns[tactic]
  for seed in (0, 1):
    qr, wq_b = _inputs(np.random.default_rng([n, m, seed]), m, n)
    label = f"{tactic} N {n} M {m} seed {seed}"
    got = fn(qr, wq_b)
    kernel = _check(qr, wq_b, got, f"kernel {label}")
    want = jax.jit(ref.indexer_q)(qr, wq_b)
    reference = _check(qr, wq_b, want, f"reference {label}")
    same = float(np.mean(O.bits(got) == O.bits(want))) if m else 1.0
    print(f"\n[{label}] max err/bound: kernel {kernel:.3f}, reference {reference:.3f}; "
          f"{same:.2%} of q bit-equal to the reference")
    _same(got, fn(qr, wq_b), f"{label} rerun")


def test_default_tactic_is_wgmma():
  """The default (tactic None) runs the wgmma tactic at the model's shape: the same bits."""
  qr, wq_b = _inputs(np.random.default_rng(2), 5, 4096)
  _same(_kernel_fn(qr, wq_b), _tactic_fns["wgmma"](qr, wq_b), "default vs wgmma")


# --------------------------------------------------------------------------- (b)

@pytest.mark.parametrize("tactic", Q_TACTICS)
@pytest.mark.parametrize("m", [1, 16, 65, 128])
def test_every_k_within_the_bound_and_deterministic(m, tactic):
  """The tactic at each K of KS: within the bound and deterministic."""
  fn = _tactic_fns[tactic]
  for k in KS[tactic]:
    assert q_kernel_tiles(256, k, tactic)
    qr, wq_b = _inputs(np.random.default_rng([7, m, k]), m, 256, k=k)
    label = f"{tactic} M {m} K {k}"
    assert f'custom_call_target="{TARGET}"' in fn.lower(qr, wq_b).compile().as_text()
    got = fn(qr, wq_b)
    print(f"\n[{label}] max err/bound {_check(qr, wq_b, got, label):.3f}")
    _same(got, fn(qr, wq_b), f"{label} rerun")


# --------------------------------------------------------------------------- (c)

def test_empty_batch():
  qr, wq_b = _inputs(np.random.default_rng(0), 0, 4096)
  assert _kernel_fn(qr, wq_b).shape == (0, 4096)


@pytest.mark.parametrize("tactic", Q_TACTICS)
def test_rows_do_not_depend_on_the_batch(tactic):
  """A row's sums do not depend on the batch: rows of a 300-row call (five 64-row CTA chunks,
  the last partial) equal the same rows computed in smaller calls (wgmma: its 16-, 32- and
  64-token instantiations), bit for bit."""
  fn = _tactic_fns[tactic]
  qr, wq_b = _inputs(np.random.default_rng(3), 300, 4096)
  full = fn(qr, wq_b)
  for rows in (slice(0, 1), slice(5, 21), slice(40, 72), slice(63, 66), slice(100, 228),
               slice(127, 130), slice(299, 300)):
    _same(full[rows], fn(qr[rows], wq_b), f"{tactic} rows {rows}")


def test_vmap_folds_into_rows():
  rng = np.random.default_rng(5)
  qrs = jnp.stack([_inputs(rng, 7, 256)[0] for _ in range(3)])
  _, wq_b = _inputs(rng, 1, 4096)
  fn = jax.jit(jax.vmap(lambda qr: glm5_jax.indexer_q(qr, wq_b)))
  text = fn.lower(qrs).compile().as_text()
  assert text.count(f'custom_call_target="{TARGET}"') == 1, "vmap should fold, not loop"
  got = fn(qrs)
  for i in range(3):
    _same(got[i], _kernel_fn(qrs[i], wq_b), f"vmap {i}")


@pytest.mark.parametrize("k", [1000, 1088])
def test_untiled_k_uses_the_reference(k):
  """K = 1000 and 1088 are not 128 * boxes (nor 256 * blocks): no FFI call, the reference's
  result. (N = heads * 128 always makes whole 32- and 64-row tiles.)"""
  qr, wq_b = _inputs(np.random.default_rng([7, k]), 5, 256, k=k)
  assert not any(q_kernel_tiles(256, k, t) for t in Q_TACTICS)
  assert TARGET not in _kernel_fn.lower(qr, wq_b).compile().as_text()
  _check(qr, wq_b, _kernel_fn(qr, wq_b), f"untiled K {k}")


@pytest.mark.parametrize("tactic", Q_TACTICS)
def test_weights_computed_just_before(tactic):
  """The kernel reads wq_b before its PDL wait: with wq_b produced in the same jit right
  before each call the results must still be right (see indexer_q's docstring)."""
  qr, wq_b = _inputs(np.random.default_rng(11), 16, 4096)

  @jax.jit
  def fn(qr, wq_b):
    outs = []
    for i in range(CALLS):
      dep = 0.0 * outs[-1][0, 0].astype(jnp.float32) if outs else 0.0
      w = (wq_b.astype(jnp.float32) * (1.0 + i) + dep).astype(jnp.bfloat16)
      outs.append(glm5_jax.indexer_q(qr, w, tactic=tactic))
    return outs

  for i, got in enumerate(fn(qr, wq_b)):
    w = (wq_b.astype(jnp.float32) * (1.0 + i)).astype(jnp.bfloat16)
    _check(qr, w, got, f"wq_b * {i + 1} computed in the jit")


def test_kernel_runs_inside_a_command_buffer(tmp_path):
  """With XLA's default flags the chained FFI calls are captured in a CUDA graph."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      f"qr = jnp.ones((4, {K}), jnp.bfloat16); w = jnp.full((4096, {K}), 0.5, jnp.bfloat16)\n"
      "def f(qr, w):\n"
      f"  return [glm5_jax.indexer_q(qr * (i + 1), w) for i in range({CALLS})]\n"
      "print(float(jax.jit(f)(qr, w)[-1][0, 0]))\n")
  out = run_and_check_graphed(script, [TARGET], tmp_path)
  # sum over K of (6 * 1) * 0.5 = 4608, exact in bf16 (4608 = 9 * 2^9).
  assert float(out.split()[-1]) == 6 * 0.5 * K, out
