"""Kernel durations of the select-path ops under Nsight Compute: each op called once per
bench shape (the WORKLOADS builders: >= 1 GB cache, pages at random), the L2 flushed
before every kernel (--cache-control all, the stock rows' "cache cold") and the clocks
left as they are (--clock-control none).

Why besides the chains: a chain of stateless calls needs a run-time dependency between
calls (one tiny XLA fusion per call, bench/harness.py), and its per-call figure carries
that fusion and the launch gaps of a command buffer; this gives what the kernels
themselves take, next to it. The two together bound the cost of one call.

  ncu --csv --metrics gpu__time_duration.sum --cache-control all --clock-control none \\
      -k regex:'mqa_logits.*kernel|pool_topk.*kernel' python -m bench.kernel_times > ncu.csv
  python -m bench.kernel_times --parse ncu.csv [--json out.json]
"""
import argparse
import csv
import io
import json
import zlib

import jax

from .sizes import Rand, sizes_for
from .workloads import WORKLOADS

OPS = ("mqa_logits", "pool_topk", "select_pools", "select_slots")
# Launches per call: select_pools and select_slots the logits kernel, then the top-k.
KERNELS = {"mqa_logits": 1, "pool_topk": 1, "select_pools": 2, "select_slots": 2}


def calls(sizes, ops=OPS):
  """[(op, label)] in the order run() calls them."""
  _, shapes = WORKLOADS[OPS[0]]
  return [(op, label) for label, _ in shapes(sizes) for op in ops]


def run(sizes, ops=OPS):
  for label, kwargs in WORKLOADS[OPS[0]][1](sizes):
    for op in ops:
      builder, _ = WORKLOADS[op]
      w = builder(Rand(zlib.crc32(f"{op} {label}".encode())), sizes, **kwargs)
      fn = jax.jit(lambda fixed, args, w=w: w.call(None, fixed, args)[1])
      jax.block_until_ready(fn(w.fixed, w.rotated[0]))


def durations(text, tool="bench.kernel_times"):
  """ncu's CSV (--csv --metrics gpu__time_duration.sum, anything printed before its
  table ignored) -> [(kernel name, µs)] in launch order."""
  start = text.find('"ID"')
  if start < 0:
    raise SystemExit(f"{tool}: no ncu CSV table in the input")
  rows = [r for r in csv.DictReader(io.StringIO(text[start:]))
          if r["Metric Name"] == "gpu__time_duration.sum"]
  scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
  return [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]])
          for r in rows]


def parse(text, sizes, ops=OPS):
  """ncu's CSV -> {op: {label: µs of the call's kernels}} (kernels in launch order)."""
  us = [v for _, v in durations(text)]
  order = calls(sizes, ops)
  want = sum(KERNELS[op] for op, _ in order)
  if len(us) != want:
    raise SystemExit(f"bench.kernel_times: {len(us)} kernels in the CSV, expected {want}")
  out, i = {}, 0
  for op, label in order:
    n = KERNELS[op]
    out.setdefault(op, {})[label] = [round(v, 2) for v in us[i:i + n]]
    i += n
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--parse", help="ncu CSV to read instead of running the ops")
  p.add_argument("--json", help="write the parsed table here")
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes (the test)")
  p.add_argument("--ops", default=",".join(OPS),
                 help="comma-separated subset of the ops, the same when running and parsing "
                      "(e.g. --ops pool_topk with ncu -k regex:pool_topk.*kernel)")
  args = p.parse_args()
  ops = tuple(o for o in args.ops.split(",") if o)
  if not set(ops) <= set(OPS):
    p.error(f"--ops: choose from {', '.join(OPS)}")
  sizes = sizes_for(False, args.cpu_smoke)
  if not args.parse:
    return run(sizes, ops)
  table = parse(open(args.parse).read(), sizes, ops)
  labels = [label for label, _ in WORKLOADS[OPS[0]][1](sizes)]
  print("kernel µs (ncu, L2 flushed before each kernel)  " + "  ".join(ops))
  for label in labels:
    print(f"{label:>18}  " + "  ".join(
        f"{'+'.join(f'{v:.2f}' for v in table[op][label]):>14}" for op in ops))
  if args.json:
    json.dump(table, open(args.json, "w"), indent=1)


if __name__ == "__main__":
  main()
