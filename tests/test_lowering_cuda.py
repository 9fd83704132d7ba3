"""The CUDA lowering of every op, checked on any machine with
jax.export(platforms=["cuda"]): FFI target names, operand/output aliasing of
the in-place caches, donation, every FFI attribute against its op's declared
type, and the routing (Routing, GLM5_JAX_KERNELS, GLM5_JAX_PDL)."""
import functools
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import export

import glm5_jax
from glm5_jax import Routing, plan
from glm5_jax._primitive import Op
from glm5_jax.indexer import (
  Q_TACTICS,
  fused_warps,
  projection_tactic,
  q_tactic,
)
from glm5_jax.logits import TOPK_MAX_POOLS
from glm5_testing.cases import CASES, stage_state

from graphs import cuda_module, glm5_calls

OPS = sorted(CASES)
# In-place ops: operand -> result aliasing their FFI calls must declare.
ALIASES = {"kpool_update": {0: 0, 1: 1}, "kpool_compress": {0: 0}, "kpool_seed_tail": {0: 0},
           "indexer_update": {5: 6, 6: 7}, "update_epilogue": {4: 3, 5: 4},
           "update_epilogue_q": {5: 4, 6: 5}, "indexer_update_q": {6: 7, 7: 8},
           "indexer_update_select": {6: 7, 7: 8}}
# Ops whose function composes other ops where its own kernel is off: those ops, whose kernels
# run by default at the cases' shapes (indexer_update runs XLA's GEMM and update_epilogue
# outside its glm5_jax.plan.KERNEL_ROWS; indexer_update_q indexer_q and indexer_update).
COMPOSED = {"indexer_update": ("update_epilogue",),
            "indexer_update_q": ("indexer_q", "indexer_update")}


def custom_calls(text):
  return re.findall(r"stablehlo.custom_call @(\w+)", text)


def call_attributes(text, target):
  """{name: (value, mlir type or None for a bool)} of the FFI call of `target`."""
  call = text[text.index(f"stablehlo.custom_call @{target}"):].split("\n")[0]
  config = re.search(r"mhlo.backend_config = \{([^}]*)\}", call).group(1)
  out = {}
  for item in filter(None, (a.strip() for a in config.split(","))):
    name, value = item.split(" = ")
    number, _, typ = value.partition(" : ")
    out[name] = (number, typ or None)
  return out


@pytest.mark.parametrize("switch", [None, "1"])
@pytest.mark.parametrize("op", OPS)
def test_cuda_lowering_uses_kernel_where_one_exists(op, switch, monkeypatch):
  """By default every kernel but those slower than XLA (Op.kernel_off), at the
  shapes of its kernel_default (where an op composes another one instead, that op's
  kernel); all of them with GLM5_JAX_KERNELS=1."""
  if switch is None:
    monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  else:
    monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  case = CASES[op]
  args = case.make(np.random.default_rng(0))
  calls = custom_calls(cuda_module(case.fn, args))
  spec = Op.registry[op]
  targets = [spec.kernel] if spec.kernel else []
  params = getattr(case.fn, "keywords", {})
  if switch is None and (spec.kernel_off or not spec.kernel_default(*args, **params)):
    targets = [Op.registry[part].kernel for part in COMPOSED.get(op, ())]
  assert [c for c in calls if c.startswith("glm5_")] == targets


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


def _projection_call(op, heads, k, tactic, rows=3):
  """(fn, args, vmap in_axes) of `op` on `rows` rows: indexer_projection or its fused form."""
  x, w_cat = np.zeros((rows, k), jnp.bfloat16), np.zeros((256 + heads, k), jnp.bfloat16)
  if op == "indexer_projection":
    return (lambda *a: glm5_jax.indexer_projection(*a, heads=heads, tactic=tactic),
            (x, w_cat), (0, None))
  fn = lambda *a: glm5_jax.indexer_projection_fused(*a, heads=heads, scale=0.1, padded=64,
                                                    tactic=tactic)
  norm = np.zeros(128, np.float32)
  return fn, (x, w_cat, np.zeros((rows, heads, 128), jnp.bfloat16), norm, norm), (
      0, None, 0, None, None)


