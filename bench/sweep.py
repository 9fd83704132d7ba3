"""Group "sweep": (--sweep-projection) indexer_projection's kernel at every (warps, split)
tactic whose warp span of K = HIDDEN stays in registers, every M: rows with variant
"kernel <warps>x<split>", the GEMV's "kernel GEMV <warps> warps", the wgmma tactic's
"kernel wgmma"; (--sweep-q) indexer_q's kernel at each of its tactics that tiles wq_b, every
M: variant "kernel <tactic>"."""
from glm5_jax.indexer import (
  GEMV_SPLIT,
  Q_TACTICS,
  WGMMA_SPLIT,
  projection_tactics,
  q_kernel_tiles,
  tile_k,
)

from .harness import amortised
from .per_op import workload
from .sizes import DIM, HEADS, HIDDEN, Q_LORA
from .variants import KERNEL, variant_env
from .workloads import WORKLOADS, floor_us

NAME = "sweep"
OP = "indexer_projection"
Q_OP = "indexer_q"


def add_arguments(parser):
  parser.add_argument("--sweep-projection", action="store_true",
                      help="also time indexer_projection's kernel at every (warps, split) "
                           "tactic")
  parser.add_argument("--sweep-tactics", default="",
                      help="only these tactics, as warps x split (e.g. 4x0,8x4; split "
                           f"{GEMV_SPLIT} = the GEMV); default every one-stage tactic")
  parser.add_argument("--sweep-q", action="store_true",
                      help=f"also time indexer_q's kernel at each tactic {Q_TACTICS}")


def run(bench):
  if bench.args.sweep_q and bench.has_kernel(Q_OP):
    tactics = [t for t in Q_TACTICS if q_kernel_tiles(HEADS * DIM, Q_LORA, t)]
    _sweep(bench, Q_OP, [(f"{KERNEL} {t}", t) for t in tactics])
  if not (bench.args.sweep_projection and bench.has_kernel(OP)):
    return
  # One-stage tactics only (each warp's span of K held in registers).
  tactics = [t for t in projection_tactics(HIDDEN) if tile_k(HIDDEN, *t)[1] == 1]
  if bench.args.sweep_tactics:
    wanted = {tuple(int(v) for v in t.split("x")) for t in bench.args.sweep_tactics.split(",")}
    tactics = [t for t in tactics if t in wanted]
  _sweep(bench, OP, [(f"{KERNEL} GEMV {w} warps" if sp == GEMV_SPLIT else
                      f"{KERNEL} wgmma" if sp == WGMMA_SPLIT else f"{KERNEL} {w}x{sp}",
                      (w, sp)) for w, sp in tactics])


def _sweep(bench, op, variants):
  """Rows of `op`'s kernel at every shape of its workloads, one per (variant, tactic)."""
  for shape, kw in WORKLOADS[op][1](bench.s):
    for variant, tactic in variants:
      if bench.over_budget():
        return
      try:
        work = workload(op, shape, bench.s, tactic=tactic, **kw)
        with variant_env(KERNEL):
          sec, _, info = amortised(work.call, None, (), work.rotated, work.dep, bench.s)
        floor = floor_us(work.nbytes, work.flops, bench.bw)
        bench.row(op, shape, variant, sec * 1e6, floor, None, R=info["R"],
                  calls=info["calls"])
        bench.log(f"{op} {shape} {variant}: {sec * 1e6:.2f} us")
      except Exception as e:                               # noqa: BLE001
        bench.error_row(op, shape, variant, e)
    bench.write_json()
