"""Where a whole jitted decode step's device time goes, kernel by kernel, under Nsight
Compute: the stage group's steps, each kernel timed alone (ncu's default graph mode,
"node": serialised, no overlap between kernels, no PDL gain).

Why: at a 1K context the stage group's runs are host-bound on the H200 (dispatch
440-1020 µs of runs of 590-1330 µs, 4 steps of 11 layers a run), so they bound a
step's device time from above and do not split it. This splits it into its kernels
(the q GEMM, the projection, the query epilogue, kpool_update, the select path), which
says where a per-layer target is lost. The kernels' sum is not the step's time: each
kernel alone reads longer than inside the step (a 1K step of 11 layers summed 237 µs
of kernels at M=1, against at most 148 µs per step in the stage group). ncu's
`--graph-profiling graph` (each command buffer timed as one workload) read 2-4x the
stage group's step times on the H200 (the GPU idles between ncu's launches), so it is
not used.

Each timed section (a stage-group variant at one shape) lies between two marker
launches, a one-kernel jitted cosine, by which the parser splits the CSV; what runs
outside the sections (XLA's compile-time autotuning, the warm-up runs) is dropped.

  python -m bench.step_times       # fills the compilation cache (no autotuning under ncu)
  ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \\
      python -m bench.step_times --runs 1 > steps.csv
  python -m bench.step_times --parse steps.csv --runs 1

With --timeline DIR the same sections run under jax.profiler instead (CUPTI, XLA's command
buffers kept: KEEP_COMMAND_BUFFERS), and each kernel's start and end inside the real step
come back: the step's span, the time the GPU ran kernels and the idle gaps between them,
and per kernel name its time and the gap before it (negative where PDL overlapped it with
the kernel before). This is what ncu's node mode cannot say: why a step whose kernels sum
to less takes longer. CUPTI's records cost some time per kernel, so compare variants of
one run, not these spans with the stage group's.

  python -m bench.step_times --runs 3 ...           # fills the compilation cache
  python -m bench.step_times --runs 3 --timeline tl ... --json timeline.json
  python -m bench.step_times --parse-timeline tl/plugins/profile/*/perfetto_trace.json.gz ...
"""
import argparse
import glob
import gzip
import json
import os
import re
import statistics

import jax
import jax.numpy as jnp

from . import stage
from .harness import CACHE_DIR, compile_fn, run_steps, use_cache
from .kernel_times import durations
from .sizes import sizes_for
from .variants import (
  KERNEL,
  Q_EPILOGUE,
  Q_KERNEL,
  Q_KERNEL_NO_PDL,
  SELECT_OPS,
  UPDATE_FUSED,
  UPDATE_ONLY,
  UPDATE_ONLY_FUSED,
  UPDATE_ONLY_FUSED_Q_KERNEL,
  UPDATE_ONLY_Q_EPILOGUE,
  UPDATE_ONLY_Q_KERNEL,
  UPDATE_ONLY_UPDATE_Q,
  UPDATE_OPS,
  UPDATE_Q,
)

VARIANTS = (KERNEL, UPDATE_OPS, UPDATE_FUSED, UPDATE_ONLY, SELECT_OPS, Q_KERNEL, Q_KERNEL_NO_PDL,
            Q_EPILOGUE, UPDATE_ONLY_Q_EPILOGUE, UPDATE_ONLY_FUSED, UPDATE_ONLY_Q_KERNEL,
            UPDATE_ONLY_FUSED_Q_KERNEL, UPDATE_Q, UPDATE_ONLY_UPDATE_Q)
# Runs before a section: XLA runs an executable's first runs thunk by thunk, then as its
# command buffer (under ncu on the H200, after two warm-up runs the first timed run was
# still thunk by thunk).
WARMUP = 4
MARKER = re.compile(r"cosine")   # the marker kernel: XLA names a lone op's fusion after it
# Without it XLA runs every command buffer thunk by thunk while a profiler is attached, which
# is not the step users run.
KEEP_COMMAND_BUFFERS = "--xla_enable_command_buffers_during_profiling=true"


def sections(contexts, rows, variants, next_n=1):
  """[(shape, variant)] in the order run() times them."""
  return [(stage.label(m, ctx, next_n), v) for ctx in contexts for m in rows for v in variants]


def _marker():
  """A call that launches one kernel named after its op (compiled here, not run)."""
  x = jnp.ones((7,), jnp.float32)
  fn = jax.jit(jnp.cos).lower(x).compile()
  return lambda: jax.block_until_ready(fn(x))