@pytest.mark.parametrize("op,heads,k,tactic,kernel", [
    ("indexer_projection", 16, 1024, None, True), ("indexer_projection", 32, 4096, None, True),
    ("indexer_projection", 32, 16384, None, True), ("indexer_projection", 32, 10240, None, False),
    ("indexer_projection", 64, 6144, None, True), ("indexer_projection", 32, 8192, None, True),
    ("indexer_projection", 32, 4096, (4, 4), True), ("indexer_projection", 32, 512, (1, 2), True),
    ("indexer_projection", 32, 6144, (8, 1), True), ("indexer_projection", 4, 1024, None, False),
    ("indexer_projection", 32, 512, (2, 0), True),
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
  """indexer_projection's kernel needs H % 16 == 0 and a K its tactic tiles (at 3 rows the
  table's (8, 4): K = 1024 * blocks, blocks 1..8 or a multiple of 8); the fused kernel
  H % 16 == 0 and K = 256 * blocks (8 warps); an explicit tactic only has to tile K. Other
  shapes lower to the reference (no FFI call), also under vmap."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", f"{op}=1")
  fn, args, axes = _projection_call(op, heads, k, tactic)
  want = [f"glm5_{op}"] if kernel else []
  assert custom_calls(cuda_module(fn, args)) == want
  stacked = tuple(a if ax is None else np.stack([a] * 2) for a, ax in zip(args, axes))
  assert custom_calls(cuda_module(jax.vmap(fn, in_axes=axes), stacked)) == want


@pytest.mark.parametrize("m", [0, 1, 2, 8, 16, 17, 32, 33, 64, 65, 128])
def test_projection_kernel_by_default_where_it_is_faster(m, monkeypatch):
  """Unset GLM5_JAX_KERNELS: the projection kernel at its plan.KERNEL_ROWS (2..64), XLA's
  GEMM at other M, counted after vmap folds the examples into the rows; naming the op turns
  it on at every M."""
  lo, hi = plan.KERNEL_ROWS["indexer_projection"].rows
  assert (lo, hi) == (2, 64)
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


@pytest.mark.parametrize("op", ["kpool_update", "kpool_compress"])
@pytest.mark.parametrize("switch", ["0", "{op}=0", "1,{op}=0"])
def test_kill_switch_routes_to_reference(op, switch, monkeypatch):
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch.format(op=op))
  case = CASES[op]
  calls = custom_calls(cuda_module(case.fn, case.make(np.random.default_rng(0))))
  assert not [c for c in calls if c.startswith("glm5_")]


@pytest.mark.parametrize("op,switch,expected,word", [
    ("kpool_update", "", True, None), ("kpool_update", "1", True, True),
    ("kpool_update", "0", False, False), ("kpool_update", "0,kpool_update=1", True, True),
    ("kpool_update", "all=0", False, False), ("kpool_update", "expand_pools=0", True, None),
    ("kpool_update", "kpool_update=0", False, False), ("upcast_logits", "", False, None),
    ("upcast_logits", "1", True, True), ("upcast_logits", "upcast_logits=1", True, True),
    ("upcast_logits", "all=1,upcast_logits=0", False, False),
    ("upcast_logits", "kpool_update=1", False, None),
    ("kpool_update", "kpool_update=1,0", False, False),
    ("kpool_update", " 0 , kpool_update = 1 ", True, True)])
def test_kill_switch_parsing(op, switch, expected, word, monkeypatch):
  """Unset/empty: each kernel's default (off for Op.kernel_off); later entries win.
  Routing.word is the switch's own word on the op: None where no entry names it."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  routing = Routing.from_env()
  assert Op.registry[op].kernel_on(routing) is expected
  assert routing.word(op) is word


BAD_SWITCHES = ["off", "false", "garbage", "indexer_projection=2", "unknown_op=1", "=1",
                "1,kpool_update=yes", "true"]


@pytest.mark.parametrize("switch", BAD_SWITCHES)
def test_kill_switch_fails_closed(switch, monkeypatch):
  """An entry that is not 0, 1, all=0|1 or <op>=0|1 raises (naming the variable, the entry
  and the valid forms) instead of leaving every kernel on; also when an op is traced,
  with or without the CUDA module (this runs on the CPU)."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", switch)
  bad = [e for e in switch.replace(" ", "").split(",") if e not in ("0", "1")][0]
  message = rf"GLM5_JAX_KERNELS=.*bad entry '{re.escape(bad)}'.*valid forms: 0, 1, all=0"
  with pytest.raises(ValueError, match=message):
    Routing.from_env()
  case = CASES["kpool_update"]
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda *a: case.fn(*a))(*case.make(np.random.default_rng(0)))
  with pytest.raises(ValueError, match=message):
    glm5_jax.IndexerConfig()


@pytest.mark.parametrize("pdl", ["no", "false", "2"])
def test_pdl_switch_fails_closed(pdl, monkeypatch):
  monkeypatch.setenv("GLM5_JAX_PDL", pdl)
  with pytest.raises(ValueError, match=rf"GLM5_JAX_PDL='{pdl}': valid forms: 1 .* or 0"):
    Routing.from_env()


@pytest.mark.parametrize("value,pdl", [(None, True), ("", True), ("1", True), ("0", False)])
def test_pdl_switch(value, pdl, monkeypatch):
  if value is None:
    monkeypatch.delenv("GLM5_JAX_PDL", raising=False)
  else:
    monkeypatch.setenv("GLM5_JAX_PDL", value)
  assert Routing.from_env().pdl is pdl


def test_routing_value():
  """Routing is hashable and normalised (a mapping and its sorted pairs are the same
  value); unknown ops and non-bool words are refused; Routing() is the built-in default,
  independent of the environment."""
  a = Routing(ops={"kpool_update": False, "expand_pools": True})
  b = Routing(ops=(("expand_pools", True), ("kpool_update", False)))
  assert a == b and hash(a) == hash(b) and a != Routing()
  assert a.word("kpool_update") is False and a.word("upcast_logits") is None
  assert Routing(kernels=False, ops={"kpool_update": True}).word("kpool_update") is True
  with pytest.raises(ValueError, match="Routing: unknown op 'kpool'"):
    Routing(ops={"kpool": True})
  with pytest.raises(TypeError, match=r"Routing: ops\['kpool_update'\] must be a bool"):
    Routing(ops={"kpool_update": 1})
  with pytest.raises(TypeError, match="kernels must be True, False or None"):
    Routing(kernels="0")
  with pytest.raises(TypeError, match="routing must be a glm5_jax.Routing"):
    glm5_jax.pool_topk(np.zeros((1, 4), np.float32), np.ones(1, np.int32), k=2, routing="0")


@pytest.mark.parametrize("op", [op for op in OPS if Op.registry[op].kernel])
def test_routing_keyword_overrides_the_environment(op, monkeypatch):
  """routing= on a public op is what its lowering uses, whatever GLM5_JAX_KERNELS says."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", "1")
  case = CASES[op]
  args = case.make(np.random.default_rng(0))
  off = functools.partial(case.fn, routing=Routing(kernels=False))
  assert not custom_calls(cuda_module(off, args))
  monkeypatch.setenv("GLM5_JAX_KERNELS", "0")
  on = functools.partial(case.fn, routing=Routing(ops={op: True}))
  assert custom_calls(cuda_module(on, args)) == [Op.registry[op].kernel]


def test_routing_is_part_of_the_jit_cache_key(monkeypatch):
  """A jitted function called with another routing (a static argument) lowers again:
  the kernel it calls follows the routing, never a stale executable."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  case = CASES["kpool_update"]
  args = case.make(np.random.default_rng(0))
  fn = jax.jit(lambda *a, routing: case.fn(*a, routing=routing), static_argnames="routing")
  checks = glm5_jax.export_checks()
  lower = lambda routing: export.export(fn, platforms=["cuda"], disabled_checks=checks)(
      *args, routing=routing).mlir_module()
  assert custom_calls(lower(Routing())) == ["glm5_kpool_update"]
  assert custom_calls(lower(Routing(kernels=False))) == []
  assert custom_calls(lower(Routing())) == ["glm5_kpool_update"]


@pytest.mark.parametrize("op", OPS)
def test_ffi_lowering_contract(op, monkeypatch):
  """With a kernel declared for every op, each lowers to one glm5_<op> FFI call
  aliasing its caches, and a donated cache is reused (tf.aliasing_output)."""
  for o in OPS:
    monkeypatch.setattr(Op.registry[o], "kernel", f"glm5_{o}")
  monkeypatch.setenv("GLM5_JAX_KERNELS", "1")
  case = CASES[op]
  aliases = ALIASES.get(op, {})
  text = cuda_module(case.fn, case.make(np.random.default_rng(0)), donate=tuple(aliases))
  assert glm5_calls(text) == [f"glm5_{op}"]
  call = text[text.index(f"stablehlo.custom_call @glm5_{op}"):].split("\n")[0]
  found = {int(o): int(r or 0) for r, o in re.findall(     # [] = the only result
      r"output_tuple_indices = \[(\d*)\], operand_index = (\d+)", call)}
  assert found == aliases
  for operand, result in aliases.items():
    assert re.search(rf"%arg{operand}: [^)]*?tf.aliasing_output = {result} ", text), text[:800]


# How each declared numpy type reads in the lowered call's backend_config.
MLIR_TYPES = {np.bool_: None, np.int32: "i32", np.int64: "i64", np.float32: "f32"}


def _case_params(op):
  fn = CASES[op].fn
  return dict(fn.keywords) if isinstance(fn, functools.partial) else {}


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("op", [op for op in OPS if Op.registry[op].kernel])
def test_attribute_schema(op, pdl):
  """Every FFI call carries exactly its op's declared attributes (pdl included), each
  with the MLIR type of its declared numpy type (bools as true/false) and the value the
  routing or the static params give it."""
  spec = Op.registry[op]
  case = CASES[op]
  routing = Routing(kernels=True, pdl=pdl)
  text = cuda_module(functools.partial(case.fn, routing=routing),
                     case.make(np.random.default_rng(0)), donate=tuple(ALIASES.get(op, {})))
  attrs = call_attributes(text, spec.kernel)
  assert set(attrs) == set(spec.attributes)
  for name, typ in spec.attributes.items():
    value, mlir_type = attrs[name]
    assert mlir_type == MLIR_TYPES[typ], (name, attrs[name])
    if typ is np.bool_:
      assert value in ("true", "false"), (name, value)
  assert attrs["pdl"] == (str(pdl).lower(), None)
  params = _case_params(op)
  for name in set(spec.attributes) & set(params):
    value, _ = attrs[name]
    want = spec.attributes[name](params[name])
    got = (value == "true") if spec.attributes[name] is np.bool_ else type(want)(float(value))
    assert got == want, (name, value, params[name])


@pytest.mark.parametrize("op", ["kpool_update", "kpool_compress"])
@pytest.mark.parametrize("scale_format,round_scale,ue8m0", [
    ("fp32", True, "false"), ("ue8m0", True, "true"), ("fp32", False, "false")])
def test_kpool_scale_attributes(op, scale_format, round_scale, ue8m0, monkeypatch):
  """The scale options reach glm5_kpool_update and glm5_kpool_compress (both on by
  default) as the bool attributes their handlers bind."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  case = CASES[op]
  fn = lambda *a: getattr(glm5_jax, op)(*a, scale_format=scale_format, round_scale=round_scale)
  text = cuda_module(fn, case.make(np.random.default_rng(0)), donate=tuple(ALIASES[op]))
  assert call_attributes(text, f"glm5_{op}") == {
      "round_scale": (str(round_scale).lower(), None), "ue8m0": (ue8m0, None),
      "pdl": ("true", None)}


# max_block (SPEC §12): the largest entry e with e * stride_rows + block_size - 1 <= 2^31 - 1
# at block_size 16, by hand: (2^31 - 16) // 16 and // 48.
MAX_BLOCK = {16: 134217727, 48: 44739242}


@pytest.mark.parametrize("compact,stride_rows,want", [(True, None, 16), (False, 48, 48)])
def test_remap_attributes(compact, stride_rows, want):
  """expand_and_remap's params reach its kernel as i64 (stride_rows None = block_size)
  and a bool; max_block, the largest entry that names a block, computed once in Python."""
  case = CASES["expand_and_remap"]
  fn = functools.partial(case.fn, compact=compact, stride_rows=stride_rows, seq_offset=3,
                         routing=Routing(kernels=True))
  attrs = call_attributes(cuda_module(fn, case.make(np.random.default_rng(0))),
                          "glm5_expand_and_remap")
  assert attrs == {"block_size": ("16", "i64"), "stride_rows": (str(want), "i64"),
                   "max_block": (str(MAX_BLOCK[want]), "i64"),
                   "seq_offset": ("3", "i64"), "compact": (str(compact).lower(), None),
                   "pdl": ("true", None)}


@pytest.mark.parametrize("scale_format,stride_rows,want", [("fp32", None, 16),
                                                            ("ue8m0", 48, 48)])
def test_slots_attributes(scale_format, stride_rows, want):
  """select_slots' params reach its one kernel as i64 (stride_rows None = block_size), the
  scale format as the bool ue8m0, the next_n hint as i64 (1: rows scored one by one) and
  max_block as expand_and_remap's; width and max_pools only in the result types. No
  expand_and_remap call: the top-k writes the slots."""
  case = CASES["select_slots"]
  fn = functools.partial(case.fn, stride_rows=stride_rows, scale_format=scale_format,
                         routing=Routing(kernels=True))
  text = cuda_module(fn, case.make(np.random.default_rng(0)))
  assert glm5_calls(text) == ["glm5_select_slots"]
  assert call_attributes(text, "glm5_select_slots") == {
      "k": ("5", "i64"), "block_size": ("16", "i64"), "stride_rows": (str(want), "i64"),
      "max_block": (str(MAX_BLOCK[want]), "i64"),
      "ue8m0": (str(scale_format == "ue8m0").lower(), None), "pdl": ("true", None),
      "next_n": ("1", "i64")}
  call = text[text.index("stablehlo.custom_call @glm5_select_slots"):].split("\n")[0]
  assert "tensor<4x24xi32>, tensor<4xi32>, tensor<4x48xf32>" in call, call


@pytest.mark.parametrize("rows,width,calls", [
    (16, 50688, 1), (17, 65537, 2),          # the cluster up to 16 rows, 8 CTAs' width
    (64, 50688, 1), (65, 50688, 2),          # GLM-5's window: a pair up to 64 rows
    (4096, 32768, 1), (65, 32769, 2),        # one CTA's width at any rows, chunks past it
    (1, 262144, 1), (1, 262145, 2),          # 1M tokens in one call, chunks past it
    (8192, 2048, 1), (8192, 262144, 2)])     # the most rows the select kernels take
def test_pool_topk_lowering_follows_the_chunks(rows, width, calls, monkeypatch):
  """pool_topk lowers to one kernel call where plan.topk_chunks holds the row whole, else to
  the chunks' call and the candidates' (two); never an XLA sort."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  args = (jax.ShapeDtypeStruct((rows, width), jnp.float32),
          jax.ShapeDtypeStruct((rows,), jnp.int32))
  text = cuda_module(functools.partial(glm5_jax.pool_topk, k=512), args)
  assert custom_calls(text) == ["glm5_pool_topk"] * calls
  assert (plan.topk_chunks(width, 512, rows).chunks == 1) is (calls == 1)
  assert "stablehlo.sort" not in text
  reference = functools.partial(glm5_jax.pool_topk, k=512, routing=Routing(kernels=False))
  assert "stablehlo.sort" in cuda_module(reference, args)   # what a fallback would show


@pytest.mark.parametrize("rows,max_pools,want", [
    (16, 50688, ["glm5_select_slots"]),      # the cluster, one call
    (8192, 2048, ["glm5_select_slots"]),     # the most rows, one CTA a row
    (8192, 50688, ["glm5_mqa_logits", "glm5_pool_topk", "glm5_pool_topk",
                   "glm5_expand_and_remap"]),
    (8192, 262144, ["glm5_mqa_logits", "glm5_pool_topk", "glm5_pool_topk",
                    "glm5_expand_and_remap"])])
def test_select_slots_lowering_at_the_most_rows(rows, max_pools, want, monkeypatch):
  """The stage's select op at its default routing up to LOGITS_MAX_ROWS rows and 1M tokens
  (avals only: the 8,192 x 262,144 logits are never allocated): kernels, never a sort."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  requests, blocks = 64, max_pools * 4 // 64 + 1
  args = (jax.ShapeDtypeStruct((rows, 64, 128), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((rows, 64), jnp.float32),
          jax.ShapeDtypeStruct((requests * max_pools // 64 + 1, 64, 132), jnp.uint8),
          jax.ShapeDtypeStruct((requests, max_pools // 64), jnp.int32),
          jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
          jax.ShapeDtypeStruct((requests, blocks), jnp.int32))
  fn = functools.partial(glm5_jax.select_slots, k=512, max_pools=max_pools, block_size=64,
                         width=2176)
  text = cuda_module(fn, args)
  assert glm5_calls(text) == want
  assert "stablehlo.sort" not in text
  reference = cuda_module(functools.partial(fn, routing=Routing(kernels=False)), args)
  assert "stablehlo.sort" in reference                         # what a fallback would show


@pytest.mark.parametrize("routing,max_pools,want", [
    (Routing(), 1024, ["glm5_select_slots"]),
    (Routing(ops={"select_slots": False}), 1024, ["glm5_select_pools", "glm5_expand_and_remap"]),
    # Past the top-k kernel's limit neither select kernel runs: the remap's kernel still does.
    (Routing(), TOPK_MAX_POOLS + 64, ["glm5_expand_and_remap"])])
def test_stage_select_path_calls(routing, max_pools, want, monkeypatch):
  """indexer_stage's select path: select_slots' one call where its kernel is chosen
  (plan.chooses_kernel), select_pools + expand_and_remap where the routing turns it
  off, and each part's own choice past its limits."""
  monkeypatch.delenv("GLM5_JAX_KERNELS", raising=False)
  config = glm5_jax.IndexerConfig(max_pools=max_pools, routing=routing)
  weights, cache, x, qr, batch = stage_state([10, 1500, 3001], config=config, hidden=512,
                                             q_lora=256)
  fn = lambda *a: glm5_jax.indexer_stage(*a, config=config)
  calls = [c for c in glm5_calls(cuda_module(fn, (weights, cache, x, qr, batch)))
           if c in ("glm5_select_slots", "glm5_select_pools", "glm5_expand_and_remap")]
  assert calls == want
  rows = batch.positions.size
  args = (jnp.zeros((rows, config.padded, 128), jnp.float8_e4m3fn),
          jnp.zeros((rows, config.padded), jnp.float32), cache.kv_cache, batch.page_table,
          batch.req_ids, batch.positions.reshape(rows), batch.block_table)
  assert plan.chooses_kernel(
      glm5_jax.select_slots, *args, k=config.topk_tokens // 4, max_pools=max_pools,
      block_size=config.block_size, width=config.width,
      routing=routing) is (want == ["glm5_select_slots"])


@pytest.mark.parametrize("op", ["indexer_query", "indexer_projection_fused"])
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
def test_indexer_query_attributes(op, wdtype, monkeypatch):
  """scale and eps reach glm5_indexer_query (and the fused kernel) as the f32 attributes
  its handler binds; padded and the w_out dtype are only in the result types."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", f"{op}=1")
  case = CASES[op]
  params = dict(scale=0.1, eps=1e-5, padded=40, w_out_dtype=wdtype)
  if op == "indexer_projection_fused":
    params["heads"] = case.fn.keywords["heads"]
  fn = lambda *a: getattr(glm5_jax, op)(*a, **params)
  text = cuda_module(fn, case.make(np.random.default_rng(0)))
  call = text[text.index(f"stablehlo.custom_call @glm5_{op}"):].split("\n")[0]
  parsed = call_attributes(text, f"glm5_{op}")
  parsed.pop("warps", None)            # the fused kernel's tactic: test_projection_attributes
  assert parsed.pop("pdl") == ("true", None)
  assert set(parsed) == {"eps", "scale"}
  for name, value in (("eps", 1e-5), ("scale", 0.1)):
    number, typ = parsed[name]
    assert typ == "f32" and np.float32(float(number)) == np.float32(value), parsed
  bf = "bf16" if wdtype == "bfloat16" else "f32"
  assert f"tensor<3x40x{bf}>" in call and "tensor<3x40x128xf8E4M3FN>" in call, call


@pytest.mark.parametrize("op,rows,k,tactic,expected", [
    ("indexer_projection", 3, 1024, None, dict(warps=8, split=4)),
    ("indexer_projection", 32, 4096, None, dict(warps=8, split=4)),
    ("indexer_projection", 33, 4096, None, dict(warps=8, split=8)),
    ("indexer_projection", 33, 1024, None, dict(warps=8, split=4)),
    ("indexer_projection", 3, 1024, (2, 4), dict(warps=2, split=4)),
    ("indexer_projection", 3, 1024, [8, 1], dict(warps=8, split=1)),
    ("indexer_projection", 1, 4096, None, dict(warps=4, split=0)),
    ("indexer_projection", 2, 4096, None, dict(warps=4, split=0)),
    ("indexer_projection", 3, 4096, None, dict(warps=8, split=4)),
    ("indexer_projection", 3, 1024, (2, 0), dict(warps=2, split=0)),
    ("indexer_projection_fused", 3, 1024, None, dict(warps=8)),
    ("indexer_projection_fused", 3, 1024, (4, 1), dict(warps=4))])
def test_projection_attributes(op, rows, k, tactic, expected, monkeypatch):
  """The tactic always reaches glm5_indexer_projection explicitly as the i32 attributes
  warps and split its handler binds (the Python table by rows where none is given: no
  "automatic" sentinel), the fused kernel as warps (its split is 1); heads is only in the
  shapes. The folded rows of vmap choose the table's entry."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", f"{op}=1")
  heads = 16
  fn, args, axes = _projection_call(op, heads, k, tactic, rows)
  attrs = call_attributes(cuda_module(fn, args), f"glm5_{op}")
  ints = {n: int(v) for n, (v, t) in attrs.items() if t == "i32"}
  assert ints == expected
  if op == "indexer_projection":
    assert tuple(expected.values()) == projection_tactic(rows, k, tactic)
  else:
    assert expected["warps"] == fused_warps(tactic)
  if rows == 33 and tactic is None:     # vmap over 3 x 11 rows folds to the same 33
    stacked = tuple(a if ax is None else a.reshape((3, 11) + a.shape[1:])
                    for a, ax in zip(args, axes))
    folded = cuda_module(jax.vmap(fn, in_axes=axes), stacked)
    assert {n: int(v) for n, (v, t) in call_attributes(folded, f"glm5_{op}").items()
            if t == "i32"} == expected


@pytest.mark.parametrize("n,k,tactic,expected", [
    (4096, 1536, None, "wgmma"), (4096, 1536, "mma", "mma"), (256, 1536, "wgmma", "wgmma"),
    (4096, 2304, None, "wgmma"), (384, 1536, None, "wgmma"), (384, 2048, "mma", "mma")])
def test_q_tactic_attribute(n, k, tactic, expected, monkeypatch):
  """indexer_q's tactic reaches glm5_indexer_q as the i32 attribute `tactic` (its index in
  Q_TACTICS): wgmma by default (it tiles every wq_b mma tiles), mma where asked; vmap's
  folded rows keep it."""
  monkeypatch.setenv("GLM5_JAX_KERNELS", "indexer_q=1")
  assert q_tactic(5, n, k, tactic) == expected
  fn = functools.partial(glm5_jax.indexer_q, tactic=tactic)
  qr, wq_b = jnp.zeros((6, k), jnp.bfloat16), jnp.zeros((n, k), jnp.bfloat16)
  for module in (cuda_module(fn, (qr, wq_b)),
                 cuda_module(jax.vmap(fn, in_axes=(0, None)), (qr.reshape(2, 3, k), wq_b))):
    attrs = call_attributes(module, "glm5_indexer_q")
    assert {n: int(v) for n, (v, t) in attrs.items() if t == "i32"} == {
        "tactic": Q_TACTICS.index(expected)}
