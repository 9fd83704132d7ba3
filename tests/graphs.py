"""Checks on compiled programs: the FFI calls of a CUDA lowering (jax.export, on any
machine), cache copies in optimized HLO, programs compiled with one GEMM algorithm
(gemm_pinned), and whether FFI calls run inside an XLA command buffer (CUDA graph), read
from the dumps of a fresh process with XLA's default flags."""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax import export

from glm5_testing.cases import CASES


def cuda_module(fn, args, donate=()):
  """The StableHLO text of jit(fn)(*args) lowered for CUDA (any machine)."""
  # Every op's target, also those the tests give a kernel (test_ffi_lowering_contract).
  checks = [export.DisabledSafetyCheck.custom_call(f"glm5_{op}") for op in CASES]
  fresh = lambda *a: fn(*a)            # a new function: jit caches lowerings per function
  exported = export.export(jax.jit(fresh, donate_argnums=donate), platforms=["cuda"],
                           disabled_checks=checks)(*args)
  return exported.mlir_module()


def glm5_calls(text):
  """The glm5_ FFI targets a lowered module's text calls, in order."""
  return re.findall(r"custom_call @(glm5_\w+)", text)


def copied_shapes(hlo, shapes):
  """The shapes (tuples) among `shapes` that optimized HLO text copies
  (copy or copy-start): a cache copied instead of updated in place."""
  wanted = {tuple(s) for s in shapes}
  found = set()
  for line in hlo.splitlines():
    if re.search(r"\bcopy(-start)?\(", line):
      found |= {tuple(int(d) for d in dims.split(","))
                for dims in re.findall(r"\w+\[([\d,]+)\]", line)} & wanted
  return found


def gemm_pinned(step, weights, cache, *args, **static):
  """step(weights, copy of cache, *args, **static) (a jitted indexer_stage or
  indexer_prefill), compiled on a GPU with XLA's GEMM autotuning off. XLA's q GEMM (and,
  at this hidden size, the projection GEMM) is the same dot in every composition of the
  stage, but the autotuner times candidate algorithms per program and can pick another
  summation order in each (the H200, 2026-11-30: q_fp8 one fp8 code off in 14% of a
  row's values, in one run of the suite and not the next); SPEC D2 leaves GEMM order
  outside the contract. At level 0 every program takes XLA's heuristic choice for the
  shape (with the stage's barrier on q, the same GEMM + convert): one order, so the rest
  of the stage is compared bit for bit."""
  cache = jax.tree.map(jnp.copy, cache)
  options = {} if jax.default_backend() == "cpu" else {"xla_gpu_autotune_level": 0}
  return step.lower(weights, cache, *args, **static).compile(
      compiler_options=options)(weights, cache, *args)


def run_and_check_graphed(script, targets, dump_dir, flags=""):
  """Runs `script` with --xla_dump_to=dump_dir (and XLA `flags`) and asserts that the optimised
  HLO calls every FFI target in `targets` and that every thunk of the program
  is a command buffer (nothing runs outside the CUDA graph). Returns stdout."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump_dir} {flags}".strip())
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                       text=True, check=True).stdout
  # The thunks of each module that calls a target: after XLA's thunk passes (the
  # command-buffer conversion), or where that dump is missing (jaxlib 0.11.2 wrote none
  # for some modules), its only thunk sequence.
  hlo, thunks = "", []
  for p in dump_dir.glob("*after_optimizations.txt"):
    text = p.read_text()
    hlo += text
    if not any(f'custom_call_target="{t}"' in text for t in targets):
      continue
    module = ".".join(p.name.split(".")[:2])              # module_NNNN.jit_name
    seqs = (sorted(dump_dir.glob(f"{module}.*thunk_sequence_after_thunk_passes*"))
            or sorted(dump_dir.glob(f"{module}.*thunk_sequence.txt")))
    thunks += [line.split(":", 1)[1].split()[0]
               for seq in seqs for line in seq.read_text().splitlines()
               if re.match(r"\d+: k", line)]
  for target in targets:
    assert f'custom_call_target="{target}"' in hlo, target
  assert thunks and set(thunks) == {"kCommandBuffer"}, (
      thunks or sorted(p.name for p in dump_dir.iterdir() if "thunk" in p.name))
  return out
