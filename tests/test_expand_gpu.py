"""expand_pools and expand_and_remap as CUDA kernels inside jit (command buffers on,
XLA default flags) against the jitted pure-JAX reference: exactly equal on every SPEC
edge case and on >= 1e5 random GLM-shaped rows. Shapes the remap kernel does not
support (G % 32 != 0, ...) must lower to the reference."""
import functools

import numpy as np
import jax
import pytest

import glm5_jax
from glm5_jax import reference as ref
from glm5_testing import triton_oracle

from graphs import glm5_calls, run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]
I32_MAX, I32_MIN = 2**31 - 1, -2**31
GLM_G, GLM_W = 512, 2176
# Pool ids that stress int32 wraparound of 4 * pid: 2^29 -> -2^31 (a negative token,
# dropped by the remap), 2^30 + 3 -> 12 (a small positive token), INT32_MAX -> -4,
# -2^30 (negative: unused, although 4 * pid wraps to 0).
HUGE_IDS = [I32_MAX, 1 << 29, (1 << 29) + 7, 1 << 30, (1 << 30) + 3, -(1 << 30), -7]


def i32(x):
  return np.asarray(x, np.int64).astype(np.int32)


# --- calls: (public op, args, static params) -------------------------------------------

class Call:
  def __init__(self, op, args, **params):
    self.op, self.args, self.params = op, tuple(i32(a) for a in args), params

  def kernel(self):
    return getattr(glm5_jax, self.op)(*self.args, **self.params)

  @property
  def supported(self):
    """Whether the kernel handles this call (else the lowering uses the reference)."""
    return self.op == "expand_pools" or (self.args[0].shape[1] % 32 == 0
                                         and 32 <= self.args[0].shape[1] <= 1024)


@functools.cache
def _reference_fn(op, params):
  return jax.jit(functools.partial(getattr(ref, op), **dict(params)))


def reference(call):
  out = _reference_fn(call.op, tuple(sorted(call.params.items())))(*call.args)
  return out if isinstance(out, tuple) else (out,)


def run_and_compare(calls):
  """All calls in one jit (so XLA can graph them); each exactly equal to its reference.
  The lowered module holds one FFI call per supported call and none for the rest."""
  def chain(*args):
    outs = []
    for call, a in zip(calls, args):
      out = getattr(glm5_jax, call.op)(*a, **call.params)
      outs.append(out if isinstance(out, tuple) else (out,))
    return outs

  args = [c.args for c in calls]
  fn = jax.jit(chain)
  found = glm5_calls(fn.lower(*args).as_text())
  want = [f"glm5_{c.op}" for c in calls if c.supported]
  assert sorted(found) == sorted(want)
  got = fn(*args)
  for i, (call, outs) in enumerate(zip(calls, got)):
    wants = reference(call)
    assert len(outs) == len(wants)
    for o, w in zip(outs, wants):
      o, w = np.asarray(o), np.asarray(w)
      assert o.dtype == np.int32 and o.shape == w.shape, (i, call.op, call.params)
      if not np.array_equal(o, w):
        bad = np.argwhere(o != w)
        pytest.fail(f"call {i} {call.op} {call.params} shapes "
                    f"{[a.shape for a in call.args]}: {len(bad)} mismatches, first at "
                    f"{bad[:5].tolist()}: got {o[tuple(bad[0])]}, want {w[tuple(bad[0])]}")


# --- edge cases --------------------------------------------------------------------------

def pool_ids(rng, rows, G, pools, p_unused=0.2):
  ids = rng.integers(0, max(pools, 1), (rows, G))
  ids[rng.random((rows, G)) < p_unused] = -1
  ids[rng.random((rows, G)) < 0.02] = rng.integers(-1000, -1)     # other negative ids
  return ids


def with_huge_ids(ids, row=1):
  if ids.shape[0] > row and ids.shape[1] >= len(HUGE_IDS):
    ids[row, -len(HUGE_IDS):] = HUGE_IDS
  return ids


