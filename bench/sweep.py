"""Group "sweep" (--sweep-projection): indexer_projection's kernel at every (warps,
split) tactic whose warp span of K = HIDDEN stays in registers, every M: rows with
variant "kernel <warps>x<split>", the GEMV's "kernel GEMV <warps> warps"."""
from glm5_jax.indexer import GEMV_SPLIT, projection_tactics, tile_k

from .harness import amortised
from .per_op import workload
from .sizes import HIDDEN
from .variants import KERNEL, variant_env
from .workloads import WORKLOADS, floor_us

NAME = "sweep"
OP = "indexer_projection"


def add_arguments(parser):
  parser.add_argument("--sweep-projection", action="store_true",
                      help="also time indexer_projection's kernel at every (warps, split) "
                           "tactic")
  parser.add_argument("--sweep-tactics", default="",
                      help="only these tactics, as warps x split (e.g. 4x0,8x4; split "
                           f"{GEMV_SPLIT} = the GEMV); default every one-stage tactic")


def run(bench):
  if not (bench.args.sweep_projection and bench.has_kernel(OP)):
    return
  # One-stage tactics only (each warp's span of K held in registers).
  tactics = [t for t in projection_tactics(HIDDEN) if tile_k(HIDDEN, *t)[1] == 1]
  if bench.args.sweep_tactics:
    wanted = {tuple(int(v) for v in t.split("x")) for t in bench.args.sweep_tactics.split(",")}
    tactics = [t for t in tactics if t in wanted]
  for shape, kw in WORKLOADS[OP][1](bench.s):
    for w, sp in tactics:
      if bench.over_budget():
        return
      variant = f"{KERNEL} GEMV {w} warps" if sp == GEMV_SPLIT else f"{KERNEL} {w}x{sp}"
      try:
        work = workload(OP, shape, bench.s, tactic=(w, sp), **kw)
        with variant_env(KERNEL):
          sec, _, info = amortised(work.call, None, (), work.rotated, work.dep, bench.s)
        floor = floor_us(work.nbytes, work.flops, bench.bw)
        bench.row(OP, shape, variant, sec * 1e6, floor, None, R=info["R"],
                  calls=info["calls"])
        bench.log(f"{OP} {shape} {variant}: {sec * 1e6:.2f} us")
      except Exception as e:                               # noqa: BLE001
        bench.error_row(OP, shape, variant, e)
    bench.write_json()
