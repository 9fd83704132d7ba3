"""Bad runtime values (docs/semantics.md §12): every bad index gives its documented result in
the reference, the oracle and the stage; check_batch names the first one; fuzzed batches
through indexer_stage, indexer_prefill and a decode loop equal the reference and never
write outside what their good rows own. The GPU form (kernels on, guard pages, under
compute-sanitizer memcheck) is test_fuzz_gpu and this file's __main__."""
import dataclasses
import functools
import re
import sys
import warnings

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import reference
from glm5_jax.checks import capacity
from glm5_jax.reference.expand import max_block_id
from glm5_testing import oracle
from glm5_testing.cases import stage_state, tree_bytes

CONFIG = glm5_jax.IndexerConfig(max_pools=1024)
STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))
PREFILL = jax.jit(glm5_jax.indexer_prefill, static_argnames=("config", "use_reference"))
I32_MAX = 2 ** 31 - 1


def state(contexts, next_n=1, seed=0):
  return stage_state(contexts, next_n, seed, config=CONFIG, hidden=256, q_lora=128)


def _replace(batch, **fields):
  return dataclasses.replace(batch, **{k: jnp.asarray(v, jnp.int32) for k, v in fields.items()})


# ----------------------------------------------------------------------- block ids (§12)

@pytest.mark.parametrize("compact", [True, False])
def test_block_ids_that_name_no_block_are_dropped(compact):
  """Entries -7, -1, 2^30 (its slots wrap int32) and max_block_id + 1 give -1 and are not
  counted; max_block_id itself is a block: reference and oracle give the same, written out."""
  block_size = stride = 8
  top = max_block_id(block_size, stride)
  assert top * stride + block_size - 1 == I32_MAX            # the largest block fits exactly
  table = np.array([[-7, 3, -1, 2 ** 30, top + 1, top, 5]], np.int32)
  # Pools 0, 1 (block 0), 2, 3 (block 1), 4, 5 (2), 6 (3), 8 (4), 10 (5), 12 (6); position 53:
  # 54 tokens, the tail is tokens 52, 53 (block 6).
  ids = np.array([[0, 1, 2, 3, 4, 5, 6, 8, 10, 12]], np.int32)
  positions, req = np.array([53], np.int32), np.zeros(1, np.int32)
  kept = [*range(24, 32), *(top * 8 + o for o in range(4)), *range(40, 44), 44, 45]
  got = reference.expand_and_remap(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(req),
                                   jnp.asarray(table), block_size=block_size, width=48,
                                   compact=compact)
  want = oracle.expand_and_remap(ids, positions, req, table, block_size=block_size, width=48,
                                 compact=compact)
  np.testing.assert_array_equal(np.asarray(got[0]), want[0])
  np.testing.assert_array_equal(np.asarray(got[1]), want[1])
  assert int(want[1][0]) == len(kept) == 18
  if compact:
    assert list(want[0][0, :18]) == kept and np.all(want[0][0, 18:] == -1)
  else:
    assert [s for s in want[0][0] if s >= 0] == kept
    assert list(want[0][0, :8]) == [-1] * 8              # the dropped pools keep their columns


def test_select_slots_drops_bad_block_ids_and_compacts():
  """select_slots (the reference; the kernel is held to it on the GPU) on a table with
  negative and overflowing entries inside the selection: the kept slots move down over them,
  the count is theirs."""
  weights, cache, x, qr, batch = state([300, 40])
  bt = np.array(batch.block_table)
  bt[0, 1], bt[1, 0] = -7, 2 ** 30
  out, _ = STEP(weights, cache, x, qr, _replace(batch, block_table=bt), config=CONFIG,
                use_reference=True)
  slots, counts = np.asarray(out.slots), np.asarray(out.counts)
  for r, pos in enumerate(np.asarray(batch.positions)[:, 0]):
    n = (pos + 1) // 4
    ids = np.where(np.arange(512) < n, np.arange(512), -1)[None].astype(np.int32)
    want, count = oracle.expand_and_remap(ids, [pos], [r], bt, block_size=128, width=2176)
    np.testing.assert_array_equal(slots[r], want[0])
    assert counts[r] == count[0] == pos + 1 - 128 * (r == 0) - min(128, pos + 1) * (r == 1)
    assert np.all(slots[r, :counts[r]] >= 0) and np.all(slots[r, counts[r]:] == -1)


# ----------------------------------------------------------------------- capacity (§12)

