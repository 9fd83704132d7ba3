"""Kernel bodies of the indexer projection family and indexer_q, measured by Nsight Compute.

  scripts/profile_projection.py [--tokens 1 16 64] [--tactics 4x8,8x4]

runs itself under `ncu` (caches flushed before every kernel, i.e. weights not
L2-resident; no command buffers), once per call after compiling everything:
indexer_projection at each tactic that tiles K, indexer_projection_fused,
indexer_query, and the jitted references (one dot of the pre-concatenated W_cat, and
the three dots), at K 4096, H 32; indexer_q at each tactic and its reference (one dot) at
GLM-5.3-Flash's q_lora 1536 and 32 heads. It prints, per call, the duration and DRAM bytes read
of each kernel it launched: the kernel body without the per-call cost of the
benchmark's harness (BENCHMARKS.md, calibration). A marker kernel (upcast_logits on
1 x 8) is launched before each call to attribute the kernels to it.
"""
import argparse
import csv
import io
import os
import subprocess
import sys
import tempfile

K, HEADS, DIM, Q_LORA = 4096, 32, 128, 1536
MARKER = "upcast_logits"
# DRAM throughput: the share of the peak over the kernel's whole duration (ramp included).
METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,"
           "dram__throughput.avg.pct_of_peak_sustained_elapsed")
KERNELS = "glm5|indexer|upcast|gemm|Gemm|dot|fusion|cutlass|xmma|nvjet|triton"


def run_calls(tokens, tactics):
  import numpy as np
  import jax
  import jax.numpy as jnp

  import glm5_jax
  from glm5_jax import reference as ref
  from glm5_jax.indexer import Q_TACTICS, q_kernel_tiles, tile_k

  rng = np.random.default_rng(0)
  w_cat = jnp.asarray(rng.standard_normal((2 * DIM + HEADS, K)) * 0.02, jnp.bfloat16)
  wq_b = jnp.asarray(rng.standard_normal((HEADS * DIM, Q_LORA)) * 0.02, jnp.bfloat16)
  nw = jnp.asarray(1 + 0.1 * rng.standard_normal(DIM), jnp.float32)
  nb = jnp.asarray(0.1 * rng.standard_normal(DIM), jnp.float32)
  query = dict(scale=DIM ** -0.5 * HEADS ** -0.5, eps=1e-6)

  def three_dots(x, w):
    dot = lambda a: jnp.dot(x, a.T, preferred_element_type=jnp.float32)
    key, weights, gate = dot(w[:DIM]), dot(w[DIM:DIM + HEADS]), dot(w[DIM + HEADS:])
    return key.astype(jnp.bfloat16), weights, gate.astype(jnp.bfloat16)

  def projection(t):
    return lambda x, w: glm5_jax.indexer_projection(x, w, heads=HEADS, tactic=t)

  calls = []   # (label, compiled, args)
  for m in tokens:
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((m, HEADS, DIM)), jnp.bfloat16)
    key, weights, _ = ref.indexer_projection(x, w_cat, heads=HEADS)
    fns = [("reference, one dot", lambda x, w: ref.indexer_projection(x, w, heads=HEADS)),
           ("reference, three dots", three_dots)]
    fns += [(f"kernel {w}x{s}", projection((w, s))) for w, s in tactics if tile_k(K, w, s)]
    fns.append(("fused", lambda x, w, q=q: glm5_jax.indexer_projection_fused(
        x, w, q, nw, nb, heads=HEADS, **query)))
    calls += [(f"M={m} {name}", jax.jit(fn).lower(x, w_cat).compile(), (x, w_cat))
              for name, fn in fns]
    qr = jnp.asarray(rng.standard_normal((m, Q_LORA)), jnp.bfloat16)
    # What XLA's own read of wq_b's bytes takes (a row sum): the kernels' bandwidth yardstick.
    qfns = [("q reference", ref.indexer_q),
            ("wq_b row sum", lambda qr, w: jnp.sum(w.astype(jnp.float32), axis=1))] + [
        (f"q kernel {t}", lambda qr, w, t=t: glm5_jax.indexer_q(qr, w, tactic=t))
        for t in Q_TACTICS if q_kernel_tiles(HEADS * DIM, Q_LORA, t)]
    calls += [(f"M={m} {name}", jax.jit(fn).lower(qr, wq_b).compile(), (qr, wq_b))
              for name, fn in qfns]
    for name, fn in (("query kernel", glm5_jax.indexer_query), ("query reference",
                                                                 ref.indexer_query)):
      qfn = lambda q, k, w, fn=fn: fn(q, k, w, nw, nb, **query)
      calls.append((f"M={m} {name}", jax.jit(qfn).lower(q, key, weights).compile(),
                    (q, key, weights)))
  marker = jax.jit(glm5_jax.upcast_logits).lower(
      jnp.zeros((1, 8), jnp.bfloat16), jnp.zeros((1,), jnp.int32)).compile()
  marker_args = (jnp.zeros((1, 8), jnp.bfloat16), jnp.full((1,), 8, jnp.int32))
  for label, fn, args in calls:
    jax.block_until_ready(marker(*marker_args))
    print(f"CALL {label}", flush=True)
    jax.block_until_ready(fn(*args))
  jax.block_until_ready(marker(*marker_args))


