"""Group "prefill": glm5_jax.indexer_prefill of whole prompts, one call per prompt set,
jitted with the cache donated (updated in place). Rows "prompt=<tokens>": one request
of that many tokens from position 0 (Sizes.prefill_prompts, --prefill-prompts), then
"prompt=<a>+<b>+..": all of them as one mixed batch (request-major, each request its
own pages and tail block). device_us is µs per call. Variant "kernel" = the default
routing, "reference" = every op on its pure-JAX reference (Routing(kernels=False)); in
this version the projection and kpool_compress have kernels; kpool_seed_tail and the
windows' gathers run as XLA code in both variants.

floor = max(bytes / copy bandwidth, FLOPs / bf16 peak) (workloads.floor_us) of one
call: W_cat, the LayerNorm weight and bias and the APE read once, x read, each
completed pool's K-cache entry (132 B) and each request's last (up to 4) tail rows
(key and gate, 512 B) written; the projection's 2 * rows * 4096 * 288 FLOPs. Runs
hold STEPS calls (harness.time_step), each on its own x (the same positions: every
call rewrites the same entries), so the host's dispatch hides behind short prompts."""
import gc

import numpy as np
import jax
import jax.numpy as jnp

import glm5_jax
from glm5_jax import synthetic
from glm5_jax.reference.numerics import DIM, POOL

from .harness import time_step
from .sizes import CONFIG, ENTRY, HIDDEN, W_ROWS, Sizes
from .stage import ROUTINGS
from .variants import KERNEL, REFERENCE
from .workloads import floor_us

NAME = "prefill"
STEPS = 4      # prefill calls per timed run, each on its own x


def add_arguments(parser):
  default = ",".join(map(str, Sizes().prefill_prompts))
  parser.add_argument("--prefill-prompts", default="",
                      help=f"comma-separated prompt lengths (tokens) of the prefill group "
                           f"(default {default}; a mixed batch of all of them follows)")


def shapes(bench):
  """[(label, prompt lengths)]: each prompt alone, then all of them together."""
  text = bench.args.prefill_prompts
  prompts = tuple(int(v) for v in text.split(",")) if text else bench.s.prefill_prompts
  out = [(f"prompt={p}", (p,)) for p in prompts]
  if len(prompts) > 1:
    out.append(("prompt=" + "+".join(map(str, prompts)), prompts))
  return out


def prefill_bytes(lengths, ring):
  """Minimum bytes of one call (the floor above)."""
  lengths = np.asarray(lengths)
  weights = W_ROWS * HIDDEN * 2 + 2 * DIM * 4 + POOL * DIM * 4
  x = int(lengths.sum()) * HIDDEN * 2
  written = int((lengths // POOL).sum()) * ENTRY + int(np.minimum(lengths, ring).sum()) * (
      2 * DIM * 2)
  return weights + x + written


def _state(lengths, seed):
  rng = np.random.default_rng(seed)
  weights = synthetic.layer(rng, CONFIG)
  cache, page_table, _ = synthetic.decode_cache(rng, len(lengths), max(lengths))
  batch, _ = synthetic.prefill_batch(np.zeros(len(lengths), int), lengths, cache, page_table)
  rows = int(sum(lengths))
  key = jax.random.key(seed)
  xs = [jax.random.normal(jax.random.fold_in(key, k), (rows, HIDDEN), jnp.bfloat16)
        for k in range(STEPS)]
  return weights, cache, xs, batch


def _step(config):
  def step(cache, k, weights, xs, batch):
    return glm5_jax.indexer_prefill(weights, cache, xs[k], batch, config=config), ()
  return step


def run(bench):
  s = bench.s
  variants = bench.kept([KERNEL, REFERENCE] if bench.module else [REFERENCE])
  labelled = [(shape, (lengths,)) for shape, lengths in shapes(bench)]
  build = lambda lengths: _state(lengths, seed=sum(lengths))  # noqa: E731
  for shape, (lengths,), state in bench.states(NAME, labelled, variants, build):
    weights, cache, xs, batch = state
    del state
    rows, ring = int(sum(lengths)), cache.tail.shape[2]
    nbytes, flops = prefill_bytes(lengths, ring), 2 * rows * HIDDEN * W_ROWS
    floor = floor_us(nbytes, flops, bench.bw)
    for variant in variants:
      config = glm5_jax.IndexerConfig(routing=ROUTINGS[variant])
      try:
        sec, cache, info = time_step(_step(config), cache, (weights, xs, batch), s,
                                     steps=STEPS)
        bench.row(NAME, shape, variant, sec * 1e6, floor, None, reps=s.reps,
                  gbps=nbytes / sec / 1e9, min_bytes=nbytes, flops=flops,
                  dispatch_us=round(info["dispatch_us"], 2), run_us=round(info["run_us"], 2),
                  compile_s=round(info["compile_s"], 2),
                  notes=f"{len(lengths)} request(s), {rows} rows in one call, {STEPS} "
                        "calls per timed run, µs per call")
        bench.log(f"prefill {shape} {variant}: {sec * 1e6:.1f} us per call "
                  f"(floor {floor:.1f}, run {info['run_us']:.0f} us, dispatch "
                  f"{info['dispatch_us']:.0f} us)")
      except Exception as e:                             # noqa: BLE001
        bench.error_row(NAME, shape, variant, e)
        if any(a.is_deleted() for a in jax.tree.leaves(cache)):
          break                                          # the cache was donated away
      bench.write_json()
    del weights, cache, xs, batch
    gc.collect()
