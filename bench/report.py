"""The report: markdown tables per op (every group's rows), the routing summary and
the plot; `--render JSON` rebuilds them from the rows of an earlier run."""
import json
import math
import os

import numpy as np

import glm5_jax
from glm5_jax._primitive import Op

from .sizes import BW_FALLBACK, sizes_for
from .variants import GEMM_QUERY, KERNEL, REFERENCE, TRITON, TWO_KERNELS, VARIANTS


def _fmt(v):
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return "—"
  return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _lookup(rows):
  return {(r["op"], r["shape"], r["variant"]): r for r in rows}


def _ratio(num, den):
  return f"{num / den:.2f}×" if num and den else "—"


def tables(rows):
  """Markdown tables, one per op: shape | µs per variant | floor | speedups | exact."""
  by = _lookup(rows)
  out = []
  for op in dict.fromkeys(r["op"] for r in rows if r["op"] != "calibration"):
    present = dict.fromkeys(r["variant"] for r in rows if r["op"] == op)
    variants = [v for v in VARIANTS if v in present] + [
        v for v in present if v not in VARIANTS]
    cols = [f"{v} µs" for v in variants] + ["floor µs"] + (
        ["reference / kernel"] if {KERNEL, REFERENCE} <= set(variants) else []) + (
        [f"{TRITON} / kernel"] if {KERNEL, TRITON} <= set(variants) else []) + ["exact"]
    out += [f"### {op}", "", "| shape | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|"]
    notes = []
    for shape in dict.fromkeys(r["shape"] for r in rows if r["op"] == op):
      got = {v: by.get((op, shape, v)) for v in variants}
      us = {v: got[v] and got[v]["device_us"] for v in variants}
      floor = next((x["floor_us"] for x in got.values() if x and x["floor_us"]), None)
      cells = [_fmt(us[v]) for v in variants] + [_fmt(floor)]
      if {KERNEL, REFERENCE} <= set(variants):
        cells.append(_ratio(us[REFERENCE], us[KERNEL]))
      if {KERNEL, TRITON} <= set(variants):
        cells.append(_ratio(us[TRITON], us[KERNEL]))
      cells.append(", ".join(f"{v}: {'yes' if got[v]['exact'] else 'no'}" for v in variants
                             if v != REFERENCE and us[v] and got[v]["exact"] is not None)
                   or "—")
      out.append(f"| {shape} | " + " | ".join(cells) + " |")
      notes += [f"- {shape} {x['variant']}: {x['notes']}" for x in got.values()
                if x and x.get("notes")]
    out += [""] + notes + ([""] if notes else [])
  return out


