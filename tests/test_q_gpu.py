"""indexer_q as the CUDA kernel (glm5_indexer_q) on the GPU.

(a) q within SPEC D2's GEMM bound of a float64 GEMM (oracle.check_q: |err| <= (K - 1) u
    sum|qr w| + half a bf16 ulp), as is the jitted reference; rerun bit-identical.
(b) Every K the kernel tiles (256 * blocks, blocks 1..8) is within the bound and
    deterministic.
(c) M = 0, rows independent of the batch (64-row CTA chunks), vmap folded into rows, a K the
    kernel does not tile (lowered to the reference), wq_b produced in the same jit
    (PDL), and the FFI call inside a command buffer.
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import reference as ref
from glm5_jax.indexer import Q_MAX_BLOCKS, q_kernel_tiles
from glm5_jax.testing import oracle as O

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


def _check(qr, wq_b, got, label):
  return O.check_q(np.asarray(qr), np.asarray(wq_b), got, label)


def _same(got, want, label):
  O.assert_same_bits([got], [want], ["q"], label)


# --------------------------------------------------------------------------- (a)

def test_lowers_to_the_kernel():
  qr, wq_b = _inputs(np.random.default_rng(0), 3, 4096)
  assert f'custom_call_target="{TARGET}"' in _kernel_fn.lower(qr, wq_b).compile().as_text()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", NS)
def test_kernel_within_the_gemm_bound(n, m):
  for seed in (0, 1):
    qr, wq_b = _inputs(np.random.default_rng([n, m, seed]), m, n)
    label = f"N {n} M {m} seed {seed}"
    got = _kernel_fn(qr, wq_b)
    kernel = _check(qr, wq_b, got, f"kernel {label}")
    want = jax.jit(ref.indexer_q)(qr, wq_b)
    reference = _check(qr, wq_b, want, f"reference {label}")
    same = float(np.mean(O.bits(got) == O.bits(want))) if m else 1.0
    print(f"\n[{label}] max err/bound: kernel {kernel:.3f}, reference {reference:.3f}; "
          f"{same:.2%} of q bit-equal to the reference")
    _same(got, _kernel_fn(qr, wq_b), f"{label} rerun")


# --------------------------------------------------------------------------- (b)

@pytest.mark.parametrize("m", [1, 16, 65])
def test_every_k_within_the_bound_and_deterministic(m):
  """K = 256 * blocks for every blocks the kernel instantiates (one kernel each)."""
  for blocks in range(1, Q_MAX_BLOCKS + 1):
    k = 256 * blocks
    assert q_kernel_tiles(256, k)
    qr, wq_b = _inputs(np.random.default_rng([7, m, k]), m, 256, k=k)
    label = f"M {m} K {k}"
    assert f'custom_call_target="{TARGET}"' in _kernel_fn.lower(qr, wq_b).compile().as_text()
    got = _kernel_fn(qr, wq_b)
    print(f"\n[{label}] max err/bound {_check(qr, wq_b, got, label):.3f}")
    _same(got, _kernel_fn(qr, wq_b), f"{label} rerun")


# --------------------------------------------------------------------------- (c)

def test_empty_batch():
  qr, wq_b = _inputs(np.random.default_rng(0), 0, 4096)
  assert _kernel_fn(qr, wq_b).shape == (0, 4096)


def test_rows_do_not_depend_on_the_batch():
  """A row's sums do not depend on the batch: rows of a 300-row call (five 64-row CTA
  chunks, the last partial) equal the same rows computed alone, bit for bit."""
  qr, wq_b = _inputs(np.random.default_rng(3), 300, 4096)
  full = _kernel_fn(qr, wq_b)
  for rows in (slice(0, 1), slice(63, 66), slice(127, 130), slice(299, 300)):
    _same(full[rows], _kernel_fn(qr[rows], wq_b), f"rows {rows}")


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


@pytest.mark.parametrize("k", [1000, 2304])
def test_untiled_k_uses_the_reference(k):
  """K = 1000 is not 256 * blocks; K = 2304 needs 9 blocks (the kernel holds 8): no FFI
  call, the reference's result. (N = heads * 128 always makes whole 32-row tiles.)"""
  qr, wq_b = _inputs(np.random.default_rng([7, k]), 5, 256, k=k)
  assert not q_kernel_tiles(256, k)
  assert TARGET not in _kernel_fn.lower(qr, wq_b).compile().as_text()
  _check(qr, wq_b, _kernel_fn(qr, wq_b), f"untiled K {k}")


def test_weights_computed_just_before():
  """The kernel reads wq_b before its PDL wait: with wq_b produced in the same jit right
  before each call the results must still be right (see indexer_q's docstring)."""
  qr, wq_b = _inputs(np.random.default_rng(11), 16, 4096)

  @jax.jit
  def fn(qr, wq_b):
    outs = []
    for i in range(CALLS):
      dep = 0.0 * outs[-1][0, 0].astype(jnp.float32) if outs else 0.0
      w = (wq_b.astype(jnp.float32) * (1.0 + i) + dep).astype(jnp.bfloat16)
      outs.append(glm5_jax.indexer_q(qr, w))
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