@pytest.mark.parametrize("past", [0, 5, "max"])
def test_a_position_past_capacity_is_a_pad(past):
  """A row at or past capacity() (what the page table, the block table and the logits
  hold) is a pad: the stage's outputs and caches equal those of the batch with that row
  -1; count 0."""
  weights, cache, x, qr, batch = state([100, 200, 7], 2)
  tokens = capacity(cache, batch, CONFIG)
  pos = np.array(batch.positions)
  pos[1, 1] = I32_MAX if past == "max" else tokens + past
  pads = pos.copy()
  pads[1, 1] = -1
  for use_reference in (False, True):
    got = STEP(weights, cache, x, qr, _replace(batch, positions=pos), config=CONFIG,
               use_reference=use_reference)
    want = STEP(weights, cache, x, qr, _replace(batch, positions=pads), config=CONFIG,
                use_reference=use_reference)
    for g, w in zip(tree_bytes(got), tree_bytes(want), strict=True):
      np.testing.assert_array_equal(g, w)
    assert int(got[0].counts[3]) == 0


# ----------------------------------------------------------------------- shapes

@pytest.mark.parametrize("field, shape, message", [
    ("page_table", (3, 0), "batch.page_table must have a row per request and a column at "
     "least, got shape (3, 0)"),
    ("block_table", (0, 10), "batch.block_table must have a row per request and a column "
     "at least, got shape (0, 10)"),
    ("block_table", (2, 10), "batch.block_table must have as many rows as batch.page_table "
     "(one per request, named by req_ids): 3, got shape (2, 10)"),
])
def test_tables_that_shapes_contradict_fail_at_trace_time(field, shape, message):
  weights, cache, x, qr, batch = state([30, 40, 50])
  bad = _replace(batch, **{field: np.zeros(shape, np.int32)})
  with pytest.raises(ValueError, match="^glm5_jax.indexer_stage: " + re.escape(message)):
    STEP(weights, cache, x, qr, bad, config=CONFIG)


# ----------------------------------------------------------------------- check_batch

def _bad(field, index, value):
  def apply(args):
    weights, cache, x, qr, batch = args
    if field in ("x", "qr"):
      a = np.array((x if field == "x" else qr).astype(jnp.float32))
      a[index] = value
      a = jnp.asarray(a, jnp.bfloat16)
      return (weights, cache, a, qr, batch) if field == "x" else (weights, cache, x, a, batch)
    a = np.array(getattr(batch, field))
    a[index] = value
    return weights, cache, x, qr, _replace(batch, **{field: a})
  return apply


CHECKS = [
    ("positions", (1, 0), -7, "batch.positions[1, 0] is below -1 (a pad is -1): got -7"),
    ("positions", (2, 1), 9000, "batch.positions[2, 1] is past the capacity, 1216 tokens = "
     "min(4 x page_table columns 19 x PAGE 16, block_table columns 10 x block_size 128, 4 x "
     "max_pools 1024): got 9000"),
    ("req_ids", (3,), 5, "batch.req_ids of the real row [1, 1] (request, token) is outside "
     "[0, 3)"),
    ("loc", (0, 0), 10 ** 6, "batch.loc[0, 0] is neither -1 nor"),
    ("tslot", (2, 0), -4, "batch.tslot[2, 0] of a real row is neither -1 nor tail block"),
    ("tslot", (0, 1), 3 * 8 + 2, "batch.tslot[0, 1] of a real row"),
    ("page_table", (1, 2), 10 ** 5, "batch.page_table[req_ids[row], column] at [row, column] = "
     "[2, 2] names no page of the cache [0, 59): got 100000"),
    ("block_table", (2, 0), -1, "batch.block_table[req_ids[row], column] at [row, column] = "
     "[4, 0] names no block"),
    ("x", (3, 17), np.nan, "x[3, 17] is not finite: got nan"),
    ("qr", (5, 0), -np.inf, "qr[5, 0] is not finite: got -inf"),
]


@pytest.mark.parametrize("field, index, value, message", CHECKS,
                         ids=[f"{c[0]}-{c[2]}" for c in CHECKS])
def test_check_batch_names_the_first_bad_value(field, index, value, message):
  args = state([300, 201, 1200], 2)
  assert glm5_jax.check_batch(*args, config=CONFIG).get() is None
  err = glm5_jax.check_batch(*_bad(field, index, value)(args), config=CONFIG)
  text = err.get()
  assert text is not None and text.startswith("glm5_jax.check_batch: " + message), text
  with pytest.raises(Exception, match="glm5_jax.check_batch"):
    err.throw()