def stage_table(rows):
  """The stage group first: µs per layer of an 11-layer jitted decode step, kernels
  (default routing) vs reference, per context (rows) and M (columns)."""
  st = {(r["shape"], r["variant"]): r.get("device_us") for r in rows if r["op"] == "stage"}
  # Rows from before the stage group chained its layers and steps (bench/stage.py's _step).
  # A cell is marked where either of its figures is such a row.
  unchained = {r["shape"] for r in rows if r["op"] == "stage"
               and r["variant"] in (KERNEL, REFERENCE) and "chained" not in r.get("notes", "")}
  # Kernel rows measured on a path the routing no longer takes at their shape: the row's
  # "superseded" says which; a run on today's path replaces the row and drops the mark.
  superseded = {r["shape"]: r["superseded"] for r in rows if r["op"] == "stage"
                and r["variant"] == KERNEL and r.get("superseded")}
  if not st:
    return []
  mark = lambda sh: (" †" if sh in unchained else "") + (" ‡" if sh in superseded else "")
  shapes = list(dict.fromkeys(sh for sh, _ in st))
  # "M=<m>,ctx=<c>" rows make the grid; "M=<m>,next_n=<n>,ctx=<c>" (MTP) rows a list below.
  mtp = [sh for sh in shapes if "next_n=" in sh]
  grid = [sh for sh in shapes if sh not in mtp]
  ms = list(dict.fromkeys(sh.split(",")[0] for sh in grid))
  ctxs = list(dict.fromkeys(sh.split(",")[1] for sh in grid))
  out = ["## indexer_stage: µs per layer (one jitted decode step of "
         f"{next((r.get('layers') for r in rows if r['op'] == 'stage'), 11)} layers)", "",
         "kernels (default routing) / reference (every op on its pure-JAX reference), "
         "the speed-up in parentheses; every layer its own weights and caches (caches "
         "donated), metadata on the device, decode steps per jitted run as each row notes "
         "(each with its own x and qr; rows noted 'every layer its own x and qr' also per "
         "layer: before, XLA merged the layers' q GEMMs behind a weight copy), runs "
         "dispatched back to back (bench/stage.py); rows dated 2026-12-01 on return one "
         "scalar that reads every layer's output (before, every output was an entry "
         "result, which made XLA re-trace its FFI call on the host every run).", "",
         "| context | " + " | ".join(ms) + " |", "|---" * (len(ms) + 1) + "|"]
  for ctx in ctxs:
    cells = []
    for m in ms:
      k, ref = st.get((f"{m},{ctx}", KERNEL)), st.get((f"{m},{ctx}", REFERENCE))
      cells.append(f"{_fmt(k)} / {_fmt(ref)} ({_ratio(ref, k)}){mark(f'{m},{ctx}')}")
    out.append(f"| {ctx.split('=')[1]} | " + " | ".join(cells) + " |")
  if mtp:
    out += ["", "| MTP rows: requests x next_n | context | kernels / reference |", "|---|---|---|"]
    for sh in mtp:
      m, n, ctx = (int(part.split("=")[1]) for part in sh.split(","))
      k, ref = st.get((sh, KERNEL)), st.get((sh, REFERENCE))
      out.append(f"| {m // n} x {n} (M={m}) | {ctx} | {_fmt(k)} / {_fmt(ref)} "
                 f"({_ratio(ref, k)}){mark(sh)} |")
  if unchained:
    out += ["", "† layers and steps independent in the kernels' figure, the reference's or "
            "both (measured before the stage group chained them): XLA's dot merger batched "
            "one layer's GEMMs over the steps of a run, so such a figure reads low "
            "(docs/performance.md, Method); the other cells chain each layer to the output "
            "before it, as a model runs."]
  if superseded:
    out += ["", "‡ " + " ".join(dict.fromkeys(superseded.values()))]
  return out + [""]


