"""Group "calibration": the copy bandwidth (the floors' denominator) and the per-call
cost of an empty XLA fusion, an empty Pallas kernel and, with the CUDA module, an
(almost) empty FFI call, each timed like an op (bench/harness.py)."""
import jax.numpy as jnp

import glm5_jax

from . import pallas_ops
from .harness import amortised
from .sizes import BF16, F32, i32, size_text
from .variants import KERNEL, NO_PDL, variant_env

NAME = "calibration"


def run(bench):
  s = bench.s
  try:
    # One call per run (a chain of elementwise ops would fuse into one), in place;
    # a run of >= 1 ms hides its dispatch.
    x = jnp.zeros(s.copy_bytes // 4, jnp.uint32)
    call = lambda st, f, a: (st + f[0], ())
    sec, x, _ = amortised(call, x, (jnp.zeros((), jnp.uint32),), [()], None, s, calls=1)
    del x
    bench.bw = 2 * s.copy_bytes / sec
    bench.row(NAME, f"copy {size_text(s.copy_bytes)}", NAME, sec * 1e6, None, True,
              gbps=bench.bw / 1e9,
              notes="x = x + s on u32 in place, one kernel; GB/s counts read + write")
    bench.log(f"calibration: copy {bench.bw / 1e9:.0f} GB/s (read + write), "
              f"{sec * 1e6:.1f} us per copy")
  except Exception as e:                                   # noqa: BLE001
    bench.error_row(NAME, "copy", NAME, e)
  empty(bench, s, "empty XLA op", "y = x + 1 on f32[8], one fusion per call",
        lambda st, f, a: (st, (a[0] + 1,)), [(jnp.full(8, i, F32),) for i in range(s.empty_r)])
  empty(bench, s, "empty Pallas call", "y = x + 1 on f32[128], one Pallas (Triton) kernel "
        "per call", lambda st, f, a: (st, (pallas_ops.empty(a[0]),)),
        [(jnp.full(128, i, F32),) for i in range(s.empty_r)])
  if bench.has_kernel("upcast_logits"):
    for variant in (KERNEL, NO_PDL):
      with variant_env(variant):
        empty(bench, s, "empty FFI call" + (", PDL off" if variant == NO_PDL else ""),
              "upcast_logits kernel on 1x8",
              lambda st, f, a: (st, (glm5_jax.upcast_logits(f[0], a[0]),)),
              [(i32([8]),) for _ in range(s.empty_r)], fixed=(jnp.ones((1, 8), BF16),))


def empty(bench, s, name, notes, call, rotated, fixed=()):
  """One calibration row: µs per call of a chain of `call` on the rotated inputs, each
  call depending on the previous one like the op rows (Sizes.data_dep: + one tiny
  fusion per call, part of this row too)."""
  try:
    sec, _, info = amortised(call, None, fixed, rotated, 0, s)
    bench.row(NAME, f"{name} x{len(rotated)}", NAME, sec * 1e6, None, True,
              R=info["R"], calls=info["calls"], notes=notes)
    bench.log(f"calibration: {name} {sec * 1e6:.2f} us ({info['calls']} calls per run)")
    if name == "empty XLA op":
      bench.empty_us = sec * 1e6
  except Exception as e:                                   # noqa: BLE001
    bench.error_row(NAME, name, NAME, e)
