"""Group "stage": indexer_stage as a serving stack runs it. One jitted decode step of
`stage_layers` (11) DSA layers, each with its own weights and caches (donated, updated
in place, threaded from step to step), batch metadata already on the device; steps
dispatched back to back (harness.time_step: STEPS decode steps per executable, so the
host's dispatch of each run is amortised; a step returns one scalar that reads every
layer's output, consumed()); layers and steps chained by default (--stage-chained: each
layer's inputs read the output before it, as in a model, so XLA cannot batch one layer's
GEMMs over the steps of a run). Rows "M=<m>,ctx=<tokens>": µs per layer
(step time / layers) in device_us, M requests of one decode token each, every request
at the same context; variant "kernel" = the default config and routing (the update part
as IndexerConfig(update="auto") chooses), "reference" = every op on its pure-JAX
reference (Routing(kernels=False)), in the same run; with --stage-update-fused also
"kernel, update fused" = the update part as indexer_update's one FFI call at every M
(update="fused", its kernel named in the routing), with --stage-update-ops also "kernel,
update as three ops" (update="ops"): the alternatives to "auto"'s choice; with
--stage-update-only also "kernel, update part only" = the stage's update part alone
(stage.update_path: q, projection, query epilogue, kpool_update as "auto" chooses; no
selection), what issue 12's targets are about, and with --stage-update-ops as well "kernel,
update part only, three ops" (update="ops") and with --stage-update-fused as well "kernel,
update part only, indexer_update" (update="fused", its kernel routed on); with
--stage-select-ops also "kernel, select as two ops" = the select path as select_pools +
expand_and_remap (Routing(ops={"select_slots": False})) where the default runs
select_slots' one call; with --stage-q-kernel also "kernel, q kernel" = the default with
indexer_q's kernel on, with --stage-pdl-off as well "kernel, q kernel, PDL off", with
--stage-update-only as well "kernel, update part only, q kernel" (and with
--stage-update-fused too "kernel, update part only, indexer_update, q kernel": indexer_q's
kernel then indexer_update's, two FFI calls); with --stage-q-epilogue
also "kernel, q in epilogue" = the default with update_epilogue_q's kernel on (q's GEMM in
the epilogue's FFI call), with --stage-update-only as well "kernel, update part only, q in
epilogue"; with --stage-update-q also "kernel, indexer_update_q" = the default with
indexer_update_q's kernel on (the whole update part in one FFI call), with
--stage-update-only as well "kernel, update part only, indexer_update_q"."""
import argparse
import gc

import numpy as np
import jax
import jax.numpy as jnp

import glm5_jax
from glm5_jax import plan, synthetic
from glm5_jax import stage as glm5_stage

from .harness import host_note, time_step
from .sizes import CONFIG, POOL, Sizes
from .variants import (
  BARRIER_CHAIN,
  KERNEL,
  NO_PDL,
  Q_EPILOGUE,
  Q_KERNEL,
  Q_KERNEL_NO_PDL,
  REFERENCE,
  SELECT_OPS,
  UPDATE_FUSED,
  UPDATE_ONLY,
  UPDATE_ONLY_FUSED,
  UPDATE_ONLY_FUSED_Q_KERNEL,
  UPDATE_ONLY_OPS,
  UPDATE_ONLY_Q_EPILOGUE,
  UPDATE_ONLY_Q_KERNEL,
  UPDATE_ONLY_UPDATE_Q,
  UPDATE_OPS,
  UPDATE_Q,
)

NAME = "stage"


def shape_arguments(parser, group):
  """--<group>-contexts and --<group>-rows, defaulting to Sizes.<group>_contexts and
  Sizes.<group>_rows (the whole-step groups: stage, serving)."""
  s = Sizes()
  for what, help_text in (("contexts", "contexts (tokens)"), ("rows", "M")):
    default = ",".join(map(str, getattr(s, f"{group}_{what}")))
    parser.add_argument(f"--{group}-{what}", default="",
                        help=f"comma-separated {help_text} of the {group} group "
                             f"(default {default})")


