"""Diagnostics: `python -m glm5_jax.info` prints versions, platforms, the routing and
which ops run a CUDA kernel, all derived from the op declarations.

`python -m glm5_jax.info --plan --rows M --next-n N --context C [--update auto|ops|fused]
[--fused] [--heads H] [--scale-format fp32|ue8m0]` prints the stage's plan (glm5_jax.plan)
at those shapes under the routing of the environment (GLM5_JAX_KERNELS), as a CUDA lowering
would run it; no GPU is needed."""
import argparse
import math
import re

import numpy as np
import jax
import jax.numpy as jnp
import jaxlib

import glm5_jax
from glm5_jax import _ffi
from glm5_jax._primitive import KERNELS_ENV, Op, Routing
from glm5_jax.reference.numerics import DIM, POOL
from glm5_jax.stage import (
  UPDATES,
  DecodeBatch,
  IndexerCache,
  IndexerConfig,
  IndexerWeights,
  stage_plan,
)
from glm5_jax.synthetic import HIDDEN, Q_LORA, ring_size


def describe(op: Op, routing: Routing, built: bool) -> str:
  """Where `op` runs on CUDA under `routing`, in words."""
  if op.kernel is None:
    return "reference (no kernel; the README's op table says why)"
  if not built:
    return "reference (CUDA module not built)"
  word = routing.word(op.name)
  if not op.kernel_on(routing):
    why = f"off in {KERNELS_ENV}/Routing" if word is not None else op.kernel_off
    return f"{op.otherwise} ({why}; kernel {op.kernel} with {KERNELS_ENV}={op.name}=1)"
  where = [op.kernel_limits] + ([op.kernel_default_note] if word is None else [])
  where = "; ".join(filter(None, where))
  return f"kernel {op.kernel}" + (f" ({where}; otherwise {op.otherwise})" if where else "")


def report() -> list[str]:
  """The diagnostics as lines of text."""
  built = _ffi.register_targets()
  routing = Routing.from_env()
  lines = [
      f"glm5_jax {glm5_jax.__version__}",
      f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
      f"CUDA module: {'built, FFI API %d.%d' % _ffi.ffi_api_version() if built else 'not built'}",
      f"platforms: {', '.join(sorted({d.platform for d in jax.devices()}))}",
      f"routing: {routing}",
      "ops (on CUDA):",
  ]
  lines += [f"  {name:26s} {describe(op, routing, built)}" for name, op in Op.registry.items()]
  return lines


def stage_args(rows: int, next_n: int, context: int, config: IndexerConfig, *,
               hidden: int = HIDDEN, q_lora: int = Q_LORA, page: int = 64):
  """Abstract (weights, cache, x, qr, batch) of indexer_stage: rows = requests x next_n
  token rows, each request with `context` tokens of cache in pages of `page` entries."""
  if rows <= 0 or next_n <= 0 or rows % next_n:
    raise ValueError(f"glm5_jax.info: rows must be a positive multiple of next_n, got "
                     f"rows={rows}, next_n={next_n}")
  s, i32, bf16, f32 = jax.ShapeDtypeStruct, np.int32, jnp.bfloat16, np.float32
  requests, heads = rows // next_n, config.heads
  weights = IndexerWeights(s((heads * DIM, q_lora), bf16), s((2 * DIM + heads, hidden), bf16),
                           s((DIM,), f32), s((DIM,), f32), s((POOL, DIM), f32))
  pages = math.ceil((context // POOL + 1) / page)
  cache = IndexerCache(s((requests * pages, page, DIM + 4), np.uint8),
                       s((requests, 2, ring_size(next_n), DIM), bf16))
  grid = s((requests, next_n), i32)
  blocks = math.ceil((context + next_n) / config.block_size)
  batch = DecodeBatch(grid, grid, grid, s((rows,), i32), s((requests, pages), i32),
                      s((requests, blocks), i32))
  return weights, cache, s((rows, hidden), bf16), s((rows, q_lora), bf16), batch


def plan_report(rows: int, next_n: int, context: int, update: str = "auto",
                fused: bool = False, heads: int = 32, scale_format: str = "fp32",
                routing: Routing | None = None) -> list[str]:
  """The stage's plan at these shapes (max_pools = context // 4) as lines of text."""
  routing = Routing.from_env() if routing is None else routing
  config = IndexerConfig(heads=heads, max_pools=max(context // POOL, 1), update=update,
                         fused=fused, scale_format=scale_format, routing=routing)
  args = stage_args(rows, next_n, context, config)
  plan = stage_plan(config, True, *args)
  return ([f"stage plan: M {rows} (next_n {next_n}), context {context}, update {update!r}, "
           f"fused {fused}, heads {heads}, scale_format {scale_format!r}",
           f"routing: {routing}"] + [f"  {line}" for line in plan.lines()]
          + lowered_report(config, args))


def stage_lowering(config: IndexerConfig, args) -> dict:
  """The stage's CUDA lowering (jax.export, any machine) at these arguments:
  {"calls": [[glm5_ target, {attribute: value}]] in order, "sort": n, "dot_general": n}
  (the XLA sorts and GEMMs beside the FFI calls)."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(op.kernel)
            for op in Op.registry.values() if op.kernel]
  step = jax.jit(lambda *a: glm5_jax.indexer_stage(*a, config=config))
  text = jax.export.export(step, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
  calls = []
  for line in text.splitlines():
    call = re.search(r"stablehlo.custom_call @(glm5_\w+)\(.*?mhlo.backend_config = \{([^}]*)\}",
                     line)
    if call:
      attrs = dict(a.strip().split(" = ", 1) for a in call.group(2).split(",") if a.strip())
      calls.append([call.group(1), attrs])
  return {"calls": calls, "sort": text.count("stablehlo.sort"),
          "dot_general": text.count("stablehlo.dot_general")}


def lowered_report(config: IndexerConfig, args) -> list[str]:
  """stage_lowering in words: the FFI targets in order, and a line naming any part that
  runs as XLA's sort or GEMM, so a fallback to XLA code is never silent."""
  lowered = stage_lowering(config, args)
  calls = [target for target, _ in lowered["calls"]]
  xla = [f"{what} x{lowered[key]}" for key, what in (
      ("sort", "sort (a top-k without its kernel)"), ("dot_general", "dot_general"))
         if lowered[key]]
  return [f"  CUDA lowering: {', '.join(calls) or 'no glm5_ kernel'}",
          f"  XLA code: {'; '.join(xla) if xla else 'none besides fusions'}"]


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m glm5_jax.info", description=__doc__)
  parser.add_argument("--plan", action="store_true", help="print the stage's plan")
  parser.add_argument("--rows", type=int, default=1, help="token rows M = requests x next_n")
  parser.add_argument("--next-n", type=int, default=1)
  parser.add_argument("--context", type=int, default=8192, help="tokens of cache a request")
  parser.add_argument("--update", choices=UPDATES, default="auto")
  parser.add_argument("--fused", action="store_true")
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--scale-format", choices=("fp32", "ue8m0"), default="fp32")
  args = parser.parse_args(argv)
  if args.plan:
    lines = plan_report(args.rows, args.next_n, args.context, args.update, args.fused,
                        args.heads, args.scale_format)
  else:
    lines = report()
  print("\n".join(lines))


if __name__ == "__main__":
  main()
