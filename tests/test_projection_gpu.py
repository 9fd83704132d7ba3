"""indexer_projection as the CUDA kernel (glm5_indexer_projection) on the GPU.

(a) Key, head weights and gate within SPEC D2's GEMM bound of a float64 GEMM
    (|err| <= GEMM_SHARE (K - 1) u sum|x w|, + half a bf16 ulp of the output for key and gate;
    oracle.check_projection, which bf16-rounded head weights, truncated key and gate, fp16
    accumulation and a row one short fail: tests/test_bounds.py), as is the jitted reference.
(b) Deterministic: the same call twice is bit-identical, for the table by rows and for every
    tactic (warps, split) that tiles K (glm5_jax.indexer.tile_k), the GEMV's and the wgmma
    tactic's included; each is within the bound.
(c) M = 0, M past one 128-token chunk, vmap folded into rows, shapes the kernel does not take
    (lowered to the reference), and the FFI call inside a command buffer.
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import plan
from glm5_jax import reference as ref
from glm5_jax.indexer import (
  GEMV_SPLIT,
  WGMMA_SPLIT,
  WGMMA_WARPS,
  projection_tactic,
  projection_tactics,
)
from glm5_testing import oracle as O

from graphs import run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]

TARGET = "glm5_indexer_projection"
KS = [4096, 6144]
HEADS = [16, 32, 64]
ROWS = [1, 2, 7, 16, 33, 64, 128, 300]
SEEDS = [0, 1]
CALLS = 6                     # calls per jit (>= XLA's minimum command-buffer size)


def _inputs(rng, m, heads, k):
  """x bf16[M, K] ~ N(0, 1); w_cat bf16[256 + H, K] ~ N(0, 0.02^2) (the oracle's scale)."""
  return (jnp.asarray(O.random_bf16(rng, (m, k))),
          jnp.asarray(O.random_bf16(rng, (2 * 128 + heads, k), 0.02)))


@functools.cache
def _kernel_fn(heads, tactic=None):
  return jax.jit(functools.partial(glm5_jax.indexer_projection, heads=heads, tactic=tactic))


@functools.cache
def _reference_fn(heads):
  return jax.jit(functools.partial(ref.indexer_projection, heads=heads))


def _assert_same_bits(got, want, label):
  O.assert_same_bits(got, want, ("key", "head_w", "gate"), label)


def _check(x, w_cat, heads, got, label):
  return O.check_projection(np.asarray(x), np.asarray(w_cat), heads, got, label)


# --------------------------------------------------------------------------- (a)

def test_lowers_to_the_kernel():
  x, w_cat = _inputs(np.random.default_rng(0), 3, 32, 4096)
  compiled = _kernel_fn(32).lower(x, w_cat).compile().as_text()
  assert f'custom_call_target="{TARGET}"' in compiled


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("k", KS)
def test_kernel_within_the_gemm_bound(k, heads, m):
  for seed in SEEDS:
    rng = np.random.default_rng([k, heads, m, seed])
    x, w_cat = _inputs(rng, m, heads, k)
    label = f"K {k} H {heads} M {m} seed {seed}"
    got = _kernel_fn(heads)(x, w_cat)
    kernel = _check(x, w_cat, heads, got, f"kernel {label}")
    want = _reference_fn(heads)(x, w_cat)
    reference = _check(x, w_cat, heads, want, f"reference {label}")
    same = np.mean(np.concatenate([(g == w).ravel()
                                   for g, w in zip(map(O.bits, got), map(O.bits, want))]))
    print(f"\n[{label}] max err/bound: kernel {kernel:.3f}, reference {reference:.3f}; "
          f"{same:.2%} of outputs bit-equal to the reference")
    _assert_same_bits(got, _kernel_fn(heads)(x, w_cat), f"{label} rerun")


# --------------------------------------------------------------------------- (b)

@pytest.mark.parametrize("m", [1, 33, 128])
@pytest.mark.parametrize("k", KS)
def test_every_tactic_within_the_bound_and_deterministic(k, m):
  heads = 32
  x, w_cat = _inputs(np.random.default_rng([k, m]), m, heads, k)
  tactics = projection_tactics(k)
  assert tactics
  for tactic in tactics:
    label = f"K {k} M {m} tactic {tactic}"
    got = _kernel_fn(heads, tactic)(x, w_cat)
    ratio = _check(x, w_cat, heads, got, label)
    _assert_same_bits(got, _kernel_fn(heads, tactic)(x, w_cat), f"{label} rerun")
    print(f"\n[{label}] max err/bound {ratio:.3f}")


@pytest.mark.parametrize("m", [1, 2, 3, 32, 33, 128])
def test_built_in_table(m):
  """tactic=None runs the table's entry by rows (glm5_jax.indexer.projection_tactic) at
  K 4096."""
  table = projection_tactic(m, 4096)
  x, w_cat = _inputs(np.random.default_rng(m), m, 32, 4096)
  _assert_same_bits(_kernel_fn(32)(x, w_cat), _kernel_fn(32, table)(x, w_cat), f"M {m}")


# --------------------------------------------------------------------------- (c)

def test_empty_batch():
  x, w_cat = _inputs(np.random.default_rng(0), 0, 32, 4096)
  key, head_w, gate = _kernel_fn(32)(x, w_cat)
  assert key.shape == (0, 128) and head_w.shape == (0, 32) and gate.shape == (0, 128)


@pytest.mark.parametrize("tactic", [(4, 8), (plan.PROJECTION_TACTICS[0].warps, GEMV_SPLIT),
                                    (WGMMA_WARPS, WGMMA_SPLIT)])
def test_rows_do_not_depend_on_the_batch(tactic):
  """A token's sums depend on the tactic only: rows of a 300-token call (three 128-token
  chunks of the mma kernel; the GEMV's loop over tokens; five 64-token grid rows of the
  wgmma kernel, against its 16-token instantiation for one row) equal the same tokens
  computed alone, bit for bit."""
  x, w_cat = _inputs(np.random.default_rng(3), 300, 32, 4096)
  full = _kernel_fn(32, tactic)(x, w_cat)
  for rows in (slice(0, 1), slice(127, 130), slice(299, 300)):
    part = _kernel_fn(32, tactic)(x[rows], w_cat)
    _assert_same_bits([o[rows] for o in full], part, f"rows {rows}")


def test_vmap_folds_into_rows():
  tactic = (4, 8)
  rng = np.random.default_rng(5)
  xs = jnp.stack([_inputs(rng, 7, 32, 4096)[0] for _ in range(3)])
  _, w_cat = _inputs(rng, 1, 32, 4096)
  fn = jax.jit(jax.vmap(lambda x: glm5_jax.indexer_projection(x, w_cat, heads=32,
                                                             tactic=tactic)))
  text = fn.lower(xs).compile().as_text()
  assert text.count(f'custom_call_target="{TARGET}"') == 1, "vmap should fold, not loop"
  got = fn(xs)
  for i in range(3):
    _assert_same_bits([o[i] for o in got], _kernel_fn(32, tactic)(xs[i], w_cat), f"vmap {i}")


@pytest.mark.parametrize("heads,k", [(4, 4096), (32, 1536), (32, 9216), (32, 256)])
def test_unsupported_shapes_use_the_reference(heads, k):
  """H % 16 != 0, or a K the table's tactic does not tile: no FFI call; results within the
  bound."""
  x, w_cat = _inputs(np.random.default_rng(7), 5, heads, k)
  fn = _kernel_fn(heads)
  assert TARGET not in fn.lower(x, w_cat).compile().as_text()
  _check(x, w_cat, heads, fn(x, w_cat), f"unsupported H {heads} K {k}")


def test_weights_computed_just_before():
  """The kernel reads w_cat before its PDL wait: with w_cat produced by the kernel right
  before it (a concatenation in the same jit) the results must still be right. A failure
  here means the early weight loads race with their producer (see the op's docstring)."""
  rng = np.random.default_rng(11)
  x, w_cat = _inputs(rng, 16, 32, 4096)
  parts = (w_cat[:128], w_cat[128:160], w_cat[160:])

  @jax.jit
  def fn(x, wk, wp, gate):
    outs = []
    for i in range(CALLS):
      # A fresh producer per call, ordered after the previous call by a zero term.
      dep = 0.0 * outs[-1][1][0, 0] if outs else 0.0
      w = jnp.concatenate([wk, wp, gate]).astype(jnp.float32) * (1.0 + i) + dep
      outs.append(glm5_jax.indexer_projection(x, w.astype(jnp.bfloat16), heads=32))
    return outs

  for i, got in enumerate(fn(x, *parts)):
    w = (w_cat.astype(jnp.float32) * (1.0 + i)).astype(jnp.bfloat16)
    _check(x, w, 32, got, f"w_cat * {i + 1} computed in the jit")


def test_kernel_runs_inside_a_command_buffer(tmp_path):
  """With XLA's default flags the chained FFI calls are captured in a CUDA graph."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      "x = jnp.ones((4, 4096), jnp.bfloat16); w = jnp.full((288, 4096), 0.5, jnp.bfloat16)\n"
      "def f(x, w):\n"
      f"  return [glm5_jax.indexer_projection(x * (i + 1), w, heads=32)[1]\n"
      f"          for i in range({CALLS})]\n"
      "print(float(jax.jit(f)(x, w)[-1][0, 0]))\n")
  out = run_and_check_graphed(script, [TARGET], tmp_path)
  # sum over 4096 of (6 * 1) * 0.5, exact in fp32.
  assert float(out.split()[-1]) == 6 * 0.5 * 4096, out