def run(sizes, contexts, rows, variants, runs, layers, steps_per_run=1, chained=True,
        barrier=False, next_n=1):
  """Runs the sections, steps_per_run decode steps in each run; returns [(shape, variant)]
  in the order it timed them (what parse() reads the CSV by: sections())."""
  marker, timed = _marker(), []
  for ctx in contexts:
    for m in rows:
      weights, caches, xs, qrs, batch = stage._state(m, ctx, layers, seed=m * 7 + ctx,
                                                     steps=steps_per_run, next_n=next_n)
      steps = {}
      for v in variants:   # every compile (and its autotuning) before the first marker
        config = stage._config(ctx, stage.ROUTINGS[v], stage.UPDATES.get(v))
        step = stage._step(config, v in stage.UPDATE_PART, chained=chained, barrier=barrier)

        def fn(c, *a, step=step):   # one f32 scalar that reads every step's output
          c, outs = run_steps(step, c, steps_per_run, *a)
          return c, sum(outs)
        steps[v], _, _ = compile_fn(fn, caches, weights, xs, qrs, batch,
                                    options=sizes.compiler_options)
        for _ in range(WARMUP):
          caches, outs = steps[v](caches, weights, xs, qrs, batch)
        jax.block_until_ready(outs)
      for v in variants:   # each section between two markers
        marker()
        for _ in range(runs):
          caches, outs = steps[v](caches, weights, xs, qrs, batch)
          jax.block_until_ready(outs)
        marker()
        timed.append((stage.label(m, ctx, next_n), v))
      del weights, caches, xs, qrs, batch, steps
  return timed


def parse(text, order, runs, layers, steps_per_run=1):
  """ncu's CSV -> [{shape, variant, step_us, layer_us, launches, kernels}]: per section
  the median over its runs of the summed durations of a run's launches (graphs or
  kernels) per step, and (node mode) each kernel name's total µs per step."""
  out = []
  for shape, variant, per_run in _split(durations(text, "bench.step_times"), order, runs,
                                        "the CSV"):
    totals = [sum(us for _, us in run) / steps_per_run for run in per_run]
    kernels = {}
    for run in per_run:
      for name, us in run:
        kernels[name] = kernels.get(name, 0.0) + us / runs / steps_per_run
    step = statistics.median(totals)
    out.append(dict(shape=shape, variant=variant, step_us=round(step, 2),
                    layer_us=round(step / layers, 2),
                    launches=len(per_run[0]) // steps_per_run,
                    kernels={n: round(v, 2) for n, v in
                             sorted(kernels.items(), key=lambda kv: -kv[1])}))
  return out


def _split(rows, order, runs, source):
  """rows [(kernel name, ...)] in launch order -> [(shape, variant, [a run's rows] * runs)]:
  each section's launches lie between two markers, and its runs launch alike."""
  cuts = [i for i, row in enumerate(rows) if MARKER.search(row[0])]
  if len(cuts) != 2 * len(order):
    raise SystemExit(f"bench.step_times: {len(cuts)} markers in {source}, expected "
                     f"{2 * len(order)} (two a section)")
  out = []
  for k, (shape, variant) in enumerate(order):
    body = rows[cuts[2 * k] + 1:cuts[2 * k + 1]]
    if len(body) % runs:
      raise SystemExit(f"bench.step_times: {shape} {variant}: {len(body)} launches for "
                       f"{runs} runs")
    per = len(body) // runs
    out.append((shape, variant, [body[r * per:(r + 1) * per] for r in range(runs)]))
  return out