def markdown(rows, meta, sizes, plot_ref):
  calib = {r["shape"].split(" x")[0]: r for r in rows if r["op"] == "calibration"}
  copy = next((r for k, r in calib.items() if k.startswith("copy")), None)
  parts = [f"copy {copy['gbps']:.0f} GB/s read + write over {copy['shape'][5:]} "
           f"({copy['device_us']:.0f} µs)" if copy and copy.get("gbps") else
           f"copy: not measured, floors use {BW_FALLBACK / 1e12:.1f} TB/s"]
  if calib.get("empty XLA op", {}).get("device_us"):
    parts.append(f"empty XLA op {calib['empty XLA op']['device_us']:.2f} µs")
  for name in ("empty Pallas call", "empty FFI call", "empty FFI call, PDL off"):
    if calib.get(name, {}).get("device_us"):
      what = "f32[128] + 1" if "Pallas" in name else "upcast_logits kernel on 1x8"
      parts.append(f"{name} ({what}) {calib[name]['device_us']:.2f} µs")
  lines = [
      "# glm5_jax benchmarks", "",
      f"GPU: {meta['gpu']} · jax {meta['jax_version']} · glm5_jax {glm5_jax.__version__} · "
      f"{meta['date']} · kernel variants: {', '.join(meta['kernels']) or 'none'}", ""]
  options = {f"{k}={v}" for r in rows for k, v in (r.get("compiler_options") or {}).items()}
  if options:
    lines += [f"XLA compiler options of some rows (see each row's JSON): "
              f"{', '.join(sorted(options))}", ""]
  lines += stage_table(rows) + [
      "Method (`python -m bench`, bench/harness.py):", "",
      "- one jitted function runs an unrolled chain of N calls of the public op (no device "
      "loop: XLA runs a `while` on the host, about 12 µs per iteration), cycling R input "
      f"sets (R ≤ {sizes.r_max}): W_cat and logits rotated past the 60 MB L2, ≥ 1 GB "
      "caches donated and threaded through the calls, stateless calls ordered by "
      "optimization barriers on the previous call's outputs" + (
          " and a run-time-zero scalar (+1 tiny fusion per call)" if sizes.data_dep else "")
      + f"; N grows until a run takes ≥ {sizes.run_s * 1e3:g} ms (N ≤ {sizes.max_calls}; R, "
      "N and the host dispatch time per run are in the JSON); runs are dispatched back to "
      "back, one queued, so the dispatch hides behind the device; XLA command buffers at "
      "their defaults;",
      f"- µs = median over {sizes.reps} runs of the interval between run completions / N, "
      "nothing subtracted (see the calibration); reference = the op with GLM5_JAX_KERNELS=0 "
      "(pure JAX under jit), kernel = its CUDA FFI kernel, `kernel, PDL off` = the same "
      "with GLM5_JAX_PDL=0; triton = the stock op order as Triton kernels "
      "(glm5_testing/triton_oracle.py: one decode-update kernel, expand, expand + "
      "column-preserving convert, convert) in a torch CUDA graph of N calls replayed "
      "back to back (indexer_query: torch's LayerNorm + the Triton Hadamard + FP8; "
      "indexer_projection_fused: a cuBLAS GEMM of W_cat, bf16 out, then the same); "
      "pallas = the op written with Pallas (Triton backend; bench/pallas_ops.py), what a "
      "JAX user could write; `reference, three dots` = the projection as three jitted "
      f"dots (wk, weights_proj, gate) instead of one of W_cat; `{TWO_KERNELS}` and "
      f"`{GEMM_QUERY}` = indexer_projection then indexer_query, both kernels or XLA's "
      "GEMM and the query kernel;",
      "- floor = max(minimum bytes / measured copy bandwidth, FLOPs / 790 TFLOP/s) "
      "(bench/workloads.py); exact = kernel outputs bit-equal to the reference, triton "
      "outputs bit-equal to the kernel's (the remap compacted first; upcast: columns below "
      "row_ends); the GEMMs (projection kernels, cuBLAS, three dots) sum in another order "
      "than XLA's one dot, and torch's LayerNorm rounds differently, so those variants are "
      "not bit-equal: the kernels' error bounds (docs/semantics.md) are checked by the "
      "GPU tests.", "",
      "Calibration: " + "; ".join(parts) + ".", ""]
  # Rows of ops (not calibration or whole-step groups) from before the unrolled chains.
  op_rows = [r for r in rows if r["op"] in Op.registry]
  if op_rows and not any("calls" in r for r in op_rows):
    lines += ["These rows were timed by the earlier method: a device loop (lax.fori_loop) "
              "of `passes` passes over R calls, whose `while` ran on the host and added "
              "about 12 µs per pass, so small ops (and the empty FFI call) read high.", ""]
  runs = {}
  for r in rows:
    runs.setdefault(r["date"], dict.fromkeys([]))[r["op"]] = None
  if len(runs) > 1:
    lines += ["Rows from several runs (same machine; see each row's method note in the "
              "JSON: rows without `calls` were timed in a device loop, before the "
              "unrolled chain): " + "; ".join(
                  f"{d}: {', '.join(ops)}" for d, ops in sorted(runs.items())) + ".", ""]
  if plot_ref:
    lines += [f"![µs per call vs shape]({plot_ref})", ""]
  return "\n".join(lines + routing(rows) + tables(rows)) + "\n"


