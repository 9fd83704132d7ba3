"""Determinism and endurance of the decode loop (issue 11, item 5): runs
`examples/decode_loop.py --endurance --steps N` twice with the same seed, each in its
own process (its own compile), and checks

- the two digests are equal: the final caches of every layer and the last step's
  outputs bit-identical between the runs;
- the device memory in use is flat in each run: bytes in use after the last step minus
  after the first step (the prefill, the compile and one step done; the same arrays
  live at both points) within --slack-mib. The default 1 MiB is below what a leak of
  one allocation per step would add over 10,000 steps (the allocator's smallest block
  is 256 bytes), and far below one more layer's caches.

  python scripts/endurance.py [--steps 10000] [--slack-mib 1] [-- DEMO ARGUMENTS]

Arguments after `--` go to the demo (e.g. `-- --layers 1 --contexts 30,210` for a small
CPU run); the demo's defaults on a GPU are 11 layers and prompts of 300, 5000 and
30000 tokens. Exits 0 when both hold, 1 otherwise. The CPU backend reports no memory
statistics: there the memory check is skipped, saying so; on any other backend a run
that reports none fails.

The runs inherit the environment, so XLA_FLAGS reaches both. Each run compiles its own
step, and XLA picks some GEMM/fusion algorithms by timing them while it compiles
(autotuning): if the digests differ, rerun with
XLA_FLAGS=--xla_gpu_deterministic_ops=true to tell such a compile-time choice (then
equal) from non-determinism at run time (still different).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "decode_loop.py")


def parse(argv):
  demo_args = []
  if "--" in argv:
    i = argv.index("--")
    argv, demo_args = argv[:i], argv[i + 1:]
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=10000, help="decode steps of each run")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--slack-mib", type=float, default=1.0,
                 help="most growth of the device memory in use over a run (MiB)")
  args = p.parse_args(argv)
  return args, demo_args


def run_demo(args, demo_args, out, label):
  """Runs the demo once; its digest JSON (dict). Its output streams through."""
  cmd = [sys.executable, DEMO, "--endurance", "--steps", str(args.steps), "--seed",
         str(args.seed), "--digest", out, *demo_args]
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
  print(f"== run {label}: {' '.join(cmd[1:])}", flush=True)
  t0 = time.perf_counter()
  done = subprocess.run(cmd, env=env)
  if done.returncode != 0:
    raise SystemExit(f"endurance: run {label} failed (exit {done.returncode})")
  print(f"== run {label}: {time.perf_counter() - t0:.0f} s", flush=True)
  with open(out) as f:
    return json.load(f)


def memory_verdict(result, label, slack):
  """(ok, line) of one run's memory check."""
  first, last = result["memory_first"], result["memory_last"]
  if first is None or last is None:
    if result["backend"] == "cpu":
      return True, (f"run {label}: memory not checked (the cpu backend reports no "
                    "memory statistics)")
    return False, f"run {label}: the {result['backend']} backend reported no memory in use"
  growth = last - first
  ok = growth <= slack
  return ok, (f"run {label}: memory in use {first:,d} -> {last:,d} bytes after "
              f"{result['steps']} steps ({growth:+,d}; {'within' if ok else 'over'} the "
              f"slack of {slack:,d} bytes)")


def main(argv=None):
  args, demo_args = parse(sys.argv[1:] if argv is None else argv)
  slack = int(args.slack_mib * 2 ** 20)
  with tempfile.TemporaryDirectory() as tmp:
    results = [run_demo(args, demo_args, os.path.join(tmp, f"{label}.json"), label)
               for label in "AB"]
  lines, ok = [], True
  for label, result in zip("AB", results):
    good, line = memory_verdict(result, label, slack)
    ok &= good
    lines.append(line)
  a, b = (r["sha256"] for r in results)
  same = a == b
  ok &= same
  lines.append(f"digests {'equal' if same else 'DIFFER'}: A {a}, B {b} (the final caches "
               f"of {results[0]['layers']} layers and step {args.steps}'s outputs)")
  if not same:
    lines.append("  rerun with XLA_FLAGS=--xla_gpu_deterministic_ops=true to tell an "
                 "autotuning choice at compile time from run-time non-determinism")
  r = results[0]
  lines.append(f"{r['device']} ({r['backend']}): {r['layers']} layers, prompts "
               f"{r['contexts']}, {args.steps} steps; {r['steps_per_s']:.0f} and "
               f"{results[1]['steps_per_s']:.0f} steps/s, sampled step p50 "
               f"{r['p50_ms']:.2f} and {results[1]['p50_ms']:.2f} ms")
  print("\n".join(["== endurance"] + lines + ["ok" if ok else "FAILED"]), flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
