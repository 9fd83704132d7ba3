"""Where a kernel's warps stall, by source line: ncu's stall samples per SASS instruction
(`ncu -i REP --page source --csv --print-source sass`, what gpu_runs/run_profile.sh's
`source` part writes) mapped to source lines through `nvdisasm -g -c` of a -lineinfo build of
the same sources with the same nvcc (the offsets then match; check one instruction).

  nvcc ... -lineinfo -cubin -o select.cubin cc/select.cu
  nvdisasm -g -c select.cubin > select.dis
  python scripts/ncu_source.py select.dis MANGLED_NAME mtp_src.sass.csv [--top 25]

A line inlined at several places (an mbarrier wait, a barrier) sums over all of them;
--hot N lists the N instructions with the most samples by offset, and --split 0x7150,0x7c70
sums the samples between those offsets (e.g. before and after a wait that only one CTA of a
cluster passes: samples weigh SM-time, so one SM's tail counts once where the cluster's
work before it counts once per SM). --metric "Instructions Executed" (any numeric column of
the CSV) counts that instead of the stall samples: where the instructions go, not the time.
"""
import argparse
import bisect
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def line_map(dis, function):
  """{instruction offset: (file, line)} of `function` in an nvdisasm -g listing."""
  lines = open(dis).read().split("\n")
  start = lines.index(f".text.{function}:")
  where, at = {}, None
  for text in lines[start + 1:]:
    if text.startswith("//-----") and ".text." in text:
      break
    m = re.search(r'//## File "([^"]+)", line (\d+)', text)
    if m:
      at = (m.group(1).split("/")[-1], int(m.group(2)))
      continue
    m = re.search(r"/\*([0-9a-f]{4,})\*/", text)
    if m and at:
      where.setdefault(int(m.group(1), 16), at)
  return where


def _rows(dis, function, csv_path):
  """(header, [(offset, (file, line), row)]) of `function`'s ncu source page over the lines
  of its nvdisasm -g listing (dis); an instruction with no line of its own counts for the
  line before it."""
  where = line_map(dis, function)
  rows = list(csv.reader(open(csv_path)))
  header, data = rows[1], rows[2:]
  address = header.index("Address")
  base = int(data[0][address], 16)
  out, at = [], None
  for r in data:
    offset = int(r[address], 16) - base
    at = where.get(offset, at)
    out.append((offset, at, r))
  return header, out


def _count(text):
  """A CSV cell as a number (ncu may group digits with commas; empty: 0)."""
  return int(float(text.replace(",", "") or 0))


def stalls_by_line(dis, function, csv_path, metric=SAMPLES):
  """({(file, line): samples}, {(file, line): {stall reason: samples}}) of `function`'s
  ncu source page (csv_path) over the lines of its nvdisasm -g listing (dis); `metric`: the
  column summed per line (the stall reasons are always samples)."""
  header, rows = _rows(dis, function, csv_path)
  samples = header.index(metric)
  stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
  by_line, reasons = collections.Counter(), collections.defaultdict(collections.Counter)
  for _, at, r in rows:
    by_line[at] += _count(r[samples])
    for i in stalls:
      reasons[at][header[i][len("stall_"):]] += _count(r[i])
  return by_line, reasons


def instructions(dis, function, csv_path, metric=SAMPLES):
  """[(offset, (file, line), samples (or `metric`), SASS text)] of `function`'s ncu source
  page, in address order."""
  header, rows = _rows(dis, function, csv_path)
  samples, text = header.index(metric), header.index("Source")
  return [(offset, at, _count(r[samples]), r[text].strip()) for offset, at, r in rows]


def regions(listing, cuts):
  """[(first offset, end offset, samples, {(file, line): samples})] of the address ranges
  that the ascending offsets `cuts` bound, over instructions()' listing."""
  bounds = [0] + list(cuts) + [float("inf")]
  lines = [collections.Counter() for _ in bounds[1:]]
  for offset, at, n, _ in listing:
    lines[bisect.bisect_right(cuts, offset)][at] += n
  return [(lo, hi, sum(c.values()), c) for lo, hi, c in zip(bounds, bounds[1:], lines)]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dis")
  p.add_argument("function", help="the kernel's mangled name")
  p.add_argument("csv")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--hot", type=int, default=0, help="the N instructions with most samples")
  p.add_argument("--split", default="", help="offsets (hex) that bound regions to sum")
  p.add_argument("--metric", default=SAMPLES, help="the CSV column to count (default: samples)")
  args = p.parse_args()
  unit = "samples" if args.metric == SAMPLES else args.metric
  if args.hot or args.split:
    listing = instructions(args.dis, args.function, args.csv, args.metric)
    for offset, at, n, text in sorted(listing, key=lambda x: -x[2])[:args.hot]:
      print(f"{offset:#8x} {n:6d}  {at[0]}:{at[1]}  {text[:60]}" if at else f"{offset:#8x} {n:6d}")
    if args.split:
      for lo, hi, n, lines in regions(listing, [int(c, 16) for c in args.split.split(",")]):
        top = ", ".join(f"{a[0]}:{a[1]} {v}" for a, v in lines.most_common(4) if a and v)
        end = "end" if hi == float("inf") else f"{hi:#x}"
        print(f"[{lo:#x}, {end}) {n} {unit}: {top}")
    return
  by_line, reasons = stalls_by_line(args.dis, args.function, args.csv, args.metric)
  total = sum(by_line.values())
  print(f"{total} {unit}")
  for at, n in by_line.most_common(args.top):
    top = ", ".join(f"{k} {v}" for k, v in reasons[at].most_common(2) if v)
    where = f"{at[0]}:{at[1]}" if at else "(no line)"
    print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {where}  ({top})")


if __name__ == "__main__":
  main()
