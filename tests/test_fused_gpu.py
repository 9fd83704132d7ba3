"""indexer_projection_fused as the CUDA kernel (glm5_indexer_projection_fused) on the GPU.

(a) Bit-identical to the unfused kernels at the same tactic: glm5_indexer_projection at
    (warps, 1) followed by glm5_indexer_query give the same q_fp8, w_out, key and gate
    bits (SPEC D2: fused and unfused projections agree where they share the K split).
(b) Within SPEC D2 of the reference: the gate within the GEMM bound of a float64 GEMM
    (oracle.check_projection, with the unfused kernel's key and head weights); given those
    projected values, q_fp8 and w_out bit-identical to glm5_jax.reference.indexer_query and
    the key within 1 bf16 ulp (oracle.compare_key).
(c) vmap folded into rows, M = 0, shapes the kernel does not take (lowered to the
    reference), and the FFI call inside a command buffer.
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from bounds import check_key

import glm5_jax
from glm5_jax import reference as ref
from glm5_jax.indexer import FUSED_WARPS
from glm5_testing import oracle as O

from graphs import run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]

TARGET = "glm5_indexer_projection_fused"
UNFUSED = ("glm5_indexer_projection", "glm5_indexer_query")
KS = [4096, 6144]
HEADS = [16, 32, 64]
ROWS = [1, 7, 16, 64, 128]
WEIGHTS = [jnp.float32, jnp.bfloat16]
EPS = 1e-6
CALLS = 6                     # calls per jit (>= XLA's minimum command-buffer size)


def _paddings(heads):
  return [heads] + ([64] if heads < 64 else [])


def _params(heads, padded, wdtype):
  return dict(scale=float(128 ** -0.5 * heads ** -0.5), eps=EPS, padded=padded,
              w_out_dtype=wdtype)


def _inputs(rng, m, heads, k):
  """x bf16[M, K] ~ N(0, 1); w_cat bf16[256 + H, K] ~ N(0, 0.02^2); q bf16[M, H, 128] with
  row magnitudes 2^-10 .. 2^6; LayerNorm weight ~ 1 + N(0, 0.1^2), bias ~ N(0, 0.1^2)."""
  q = rng.standard_normal((m, heads, 128)) * 2.0 ** rng.uniform(-10, 6, (m, heads, 1))
  return (jnp.asarray(O.random_bf16(rng, (m, k))),
          jnp.asarray(O.random_bf16(rng, (2 * 128 + heads, k), 0.02)),
          jnp.asarray(O.to_bf16(q)),
          jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32),
          jnp.asarray(0.1 * rng.standard_normal(128), jnp.float32))


@functools.cache
def _fused_fn(heads, padded, wdtype, tactic=None):
  return jax.jit(functools.partial(glm5_jax.indexer_projection_fused, heads=heads,
                                   tactic=tactic, **_params(heads, padded, wdtype)))


@functools.cache
def _unfused_fn(heads, padded, wdtype, warps):
  """glm5_indexer_projection at (warps, 1), then glm5_indexer_query: ((q_fp8, w_out, key,
  gate), (key_raw, head weights))."""
  def fn(x, w_cat, q, nw, nb):
    key_raw, head_w, gate = glm5_jax.indexer_projection(x, w_cat, heads=heads,
                                                         tactic=(warps, 1))
    q8, w_out, key = glm5_jax.indexer_query(q, key_raw, head_w, nw, nb,
                                            **_params(heads, padded, wdtype))
    return (q8, w_out, key, gate), (key_raw, head_w)
  return jax.jit(fn)


@functools.cache
def _query_reference_fn(heads, padded, wdtype):
  return jax.jit(functools.partial(ref.indexer_query, **_params(heads, padded, wdtype)))


def _assert_same_bits(got, want, label):
  O.assert_same_bits(got, want, ("q_fp8", "w_out", "key", "gate"), label)


# --------------------------------------------------------------------------- (a)

def test_lowers_to_the_kernel():
  args = _inputs(np.random.default_rng(0), 3, 32, 4096)
  assert f'custom_call_target="{TARGET}"' in (
      _fused_fn(32, 32, jnp.float32).lower(*args).compile().as_text())
  unfused = _unfused_fn(32, 32, jnp.float32, FUSED_WARPS).lower(*args).compile().as_text()
  for target in UNFUSED:
    assert f'custom_call_target="{target}"' in unfused, target


@pytest.mark.parametrize("wdtype", WEIGHTS, ids=["f32", "bf16"])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("k", KS)
def test_fused_equals_unfused_and_the_reference(k, heads, m, wdtype):
  for padded in _paddings(heads):
    rng = np.random.default_rng([k, heads, m, padded, int(wdtype == jnp.bfloat16)])
    args = _inputs(rng, m, heads, k)
    label = f"K {k} H {heads}/{padded} M {m} {np.dtype(wdtype).name}"
    got = _fused_fn(heads, padded, wdtype)(*args)
    unfused, (key_raw, head_w) = _unfused_fn(heads, padded, wdtype, FUSED_WARPS)(*args)
    _assert_same_bits(got, unfused, f"{label} fused vs unfused")                    # (a)

    q8, w_out, key, gate = got                                                       # (b)
    ratio = O.check_projection(np.asarray(args[0]), np.asarray(args[1]), heads,
                               (key_raw, head_w, gate), label)
    wq8, ww, wkey = _query_reference_fn(heads, padded, wdtype)(
        args[2], key_raw, head_w, args[3], args[4])
    np.testing.assert_array_equal(O.bits(q8), O.bits(wq8), err_msg=f"{label}: q_fp8 vs ref")
    np.testing.assert_array_equal(O.bits(w_out), O.bits(ww), err_msg=f"{label}: w_out vs ref")
    assert not O.bits(q8)[:, heads:].any() and not O.bits(w_out)[:, heads:].any(), label
    bad, total = check_key(key, wkey, label)
    print(f"\n[{label}] GEMM max err/bound {ratio:.3f}; key 1-ulp mismatches vs the "
          f"reference LayerNorm {bad}/{total}")


@pytest.mark.parametrize("warps", [1, 2, 4, 8])
@pytest.mark.parametrize("k", KS)
def test_every_tactic_equals_unfused(k, warps):
  """tactic (warps, 1), 1..48 stages of 8 K blocks per warp: fused == unfused bit for bit."""
  args = _inputs(np.random.default_rng([k, warps]), 33, 32, k)
  got = _fused_fn(32, 32, jnp.float32, (warps, 1))(*args)
  unfused, _ = _unfused_fn(32, 32, jnp.float32, warps)(*args)
  _assert_same_bits(got, unfused, f"K {k} tactic ({warps}, 1)")


def test_chunks_equal_unfused():
  """M = 300: three 128-token chunks (grid z), each with its own key cluster."""
  args = _inputs(np.random.default_rng(300), 300, 32, 4096)
  _assert_same_bits(_fused_fn(32, 64, jnp.float32)(*args),
                    _unfused_fn(32, 64, jnp.float32, FUSED_WARPS)(*args)[0], "M 300")


# --------------------------------------------------------------------------- (c)

def test_vmap_folds_into_rows():
  rng = np.random.default_rng(5)
  calls = [_inputs(rng, 7, 32, 4096) for _ in range(3)]
  x, w_cat, q, nw, nb = calls[0]
  xs, qs = jnp.stack([c[0] for c in calls]), jnp.stack([c[2] for c in calls])
  one = _fused_fn(32, 32, jnp.float32)
  fn = jax.jit(jax.vmap(one, in_axes=(0, None, 0, None, None)))
  text = fn.lower(xs, w_cat, qs, nw, nb).compile().as_text()
  assert text.count(f'custom_call_target="{TARGET}"') == 1, "vmap should fold, not loop"
  got = fn(xs, w_cat, qs, nw, nb)
  for i in range(3):
    _assert_same_bits([o[i] for o in got], one(xs[i], w_cat, qs[i], nw, nb), f"vmap {i}")


@pytest.mark.parametrize("heads,padded", [(32, 32), (16, 64)])
def test_empty_batch(heads, padded):
  args = _inputs(np.random.default_rng(0), 0, heads, 4096)
  q8, w_out, key, gate = _fused_fn(heads, padded, jnp.float32)(*args)
  assert q8.shape == (0, padded, 128) and w_out.shape == (0, padded)
  assert key.shape == (0, 128) and gate.shape == (0, 128)


@pytest.mark.parametrize("heads,k", [(24, 4096), (32, 2304), (32, 1000)])
def test_unsupported_shapes_use_the_reference(heads, k):
  """H % 16 != 0, or K not 256 * blocks (blocks 1..8 or a multiple of 8): no FFI call;
  q_fp8 bytes equal the jitted reference's and the gate is within the GEMM bound."""
  args = _inputs(np.random.default_rng(7), 5, heads, k)
  fn = _fused_fn(heads, heads, jnp.float32)
  assert TARGET not in fn.lower(*args).compile().as_text()
  got = fn(*args)
  want = jax.jit(functools.partial(ref.indexer_projection_fused, heads=heads,
                                   **_params(heads, heads, jnp.float32)))(*args)
  np.testing.assert_array_equal(O.bits(got[0]), O.bits(want[0]))
  key_raw, head_w, _ = jax.jit(functools.partial(ref.indexer_projection, heads=heads))(
      *args[:2])
  O.check_projection(np.asarray(args[0]), np.asarray(args[1]), heads,
                     (key_raw, head_w, got[3]), f"unsupported H {heads} K {k}")


def test_kernel_runs_inside_a_command_buffer(tmp_path):
  """With XLA's default flags the chained FFI calls are captured in a CUDA graph."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      "x = jnp.ones((4, 4096), jnp.bfloat16); w = jnp.full((288, 4096), 0.5, jnp.bfloat16)\n"
      "q = jnp.ones((4, 32, 128), jnp.bfloat16); nw = jnp.ones(128, jnp.float32)\n"
      "nb = jnp.zeros(128, jnp.float32)\n"
      "def f(x, w, q):\n"
      f"  return [glm5_jax.indexer_projection_fused(x * (i + 1), w, q, nw, nb, heads=32,\n"
      f"                                            scale=2.0 ** -6)[1]\n"
      f"          for i in range({CALLS})]\n"
      "print(float(jax.jit(f)(x, w, q)[-1][0, 0]))\n")
  out = run_and_check_graphed(script, [TARGET], tmp_path)
  # Head weight 4096 * 6 * 0.5 = 12288 (exact); q row of ones: Hadamard -> 128 at dim 0,
  # * 2^-3.5 -> bf16 11.3125, v = 0.02525, E = -5: w_out = 12288 * 2^-5 * 2^-6 = 6.
  assert float(out.split()[-1]) == 6.0, out
