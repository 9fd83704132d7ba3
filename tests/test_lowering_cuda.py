"""The CUDA lowering of every op, checked on any machine with
jax.export(platforms=["cuda"]): FFI target names, operand/output aliasing of
the in-place caches, donation, and the GLM5_JAX_KERNELS switch."""
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import export

import glm5_jax
from glm5_jax import _ffi
from cases import CASES

OPS = sorted(CASES)
# In-place ops: operand -> result aliasing their FFI calls must declare.
ALIASES = {"kpool_update": {0: 0, 1: 1}, "kpool_compress": {0: 0}, "kpool_seed_tail": {0: 0}}


def cuda_module(fn, args, donate=()):
  checks = [export.DisabledSafetyCheck.custom_call(f"glm5_{op}") for op in OPS]
  fresh = lambda *a: fn(*a)            # a new function: jit caches lowerings per function
  exported = export.export(jax.jit(fresh, donate_argnums=donate), platforms=["cuda"],
                           disabled_checks=checks)(*args)
  return exported.mlir_module()


def custom_calls(text):
  return re.findall(r"stablehlo.custom_call @(\w+)", text)


@pytest.mark.parametrize("switch", [None, "1"])
@pytest.mark.parametrize("op", OPS)
def test_cuda_lowering_uses_kernel_where_one_exists(op, switch, monkeypatch):
  """By default every kernel but those slower than XLA (KERNEL_DEFAULT_OFF); all
  of them with GLM5_JAX_KERNELS=1."""
  if switch is None:
    monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  else:
    monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  case = CASES[op]
  calls = custom_calls(cuda_module(case.fn, case.make(np.random.default_rng(0))))
  target = _ffi.KERNEL_TARGETS.get(op)
  if switch is None and op in _ffi.KERNEL_DEFAULT_OFF:
    target = None
  assert [c for c in calls if c.startswith("glm5_")] == ([target] if target else [])


@pytest.mark.parametrize("groups,kernel", [(32, True), (64, True), (1024, True), (40, False),
                                           (8, False), (1056, False), (0, False)])
def test_remap_kernel_only_for_supported_shapes(groups, kernel, monkeypatch):
  """expand_and_remap's kernel needs G % 32 == 0 and 32 <= G <= 1024; other shapes
  lower to the reference (no FFI call), also under vmap."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  rng = np.random.default_rng(0)
  ids = rng.integers(-1, 50, (3, groups)).astype(np.int32)
  args = (ids, np.array([4, 9, -1], np.int32), np.array([0, 1, 1, 0], np.int32),
          rng.integers(0, 50, (2, 8)).astype(np.int32))
  fn = lambda *a: glm5_jax.expand_and_remap(*a, block_size=16, width=4 * groups + 4)
  want = ["glm5_expand_and_remap"] if kernel else []
  assert custom_calls(cuda_module(fn, args)) == want
  batched = jax.vmap(fn, in_axes=(0, 0, 0, None))
  stacked = tuple(np.stack([a, a]) for a in args[:3]) + args[3:]
  assert custom_calls(cuda_module(batched, stacked)) == want


@pytest.mark.parametrize("heads,k,tactic,kernel", [
    (16, 1024, None, True), (32, 4096, None, True), (64, 6144, None, True),
    (32, 8192, None, True), (32, 4096, (4, 4), True), (32, 512, (1, 2), True),
    (32, 6144, (8, 1), True),
    (4, 1024, None, False), (24, 4096, None, False), (32, 512, None, False),
    (32, 1536, None, False), (32, 9216, None, False)])
def test_projection_kernel_only_for_supported_shapes(heads, k, tactic, kernel, monkeypatch):
  """indexer_projection's kernel needs H % 16 == 0 and, with the built-in tactic table,
  K % 1024 == 0, K <= 8192 (an explicit tactic only has to tile K); other shapes lower to
  the reference (no FFI call), also under vmap."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", "indexer_projection=1")
  args = (np.zeros((3, k), jnp.bfloat16), np.zeros((256 + heads, k), jnp.bfloat16))
  fn = lambda *a: glm5_jax.indexer_projection(*a, heads=heads, tactic=tactic)
  want = ["glm5_indexer_projection"] if kernel else []
  assert custom_calls(cuda_module(fn, args)) == want
  batched = jax.vmap(fn, in_axes=(0, None))
  assert custom_calls(cuda_module(batched, (np.stack([args[0]] * 2), args[1]))) == want


@pytest.mark.parametrize("switch", ["0", "kpool_update=0", "1,kpool_update=0"])
def test_kill_switch_routes_to_reference(switch, monkeypatch):
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  case = CASES["kpool_update"]
  calls = custom_calls(cuda_module(case.fn, case.make(np.random.default_rng(0))))
  assert not [c for c in calls if c.startswith("glm5_")]