def label(m, ctx, next_n=1):
  """A whole-step row's shape: "M=<m>[,next_n=<n>],ctx=<context>", next_n named where rows
  come as requests of more than one."""
  return f"M={m}{f',next_n={next_n}' if next_n > 1 else ''},ctx={ctx}"


def shapes(bench, group, next_n=1):
  """[(label, (context, M))] of a whole-step group: its flags, else the run's sizes."""
  def ints(what):
    text = getattr(bench.args, f"{group}_{what}")
    return (tuple(int(v) for v in text.split(",")) if text
            else getattr(bench.s, f"{group}_{what}"))
  return [(label(m, ctx, next_n), (ctx, m)) for ctx in ints("contexts") for m in ints("rows")]


def stage_shapes(bench):
  """[(label, (context, M, next_n))] of the stage group: shapes() at --stage-next-n, and
  where no shape flag narrows the run, the serving envelope past the grid too
  (Sizes.stage_envelope)."""
  next_n = bench.args.stage_next_n
  out = {name: (ctx, m, next_n) for name, (ctx, m) in shapes(bench, NAME, next_n)}
  if not (bench.args.stage_contexts or bench.args.stage_rows) and next_n == 1:
    for ctx, m, n in bench.s.stage_envelope:
      out.setdefault(label(m, ctx, n), (ctx, m, n))
  return list(out.items())


def add_arguments(parser):
  shape_arguments(parser, NAME)
  parser.add_argument("--stage-next-n", type=int, default=1,
                      help="rows per request (MTP: 1 + the draft tokens): M rows are M / N "
                           "requests of N consecutive positions (default 1)")
  parser.add_argument("--stage-pdl-off", action="store_true",
                      help="also time the kernels with PDL off (Routing(pdl=False)): the "
                           "launches after XLA's own kernels gain nothing from it")
  parser.add_argument("--stage-update-fused", action="store_true",
                      help="also time the stage with IndexerConfig(update='fused'): "
                           "indexer_update's kernel (projection, query epilogue and "
                           "kpool_update in one FFI call) at every M")
  parser.add_argument("--stage-update-ops", action="store_true",
                      help="also time the stage with IndexerConfig(update='ops'): the "
                           "update part as the three ops at every M")
  parser.add_argument("--stage-select-ops", action="store_true",
                      help="also time the stage with Routing(ops={'select_slots': False}): "
                           "the select path as select_pools + expand_and_remap (two FFI "
                           "calls) instead of select_slots' one")
  parser.add_argument("--stage-q-kernel", action="store_true",
                      help="also time the stage with indexer_q's kernel forced on at every "
                           f"M (the default runs it at {plan.KERNEL_ROWS['indexer_q'].rows}, "
                           "plan.KERNEL_ROWS); with --stage-pdl-off also with PDL off")
  parser.add_argument("--stage-q-epilogue", action="store_true",
                      help="also time the stage with update_epilogue_q's kernel on (q's GEMM "
                           "and the epilogue in one FFI call)")
  parser.add_argument("--stage-update-q", action="store_true",
                      help="also time the stage with indexer_update_q's kernel on (the "
                           "q GEMM, the projection and the epilogue in one FFI call)")
  parser.add_argument("--stage-steps", type=int, default=STEPS,
                      help=f"decode steps per timed run (default {STEPS}; the reference at "
                           f"most {REFERENCE_STEPS}); each step its own inputs, so a run's "
                           "dispatch grows with them too")
  parser.add_argument("--stage-chained", action=argparse.BooleanOptionalAction, default=True,
                      help="layer l + 1's inputs read layer l's output, the first layer's the "
                           "last layer's cache of the step before (_step's chained), as in a "
                           "model; --no-stage-chained: independent layers and steps, which "
                           "XLA's dot merger batches across the steps of a run")
  parser.add_argument("--stage-chain-barrier", action="store_true",
                      help="chain layers and steps through lax.optimization_barrier instead "
                           "of the two fusions (x + 0 * prev, qr + 0 * prev) a layer: the "
                           "same order of work without the fusions' ~2.9 µs a layer, which "
                           "stand for the model's ops that make x and qr")
  parser.add_argument("--stage-update-only", action="store_true",
                      help="also time the stage's update part alone (q, projection, "
                           "query epilogue, kpool_update; no selection)")


