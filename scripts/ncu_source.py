"""Where a kernel's warps stall, by source line: ncu's stall samples per SASS instruction
(`ncu -i REP --page source --csv --print-source sass`, what gpu_runs/run_profile.sh's
`source` part writes) mapped to source lines through `nvdisasm -g -c` of a -lineinfo build of
the same sources with the same nvcc (the offsets then match; check one instruction).

  nvcc ... -lineinfo -cubin -o select.cubin cc/select.cu
  nvdisasm -g -c select.cubin > select.dis
  python scripts/ncu_source.py select.dis MANGLED_NAME mtp_src.sass.csv [--top 25]
"""
import argparse
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


def stalls_by_line(dis, function, csv_path):
  """({(file, line): samples}, {(file, line): {stall reason: samples}}) of `function`'s
  ncu source page (csv_path) over the lines of its nvdisasm -g listing (dis); an
  instruction with no line of its own counts for the line before it."""
  where = line_map(dis, function)
  rows = list(csv.reader(open(csv_path)))
  header, data = rows[1], rows[2:]
  address, samples = header.index("Address"), header.index(SAMPLES)
  stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
  base = int(data[0][address], 16)
  by_line, reasons, at = collections.Counter(), collections.defaultdict(collections.Counter), None
  for r in data:
    at = where.get(int(r[address], 16) - base, at)
    by_line[at] += int(r[samples] or 0)
    for i in stalls:
      reasons[at][header[i][len("stall_"):]] += int(r[i] or 0)
  return by_line, reasons


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dis")
  p.add_argument("function", help="the kernel's mangled name")
  p.add_argument("csv")
  p.add_argument("--top", type=int, default=25)
  args = p.parse_args()
  by_line, reasons = stalls_by_line(args.dis, args.function, args.csv)
  total = sum(by_line.values())
  print(f"{total} samples")
  for at, n in by_line.most_common(args.top):
    top = ", ".join(f"{k} {v}" for k, v in reasons[at].most_common(2) if v)
    where = f"{at[0]}:{at[1]}" if at else "(no line)"
    print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {where}  ({top})")


if __name__ == "__main__":
  main()