# n = seq_len + seq_offset: tail counts 0..3, n <= 0 (padding), n wrapping past INT32_MAX.
SEQ_LENS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 401, 402, 403, 404, -1, -2, -4, -5, -400,
            I32_MAX, I32_MAX - 1, I32_MAX - 2, I32_MIN, 1 << 20, (1 << 20) + 3]


def expand_edge_calls(rng):
  calls = []
  rows = len(SEQ_LENS)
  seq = np.array(SEQ_LENS)
  for width in [2051, 2052, 2053, 2054, 2055, 2056, 2100, 2175, 2176]:
    ids = with_huge_ids(pool_ids(rng, rows, GLM_G, 50000))
    ids[0] = -1                                                    # no pools at all
    for off in (0, 1):
      calls.append(Call("expand_pools", (ids, seq), seq_offset=off, width=width))
  for G in [0, 1, 3, 8, 32, 40, 64, 1024, 5000]:
    for width in sorted({4 * G + 3, 4 * G + 4, 4 * G + 3 + 130, 4 * G + 3 + 513}):
      ids = with_huge_ids(pool_ids(rng, rows, G, 3000))
      calls.append(Call("expand_pools", (ids, seq), seq_offset=int(rng.integers(-3, 4)),
                        width=width))
  for rows in [0, 1]:                                              # empty and single row
    calls.append(Call("expand_pools", (pool_ids(rng, rows, GLM_G, 9000),
                                       np.full(rows, 77)), seq_offset=1, width=GLM_W))
  return calls