@pytest.mark.parametrize("op,switch,expected", [
    ("kpool_update", "", True), ("kpool_update", "1", True), ("kpool_update", "0", False),
    ("kpool_update", "0,kpool_update=1", True), ("kpool_update", "all=0", False),
    ("kpool_update", "expand_pools=0", True), ("kpool_update", "kpool_update=0", False),
    ("upcast_logits", "", False), ("upcast_logits", "1", True),
    ("upcast_logits", "upcast_logits=1", True), ("upcast_logits", "all=1,upcast_logits=0", False)])
def test_kill_switch_parsing(op, switch, expected, monkeypatch):
  """Unset/empty: each kernel's default (off for KERNEL_DEFAULT_OFF); later entries win."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  assert _ffi.kernels_enabled(op) is expected


@pytest.mark.parametrize("op", OPS)
def test_ffi_lowering_contract(op, monkeypatch):
  """With a kernel declared for every op, each lowers to one glm5_<op> FFI call
  aliasing its caches, and a donated cache is reused (tf.aliasing_output)."""
  monkeypatch.setattr(_ffi, "KERNEL_TARGETS", {o: f"glm5_{o}" for o in OPS})
  monkeypatch.setenv("GLM5_JAX_KERNELS", "1")
  case = CASES[op]
  aliases = ALIASES.get(op, {})
  text = cuda_module(case.fn, case.make(np.random.default_rng(0)), donate=tuple(aliases))
  assert [c for c in custom_calls(text) if c.startswith("glm5_")] == [f"glm5_{op}"]
  call = text[text.index(f"stablehlo.custom_call @glm5_{op}"):].split("\n")[0]
  found = {int(o): int(r or 0) for r, o in re.findall(     # [] = the only result
      r"output_tuple_indices = \[(\d*)\], operand_index = (\d+)", call)}
  assert found == aliases
  for operand, result in aliases.items():
    assert re.search(rf"%arg{operand}: [^)]*?tf.aliasing_output = {result} ", text), text[:800]


@pytest.mark.parametrize("scale_format,round_scale,ue8m0", [
    ("fp32", True, "false"), ("ue8m0", True, "true"), ("fp32", False, "false")])
def test_kpool_update_scale_attributes(scale_format, round_scale, ue8m0, monkeypatch):
  """The scale options reach glm5_kpool_update as the bool attributes its handler binds."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  case = CASES["kpool_update"]
  fn = lambda *a: glm5_jax.kpool_update(*a, scale_format=scale_format, round_scale=round_scale)
  text = cuda_module(fn, case.make(np.random.default_rng(0)), donate=(0, 1))
  call = text[text.index("stablehlo.custom_call @glm5_kpool_update"):].split("\n")[0]
  attrs = re.search(r"mhlo.backend_config = \{([^}]*)\}", call).group(1)
  assert sorted(a.strip() for a in attrs.split(",")) == [
      f"round_scale = {str(round_scale).lower()}", f"ue8m0 = {ue8m0}"]


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
def test_indexer_query_attributes(wdtype, monkeypatch):
  """scale and eps reach glm5_indexer_query as the f32 attributes its handler binds;
  padded and the weights dtype are only in the result types."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", "indexer_query=1")
  case = CASES["indexer_query"]
  fn = lambda *a: glm5_jax.indexer_query(*a, scale=0.1, eps=1e-5, padded=40,
                                         weights_dtype=wdtype)
  text = cuda_module(fn, case.make(np.random.default_rng(0)))
  call = text[text.index("stablehlo.custom_call @glm5_indexer_query"):].split("\n")[0]
  attrs = re.search(r"mhlo.backend_config = \{([^}]*)\}", call).group(1)
  parsed = dict(a.strip().split(" = ") for a in attrs.split(","))
  assert set(parsed) == {"eps", "scale"}
  for name, value in (("eps", 1e-5), ("scale", 0.1)):
    number, _, typ = parsed[name].partition(" : ")
    assert typ == "f32" and np.float32(float(number)) == np.float32(value), parsed
  bf = "bf16" if wdtype == "bfloat16" else "f32"
  assert f"tensor<3x40x{bf}>" in call and "tensor<3x40x128xf8E4M3FN>" in call, call


@pytest.mark.parametrize("tactic,warps,split", [(None, 0, 0), ((2, 4), 2, 4), ([8, 1], 8, 1)])
def test_indexer_projection_attributes(tactic, warps, split, monkeypatch):
  """The tactic reaches glm5_indexer_projection as the i32 attributes warps and split its
  handler binds (0, 0 = the kernel's table); heads is only in the result types."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", "indexer_projection=1")
  case = CASES["indexer_projection"]
  fn = lambda *a: glm5_jax.indexer_projection(*a, heads=16, tactic=tactic)
  text = cuda_module(fn, case.make(np.random.default_rng(0)))
  call = text[text.index("stablehlo.custom_call @glm5_indexer_projection"):].split("\n")[0]
  attrs = re.search(r"mhlo.backend_config = \{([^}]*)\}", call).group(1)
  assert sorted(a.strip() for a in attrs.split(",")) == [
      f"split = {split} : i32", f"warps = {warps} : i32"]
  assert "tensor<3x16xf32>" in call, call
