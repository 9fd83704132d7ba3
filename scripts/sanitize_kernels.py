"""Runs every CUDA kernel of glm5_jax once per case, for compute-sanitizer.

  compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/sanitize_kernels.py

The GPU runs only the kernels and the jit's glue (no reference programs there:
compute-sanitizer crashes on some of XLA's own kernels inside the test suite);
each output is checked against the reference run on the CPU backend. Inputs:
glm5_jax/testing/cases.py (padding, negative and out-of-range indices, ragged rows) plus
kernel-sized variants, several seeds each. Exit status 1 on a mismatch.
"""
import functools
import os
import sys

os.environ["GLM5_JAX_KERNELS"] = "1"

import numpy as np  # noqa: E402
import jax  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax.testing import cases  # noqa: E402

SEEDS = 3


def _variants():
  """(name, fn, make, valid, exact) for every kernel op: the shared cases plus kernel-only
  shapes."""
  out = []
  for op in glm5_jax.KERNEL_TARGETS:
    case = cases.CASES[op]
    out.append((op, case.fn, case.make, case.valid, case.exact))
  remap = cases.CASES["expand_and_remap"]
  out.append(("expand_and_remap compact=False",
              functools.partial(remap.fn, compact=False), remap.make, None, True))
  query = cases.CASES["indexer_query"]
  out.append(("indexer_query padded=32",
              functools.partial(query.fn, padded=32), query.make, None, True))
  return out


def _masked(valid, args, outs):
  return tuple(valid(args, outs)) if valid else outs


def main():
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]   # gpu is the CPU on a CPU-only smoke run
  print(f"kernels on {gpu.platform}, reference on cpu")
  bad = 0
  for name, fn, make, valid, exact in _variants():
    for seed in range(SEEDS):
      args = make(np.random.default_rng(seed))
      got = jax.jit(fn)(*jax.device_put(args, gpu))
      want = jax.jit(fn)(*jax.device_put(args, cpu))
      got, want = (jax.tree.leaves(jax.device_get(t)) for t in (got, want))
      got, want = _masked(valid, args, got), _masked(valid, args, want)
      same = [np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
              if exact else   # GEMMs: summation order differs (SPEC D2)
              np.allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                          **cases.TOLERANCE)
              for g, w in zip(got, want)]
      # kpool_update's K cache may differ by SPEC D2 (stock arithmetic vs reference)
      ok = all(same) or (name == "kpool_update" and all(same[1:]))
      bad += not ok
      how = "identical to" if exact else "close to"
      print(f"{name:32s} seed {seed}: outputs {how} the CPU reference {same}")
  print(f"sanitize_kernels: {'FAIL' if bad else 'ok'}")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
