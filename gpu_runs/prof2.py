"""Two calls of each op at the given select shapes, so that ncu -s 1 -c 1 profiles the
second (its code and operands warm in L2, as in the stage):
python gpu_runs/prof2.py OPS POOLS ROWS"""
import dataclasses
import sys

from bench import kernel_times
from bench.sizes import sizes_for

ops, pools, rows = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
s = dataclasses.replace(sizes_for(False, False),
                        select_pools=tuple(int(p) for p in pools.split(",")),
                        select_rows=tuple(int(r) for r in rows.split(",")))
for _ in range(2):
  kernel_times.run(s, tuple(ops))
