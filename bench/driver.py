"""Bench: the result rows of one run, and the measurement of one Workload in each
of its variants (checked, then timed). The groups (bench/groups.py) drive it."""
import datetime
import json
import re
import time
import traceback

import jax

import glm5_jax
from glm5_jax import _ffi

from . import harness, stock
from .sizes import BW_FALLBACK
from .variants import (
  ALTERNATIVES,
  KERNEL,
  NO_PDL,
  REFERENCE,
  TRITON,
  expected_targets,
  variant_env,
  with_call,
)
from .workloads import WORKLOADS, floor_us


class Bench:
  """Collects result rows; measures workloads. bw (copy bandwidth, for the floors) is
  set by the calibration group."""

  def __init__(self, sizes, args, ops=()):
    self.s, self.args, self.ops = sizes, args, list(ops)
    self.rows, self.t0 = [], time.monotonic()
    self.bw, self.empty_us = BW_FALLBACK, None
    dev = jax.devices()[0]
    self.meta = dict(gpu=dev.device_kind, jax_version=jax.__version__,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds"))
    if sizes.compiler_options:
      self.meta["compiler_options"] = dict(sizes.compiler_options)
    self.gpu = jax.default_backend() == "gpu"
    self.module = self.gpu and _ffi.register_targets()
    self.kernels = [op for op in glm5_jax.KERNEL_TARGETS if self.has_kernel(op)]
    self.kernel_targets = {glm5_jax.KERNEL_TARGETS[op] for op in self.kernels}

  def log(self, msg):
    print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

  def row(self, op, shape, variant, device_us, floor, exact, **extra):
    row = dict(op=op, shape=shape, variant=variant, device_us=device_us, floor_us=floor,
               exact=exact, **self.meta, **{k: v for k, v in extra.items() if v is not None})
    self.rows.append(row)
    return row

  def error_row(self, op, shape, variant, e):
    note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    self.log(f"{op} {shape} {variant}: {note}")
    if self.args.verbose:
      traceback.print_exc()
    self.row(op, shape, variant, None, None, False, notes=note)

  def has_kernel(self, op):
    return self.module and op in glm5_jax.KERNEL_TARGETS

  def states(self, group, shapes, variants, build):
    """(shape label, args, state) of each (label, args) of `shapes` of a whole-step group
    whose state build(*args) could be made: a shape past the time budget is skipped
    (logged), a failed build gives an error row for each variant."""
    for shape, args in shapes:
      if self.over_budget():
        self.log(f"{group} {shape}: skipped (over the time budget)")
        continue
      try:
        state = build(*args)
      except Exception as e:                               # noqa: BLE001
        for v in variants:
          self.error_row(group, shape, v, e)
        continue
      yield shape, args, state
      del state   # before the next build: a step's caches can be most of the GPU

  def over_budget(self):
    return time.monotonic() - self.t0 > self.args.budget_s

  def write_json(self):
    with open(self.args.out, "w") as f:
      json.dump(self.rows, f, indent=1, default=float)

  def sort_rows(self):
    """Calibration first, then the workload ops in self.ops order with shapes in
    WORKLOADS order; rows of other groups after them, as they came."""
    order = {(op, shape): (i, j) for i, op in enumerate(self.ops)
             for j, (shape, _) in enumerate(WORKLOADS[op][1](self.s))}
    late = (len(self.ops), 0)
    self.rows.sort(key=lambda r: (r["op"] != "calibration",
                                  order.get((r["op"], r["shape"]), late)))

  # workloads -------------------------------------------------------------------
  def variants(self, op):
    return self.kept(self.all_variants(op))

  def kept(self, variants):
    """`variants` less those named by --skip-variants (every group's variants)."""
    return [v for v in variants if v not in self.args.skip_variants]

  def all_variants(self, op):
    return ([REFERENCE] + ([KERNEL, NO_PDL] if self.has_kernel(op) else [])
            + ([TRITON] if self.gpu and op in stock.TRITON_CALLS and stock.triton_oracle()
               else [])
            + [v for v, alt in ALTERNATIVES.get(op, {}).items()
               if set(alt.targets) <= self.kernel_targets])

  def chain_length(self, work, wall):
    """R (rotated input sets cycled by the chain): <= r_max, one cycle of <= chain_s
    (one call's wall time); >= r_min and work.r_min."""
    s = self.s
    r = min(s.r_max, int(s.chain_s / wall))
    return min(len(work.rotated), max(r, s.r_min, work.r_min))

  def max_calls(self, lines):
    """Most calls of a chain: <= chain_lines lowered lines (compile time)."""
    return max(1, self.s.chain_lines // max(1, lines))

  def check(self, work, state, variant, results):
    """(result leaves, R, most calls) of one call of `variant` from `state`."""
    if variant == TRITON:
      got = stock.triton_single_call(work, state)
      return got, results["chain"][0], results["chain"][1]
    with variant_env(variant, work.op):
      text, got, wall = harness.single_call(with_call(work, variant), state)
    called = set(re.findall(r"custom_call @(glm5_\w+)", text))
    want = expected_targets(work.op, variant)
    if called != want:
      raise RuntimeError(f"the {variant} variant calls {sorted(called)}, not {sorted(want)}")
    r, most = self.chain_length(work, wall), self.max_calls(text.count("\n"))
    results.setdefault("chain", (r, most))
    return got, r, most

  def run_case(self, work, variants):
    """Checks every variant once (from the same initial state): the JAX variants
    against the reference, the Triton one against the kernel (its stock op order;
    the reference where there is no kernel). Then times each; the state is
    threaded from run to run (the Triton variant times on its own copy, with as
    many calls per graph as the first JAX variant's chain)."""
    s, state = self.s, work.state
    floor = floor_us(work.nbytes, work.flops, self.bw)
    results, checked = {}, {}                        # variant -> (exact, R, most calls)
    for variant in variants:
      try:
        got, r, most = self.check(work, state, variant, results)
        if variant == REFERENCE:
          exact = True
        else:
          want = results.get(KERNEL if variant == TRITON else REFERENCE,
                             results.get(REFERENCE))
          # None (not checked) where this run has nothing to compare with (the
          # reference skipped): a "no" would claim a mismatch nobody saw.
          exact = None if want is None else all(
              bool(harness.same_bits(a, b)) for a, b in zip(got, want))
        if variant in (REFERENCE, KERNEL):
          results[variant] = got
        checked[variant] = exact, r, most
        del got
      except Exception as e:                               # noqa: BLE001
        self.error_row(work.op, work.shape, variant, e)
    results.clear()
    calls = None
    for variant, (exact, r, most) in checked.items():
      try:
        if variant == TRITON:
          sec, info = stock.triton_amortised(work, state, r, calls or r, s)
        else:
          with variant_env(variant, work.op):
            sec, state, info = harness.amortised(
                with_call(work, variant).call, state, work.fixed, work.rotated[:r],
                work.dep, s, max_calls=most)
          calls = calls or info["calls"]
        us = sec * 1e6
        self.row(work.op, work.shape, variant, us, floor, exact,
                 gbps=work.nbytes / sec / 1e9, R=info["R"], calls=info["calls"],
                 passes=info.get("passes"), reps=s.reps,
                 dispatch_us=_round(info.get("dispatch_us")),
                 run_us=_round(info.get("run_us")),
                 compile_s=round(info["compile_s"], 2), min_bytes=int(work.nbytes),
                 flops=int(work.flops) or None,
                 notes=_notes(harness.host_note(info), harness.not_in_place(info["temp"], state)))
        self.log(f"{work.op} {work.shape} {variant}: {us:.2f} us (floor {floor:.3f}, "
                 f"R={info['R']}, {info['calls']} calls"
                 + (f" x {info['passes']} replays" if info.get("passes") else "")
                 + f", exact={exact}, compile {info['compile_s']:.1f}s)")
      except Exception as e:                               # noqa: BLE001
        self.error_row(work.op, work.shape, variant, e)
        if any(a.is_deleted() for a in jax.tree.leaves(state)):
          return                                           # the state was donated away


def _notes(*notes):
  return "; ".join(n for n in notes if n) or None


def _round(v):
  return None if v is None else round(v, 2)