def test_check_batch_reports_in_argument_order():
  """Two bad values: the first check in the documented order wins (positions before x)."""
  args = _bad("x", (0, 0), np.nan)(_bad("positions", (0, 1), -3)(state([30, 40], 2)))
  assert "batch.positions[0, 1] is below -1" in glm5_jax.check_batch(*args, config=CONFIG).get()


def test_check_batch_under_jit_and_trace_time_errors():
  args = state([30, 40])
  step = jax.jit(lambda *a: glm5_jax.check_batch(*a, config=CONFIG))
  assert step(*args).get() is None
  assert "x[1, 2]" in step(*_bad("x", (1, 2), np.inf)(args)).get()
  weights, cache, x, qr, batch = args
  with pytest.raises(ValueError, match="glm5_jax.indexer_stage: x must have shape"):
    glm5_jax.check_batch(weights, cache, x[:1], qr, batch, config=CONFIG)


# ----------------------------------------------------------------------- smaller things

@pytest.mark.parametrize("use_reference", [False, True])
@pytest.mark.parametrize("wrap", ["grad", "grad(jit)", "jit(grad)"])
def test_stage_is_not_differentiable(use_reference, wrap):
  weights, cache, x, qr, batch = state([30])

  def loss(x):
    out, _ = glm5_jax.indexer_stage(weights, cache, x, qr, batch, config=CONFIG,
                                    use_reference=use_reference)
    return out.w_out.sum()

  fn = {"grad": jax.grad(loss), "grad(jit)": jax.grad(jax.jit(loss)),
        "jit(grad)": jax.jit(jax.grad(loss))}[wrap]
  with pytest.raises(TypeError, match=r"^glm5_jax\.indexer_stage is not differentiable"):
    fn(x)


def test_unknown_variable_warns_once(monkeypatch):
  from glm5_jax import _primitive
  monkeypatch.setattr(_primitive, "_warned_env", set())
  monkeypatch.setenv("GLM5_JAX_KERNEL", "0")
  with pytest.warns(UserWarning, match="GLM5_JAX_KERNEL is not a glm5_jax variable"):
    glm5_jax.Routing.from_env()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    glm5_jax.Routing.from_env()                  # once per name
    glm5_jax.Routing.from_env({"GLM5_JAX_KERNELS": "0", "GLM5_JAX_PDL": "1"})


# ----------------------------------------------------------------------- fuzz

def bad_values(cache, batch, config):
  """{field: [bad values]}: each index argument's out-of-range forms (negative, huge, just
  past its table), never an in-range id of another row (aliasing is a scheduler's contract,
  not a value the ops can tell)."""
  pages, page = cache.kv_cache.shape[:2]
  blocks, ring = cache.tail.shape[0], cache.tail.shape[2]
  tokens = capacity(cache, batch, config)
  return {
      "positions": [-1, -7, tokens, tokens + 5, I32_MAX],
      "loc": [-5, pages * page, I32_MAX],
      "tslot": [-3, blocks * ring, I32_MAX],
      "req_ids": [-1, batch.page_table.shape[0], I32_MAX],
      "page_table": [-1, pages, I32_MAX],
      "block_table": [-7, -1, 2 ** 30, max_block_id(config.block_size, config.block_size) + 1,
                      I32_MAX],
  }


def fuzz(rng, args, config, cells=3):
  """args with `cells` random elements of random fields set to random bad values, and
  maybe a NaN or inf in x or qr."""
  weights, cache, x, qr, batch = args
  fields = {}
  for field, values in bad_values(cache, batch, config).items():
    if rng.random() < 0.6:
      a = np.array(getattr(batch, field))
      flat = a.reshape(-1)
      flat[rng.integers(0, flat.size, cells)] = rng.choice(values, cells)
      fields[field] = a
  batch = _replace(batch, **fields)
  for name in ("x", "qr"):
    if rng.random() < 0.3:
      a = np.array((x if name == "x" else qr).astype(jnp.float32))
      a[rng.integers(0, a.shape[0]), rng.integers(0, a.shape[1])] = rng.choice(
          [np.nan, np.inf, -np.inf])
      a = jnp.asarray(a, jnp.bfloat16)
      x, qr = (a, qr) if name == "x" else (x, a)
  return weights, cache, x, qr, batch