def _number(text):
  """An ncu CSV value ("3,936": thousands separated)."""
  return float(text.replace(",", ""))


def report(rows, labels):
  """Kernels between consecutive markers, attributed to the calls in order."""
  groups, current = [], None
  for r in rows:
    if MARKER in r["Kernel Name"]:
      if current is not None:
        groups.append(current)
      current = []
    elif current is not None:
      current.append(r)
  if len(groups) != len(labels):
    sys.exit(f"{len(groups)} kernel groups for {len(labels)} calls")
  print(f"{'call':34} {'µs':>7} {'DRAM MB':>8}  kernels (µs, DRAM % of peak)")
  for label, kernels in zip(labels, groups):
    us = [_number(k["gpu__time_duration.sum"]) / 1e3 for k in kernels]
    mb = sum(_number(k["dram__bytes_read.sum"]) for k in kernels) / 1e6
    names = ", ".join(f"{k['Kernel Name'][:40]} grid{k.get('Grid Size')} "
                      f"block{k.get('Block Size')} {u:.2f} "
                      f"{_number(k['dram__throughput.avg.pct_of_peak_sustained_elapsed']):.0f}%"
                      for k, u in zip(kernels, us))
    print(f"{label:34} {sum(us):7.2f} {mb:8.3f}  {names}")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64])
  p.add_argument("--tactics", default="1x1,2x1,4x1,8x1,4x2,4x4,4x8,8x2,8x4,8x8,2x8,1x8",
                 help="warps x split, comma separated")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  tactics = [tuple(map(int, t.split("x"))) for t in args.tactics.split(",")]
  if args.child:
    run_calls(args.tokens, tactics)
    return
  # A first run without ncu fills a compilation cache, so that under ncu nothing is
  # autotuned (XLA's GEMM autotuning launches many kernels) and only the kernels named
  # by KERNELS are profiled.
  env = dict(os.environ, GLM5_JAX_KERNELS="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=",
             JAX_COMPILATION_CACHE_DIR=tempfile.mkdtemp(prefix="profile_projection_"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  child = [sys.executable, __file__, "--child", "--tokens", *map(str, args.tokens),
           "--tactics", args.tactics]
  subprocess.run(child, env=env, check=True, capture_output=True)
  cmd = ["ncu", "--csv", "--page", "raw", "--print-units", "base", "--metrics", METRICS,
         "--kernel-name", f"regex:{KERNELS}", *child]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  labels = [line[5:] for line in proc.stdout.splitlines() if line.startswith("CALL ")]
  table = "\n".join(line for line in proc.stdout.splitlines() if line.startswith('"'))
  if proc.returncode != 0 or not table:
    sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  rows = [r for r in csv.DictReader(io.StringIO(table)) if r.get("ID", "").isdigit()]
  report(rows, labels)


if __name__ == "__main__":
  main()