def gpu_kernels(trace):
  """jax.profiler's Perfetto trace (the JSON's dict) -> [(kernel name, start µs, µs)] of the
  GPU's stream lines, by start. The device's derived lines (XLA Ops, XLA Modules: the same
  time again under HLO names) are left out."""
  events = trace["traceEvents"]
  meta = [e for e in events if e.get("ph") == "M"]
  gpus = {e["pid"] for e in meta if e.get("name") == "process_name"
          and e["args"]["name"].startswith("/device:GPU")}
  names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
           if e.get("name") == "thread_name" and e["pid"] in gpus}
  streams = {line for line, name in names.items() if name.startswith("Stream")}
  if not streams:
    raise SystemExit("bench.step_times: no GPU stream line in the trace (the GPU's lines: "
                     f"{sorted(set(names.values()))})")
  kernels = sorted((e["ts"], e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams)
  return [(name, ts, dur) for ts, dur, name in kernels]


def timeline(kernels, order, runs, layers, steps_per_run=1):
  """gpu_kernels()' list -> [{shape, variant, step_us, layer_us, busy_us, idle_us, launches,
  kernels}]: per section the medians over its runs of a run's span (first kernel's start to
  last kernel's end), of the time some kernel ran (busy) and of the rest (idle: launch gaps,
  waits), each per step; per kernel name its µs per step and the sum of the gaps before its
  launches (from the latest end of an earlier kernel of the run; negative: overlapped), as
  [µs, gap µs]."""
  out = []
  for shape, variant, per_run in _split(kernels, order, runs, "the trace"):
    spans, busy, per_name = [], [], {}
    for run in per_run:
      start, end, ran = run[0][1], run[0][1], 0.0
      for name, ts, dur in run:
        gap = ts - end                                # 0 for the run's first kernel
        ran += max(0.0, ts + dur - max(ts, end))      # the part no earlier kernel covered
        end = max(end, ts + dur)
        us, gaps = per_name.get(name, (0.0, 0.0))
        per_name[name] = (us + dur / runs / steps_per_run, gaps + gap / runs / steps_per_run)
      spans.append((end - start) / steps_per_run)
      busy.append(ran / steps_per_run)
    step, ran = statistics.median(spans), statistics.median(busy)
    out.append(dict(shape=shape, variant=variant, step_us=round(step, 2),
                    layer_us=round(step / layers, 2), busy_us=round(ran, 2),
                    idle_us=round(step - ran, 2), launches=len(per_run[0]) // steps_per_run,
                    kernels={n: [round(us, 2), round(gap, 2)] for n, (us, gap) in
                             sorted(per_name.items(), key=lambda kv: -kv[1][0])}))
  return out


def _trace_file(path):
  """The Perfetto trace at `path`, or the newest one jax.profiler wrote under it."""
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not found:
      raise SystemExit(f"bench.step_times: no perfetto_trace.json.gz under {path}")
    path = found[-1]
  with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    return json.load(f)


def _ints(text):
  return tuple(int(v) for v in text.split(",") if v)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--parse", help="ncu CSV to read instead of running the steps")
  p.add_argument("--timeline", help="run the sections under jax.profiler, the trace into this "
                                    "folder, and read it")
  p.add_argument("--parse-timeline", help="a --timeline trace (its folder or its "
                                          "perfetto_trace.json.gz) to read instead of running")
  p.add_argument("--json", help="write the parsed rows here")
  p.add_argument("--contexts", default="1024", help="comma-separated contexts (tokens)")
  p.add_argument("--rows", default="1,16,64", help="comma-separated M")
  p.add_argument("--variants", default=";".join(VARIANTS),
                 help=f"';'-separated (the names hold commas), of: {'; '.join(VARIANTS)}")
  p.add_argument("--next-n", type=int, default=1,
                 help="rows per request (MTP), as the stage group's --stage-next-n")
  p.add_argument("--runs", type=int, default=3, help="timed runs per section")
  p.add_argument("--steps", type=int, default=1,
                 help="decode steps a run (one executable; the stage group runs 16): more "
                      "keep the GPU busy, and its clock up, through a run")
  p.add_argument("--chained", action=argparse.BooleanOptionalAction, default=True,
                 help="layers and steps read the output before them (the stage group's "
                      "--stage-chained, its default)")
  p.add_argument("--chain-barrier", action="store_true",
                 help="the chain through optimization barriers (the stage group's "
                      "--stage-chain-barrier)")
  p.add_argument("--layers", type=int, default=0,
                 help="layers per step (default: the stage group's, 11)")
  p.add_argument("--top", type=int, default=8, help="kernels listed per section (node mode)")
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes (the test)")
  p.add_argument("--cache-dir", default=CACHE_DIR,
                 help="persistent XLA compilation cache ('' = off): run once without ncu "
                      "to fill it, so that under ncu no compile autotunes (launches)")
  args = p.parse_args()
  if args.timeline:   # before the backend starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {KEEP_COMMAND_BUFFERS}".strip()
  variants = tuple(v.strip() for v in args.variants.split(";") if v.strip())
  if not set(variants) <= set(VARIANTS):
    p.error(f"--variants: choose from {'; '.join(VARIANTS)}")
  sizes = sizes_for(False, args.cpu_smoke)
  layers = args.layers or sizes.stage_layers
  contexts, rows = _ints(args.contexts), _ints(args.rows)
  order = sections(contexts, rows, variants, args.next_n)
  if not (args.parse or args.parse_timeline):
    use_cache(args.cache_dir, min_compile_s=0)
    if not args.timeline:
      run(sizes, contexts, rows, variants, args.runs, layers, args.steps, args.chained,
          args.chain_barrier, args.next_n)
      return
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level, options.host_tracer_level = 0, 1
    with jax.profiler.trace(args.timeline, create_perfetto_trace=True,
                            profiler_options=options):
      run(sizes, contexts, rows, variants, args.runs, layers, args.steps, args.chained,
          args.chain_barrier, args.next_n)
  if args.parse:
    table = parse(open(args.parse).read(), order, args.runs, layers, args.steps)
  else:
    trace = _trace_file(args.parse_timeline or args.timeline)
    table = timeline(gpu_kernels(trace), order, args.runs, layers, args.steps)
  print(f"device µs per step of {layers} layers ({'ncu' if args.parse else 'timeline'}), "
        "and per layer" + ("" if args.parse else "; per kernel: µs a step, gaps before it"))
  for r in table:
    extra = ("" if args.parse else
             f"  busy {r['busy_us'] / layers:.2f}, idle {r['idle_us'] / layers:.2f} a layer")
    print(f"{r['shape']:>16}  {r['variant']:<40} {r['step_us']:>9.2f} {r['layer_us']:>8.2f}"
          f"  ({r['launches']} launches a step){extra}")
    for name, v in list(r["kernels"].items())[:args.top if r["launches"] > 1 else 0]:
      us, gap = (v, None) if args.parse else v
      print(f"{'':>18}{us:>9.2f}" + ("" if gap is None else f" {gap:>8.2f}") + f"  {name[:100]}")
  if args.json:
    json.dump(table, open(args.json, "w"), indent=1)


if __name__ == "__main__":
  main()
