"""Group "sweep" (--sweep-projection): indexer_projection's kernel at every (warps,
split) tactic whose warp span of K = HIDDEN stays in registers, every M: rows with
variant "kernel <warps>x<split>"."""
from glm5_jax.indexer import BLOCK_K, MAX_BLOCKS, MAX_SPLIT, MAX_WARPS

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


def _pow2(n):
  return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def run(bench):
  if not (bench.args.sweep_projection and bench.has_kernel(OP)):
    return
  tactics = [(w, sp) for w in _pow2(MAX_WARPS) for sp in _pow2(MAX_SPLIT)
             if HIDDEN % (BLOCK_K * w * sp) == 0 and HIDDEN // (BLOCK_K * w * sp) <= MAX_BLOCKS]
  for shape, kw in WORKLOADS[OP][1](bench.s):
    for w, sp in tactics:
      if bench.over_budget():
        return
      variant = f"{KERNEL} {w}x{sp}"
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
