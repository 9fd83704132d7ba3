"""`python -m bench`: the command line (see bench/__init__.py)."""
import argparse
import dataclasses
import os

import jax

import glm5_jax

from . import __doc__ as DOC
from .driver import Bench
from .groups import GROUPS
from .harness import CACHE_DIR, use_cache
from .report import markdown, plot_or_none, render
from .sizes import sizes_for
from .variants import REFERENCE, VARIANTS

HERE = os.path.dirname(os.path.abspath(__file__))


def parser():
  p = argparse.ArgumentParser(prog="python -m bench", description=DOC.split("\n")[0])
  p.add_argument("--out", default="BENCHMARKS.json", help="JSON rows")
  p.add_argument("--md", default="BENCHMARKS.md", help="markdown report")
  p.add_argument("--plot", default=os.path.join(HERE, "benchmarks.png"),
                 help="PNG plot ('': none)")
  p.add_argument("--quick", action="store_true",
                 help="M (B, n, rows) in {1, 64} and the first of the other sizes")
  p.add_argument("--ops", default="", help="comma-separated ops (default: all)")
  p.add_argument("--rows", default="",
                 help="comma-separated M (B, n, rows) instead of 1,8,16,64")
  p.add_argument("--select-pools", default="",
                 help="comma-separated P of the select ops (mqa_logits, pool_topk, "
                      "select_pools, select_slots) instead of 2048,8192,32768")
  p.add_argument("--select-rows", default="",
                 help="comma-separated rows of the select ops instead of 1,16,64")
  p.add_argument("--skip-variants", nargs="+", default=[], metavar="VARIANT",
                 choices=VARIANTS,
                 help=f"variants not to run in any group, each one argument (of: "
                      f"{'; '.join(VARIANTS)}); without {REFERENCE}, a shape's other rows are "
                      f"not checked against it (unchecked), triton's still against the kernel")
  p.add_argument("--cpu-smoke", action=argparse.BooleanOptionalAction, default=None,
                 help="tiny caches, contexts, R and N (default: on for the CPU backend)")
  p.add_argument("--budget-s", type=float, default=230,
                 help="skip the remaining shapes after this many seconds")
  p.add_argument("--cache-dir", default=CACHE_DIR,
                 help="persistent XLA compilation cache ('' = off); reruns skip "
                      "the unchanged compiles")
  p.add_argument("--data-dep", action=argparse.BooleanOptionalAction, default=True,
                 help="chain stateless calls through a run-time-zero scalar (one extra tiny "
                      "fusion per call; the default: without it XLA merges the calls of a "
                      "chain that share an input set, see bench/harness.py chain)")
  p.add_argument("--groups", default="calibration,ops,sweep",
                 help="comma-separated groups to run, of: "
                      + ", ".join(g.NAME for g in GROUPS)
                      + " (stage: whole decode steps; serving: the decode loop; prefill: "
                        "indexer_prefill of whole prompts)")
  p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                 help="an XLA compiler option of every timed executable (repeatable), e.g. "
                      "xla_gpu_command_buffer_update_mode=SKIP_TEMP (jaxlib 0.11.2 has no "
                      "CAPTURE_CMD_NEVER_UPDATE); "
                      "recorded in every row")
  p.add_argument("--max-sets", type=int, default=None, metavar="R",
                 help="at most R rotated input sets per chain (default: Sizes.r_max; an op's own "
                      "minimum still applies); fewer "
                      "sets dispatch faster: 64-set chains of the projection were host-bound "
                      "where 32-set ones were not")
  p.add_argument("--max-calls", type=int, default=None, metavar="N",
                 help="at most N calls unrolled per chain (default: Sizes.max_calls); the "
                      "dispatch of a chain grows with its FFI calls")
  p.add_argument("--verbose", action="store_true", help="print tracebacks")
  p.add_argument("--render", metavar="JSON",
                 help="measure nothing: rebuild --md and --plot from these JSON rows")
  for group in GROUPS:
    if hasattr(group, "add_arguments"):
      group.add_arguments(p)
  return p


def _option_value(text):
  """An --xla-option value as XLA's option setter takes it: true / false as a bool (it
  rejects the strings), an integer as an int, anything else (enum names) as given."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  try:
    return int(text)
  except ValueError:
    return text


def sizes_from(p, args):
  """The run's Sizes from the command line (parser `p` reports bad values)."""
  options = tuple(tuple(o.split("=", 1)) for o in args.xla_option)
  if any(len(o) != 2 for o in options):
    p.error("--xla-option takes NAME=VALUE")
  options = tuple((name, _option_value(value)) for name, value in options)
  sizes = dataclasses.replace(sizes_for(args.quick, args.cpu_smoke), data_dep=args.data_dep,
                              compiler_options=options)
  if args.rows:
    sizes = dataclasses.replace(sizes, rows=tuple(int(m) for m in args.rows.split(",")))
  for flag in ("select_pools", "select_rows"):
    if getattr(args, flag):
      sizes = dataclasses.replace(
          sizes, **{flag: tuple(int(v) for v in getattr(args, flag).split(","))})
  for flag, field in (("max_sets", "r_max"), ("max_calls", "max_calls")):
    value = getattr(args, flag)
    if value is not None:
      if value < 1:
        p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
      sizes = dataclasses.replace(sizes, **{field: value})
  return sizes


def main():
  p = parser()
  args = p.parse_args()
  if args.render:
    render(args)
    return
  if args.cpu_smoke is None:
    args.cpu_smoke = jax.default_backend() == "cpu"
  use_cache(args.cache_dir)
  ops = [o for o in args.ops.replace(" ", "").split(",") if o] or list(glm5_jax.OPS)
  unknown = set(ops) - set(glm5_jax.OPS)
  if unknown:
    p.error(f"unknown ops {sorted(unknown)}; choose from {', '.join(glm5_jax.OPS)}")
  # Ops with a kernel first: they matter most if the budget runs out.
  ops = sorted(ops, key=lambda o: (o not in glm5_jax.KERNEL_TARGETS, glm5_jax.OPS.index(o)))

  for path in (args.out, args.md):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  sizes = sizes_from(p, args)
  bench = Bench(sizes, args, ops)
  bench.log(f"{bench.meta['gpu']} ({jax.default_backend()}), jax {jax.__version__}, "
            f"CUDA module {'built' if bench.module else 'absent'}, kernel variants: "
            f"{bench.kernels}, compilation cache: {args.cache_dir or 'off'}"
            + (", --cpu-smoke sizes" if args.cpu_smoke else ""))
  chosen = set(args.groups.replace(" ", "").split(","))
  unknown = chosen - {g.NAME for g in GROUPS}
  if unknown:
    p.error(f"unknown groups {sorted(unknown)}")
  for group in GROUPS:
    if group.NAME in chosen:
      group.run(bench)
      bench.write_json()
  bench.sort_rows()
  bench.write_json()

  plot_ref = plot_or_none(bench.rows, args)
  text = markdown(bench.rows, dict(bench.meta, kernels=bench.kernels), sizes, plot_ref)
  with open(args.md, "w") as f:
    f.write(text)
  compile_s = sum(r.get("compile_s", 0) for r in bench.rows)
  bench.log(f"wrote {args.out}, {args.md}" + (f", {args.plot}" if plot_ref else "")
            + f"; chain compiles took {compile_s:.0f}s")
  print("\n".join(line for line in text.splitlines() if not line.startswith("![")), flush=True)


if __name__ == "__main__":
  main()
