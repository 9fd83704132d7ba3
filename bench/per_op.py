"""Group "ops": every selected op (--ops) at its WORKLOADS shapes, in each variant."""
import gc
import zlib

from .sizes import Rand, sizes_for
from .workloads import WORKLOADS

NAME = "ops"


def run(bench):
  """Two passes, so a run cut short by --budget-s still has every op's extreme
  shapes: first the --quick subset (M in {1, 64}), then the rest."""
  quick = sizes_for(True, bench.args.cpu_smoke)
  first = {op: {label for label, _ in WORKLOADS[op][1](quick)} for op in bench.ops}
  for op in bench.ops:
    run_op(bench, op, first[op])
  for op in bench.ops:
    run_op(bench, op, {label for label, _ in WORKLOADS[op][1](bench.s)} - first[op])


def workload(op, shape, sizes, **kwargs):
  """The Workload of `op` at `shape` (its label), on inputs seeded by both."""
  builder, _ = WORKLOADS[op]
  return builder(Rand(zlib.crc32(f"{op} {shape}".encode())), sizes, **kwargs)._replace(
      shape=shape)


def run_op(bench, op, labels):
  """Measures `op` at the shapes of WORKLOADS[op] named in `labels`."""
  variants = bench.variants(op)
  for shape, kw in WORKLOADS[op][1](bench.s):
    if shape not in labels:
      continue
    if bench.over_budget():
      for v in variants:
        bench.row(op, shape, v, None, None, False, notes="skipped: over the time budget")
      bench.log(f"{op} {shape}: skipped (over the time budget)")
      continue
    try:
      work = workload(op, shape, bench.s, **kw)
    except Exception as e:                                 # noqa: BLE001
      for v in variants:
        bench.error_row(op, shape, v, e)
      continue
    bench.run_case(work, variants)
    del work
    gc.collect()
    bench.write_json()