ROUTINGS = {KERNEL: glm5_jax.Routing(), REFERENCE: glm5_jax.Routing(kernels=False),
            NO_PDL: glm5_jax.Routing(pdl=False),
            UPDATE_FUSED: glm5_jax.Routing(ops={"indexer_update": True}),
            UPDATE_OPS: glm5_jax.Routing(), UPDATE_ONLY: glm5_jax.Routing(),
            UPDATE_ONLY_OPS: glm5_jax.Routing(),
            UPDATE_ONLY_FUSED: glm5_jax.Routing(ops={"indexer_update": True}),
            SELECT_OPS: glm5_jax.Routing(ops={"select_slots": False}),
            Q_KERNEL: glm5_jax.Routing(ops={"indexer_q": True}),
            Q_KERNEL_NO_PDL: glm5_jax.Routing(pdl=False, ops={"indexer_q": True}),
            UPDATE_ONLY_Q_KERNEL: glm5_jax.Routing(ops={"indexer_q": True}),
            UPDATE_ONLY_FUSED_Q_KERNEL: glm5_jax.Routing(ops={"indexer_update": True,
                                                              "indexer_q": True}),
            Q_EPILOGUE: glm5_jax.Routing(ops={"update_epilogue_q": True}),
            UPDATE_ONLY_Q_EPILOGUE: glm5_jax.Routing(ops={"update_epilogue_q": True}),
            UPDATE_Q: glm5_jax.Routing(ops={"indexer_update_q": True}),
            UPDATE_ONLY_UPDATE_Q: glm5_jax.Routing(ops={"indexer_update_q": True})}
# The variants whose stage runs IndexerConfig.update other than its default.
UPDATES = {UPDATE_FUSED: "fused", UPDATE_OPS: "ops", UPDATE_ONLY_OPS: "ops",
           UPDATE_ONLY_FUSED: "fused", UPDATE_ONLY_FUSED_Q_KERNEL: "fused"}
# The variants that time the update part alone.
UPDATE_PART = (UPDATE_ONLY, UPDATE_ONLY_OPS, UPDATE_ONLY_FUSED, UPDATE_ONLY_Q_KERNEL,
               UPDATE_ONLY_FUSED_Q_KERNEL, UPDATE_ONLY_Q_EPILOGUE, UPDATE_ONLY_UPDATE_Q)


# Decode steps per timed run (one executable): a run costs the host a fixed ~200 µs plus
# ~35-50 µs a step (H200, 1K context, M = 1, session 15: 414 µs of dispatch per 4-step run,
# 806 per 16): 4 steps left every 1K row host-bound; 16 amortise the fixed part.
STEPS = 16
# Decode steps a run of the reference variant (at most --stage-steps): with layers and steps
# chained, XLA took over 130 s to compile the reference's 16 steps of 11 layers on the H200
# (2026-12-02; the kernels' 4 s), and a reference step (70-1800 µs) is long enough that two
# steps a run amortise the host's dispatch.
REFERENCE_STEPS = 2