def remap_call(rng, *, G, width, block_size, compact, rows, expanded, stride_rows=None,
               seq_offset=1, R=5, MB=12):
  """Pools past the table (~1/3 of ids), unused and other negative ids, huge ids,
  tail counts 0..3, padding positions, requests outside [0, R), rows past `expanded`,
  negative and huge block-table entries (int32 wraparound of entry * stride_rows)."""
  ids = with_huge_ids(pool_ids(rng, expanded, G, MB * block_size * 3 // 8), row=3)
  if expanded > 2:
    ids[0] = -1                                                    # no pools
    ids[2] = np.arange(G)                                          # every pool (a prefix)
  positions = rng.integers(-3, MB * block_size + 40, expanded)
  special = [-1, 0, 1, 2, 3, 4, 5, 6, I32_MAX, I32_MAX - 2, MB * block_size - 2,
             MB * block_size - 1, MB * block_size]
  positions[:min(expanded, len(special))] = special[:expanded]
  req = rng.integers(0, R, rows)
  for r, bad in zip([1, 4, 7, 10], [-1, R, I32_MAX, I32_MIN]):
    if r < rows:
      req[r] = bad
  table = rng.integers(-3, 1 << 20, (R, MB))
  table[0, :3] = [I32_MAX, I32_MAX // 3, -(1 << 30)]
  return Call("expand_and_remap", (ids, positions, req, table), block_size=block_size,
              width=width, stride_rows=stride_rows, seq_offset=seq_offset, compact=compact)


def remap_edge_calls(rng, compact):
  calls = []
  for G, widths in [(32, [131, 132, 133, 200]), (64, [259, 260, 515]),
                    (512, [2051, 2052, 2053, 2055, 2176, 2300]), (1024, [4099, 4100, 4352]),
                    (40, [163, 164]), (8, [35, 36])]:
    for width in widths:
      block_size = int(rng.choice([4, 12, 16, 48, 64, 128]))   # 12, 48: not powers of 2
      stride = int(rng.choice([block_size, 2 * block_size + 8, 1 << 20]))
      calls.append(remap_call(rng, G=G, width=width, block_size=block_size, compact=compact,
                              rows=14, expanded=11, stride_rows=stride,
                              seq_offset=int(rng.choice([0, 1, 3, -2]))))
  for rows, expanded in [(3, 9), (6, 0), (0, 4), (0, 0), (40, 40), (1, 1)]:
    calls.append(remap_call(rng, G=GLM_G, width=GLM_W, block_size=64, compact=compact,
                            rows=rows, expanded=expanded))
  return calls


def test_expand_pools_edge_cases():
  run_and_compare(expand_edge_calls(np.random.default_rng(1)))


# One test per compaction mode, so that pytest-xdist runs them side by side (as one jit of
# every edge call they were the GPU suite's second-longest test, 103 s).
@pytest.mark.long
@pytest.mark.parametrize("compact", [True, False])
def test_expand_and_remap_edge_cases(compact):
  run_and_compare(remap_edge_calls(np.random.default_rng(2 + compact), compact))


def test_expand_pools_grid_stride():
  """More quads per row than one grid column of CTAs covers (65535 x 128)."""
  rng = np.random.default_rng(3)
  G = 65535 * 128 + 1000
  calls = [Call("expand_pools", (pool_ids(rng, 1, G, 1 << 28), [4 * G + k]), seq_offset=0,
                width=4 * G + 3 + k) for k in range(5)]
  run_and_compare(calls)


# --- random GLM-shaped batches -------------------------------------------------------------

def glm_batch(rng, rows, *, block_size, requests=64, max_len=1 << 20):
  """Decode rows of `requests` requests with contexts up to 1M tokens: each row holds
  random pools of its context (every rank for a context of >= 512 pools, the first
  n // 4 ranks of a shorter one), ~20% -1; positions = length - 1 (seq_offset 1).
  The block table stops 3 blocks short of 1M tokens, so the last tokens are dropped."""
  lens = rng.integers(1, max_len + 1, requests)
  lens[:5] = [1, 4, 7, 2047, 2048]                      # short contexts: causal-fill rows
  req = rng.integers(0, requests, rows)
  n = lens[req]
  npools = n // 4
  ids = np.floor(rng.random((rows, GLM_G)) * npools[:, None]).astype(np.int64)
  ids = np.where(np.arange(GLM_G) < npools[:, None], ids, -1)
  ids[rng.random((rows, GLM_G)) < 0.2] = -1
  table = rng.integers(0, 1 << 22, (requests, -(-max_len // block_size) - 3))
  req[rng.random(rows) < 0.01] = -1                     # a few rows without a request
  return ids, n - 1, req, table


def test_random_glm_batches():
  """>= 1e5 random rows: 4 x 16384 remap rows (block 64/128, compact or not) and
  2 x 24576 expand rows, in one jit."""
  rng = np.random.default_rng(4)
  calls = []
  for block_size in (64, 128):
    for compact in (True, False):
      ids, pos, req, table = glm_batch(rng, 16384, block_size=block_size)
      expanded = ids.shape[0] - 128                     # CUDA-graph padding rows
      calls.append(Call("expand_and_remap", (ids[:expanded], pos[:expanded], req, table),
                        block_size=block_size, width=GLM_W, compact=compact))
  for off in (0, 1):
    ids, pos, _, _ = glm_batch(rng, 24576, block_size=64)
    calls.append(Call("expand_pools", (ids, pos + 1 - off), seq_offset=off, width=GLM_W))
  assert sum(c.args[0].shape[0] for c in calls) >= 100_000
  run_and_compare(calls)


def test_triton_index_kernels_match_the_reference():
  """The stock-order Triton expand and column-preserving convert that `python -m bench`
  times next to the kernels (glm5_testing/triton_oracle.py) equal the reference."""
  T = triton_oracle.require()
  rng = np.random.default_rng(6)
  ids, pos, req, table = (i32(a) for a in glm_batch(rng, 4096, block_size=128))
  tokens = T.expand(T.to_torch(ids), T.to_torch(pos), seq_offset=1, width=GLM_W)
  want = ref.expand_pools(ids, pos, seq_offset=1, width=GLM_W)
  np.testing.assert_array_equal(T.to_numpy(tokens), np.asarray(want))
  out, counts = T.convert(T.to_torch(req), T.to_torch(table), tokens, block_size=128,
                          stride_rows=128)
  want = ref.expand_and_remap(ids, pos, req, table, block_size=128, width=GLM_W,
                              compact=False)
  np.testing.assert_array_equal(T.to_numpy(out), np.asarray(want[0]))
  np.testing.assert_array_equal(T.to_numpy(counts), np.asarray(want[1]))


def test_unsupported_shapes_use_the_reference():
  """G % 32 != 0 or G > 1024 lowers without the remap kernel; results still exact."""
  rng = np.random.default_rng(5)
  calls = [remap_call(rng, G=G, width=4 * G + 4, block_size=16, compact=compact, rows=6,
                      expanded=5) for G in (40, 8, 1056) for compact in (True, False)]
  assert not any(c.supported for c in calls)
  run_and_compare(calls)


def test_kernels_run_inside_a_command_buffer(tmp_path):
  """With XLA's default flags both FFI calls are captured in a CUDA graph."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      "ids = jnp.arange(3 * 512, dtype=jnp.int32).reshape(3, 512) % 700 - 100\n"
      "pos = jnp.array([5, 4000, -1], jnp.int32); req = jnp.array([0, 1, 1, 0], jnp.int32)\n"
      "table = jnp.arange(2 * 64, dtype=jnp.int32).reshape(2, 64)\n"
      "def f(ids, pos, req, table):\n"
      "  outs = []\n"
      "  for i in range(3):\n"
      "    outs.append(glm5_jax.expand_pools(ids + i, pos, seq_offset=1, width=2176))\n"
      "    outs += glm5_jax.expand_and_remap(ids + i, pos, req, table, block_size=64,\n"
      "                                      width=2176, compact=i != 1)\n"
      "  return outs\n"
      "outs = jax.jit(f)(ids, pos, req, table)\n"
      "print(int(outs[-1][1]), int(outs[0][0, 0]))\n")
  out = run_and_check_graphed(script, ["glm5_expand_pools", "glm5_expand_and_remap"],
                              tmp_path)
  ids = (np.arange(3 * 512).reshape(3, 512) % 700 - 100).astype(np.int32) + 2
  want_count = np.asarray(ref.expand_and_remap(ids, np.array([5, 4000, -1], np.int32),
                                               np.array([0, 1, 1, 0], np.int32),
                                               np.arange(128, dtype=np.int32).reshape(2, 64),
                                               block_size=64, width=2176)[1])[1]
  assert out.split() == [str(want_count), "-1"]


@pytest.mark.parametrize("max_block,error", [(134217727, None), (134217728, "max_block"),
                                             (-1, "max_block")])
def test_remap_handler_checks_max_block(max_block, error):
  """max_block is computed once in Python (remap_attribute_values) and only checked by the
  handler: slots of an entry in [0, max_block] must fit int32 ((2^31 - 16) // 16 at
  block_size 16 is the largest; one more, or a negative one, is refused by name). A direct
  call of the target with the largest runs and equals the op."""
  G, W = 32, 4 * 32 + 3
  pool_ids = i32(np.arange(2 * G).reshape(2, G))
  positions, req_ids, table = i32([200, 9]), i32([0, 1]), i32([[3, 4, 5, 6], [7, 8, 9, 10]])
  out_types = (jax.ShapeDtypeStruct((2, W), np.int32), jax.ShapeDtypeStruct((2,), np.int32))
  call = jax.ffi.ffi_call("glm5_expand_and_remap", out_types)
  run = lambda: jax.block_until_ready(call(
      pool_ids, positions, req_ids, table, block_size=np.int64(16), stride_rows=np.int64(16),
      max_block=np.int64(max_block), seq_offset=np.int64(1), compact=True, pdl=False))
  if error is not None:
    with pytest.raises(Exception, match=f"glm5_expand_and_remap.*{error}"):
      run()
    return
  want = glm5_jax.expand_and_remap(pool_ids, positions, req_ids, table, block_size=16, width=W)
  for got, ref_out in zip(run(), want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref_out))
