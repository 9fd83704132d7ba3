"""Per-step metadata of a serving loop: DecodeBatch.pack / unpack, the packed step
(glm5_jax.serving.indexer_step) against the DecodeBatch step, donation kept."""
import functools
import json
import os
import subprocess
import sys

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import serving
from glm5_testing import tiers
from glm5_testing.cases import stage_state, tree_bytes

from graphs import copied_shapes

STAGE = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"),
                donate_argnames="cache")
STEP = jax.jit(serving.indexer_step, static_argnames=("config", "use_reference"),
               donate_argnames="cache")
CONFIG = glm5_jax.IndexerConfig(max_pools=1024)


def state(contexts, next_n=1, seed=0):
  return stage_state(contexts, next_n, seed, config=CONFIG, hidden=512, q_lora=256)


def test_pack_unpack_round_trip():
  _, _, _, _, batch = state([10, 1500, 3001], next_n=2)
  packed = batch.packed()
  assert isinstance(packed, np.ndarray) and packed.dtype == np.int32
  assert packed.shape == (4, 3, 2)
  got = glm5_jax.DecodeBatch.unpack(packed, batch.page_table, batch.block_table)
  for name in ("positions", "loc", "tslot", "req_ids", "page_table", "block_table"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                  np.asarray(getattr(batch, name)), err_msg=name)
    assert np.shape(getattr(got, name)) == np.shape(getattr(batch, name)), name
  # inside jit too: the same fields and shapes
  fields = jax.jit(lambda p: jax.tree.leaves(glm5_jax.DecodeBatch.unpack(
      p, batch.page_table, batch.block_table)))(packed)
  for g, w in zip(fields, jax.tree.leaves(batch)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _permuted_batch():
  """(batch, page, ring, positions with a pad, requests, tail blocks): 4 requests of
  next_n 3, their page-table rows and tail blocks permuted."""
  _, cache, _, _, batch = state([10, 1499, 3003, 77], next_n=3)
  pos = np.asarray(batch.positions).copy()
  pos[1, 2] = -1                                              # a pad
  return (batch, cache.kv_cache.shape[1], cache.tail.shape[2], pos, np.array([2, 0, 3, 1]),
          np.array([1, 3, 0, 2]))


def test_decode_metadata_matches_spec_per_token():
  """The host builder (serving.token_slots, which synthetic.decode_batch also uses)
  against SPEC §0 token by token: loc = page_table[request, pool // PAGE] * PAGE +
  pool % PAGE for a token completing its pool (position % 4 == 3), else -1; tslot =
  tail block * RING + position % RING; -1 for pads. Requests and tail blocks permuted."""
  batch, page, ring, pos, requests, tails = _permuted_batch()
  table = np.asarray(batch.page_table)
  packed = serving.decode_metadata(pos, table, page=page, ring=ring, requests=requests,
                                   tail_blocks=tails)
  for b in range(pos.shape[0]):
    for n in range(pos.shape[1]):
      p, r = int(pos[b, n]), int(requests[b])
      loc = table[r, p // 4 // page] * page + p // 4 % page if p >= 0 and p % 4 == 3 else -1
      tslot = int(tails[b]) * ring + p % ring if p >= 0 else -1
      assert packed[:, b, n].tolist() == [p, loc, tslot, r], (b, n)


@pytest.mark.parametrize("accepted", [1, [3, 1, 0, 2]])
def test_advance_equals_host_metadata_of_the_next_positions(accepted):
  """serving.advance on the device == decode_metadata (the host rule) of the positions
  each request reaches: requests and tail blocks permuted, a pad that stays a pad, MTP
  rows (next_n 3), pools completed across the step, per-request accepted counts."""
  batch, page, ring, pos, requests, tails = _permuted_batch()
  table = np.asarray(batch.page_table)
  meta = lambda p: serving.decode_metadata(p, table, page=page, ring=ring,  # noqa: E731
                                           requests=requests, tail_blocks=tails)
  got = jax.jit(functools.partial(serving.advance, page=page, ring=ring))(
      jnp.asarray(meta(pos)), batch.page_table, accepted=jnp.asarray(accepted, jnp.int32))
  step = np.broadcast_to(np.asarray(accepted).reshape(-1, 1), (4, 1))
  want = meta(np.where(pos >= 0, pos + step, -1))
  assert want[1].max() >= 0 and (want[1] != meta(pos)[1]).any()   # pools completed
  np.testing.assert_array_equal(np.asarray(got), want)


def test_advance_rejects_a_batch_that_is_not_packed():
  with pytest.raises(ValueError, match="glm5_jax.serving.advance: packed"):
    serving.advance(jnp.zeros((3, 2, 1), jnp.int32), jnp.zeros((2, 4), jnp.int32),
                    page=16, ring=8)
  for accepted in (jnp.ones(3, jnp.int32), jnp.ones(2, jnp.float32)):
    with pytest.raises(ValueError, match="glm5_jax.serving.advance: accepted"):
      serving.advance(jnp.zeros((4, 2, 1), jnp.int32), jnp.zeros((2, 4), jnp.int32),
                      page=16, ring=8, accepted=accepted)


def test_decode_metadata_pads():
  packed = serving.decode_metadata(np.array([[7, -1]]), np.array([[5, 6]]), page=16, ring=8)
  pos, loc, tslot, req = packed[:, 0]
  assert pos.tolist() == [7, -1] and loc.tolist() == [5 * 16 + 1, -1]
  assert tslot.tolist() == [7, -1] and req.tolist() == [0, 0]


@pytest.mark.parametrize("contexts,next_n", tiers.first(([10, 1500, 3001, 77], 1), ([40, 2999], 4)))
def test_packed_step_equals_batch_step(contexts, next_n):
  weights, cache, x, qr, batch = state(contexts, next_n)
  want = STAGE(weights, jax.tree.map(jnp.copy, cache), x, qr, batch, config=CONFIG)
  got = STEP(weights, jax.tree.map(jnp.copy, cache), x, qr, batch.packed(), batch.page_table,
             batch.block_table, config=CONFIG)
  for g, w in zip(tree_bytes(got), tree_bytes(want)):
    np.testing.assert_array_equal(g, w)


def test_packed_step_donates_the_cache():
  weights, cache, x, qr, batch = state([10, 1500, 3001, 77])
  args = (weights, cache, x, qr, batch.packed(), batch.page_table, batch.block_table)
  text = STEP.lower(*args, config=CONFIG).compile().as_text()
  copies = copied_shapes(text, [cache.kv_cache.shape, cache.tail.shape])
  if jax.default_backend() == "cpu":   # the CPU backend copies the tail's bitcasts (test_stage)
    copies.discard(tuple(cache.tail.shape))
  assert copies == set()
  before = cache.kv_cache.unsafe_buffer_pointer()
  _, new = STEP(*args, config=CONFIG)
  assert cache.kv_cache.is_deleted()
  assert new.kv_cache.unsafe_buffer_pointer() == before


def test_pack_errors_name_the_argument():
  pos = np.zeros((2, 1), np.int32)
  with pytest.raises(ValueError, match=r"glm5_jax.DecodeBatch.pack: loc must have shape"):
    glm5_jax.DecodeBatch.pack(pos, np.zeros((2, 2)), pos, np.zeros(2))
  with pytest.raises(ValueError, match=r"DecodeBatch.pack: req_ids must have shape \(2,\)"):
    glm5_jax.DecodeBatch.pack(pos, pos, pos, np.zeros(3))
  with pytest.raises(TypeError, match=r"DecodeBatch.pack: tslot must be integer"):
    glm5_jax.DecodeBatch.pack(pos, pos, pos.astype(np.float32), np.zeros(2, np.int32))
  with pytest.raises(ValueError, match=r"DecodeBatch.unpack: packed must have shape"):
    glm5_jax.DecodeBatch.unpack(np.zeros((3, 2, 1), np.int32), None, None)
  with pytest.raises(TypeError, match=r"DecodeBatch.unpack: packed must be int32"):
    glm5_jax.DecodeBatch.unpack(np.zeros((4, 2, 1), np.int64), None, None)


@pytest.mark.slow
@pytest.mark.parametrize("metadata,says", [("device", "metadata advanced on the device"),
                                           ("host", "host metadata + transfer")])
def test_decode_loop_demo_runs(metadata, says):
  """The README's demo, small: runs, and its check against the reference passes. With
  the metadata advanced on the device (serving.advance) the reference replay still
  takes the host's metadata (decode_metadata) every step, so the check also compares
  the two; position 31 completes a pool in the second step."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "examples/decode_loop.py", "--layers", "1",
                         "--contexts", "30,2100", "--steps", "3", "--metadata", metadata],
                        cwd=root, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=root))
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert says in done.stdout
  assert "check:" in done.stdout and done.stdout.rstrip().endswith("ok")


@pytest.mark.slow
def test_bench_serving_group_cpu_smoke(tmp_path):
  """`python -m bench --groups serving` measures every variant (no error rows)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "b.json"
  done = subprocess.run(
      [sys.executable, "-m", "bench", "--groups", "serving", "--cpu-smoke", "--cache-dir", "",
       "--serving-rows", "1", "--out", str(out), "--md", str(tmp_path / "b.md"),
       "--plot", str(tmp_path / "b.png")], cwd=root, capture_output=True, text=True,
      timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  rows = json.loads(out.read_text())
  assert {r["variant"] for r in rows if r["op"] == "serving"} == {
      "device metadata", "host metadata, packed", "host metadata, fields",
      "host metadata, pinned", "arguments only", "device metadata, advanced"}
  assert all(r["device_us"] > 0 for r in rows if r["op"] == "serving"), rows
  assert any("the device-metadata step" in r["notes"] for r in rows if r["op"] == "serving")


def _endurance_script():
  import importlib.util
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      "endurance", os.path.join(root, "scripts", "endurance.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_endurance_memory_verdict():
  """scripts/endurance.py's memory check: growth within the slack passes, past it
  fails; no statistics pass only on the CPU backend."""
  verdict = _endurance_script().memory_verdict
  run = dict(backend="gpu", steps=10000, memory_first=1000, memory_last=1000 + 4096)
  assert verdict(run, "A", 4096)[0] and not verdict(run, "A", 4095)[0]
  none = dict(run, memory_first=None, memory_last=None)
  assert not verdict(none, "A", 4096)[0]
  assert verdict(dict(none, backend="cpu"), "A", 4096)[0]


@pytest.mark.slow
def test_endurance_script_small():
  """`scripts/endurance.py`, a few steps of a small demo: both runs give the same digest
  and it exits 0 (on the CPU the memory check is skipped, saying so)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "scripts/endurance.py", "--steps", "3", "--",
                         "--layers", "1", "--contexts", "30,210"], cwd=root,
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "digests equal" in done.stdout, done.stdout[-3000:]
  assert "memory not checked (the cpu backend" in done.stdout
  assert done.stdout.rstrip().endswith("ok")