def _config(ctx, routing, update=None):
  # The logits width of a deployment serving contexts up to ctx tokens (page-padded).
  max_pools = max(-(-(ctx // POOL) // 64) * 64, CONFIG.topk_tokens // POOL)
  update = {} if update is None else dict(update=update)
  return glm5_jax.IndexerConfig(max_pools=max_pools, routing=routing, **update)


def layers_state(rng, m, max_context, layers, next_n=1):
  """(weights, caches, page_table, block_table) of `layers` layers for m requests of up
  to max_context tokens, next_n rows each: each layer its own weights and cache buffers."""
  weights = [synthetic.layer(rng, CONFIG) for _ in range(layers)]
  # One random cache, copied on the device per layer: distinct buffers (each layer's
  # pages cold), without drawing 11 x up to 280 MB of random numbers on the host.
  cache, pt, bt = synthetic.decode_cache(rng, m, max_context, next_n=next_n)
  caches = [cache] + [jax.tree.map(jnp.copy, cache) for _ in range(layers - 1)]
  return weights, caches, pt, bt


def _state(m, ctx, layers, seed, steps=STEPS, next_n=1):
  rng = np.random.default_rng(seed)
  if m % next_n:
    raise ValueError(f"M={m} is not a multiple of next_n={next_n}")
  weights, caches, pt, bt = layers_state(rng, m // next_n, ctx, layers, next_n)
  cache = caches[0]
  # Every request at ctx tokens with this step's tokens (positions ctx - next_n .. ctx - 1,
  # the last one ctx / 4 pools).
  positions = np.broadcast_to(ctx - next_n + np.arange(next_n), (m // next_n, next_n))
  batch = synthetic.decode_batch(positions, cache, pt, bt)
  # Every layer of each of the steps of a run gets its own x and qr (no work shared
  # between layers or steps; synthetic.layer_inputs says why).
  xs, qrs = map(list, zip(*(synthetic.layer_inputs(rng, m, layers) for _ in range(steps))))
  return weights, caches, xs, qrs, batch


def _step(config, update_only=False, consume=True, chained=False, barrier=False, ops=None):
  """step(caches, k, weights, xs, qrs, batch) -> (caches, out): decode step k of every
  layer (layer l on xs[k][l], qrs[k][l]): indexer_stage (out reads every layer's counts),
  or with update_only its update part alone (out reads every layer's w_out): consumed(),
  or without consume the list of those outputs. chained: layer l + 1's x and qr also read
  layer l's output (as in a model, where they are computed from it), and the first layer's
  read the last layer's cache as the step before left it, so that neither a graph scheduled
  for concurrency nor XLA's dot merger (which batches GEMMs that share a weight and do not
  depend on each other: one layer's over the steps of a run) can join work that a model
  runs one after the other; without it the layers and steps are independent. barrier:
  the chain is an optimization barrier over (x, qr, the output before) instead of the two
  fusions: no kernels, only the order (whether the device keeps it is for a timeline to
  show: step_times). ops: the update part's ops (None: glm5_jax.stage's under config;
  scripts/update_q_tactics.py passes them with one op's tactic fixed)."""
  ops = glm5_stage._ops(config, use_reference=False) if ops is None else ops

  def step(caches, k, weights, xs, qrs, batch):
    outs, new = [], []
    for w, c, x, qr in zip(weights, caches, xs[k], qrs[k]):
      if chained:
        # + 0 * (the last layer's first output element): a float multiply XLA does not fold
        # (NaN * 0 is NaN). The first layer reads the last layer's tail ring as the step
        # before left it (a model's next token comes from its last step's output): without
        # it XLA's GPU dot merger batches one layer's GEMMs of all the steps of a run into
        # one (H200 timeline: 56 -> 25 launches a step, q's GEMM 0.55 µs a layer, under
        # its 12.6 MB's 2.6 µs floor). Not a pred converted to f32: XLA turns that times 0
        # into a select of two zeros, which it may fold.
        prev = outs[-1] if outs else caches[-1].tail
      if chained and barrier:
        x, qr, _ = jax.lax.optimization_barrier((x, qr, prev))
      elif chained:
        dep = prev.reshape(-1)[0].astype(jnp.float32) * 0.0
        x, qr = (x + dep).astype(x.dtype), (qr + dep).astype(qr.dtype)
      if update_only:
        rows = batch.positions.size
        _, out, c = glm5_stage.update_path(ops, config, w, c, x, qr, batch, rows)
      else:
        out, c = glm5_jax.indexer_stage(w, c, x, qr, batch, config=config)
        out = out.counts
      outs.append(out)
      new.append(c)
    return new, consumed(outs) if consume else outs
  return step


def consumed(outs):
  """One f32 scalar that reads every layer's output (its first element), as the model's next
  op would consume them inside the step. Returning the outputs themselves makes each an
  entry result in a fresh buffer every run, and XLA re-traces the FFI call that writes it
  (the handler again on the host, every run): host time a serving step does not pay, which
  made the 1K rows host-bound."""
  return sum(o.reshape(-1)[0].astype(jnp.float32) for o in outs)


def run(bench):
  s = bench.s
  variants = bench.kept([KERNEL, REFERENCE] + ([NO_PDL] if bench.args.stage_pdl_off else [])
                        + ([UPDATE_FUSED] if bench.args.stage_update_fused else [])
                        + ([UPDATE_OPS] if bench.args.stage_update_ops else [])
                        + ([UPDATE_ONLY] if bench.args.stage_update_only else [])
                        + ([UPDATE_ONLY_OPS] if bench.args.stage_update_only
                           and bench.args.stage_update_ops else [])
                        + ([UPDATE_ONLY_FUSED] if bench.args.stage_update_only
                           and bench.args.stage_update_fused else [])
                        + ([SELECT_OPS] if bench.args.stage_select_ops else [])
                        + ([Q_KERNEL] if bench.args.stage_q_kernel else [])
                        + ([Q_KERNEL_NO_PDL] if bench.args.stage_q_kernel
                           and bench.args.stage_pdl_off else [])
                        + ([UPDATE_ONLY_Q_KERNEL] if bench.args.stage_q_kernel
                           and bench.args.stage_update_only else [])
                        + ([UPDATE_ONLY_FUSED_Q_KERNEL] if bench.args.stage_q_kernel
                           and bench.args.stage_update_only
                           and bench.args.stage_update_fused else [])
                        + ([Q_EPILOGUE] if bench.args.stage_q_epilogue else [])
                        + ([UPDATE_ONLY_Q_EPILOGUE] if bench.args.stage_q_epilogue
                           and bench.args.stage_update_only else [])
                        + ([UPDATE_Q] if bench.args.stage_update_q else [])
                        + ([UPDATE_ONLY_UPDATE_Q] if bench.args.stage_update_q
                           and bench.args.stage_update_only else [])
                        if bench.module else [REFERENCE])
  steps, chained = bench.args.stage_steps, bench.args.stage_chained
  barrier = chained and bench.args.stage_chain_barrier
  build = lambda ctx, m, next_n: _state(m, ctx, s.stage_layers,  # noqa: E731
                                        seed=m * 7 + ctx, steps=steps, next_n=next_n)
  for shape, (ctx, _, _), state in bench.states(NAME, stage_shapes(bench), variants, build):
    weights, caches, xs, qrs, batch = state
    del state
    for variant in variants:
      routing, name = ROUTINGS[variant], variant + (BARRIER_CHAIN if barrier else "")
      try:
        config = _config(ctx, routing, UPDATES.get(variant))
        step = _step(config, variant in UPDATE_PART, chained=chained, barrier=barrier)
        variant_steps = min(steps, REFERENCE_STEPS) if variant == REFERENCE else steps
        sec, caches, info = time_step(step, caches, (weights, xs, qrs, batch), s,
                                      units=s.stage_layers, steps=variant_steps)
        host = host_note(info)
        bench.row(NAME, shape, name, sec * 1e6, None, None, layers=s.stage_layers,
                  dispatch_us=info["dispatch_us"], run_us=info["run_us"],
                  compile_s=info["compile_s"],
                  notes=f"{s.stage_layers} layers per decode step, {variant_steps} steps per "
                        "timed run, µs per layer" + ("; layers and steps chained (each reads "
                                                     "the output before it" + (
                                                         ", through optimization barriers)"
                                                         if barrier else ")")
                                                     if chained else
                                                     "; layers and steps independent")
                        + (f"; {host}" if host else ""))
        bench.log(f"stage {shape} {name}: {sec * 1e6:.1f} us per layer "
                  f"(step {info['run_us']:.0f} us, dispatch {info['dispatch_us']:.0f} us)")
      except Exception as e:                             # noqa: BLE001
        bench.error_row(NAME, shape, name, e)
      bench.write_json()
    del weights, caches, xs, qrs, batch
    gc.collect()
