"""jax.export of the composed stage and of every op: glm5_jax.export_checks() is all a
caller needs for the glm5_ custom calls, and the stage's dataclasses serialize, so an
exported stage round-trips through bytes and the deserialized call equals the original."""
import os

import numpy as np
import jax
import pytest
from jax import export

import glm5_jax
from glm5_jax import Routing, synthetic
from glm5_testing import tiers
from glm5_testing.cases import CASES

CONFIG = glm5_jax.IndexerConfig(max_pools=1024, routing=Routing(kernels=True))
STAGE = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))


def _state(contexts=(10, 1500, 3001, 77), seed=0):
  rng = np.random.default_rng(seed)
  weights = synthetic.layer(rng, CONFIG, hidden=512, q_lora=256)
  cache, pt, bt = synthetic.decode_cache(rng, len(contexts), max(contexts) + 1, page=16)
  batch = synthetic.decode_batch(np.asarray(contexts)[:, None], cache, pt, bt)
  x, qr = synthetic.inputs(rng, len(contexts), hidden=512, q_lora=256)
  return weights, cache, x, qr, batch


def _round_trip(exported):
  """Exported -> bytes -> Exported (jax's serialization needs the flatbuffers package)."""
  try:
    import flatbuffers  # noqa: F401
  except ImportError:
    if os.environ.get("GLM5_JAX_REQUIRE_GPU") == "1":
      pytest.fail("GLM5_JAX_REQUIRE_GPU=1: jax.export serialization needs flatbuffers")
    pytest.skip("jax.export serialization needs the flatbuffers package")
  restored = export.deserialize(exported.serialize())
  assert restored.in_tree == exported.in_tree and restored.out_tree == exported.out_tree
  return restored


def _on_cpu(fn):
  """Run `fn` with the CPU as the default device (and its array arguments moved there):
  what a deserialized export is compared on, GPU machine or not. On a GPU the CUDA
  lowering's outputs include bytes the ops leave unspecified (select_pools' logits of rows
  that fit, upcast_logits past each row end)."""
  cpu = jax.devices("cpu")[0]
  def run(*args):
    with jax.default_device(cpu):
      return fn(*jax.device_put(args, cpu))
  return run


def _same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_export_checks_name_every_kernel():
  checks = glm5_jax.export_checks()
  assert checks == [export.DisabledSafetyCheck.custom_call(t)
                    for t in glm5_jax.KERNEL_TARGETS.values()]


@pytest.mark.slow
@pytest.mark.parametrize("platforms", [["cpu"], ["cpu", "cuda"]])
def test_stage_round_trip(platforms):
  """Exported (for the CPU, or the CPU and CUDA with every kernel routed on), serialized,
  deserialized: the call on the CPU gives the original's bits and trees."""
  args = _state()
  exported = export.export(STAGE, platforms=platforms,
                           disabled_checks=glm5_jax.export_checks())(*args, config=CONFIG)
  if "cuda" in platforms:
    # Every kernel on, at a hidden size no projection tactic tiles: XLA's GEMM, then
    # update_epilogue's one call for the query epilogue and the kpool update.
    text = exported.mlir_module()
    assert "stablehlo.custom_call @glm5_update_epilogue" in text
    assert "stablehlo.custom_call @glm5_kpool_update" not in text
  want = _on_cpu(lambda *a: STAGE(*a, config=CONFIG))(*args)
  _same(_on_cpu(exported.call)(*args), want)
  _same(_on_cpu(_round_trip(exported).call)(*args), want)
  if "cuda" in platforms and jax.default_backend() == "gpu":
    # The stage's outputs are all specified: the CUDA lowering round-trips on the GPU too.
    _same(_round_trip(exported).call(*args), STAGE(*args, config=CONFIG))


def test_cuda_export_needs_the_checks():
  """Without export_checks() jax refuses the glm5_ custom calls (not on its list of
  stable targets); with them the CUDA lowering exports."""
  args = _state()
  with pytest.raises(ValueError, match="glm5_"):
    export.export(STAGE, platforms=["cuda"])(*args, config=CONFIG)
  export.export(STAGE, platforms=["cuda"], disabled_checks=glm5_jax.export_checks())(
      *args, config=CONFIG)


@pytest.mark.parametrize("op", [pytest.param(op, marks=[pytest.mark.slow] * (op in tiers.CACHE_OPS))
                                for op in sorted(CASES)])
def test_every_op_exports(op):
  """Every op exports for the CPU and CUDA with its kernel on, round-trips, and the
  deserialized call equals the op on the CPU."""
  case = CASES[op]
  args = case.make(np.random.default_rng(0))
  fn = jax.jit(lambda *a: case.fn(*a, routing=Routing(kernels=True)))
  exported = export.export(fn, platforms=["cpu", "cuda"],
                           disabled_checks=glm5_jax.export_checks())(*args)
  want = _on_cpu(fn)(*args)
  _same(_on_cpu(exported.call)(*args), want)
  _same(_on_cpu(_round_trip(exported).call)(*args), want)
