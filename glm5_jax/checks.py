"""Runtime values of a decode step: the capacity rule every op path shares, and the checked
mode a serving loop can run every N steps (docs/semantics.md §12).

The ops give a defined result for every index value (SPEC §12: a bad one is dropped, never
counted, never written out of bounds), so a scheduler bug shows as missing slots, not as a
crash. check_batch is the signal: it names the first value that is not one of the documented
forms, by argument, row and value, under jit on any backend (jax.experimental.checkify).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from .reference.expand import max_block_id
from .reference.numerics import POOL

__all__ = ["capacity", "check_batch", "pad_past_capacity"]


def capacity(cache, batch, config) -> int:
  """Tokens a request can hold (SPEC §12): min(4 * MP * PAGE, MB * block_size,
  4 * max_pools) for batch.page_table i32[R, MP], cache.kv_cache pages of PAGE entries and
  batch.block_table i32[R, MB]: the pools its page table names, the tokens its block table
  maps, the pools the logits can score. Shapes only (trace time)."""
  page = cache.kv_cache.shape[1]
  return min(POOL * batch.page_table.shape[1] * page,
             batch.block_table.shape[1] * config.block_size, POOL * config.max_pools)


def pad_past_capacity(cache, batch, config):
  """`batch` (a DecodeBatch) with every position at or past capacity(cache, batch, config)
  made a pad (-1): such a row touches no cache and selects nothing (count 0), SPEC §12."""
  positions = batch.positions
  positions = jnp.where(positions < capacity(cache, batch, config), positions, -1)
  return dataclasses.replace(batch, positions=positions.astype(batch.positions.dtype))


def _first(bad):
  """(any, flat index of the first True) of a bool array."""
  flat = bad.reshape(-1)
  return jnp.any(flat), jnp.argmax(flat)


def _check(bad, values, message):
  """checkify.check that no element of `bad` is set. `message` names the element with
  "{at}", which becomes the first set one's index (comma-separated), and ends with its value
  from `values` (bad's shape)."""
  found, first = _first(bad)
  index = jnp.unravel_index(first, bad.shape)
  at = ", ".join("{" + f"i{d}" + "}" for d in range(bad.ndim))
  checkify.check(~found, message.replace("{at}", at) + ": got {value}",
                 value=values.reshape(-1)[first], **{f"i{d}": i for d, i in enumerate(index)})


def _batch_checks(cache, x, qr, batch, config):
  kv, tail = cache.kv_cache, cache.tail
  pages, page = kv.shape[:2]
  blocks, ring = tail.shape[0], tail.shape[2]
  requests = min(batch.page_table.shape[0], batch.block_table.shape[0])
  tokens = capacity(cache, batch, config)
  positions, loc, tslot = batch.positions, batch.loc, batch.tslot
  b, n = positions.shape
  op = "glm5_jax.check_batch: "
  _check(positions < -1, positions, op + "batch.positions[{at}] is below -1 (a pad is -1)")
  _check(positions >= tokens, positions,
         op + "batch.positions[{at}] is past the capacity, " + f"{tokens} tokens = min(4 x "
         f"page_table columns {batch.page_table.shape[1]} x PAGE {page}, block_table columns "
         f"{batch.block_table.shape[1]} x block_size {config.block_size}, 4 x max_pools "
         f"{config.max_pools})")
  real = positions >= 0
  req = batch.req_ids.reshape(b, n)
  _check(real & ((req < 0) | (req >= requests)), req,
         op + "batch.req_ids of the real row [{at}] (request, token) is outside " +
         f"[0, {requests}) (the page_table and block_table rows)")
  completes = real & (positions % POOL == POOL - 1)
  _check((loc < -1) | (loc >= pages * page) | (~completes & (loc >= 0)), loc,
         op + "batch.loc[{at}] is neither -1 nor, on a row completing a pool, a slot in " +
         f"[0, {pages * page}) (kv_cache pages x PAGE)")
  want = jnp.where(real, positions, 0) % ring
  _check(real & ((tslot < -1) | (tslot >= blocks * ring) | ((tslot >= 0) & (tslot % ring != want))),
         tslot, op + "batch.tslot[{at}] of a real row is neither -1 nor tail block x " +
         f"{ring} + position % {ring} inside the tail ({blocks} blocks)")
  # The table entries a real row reads: the pages of its pools, the blocks of its tokens
  # (only where the row and its request are good: reported above otherwise).
  ok = (real & (positions < tokens) & (req >= 0) & (req < requests)).reshape(-1)
  r = jnp.clip(batch.req_ids, 0, requests - 1)
  pos = jnp.where(ok, positions.reshape(-1), -1)
  pools = jnp.where(pos >= 0, pos // POOL + (pos % POOL == POOL - 1), 0)
  page_rows = batch.page_table[r]
  used = jnp.arange(page_rows.shape[1]) * page < pools[:, None]
  _check(used & ((page_rows < 0) | (page_rows >= pages)), page_rows,
         op + "batch.page_table[req_ids[row], column] at [row, column] = [{at}] names no "
         f"page of the cache [0, {pages})")
  block_rows = batch.block_table[r]
  used = jnp.arange(block_rows.shape[1]) * config.block_size <= pos[:, None]
  top = max_block_id(config.block_size, config.block_size)
  _check(used & ((block_rows < 0) | (block_rows > top)), block_rows,
         op + "batch.block_table[req_ids[row], column] at [row, column] = [{at}] names no "
         f"block (entries 0..{top})")
  for name, value in (("x", x), ("qr", qr)):
    value = value.astype(jnp.float32)
    _check(~jnp.isfinite(value), value, op + name + "[{at}] is not finite")


@functools.partial(jax.jit, static_argnames="config")
def _checked(cache, x, qr, batch, config):
  error, _ = checkify.checkify(_batch_checks)(cache, x, qr, batch, config)
  return error


def check_batch(weights, cache, x, qr, batch, *, config=None) -> checkify.Error:
  """The first value of a decode step's inputs that is not a documented form
  (docs/semantics.md §12), as a checkify.Error: err.get() is None where every value is
  good, else "glm5_jax.check_batch: <argument>[<row>, ...] <what is wrong> (got <value>)";
  err.throw() raises it. Jitted (config static); a serving loop calls it every N steps on
  indexer_stage's arguments (cache: the IndexerCache before the step); they are checked at
  trace time as indexer_stage checks them.

  Checked, in this order (the first failing check is reported, its first element):
  positions below -1 or past capacity(); req_ids of real rows outside both tables; loc
  other than -1 or, on a row completing a pool, a slot of the cache; tslot of real rows
  other than -1 or its tail block's row of the position; page_table entries of the pages a
  real row reads outside the cache; block_table entries of the blocks it reads naming no
  block (negative, or slots past int32); non-finite x or qr.
  """
  from .stage import IndexerConfig, _check_stage_inputs
  config = IndexerConfig() if config is None else config
  _check_stage_inputs(weights, cache, x, qr, batch, config)
  return _checked(cache, x, qr, batch, config)