def owned(cache, batch, positions):
  """(K-cache slots, tail (block, row) pairs) the good rows of a step may write (SPEC §3):
  real rows (0 <= position) of a tail block inside the ring; a completing one its loc."""
  pages, page = cache.kv_cache.shape[:2]
  blocks, ring = cache.tail.shape[0], cache.tail.shape[2]
  slots, rows = set(), set()
  for p, loc, ts in zip(*(np.asarray(a).reshape(-1) for a in (positions, batch.loc, batch.tslot))):
    blk = max(int(ts), 0) // ring
    if p < 0 or blk >= blocks:
      continue
    if p % 4 == 3 and 0 <= loc < pages * page:
      slots.add(int(loc))
    if ts >= 0:
      rows.add((blk, int(p) % ring))
  return slots, rows


def changed_tail_rows(before, after):
  b, a = np.asarray(before).view(np.uint16), np.asarray(after).view(np.uint16)
  diff = np.any(b != a, axis=(1, 3))                                   # [blocks, RING]
  return {(int(i), int(j)) for i, j in zip(*np.nonzero(diff))}


def check_step(args, got, want, config):
  """got (the stage) == want (its reference) bit for bit, and both hold the documented
  semantics: slots and counts those of the oracle's remap of the causal selection with rows
  past capacity made pads; no cache byte written outside what the good rows own."""
  weights, cache, x, qr, batch = args
  for g, w in zip(tree_bytes(got), tree_bytes(want), strict=True):
    np.testing.assert_array_equal(g, w)
  out, new = got
  tokens = capacity(cache, batch, config)
  pos = np.asarray(batch.positions).reshape(-1)
  pos = np.where(pos < tokens, pos, -1)
  pools = np.where(pos >= 0, (pos.astype(np.int64) + 1) // 4, 0)
  k = config.topk_tokens // 4
  assert pools.max() <= k, "the fuzz cases keep every row within the causal fill"
  ids = np.where(np.arange(k) < pools[:, None], np.arange(k), -1).astype(np.int32)
  # Rows whose request has no page-table row select nothing either (SPEC §12).
  slots, counts = oracle.expand_and_remap(ids, pos, np.asarray(batch.req_ids),
                                          np.asarray(batch.block_table),
                                          block_size=config.block_size, width=config.width)
  np.testing.assert_array_equal(np.asarray(out.slots), slots)
  np.testing.assert_array_equal(np.asarray(out.counts), counts)
  own_slots, own_rows = owned(cache, batch, pos.reshape(batch.positions.shape))
  assert set(oracle.differing_entries(new.kv_cache, cache.kv_cache)) <= own_slots
  assert changed_tail_rows(cache.tail, new.tail) <= own_rows


def _stage_cases(seed, count, vary=True):
  """Fuzzed stage arguments: 1-4 requests of 1-3 tokens at random contexts (vary), else 4
  of 2 with the last at 1400 (one set of shapes: one compile for all cases)."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    if vary:
      contexts, next_n = list(rng.integers(0, 1500, rng.integers(1, 5))), int(rng.integers(1, 4))
    else:
      contexts, next_n = list(rng.integers(0, 1400, 3)) + [1400], 2
    args = state(contexts, next_n, seed=int(rng.integers(1 << 30)))
    yield fuzz(rng, args, CONFIG, cells=int(rng.integers(1, 4)))


def on_cpu(fuzzer):
  """A fuzzer that compares the stage with its reference bit for bit, run on the CPU: only
  there are both the reference's lowering (on a GPU the kernels meet SPEC D2's rules, which
  run_gpu_fuzz, their GPU form, checks)."""
  @functools.wraps(fuzzer)
  def run(*args, **kwargs):
    with jax.default_device(jax.devices("cpu")[0]):
      return fuzzer(*args, **kwargs)
  return run


@on_cpu
def run_stage_fuzz(seed, count, vary=True):
  for args in _stage_cases(seed, count, vary):
    got = STEP(*args, config=CONFIG)
    want = STEP(*args, config=CONFIG, use_reference=True)
    check_step(args, got, want, CONFIG)


@on_cpu
def run_decode_fuzz(seed, steps):
  """A decode loop: every step advances each request by next_n and fuzzes its batch; the
  stage's caches carry over and stay equal to the reference's."""
  rng = np.random.default_rng(seed)
  weights, cache, x, qr, batch = state([11, 402, 960], 2, seed=seed)
  ref_cache = cache
  for _ in range(steps):
    args = fuzz(rng, (weights, cache, x, qr, batch), CONFIG)
    got = STEP(*args, config=CONFIG)
    want = STEP(args[0], ref_cache, *args[2:], config=CONFIG, use_reference=True)
    check_step(args, got, want, CONFIG)
    cache, ref_cache = got[1], want[1]
    pos = np.asarray(batch.positions) + 2
    from glm5_jax import synthetic
    batch = synthetic.decode_batch(pos, cache, batch.page_table, batch.block_table)


@on_cpu
def run_prefill_fuzz(seed, count):
  from glm5_jax import synthetic
  rng = np.random.default_rng(seed)
  for _ in range(count):
    weights, cache, _, _, dbatch = state([40, 700], 1, seed=int(rng.integers(1 << 30)))
    starts = rng.integers(0, 600, 2)
    lengths = rng.integers(1, 12, 2)
    pbatch, _ = synthetic.prefill_batch(starts, lengths, cache, dbatch.page_table,
                                        rows=24)
    x = synthetic.inputs(rng, pbatch.positions.shape[0], hidden=256, q_lora=128)[0]
    fake = dataclasses.replace(dbatch, positions=pbatch.positions[:, None],
                               loc=pbatch.loc[:, None], tslot=pbatch.tslot[:, None],
                               req_ids=jnp.zeros(pbatch.positions.shape, jnp.int32))
    _, cache, x, _, fake = fuzz(rng, (weights, cache, x, x[:, :128], fake), CONFIG)
    pbatch = glm5_jax.PrefillBatch(fake.positions[:, 0], fake.loc[:, 0], fake.tslot[:, 0])
    got = PREFILL(weights, cache, x, pbatch, config=CONFIG)
    want = PREFILL(weights, cache, x, pbatch, config=CONFIG, use_reference=True)
    for g, w in zip(tree_bytes(got), tree_bytes(want), strict=True):
      np.testing.assert_array_equal(g, w)
    # Prefill has no page table: a pad is a negative position; the seed follows tslot alone.
    own_slots, _ = owned(cache, fake, fake.positions)
    assert set(oracle.differing_entries(got.kv_cache, cache.kv_cache)) <= own_slots
    blocks, ring = cache.tail.shape[0], cache.tail.shape[2]
    seeds = {(int(t) // ring, int(t) % ring) for t in np.asarray(pbatch.tslot)
             if 0 <= t < blocks * ring}
    assert changed_tail_rows(cache.tail, got.tail) <= seeds


def test_fuzz_stage():
  run_stage_fuzz(seed=0, count=6, vary=False)


def test_fuzz_decode_loop():
  run_decode_fuzz(seed=1, steps=3)


def test_fuzz_prefill():
  run_prefill_fuzz(seed=2, count=3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_fuzz_long(seed):
  run_stage_fuzz(seed=100 + seed, count=12)
  run_decode_fuzz(seed=200 + seed, steps=8)
  run_prefill_fuzz(seed=300 + seed, count=8)


# ----------------------------------------------------------------------- GPU

def run_gpu_fuzz(seed, count):
  """The stage with every kernel on against its reference (on the CPU) on fuzzed batches.
  Slots, counts and the tail bit for bit; the K cache within SPEC D2 (oracle.compare_cache:
  the kernels' exp and division) and unchanged outside the good rows' entries, its guard
  pages (the spare pages no page table names) included; no tail row changed outside the
  good rows'. Out-of-range ids point outside the buffers: compute-sanitizer memcheck (this
  file's __main__) catches a write there."""
  cpu = jax.devices("cpu")[0]
  config = dataclasses.replace(CONFIG, routing=glm5_jax.Routing(kernels=True))
  for args in _stage_cases(seed, count):
    weights, cache, x, qr, batch = args
    guard_pages = sorted(set(range(cache.kv_cache.shape[0]))
                         - set(np.asarray(batch.page_table).reshape(-1).tolist()))
    before, tail_before = np.asarray(cache.kv_cache), np.asarray(cache.tail)
    out, new = STEP(*args, config=config)
    ref_out, ref_new = STEP(*jax.device_put(args, cpu), config=CONFIG, use_reference=True)
    np.testing.assert_array_equal(np.asarray(out.slots), np.asarray(ref_out.slots))
    np.testing.assert_array_equal(np.asarray(out.counts), np.asarray(ref_out.counts))
    np.testing.assert_array_equal(oracle.bits_any_nan(new.tail),
                                  oracle.bits_any_nan(ref_new.tail))
    tokens = capacity(cache, batch, CONFIG)
    pos = np.asarray(batch.positions)
    own_slots, own_rows = owned(cache, batch, np.where(pos < tokens, pos, -1))
    oracle.compare_cache(ref_new.kv_cache, new.kv_cache, before, own_slots,
                         label=f"seed {seed}")
    got = np.asarray(new.kv_cache)
    for p in guard_pages:
      np.testing.assert_array_equal(got[p], before[p], err_msg=f"guard page {p}")
    assert changed_tail_rows(tail_before, new.tail) <= own_rows


@pytest.mark.gpu
@pytest.mark.parametrize("contexts, next_n", [([30000, 60000], 1), ([8000] * 16, 1),
                                              ([100, 3000, 20000, 5], 2), ([1500] * 3, 1),
                                              ([202752, 150000], 1)])
def test_select_slots_kernel_closes_holes(contexts, next_n):
  """select_slots' kernel on block tables with entries that name no block inside the
  selection (the causal fill, the one-CTA top-k, the cluster top-k and, past 32,768 pools,
  the 8-CTA cluster): bit-equal to select_pools' kernel then the reference remap, whose
  compaction closes the holes."""
  from test_select_gpu import _select_inputs
  rng = np.random.default_rng(sum(contexts) + next_n)
  args, max_pools = _select_inputs(rng, contexts, next_n)
  blocks = max(contexts) // 128 + 2
  table = rng.permutation(len(contexts) * blocks).reshape(len(contexts), blocks)
  for r, context in enumerate(contexts):
    cols = rng.integers(0, context // 128 + 1, 3)
    table[r, cols] = rng.choice([-7, -1, 2 ** 30, max_block_id(128, 128) + 1, I32_MAX], 3)
  table = jnp.asarray(table, jnp.int32)
  params = dict(k=512, max_pools=max_pools, block_size=128, width=2176,
                routing=glm5_jax.Routing(kernels=True))
  assert glm5_jax.plan.chooses_kernel(glm5_jax.select_slots, *args, table, **params)
  slots, counts = jax.jit(lambda *a: glm5_jax.select_slots(*a, **params))(*args, table)
  ids, _ = jax.jit(lambda *a: glm5_jax.select_pools(
      *a, k=512, max_pools=max_pools, routing=params["routing"]))(*args)
  _, _, _, _, req, pos = (np.asarray(a) for a in args)
  want = oracle.expand_and_remap(np.asarray(ids), pos, req, np.asarray(table), block_size=128,
                                 width=2176)
  np.testing.assert_array_equal(np.asarray(slots), want[0])
  np.testing.assert_array_equal(np.asarray(counts), want[1])
  assert np.any(want[1] < np.minimum(4 * 512 + 3, pos + 1)), "no hole was selected"


def test_bits_any_nan_tells_everything_but_nan_patterns_apart():
  """The tail check of run_gpu_fuzz: CUDA's and the CPU's NaN patterns compare equal; -0
  against +0, one bf16 ulp, and NaN against inf do not."""
  want = np.array([0xFFC0, 0x0000, 0x3F80, 0x7F80], np.uint16).view(jnp.bfloat16)
  same = np.array([0x7FFF, 0x0000, 0x3F80, 0x7F80], np.uint16).view(jnp.bfloat16)
  np.testing.assert_array_equal(oracle.bits_any_nan(same), oracle.bits_any_nan(want))
  for wrong in ([0x7FFF, 0x8000, 0x3F80, 0x7F80], [0x7FFF, 0x0000, 0x3F81, 0x7F80],
                [0x7F80, 0x0000, 0x3F80, 0x7F80], [0x7FFF, 0x0000, 0x3F80, 0x7FC0]):
    got = np.array(wrong, np.uint16).view(jnp.bfloat16)
    assert np.any(oracle.bits_any_nan(got) != oracle.bits_any_nan(want)), wrong


@pytest.mark.gpu
def test_fuzz_gpu():
  run_gpu_fuzz(seed=7, count=16)


if __name__ == "__main__":
  # compute-sanitizer --tool memcheck --error-exitcode 9 python tests/test_values.py [cases]
  run_gpu_fuzz(seed=11, count=int(sys.argv[1]) if len(sys.argv) > 1 else 24)
  print("fuzz: ok")