def routing(rows):
  """Where each kernel loses to the jitted reference, and what the op runs by
  default (Op.kernel_off)."""
  by = _lookup(rows)
  lines = ["Routing (kernel vs jitted reference, same run):", ""]
  for op in dict.fromkeys(r["op"] for r in rows if r["variant"] == "kernel"):
    if op not in Op.registry:   # a group of whole steps (stage): its own table
      continue
    pairs = [(sh, by.get((op, sh, REFERENCE)), k) for (o, sh, v), k in by.items()
             if o == op and v == "kernel"]
    slower = lambda other, op=op, pairs=pairs: [
        sh for sh, _, k in pairs if (o := by.get((op, sh, other))) and
        o.get("device_us") and k.get("device_us") and k["device_us"] > o["device_us"]]
    spec = Op.registry[op]
    note = spec.kernel_default_note
    default = (f"{spec.otherwise} by default ({spec.kernel_off})" if spec.kernel_off else
               f"kernel by default at {note}; elsewhere {spec.otherwise}" if note else
               "kernel by default")
    vs_ref, vs_triton = slower(REFERENCE), slower(TRITON)
    with_ref = sum(1 for _, ref, _ in pairs if ref)
    lines.append(f"- `{op}`: " + (f"kernel slower than the reference at {len(vs_ref)} of "
                 f"{with_ref} shapes" + (f" ({', '.join(vs_ref)})" if vs_ref else "")
                 if with_ref else "no reference rows")
                 + (f", than Triton at {len(vs_triton)}" + (
                     f" ({', '.join(vs_triton)})" if vs_triton else "")
                    if any(by.get((op, sh, TRITON)) for sh, _, _ in pairs) else "")
                 + f"; {default}.")
  return lines + [""]


def plot(rows, path):
  """One panel per op: µs per call vs shape (log y), every variant, floor."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  by = _lookup(rows)
  ops = list(dict.fromkeys(r["op"] for r in rows if r["op"] != "calibration"))
  cols, rows_ = 3, -(-len(ops) // 3)
  fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.3 * rows_), squeeze=False)
  for ax, op in zip(axes.flat, ops):
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["op"] == op))
    x = np.arange(len(shapes))

    def series(variant, key="device_us", op=op, shapes=shapes):
      vals = [(by.get((op, sh, variant)) or {}).get(key) for sh in shapes]
      return np.array([v if v else np.nan for v in vals], float)

    for variant, style in zip(VARIANTS, ("o-", "s-", "x:", "^-", "v-", "d--", "P-", "*-")):
      y = series(variant)
      if np.isfinite(y).any():
        ax.plot(x, y, style, label=variant)
    floor = series(REFERENCE, "floor_us")
    if np.isfinite(floor).any():
      ax.plot(x, floor, "k--", label="floor")
    ax.set_yscale("log")
    ax.set_title(op, fontsize=10)
    ax.set_ylabel("µs per call", fontsize=8)
    ax.set_xticks(x, shapes, rotation=30, ha="right", fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(ops):]:
    ax.set_visible(False)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_or_none(rows, args):
  """Writes args.plot; its path relative to args.md, or None when plotting fails
  (e.g. no matplotlib: the report is written without the plot) or --plot '' (none wanted)."""
  if not args.plot:
    return None
  try:
    plot(rows, args.plot)
  except Exception as e:                                   # noqa: BLE001
    print(f"plot failed: {type(e).__name__}: {e}", flush=True)
    return None
  return os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.md)))


def render(args):
  """BENCHMARKS.md and the plot from the rows of an earlier run."""
  with open(args.render) as f:
    rows = json.load(f)
  meta = {k: rows[0][k] for k in ("gpu", "jax_version")}
  meta["date"] = max(r["date"] for r in rows)     # the newest run's; each row keeps its own
  meta["kernels"] = list(dict.fromkeys(r["op"] for r in rows
                                       if r["variant"] == "kernel" and r["op"] in Op.registry))
  with open(args.md, "w") as f:
    f.write(markdown(rows, meta, sizes_for(False, False), plot_or_none(rows, args)))
