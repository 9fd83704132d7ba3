"""Every primitive under jit and vmap, against the reference, with bad input
and under differentiation. On a GPU run these exercise the CUDA kernels."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import reference as ref
from glm5_testing.cases import CASES, TOLERANCE
from glm5_testing.tiers import CACHE_OPS

OPS = sorted(CASES)


def as_numpy(x):
  x = np.asarray(x)
  if x.dtype == jnp.float8_e4m3fn:
    return x.view(np.uint8)
  if x.dtype == jnp.bfloat16:
    return x.astype(np.float32)
  return x


def outputs(op, args, outs):
  outs = outs if isinstance(outs, tuple) else (outs,)
  valid = CASES[op].valid
  outs = valid(args, outs) if valid else outs
  return [as_numpy(o) for o in outs]


def assert_same(op, got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    if CASES[op].exact or g.dtype.kind in "iub":
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g, w, **TOLERANCE)


def test_every_op_has_a_case():
  assert set(OPS) == set(glm5_jax.OPS)


@pytest.mark.parametrize("op", OPS)
def test_jit_matches_reference(op):
  """On a GPU: the kernel (where one runs) against the reference. On the CPU the
  primitive lowers to the reference: this checks its plumbing (argument order,
  static params, result order); the reference itself is checked against the
  numpy oracle in test_reference_*."""
  case = CASES[op]
  args = case.make(np.random.default_rng(0))
  got = outputs(op, args, jax.jit(case.fn)(*args))
  want = outputs(op, args, jax.jit(_reference(op))(*args))
  assert_same(op, got, want)
  assert any(np.any(g != 0) for g in got)


def _reference(op):
  """The op's reference with the case's static arguments (w_out f32 where the op's is)."""
  static = getattr(CASES[op].fn, "keywords", {})
  if op.startswith("indexer_query") or op == "indexer_projection_fused":
    static = {**static, "w_out_dtype": jnp.float32}
  return lambda *a: getattr(ref, op)(*a, **static)


@pytest.mark.parametrize("op", OPS)
def test_reference_runs_eagerly_on_numpy(op):
  """The executable spec runs as a plain function on numpy inputs, as oracle comparisons
  and scripts call it: bit-equal to its jitted form (a loop or branch that indexes a
  numpy operand with a traced value fails here). On the CPU backend on any machine: what
  is checked is the Python, and both forms then round alike."""
  args = [np.asarray(a) for a in CASES[op].make(np.random.default_rng(2))]
  with jax.default_device(jax.devices("cpu")[0]):
    got = outputs(op, args, _reference(op)(*args))
    want = outputs(op, args, jax.jit(_reference(op))(*args))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("op", OPS)
def test_eager_matches_jit(op):
  case = CASES[op]
  args = case.make(np.random.default_rng(1))
  assert_same(op, outputs(op, args, case.fn(*args)),
              outputs(op, args, jax.jit(case.fn)(*args)))


def _vmap_cases():
  for op in OPS:
    for which in ["all"] + list(range(len(CASES[op].make(np.random.default_rng(0))))):
      # The fast tier maps over all operands at once and over the first alone (the caches'
      # ops, seconds per operand: all at once); the slow tier over each operand alone.
      slow = which != "all" and (which != 0 or op in CACHE_OPS)
      yield pytest.param(op, which, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("op,which", list(_vmap_cases()))
def test_vmap_equals_stacked(op, which):
  """vmap over one operand (or all) equals the per-example results stacked."""
  case = CASES[op]
  examples = [case.make(np.random.default_rng(10 + i)) for i in range(3)]
  base = examples[0]
  batched = range(len(base)) if which == "all" else [which]
  axes = [0 if i in batched else None for i in range(len(base))]
  stacked = [jnp.stack([e[i] for e in examples]) if i in batched else base[i]
             for i in range(len(base))]
  got = jax.jit(jax.vmap(case.fn, in_axes=axes))(*stacked)
  got = got if isinstance(got, tuple) else (got,)
  for v in range(len(examples)):
    args = [examples[v][i] if i in batched else base[i] for i in range(len(base))]
    want = outputs(op, args, jax.jit(case.fn)(*args))
    assert_same(op, outputs(op, args, tuple(o[v] for o in got)), want)


def test_vmap_batch_axis_not_leading():
  rng = np.random.default_rng(3)
  logits, ends = CASES["upcast_logits"].make(rng)
  stacked = jnp.stack([logits, logits * 2], axis=1)      # [rows, 2, width]
  got = jax.vmap(glm5_jax.upcast_logits, in_axes=(1, None), out_axes=1)(stacked, ends)
  for v in range(2):
    want = glm5_jax.upcast_logits(stacked[:, v], ends)
    (g,), (w,) = (outputs("upcast_logits", (stacked[:, v], ends), (x,))
                  for x in (got[:, v], want))
    np.testing.assert_array_equal(g, w)


def _float_operand(op):
  args = CASES[op].make(np.random.default_rng(0))
  return next((i for i, a in enumerate(args) if a.dtype in (jnp.float32, jnp.bfloat16)), None)


@pytest.mark.parametrize("op", [op for op in OPS if _float_operand(op) is not None])
def test_not_differentiable(op):
  """Integer-only ops (expand, remap) have nothing to differentiate."""
  case = CASES[op]
  args = case.make(np.random.default_rng(0))
  i = _float_operand(op)

  def loss(x):
    full = list(args)
    full[i] = x
    outs = case.fn(*full)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)

  with pytest.raises(TypeError, match=f"glm5_jax.{op} is not differentiable"):
    jax.grad(loss)(args[i])
