"""The CUDA lowering of every op, checked on any machine with
jax.export(platforms=["cuda"]): FFI target names, operand/output aliasing of
the in-place caches, donation, and the GLM5_JAX_KERNELS switch."""
import functools
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import export

import glm5_jax
from glm5_jax import _ffi
from glm5_jax._primitive import Op
from glm5_jax.indexer import PROJECTION_KERNEL_ROWS
from glm5_jax.testing.cases import CASES

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
  """By default every kernel but those slower than XLA (KERNEL_DEFAULT_OFF), at the
  shapes of its kernel_default; all of them with GLM5_JAX_KERNELS=1."""
  if switch is None:
    monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  else:
    monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  case = CASES[op]
  args = case.make(np.random.default_rng(0))
  calls = custom_calls(cuda_module(case.fn, args))
  target = _ffi.KERNEL_TARGETS.get(op)
  if switch is None and (op in _ffi.KERNEL_DEFAULT_OFF
                         or not Op.registry[op].kernel_default(*args)):
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


def _projection_call(op, heads, k, tactic):
  """(fn, args, vmap in_axes) of `op` on 3 tokens: indexer_projection or its fused form."""
  x, w_cat = np.zeros((3, k), jnp.bfloat16), np.zeros((256 + heads, k), jnp.bfloat16)
  if op == "indexer_projection":
    return (lambda *a: glm5_jax.indexer_projection(*a, heads=heads, tactic=tactic),
            (x, w_cat), (0, None))
  fn = lambda *a: glm5_jax.indexer_projection_fused(*a, heads=heads, scale=0.1, padded=64,
                                                    tactic=tactic)
  norm = np.zeros(128, np.float32)
  return fn, (x, w_cat, np.zeros((3, heads, 128), jnp.bfloat16), norm, norm), (0, None, 0,
                                                                                None, None)


@pytest.mark.parametrize("op,heads,k,tactic,kernel", [
    ("indexer_projection", 16, 1024, None, True), ("indexer_projection", 32, 4096, None, True),
    ("indexer_projection", 64, 6144, None, True), ("indexer_projection", 32, 8192, None, True),
    ("indexer_projection", 32, 4096, (4, 4), True), ("indexer_projection", 32, 512, (1, 2), True),
    ("indexer_projection", 32, 6144, (8, 1), True), ("indexer_projection", 4, 1024, None, False),
    ("indexer_projection", 24, 4096, None, False), ("indexer_projection", 32, 512, None, False),
    ("indexer_projection", 32, 1536, None, False), ("indexer_projection", 32, 9216, None, False),
    ("indexer_projection_fused", 16, 4096, None, True),
    ("indexer_projection_fused", 64, 6144, None, True),
    ("indexer_projection_fused", 32, 512, None, True),
    ("indexer_projection_fused", 32, 4096, (2, 1), True),
    ("indexer_projection_fused", 24, 4096, None, False),
    ("indexer_projection_fused", 32, 1000, None, False),
    ("indexer_projection_fused", 32, 2304, None, False),
    ("indexer_projection_fused", 32, 9216, None, False)])
