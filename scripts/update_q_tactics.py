"""The stage's update part with indexer_update_q at given projection tactics, on the GPU.

For choosing glm5_jax.plan.UPDATE_Q_TACTICS: beside q's GEMM the projection is the update
part's critical path (docs/performance.md), and its best (warps, split)
there is not the standalone table's. Each row: µs per layer of a jitted step of 11 layers,
16 decode steps a run, every layer chained to the output before it through optimization
barriers (bench.stage's --stage-chain-barrier), 1K context, the default routing with
indexer_update_q chosen; "default" is the stage's default routing at that M, "no update_q" the
default without indexer_update_q (update_epilogue_q's or indexer_update's kernel, or the ops).

  python scripts/update_q_tactics.py --rows 16,64 --tactics 8x4,4x8,4x-1   (-1: wgmma)
"""
import argparse
import functools

import glm5_jax
from bench import stage
from bench.harness import time_step
from bench.sizes import sizes_for
from bench.variants import UPDATE_ONLY, UPDATE_ONLY_UPDATE_Q
from glm5_jax import stage as glm5_stage
from glm5_jax.update import UPDATE_Q_OP


def update_step(config, tactic):
  """bench.stage's update-part step (chained through barriers) with indexer_update_q's
  projection at `tactic` (None: its own table)."""
  ops = glm5_stage._ops(config, use_reference=False)
  if tactic is not None:
    ops.indexer_update_q = functools.partial(glm5_jax.indexer_update_q, tactic=tactic,
                                             routing=config.routing)
  return stage._step(config, update_only=True, chained=True, barrier=True, ops=ops)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", default="16,64", help="comma-separated M")
  p.add_argument("--tactics", default="8x4,8x8,4x8,4x4",
                 help="comma-separated <warps>x<split> (split -1: wgmma, 0: the GEMV)")
  p.add_argument("--context", type=int, default=1024)
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes (no kernels)")
  args = p.parse_args()
  s = sizes_for(False, args.cpu_smoke)
  tactics = [tuple(int(v) for v in t.split("x")) for t in args.tactics.split(",") if t]
  ctx = args.context
  for m in (int(r) for r in args.rows.split(",") if r):
    weights, caches, xs, qrs, batch = stage._state(m, ctx, s.stage_layers, seed=m * 7 + ctx)
    update_q = stage.ROUTINGS[UPDATE_ONLY_UPDATE_Q]
    for name, routing, tactic in ([("default", stage.ROUTINGS[UPDATE_ONLY], None),
                                   ("no update_q", glm5_jax.Routing(ops={UPDATE_Q_OP: False}),
                                    None),
                                   ("update_q table", update_q, None)]
                                  + [("x".join(map(str, t)), update_q, t) for t in tactics]):
      config = stage._config(ctx, routing)
      try:
        sec, caches, _ = time_step(update_step(config, tactic), caches,
                                   (weights, xs, qrs, batch), s, units=s.stage_layers,
                                   steps=stage.STEPS)
        print(f"M={m} {name}: {sec * 1e6:.2f} us per layer", flush=True)
      except Exception as e:  # noqa: BLE001 - a tactic that does not tile K: say so, go on
        print(f"M={m} {name}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
  main()
