"""Merge bench JSON rows (H200 only) into BENCHMARKS.json: a row replaces the one of the same
op, shape and variant; new rows are appended.  python gpu_runs/merge.py RUN.json [...]"""
import json
import sys

rows = json.load(open("BENCHMARKS.json"))
index = {(r["op"], r["shape"], r["variant"]): i for i, r in enumerate(rows)}
for path in sys.argv[1:]:
  for r in json.load(open(path)):
    if r.get("gpu") != "NVIDIA H200":
      sys.exit(f"{path}: a row from {r.get('gpu')}, not an H200")
    key = (r["op"], r["shape"], r["variant"])
    if key in index:
      rows[index[key]] = r
    else:
      index[key] = len(rows)
      rows.append(r)
    print("merged", *key, round(r["device_us"], 2))
open("BENCHMARKS.json", "w").write(json.dumps(rows, indent=1, ensure_ascii=False))