def test_projection_kernel_only_for_supported_shapes(op, heads, k, tactic, kernel, monkeypatch):
  """indexer_projection's kernel needs H % 16 == 0 and, with the built-in tactic table,
  K % 1024 == 0, K <= 8192; the fused kernel H % 16 == 0 and K = 256 * blocks (8 warps,
  blocks 1..8 or a multiple of 8); an explicit tactic only has to tile K. Other shapes lower
  to the reference (no FFI call), also under vmap."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", f"{op}=1")
  fn, args, axes = _projection_call(op, heads, k, tactic)
  want = [f"glm5_{op}"] if kernel else []
  assert custom_calls(cuda_module(fn, args)) == want
  stacked = tuple(a if ax is None else np.stack([a] * 2) for a, ax in zip(args, axes))
  assert custom_calls(cuda_module(jax.vmap(fn, in_axes=axes), stacked)) == want


@pytest.mark.parametrize("m", [0, 1, 2, 8, 16, 17, 64])
def test_projection_kernel_by_default_where_it_is_faster(m, monkeypatch):
  """Unset GLM5_JAX_KERNELS: the projection kernel at PROJECTION_KERNEL_ROWS (2..16, the M
  where it beat XLA's GEMM on the H200), XLA's GEMM at other M, counted after vmap folds
  the examples into the rows; naming the op turns it on at every M."""
  lo, hi = PROJECTION_KERNEL_ROWS
  fn = lambda x, w: glm5_jax.indexer_projection(x, w, heads=32)
  x, w_cat = np.zeros((m, 4096), jnp.bfloat16), np.zeros((288, 4096), jnp.bfloat16)
  kernel = ["glm5_indexer_projection"]
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  assert custom_calls(cuda_module(fn, (x, w_cat))) == (kernel if lo <= m <= hi else [])
  folded = jax.vmap(fn, in_axes=(0, None))
  assert custom_calls(cuda_module(folded, (np.stack([x] * 2), w_cat))) == (
      kernel if lo <= 2 * m <= hi else [])
  monkeypatch.setenv("GLM5_JAX_KERNELS", "indexer_projection=1")
  assert custom_calls(cuda_module(fn, (x, w_cat))) == kernel


@pytest.mark.parametrize("switch", ["0", "kpool_update=0", "1,kpool_update=0"])
def test_kill_switch_routes_to_reference(switch, monkeypatch):
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  case = CASES["kpool_update"]
  calls = custom_calls(cuda_module(case.fn, case.make(np.random.default_rng(0))))
  assert not [c for c in calls if c.startswith("glm5_")]


@pytest.mark.parametrize("op,switch,expected,word", [
    ("kpool_update", "", True, None), ("kpool_update", "1", True, True),
    ("kpool_update", "0", False, False), ("kpool_update", "0,kpool_update=1", True, True),
    ("kpool_update", "all=0", False, False), ("kpool_update", "expand_pools=0", True, None),
    ("kpool_update", "kpool_update=0", False, False), ("upcast_logits", "", False, None),
    ("upcast_logits", "1", True, True), ("upcast_logits", "upcast_logits=1", True, True),
    ("upcast_logits", "all=1,upcast_logits=0", False, False),
    ("upcast_logits", "kpool_update=1", False, None)])
def test_kill_switch_parsing(op, switch, expected, word, monkeypatch):
  """Unset/empty: each kernel's default (off for KERNEL_DEFAULT_OFF); later entries win.
  kernel_switch is the switch's own word on the op: None where no entry names it."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  assert _ffi.kernels_enabled(op) is expected
  assert _ffi.kernel_switch(op) is word


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


@pytest.mark.parametrize("op", ["indexer_query", "indexer_projection_fused"])
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
def test_indexer_query_attributes(op, wdtype, monkeypatch):
  """scale and eps reach glm5_indexer_query (and the fused kernel) as the f32 attributes
  its handler binds; padded and the weights dtype are only in the result types."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", f"{op}=1")
  case = CASES[op]
  params = dict(scale=0.1, eps=1e-5, padded=40, weights_dtype=wdtype)
  if op == "indexer_projection_fused":
    params["heads"] = case.fn.keywords["heads"]
  fn = lambda *a: getattr(glm5_jax, op)(*a, **params)
  text = cuda_module(fn, case.make(np.random.default_rng(0)))
  call = text[text.index(f"stablehlo.custom_call @glm5_{op}"):].split("\n")[0]
  attrs = re.search(r"mhlo.backend_config = \{([^}]*)\}", call).group(1)
  parsed = dict(a.strip().split(" = ") for a in attrs.split(","))
  parsed.pop("warps", None)            # the fused kernel's tactic: test_projection_attributes
  assert set(parsed) == {"eps", "scale"}
  for name, value in (("eps", 1e-5), ("scale", 0.1)):
    number, _, typ = parsed[name].partition(" : ")
    assert typ == "f32" and np.float32(float(number)) == np.float32(value), parsed
  bf = "bf16" if wdtype == "bfloat16" else "f32"
  assert f"tensor<3x40x{bf}>" in call and "tensor<3x40x128xf8E4M3FN>" in call, call


@pytest.mark.parametrize("op,tactic,expected", [
    ("indexer_projection", None, dict(warps=0, split=0)),
    ("indexer_projection", (2, 4), dict(warps=2, split=4)),
    ("indexer_projection", [8, 1], dict(warps=8, split=1)),
    ("indexer_projection_fused", None, dict(warps=0)),
    ("indexer_projection_fused", (4, 1), dict(warps=4))])
def test_projection_attributes(op, tactic, expected, monkeypatch):
  """The tactic reaches glm5_indexer_projection as the i32 attributes warps and split its
  handler binds (0, 0 = the kernel's table), the fused kernel as warps (0 = 8; split is 1);
  heads is only in the shapes."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", f"{op}=1")
  case = CASES[op]
  fn = functools.partial(case.fn, tactic=tactic)
  text = cuda_module(fn, case.make(np.random.default_rng(0)))
  call = text[text.index(f"stablehlo.custom_call @glm5_{op}"):].split("\n")[0]
  attrs = re.search(r"mhlo.backend_config = \{([^}]*)\}", call).group(1)
  ints = sorted(a.strip() for a in attrs.split(",") if a.strip().endswith(": i32"))
  assert ints == sorted(f"{name} = {value} : i32" for name, value in expected.items())
  assert "tensor<3x16x" in call, call
