"""The A/B table of run_tail_b.sh's results: python gpu_runs/ab_table.py DIR [BASE]

DIR holds the bench JSONs named <name>_r<rep>_<tree>.json (or <name>_<tree>.json); each
row is keyed by (op, shape, variant). Prints, per key, every run's µs per call (or per
layer), their mean per run label (name and tree, the rep dropped), and the mean against
BASE's (a run label such as stage_main; default: the first label seen)."""
import collections
import json
import re
import sys
from pathlib import Path


def runs(folder):
  """{label: {(op, shape, variant): [µs, ...]}} from every JSON in `folder`."""
  out = collections.defaultdict(lambda: collections.defaultdict(list))
  for path in sorted(Path(folder).glob("*.json")):
    label = re.sub(r"_?r\d+(?=_|$)", "", path.stem)
    for row in json.loads(path.read_text()):
      if row.get("device_us") is not None:
        out[label][(row["op"], row["shape"], row["variant"])].append(row["device_us"])
  return out


def main():
  by_label = runs(sys.argv[1])
  labels = list(by_label)
  base = sys.argv[2] if len(sys.argv) > 2 else labels[0]
  keys = sorted({k for rows in by_label.values() for k in rows})
  for key in keys:
    print(" | ".join(key))
    ref = by_label.get(base, {}).get(key)
    for label in labels:
      values = by_label[label].get(key)
      if not values:
        continue
      mean = sum(values) / len(values)
      vs = f"{mean / (sum(ref) / len(ref)):.3f}x {base}" if ref else ""
      print(f"  {label:28s} {mean:9.2f}  ({', '.join(f'{v:.2f}' for v in values)})  {vs}")


if __name__ == "__main__":
  main()
