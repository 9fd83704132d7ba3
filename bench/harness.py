"""How the bench times: unrolled chains of calls (amortised), whole jitted steps
(time_step), one checked call (single_call). The method is in bench/__init__.py.

No device loop: XLA runs a `while` (lax.fori_loop) on the host, one round trip per
iteration (about 12 µs on the H200), which inflated every small op timed inside one.
A chain here is N calls written out one after the other in one jitted function (one
executable, one command buffer), and runs of it are dispatched back to back.
"""
import functools
import os
import statistics
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from .sizes import size_text

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_NAN_BITS = {2: 0x7FED, 4: 0x7FEDCBA9}      # NaN payloads / ints no op produces


def _sentinel(outs):
  """A bool scalar that is False at run time but cannot be folded: does the first
  element of a >= 2-byte output hold a bit pattern no op produces?"""
  hits = [lax.bitcast_convert_type(o.reshape(-1)[0], _UINT[o.dtype.itemsize])
          == _NAN_BITS[o.dtype.itemsize]
          for o in outs if o.dtype.itemsize in _NAN_BITS and o.size]
  return functools.reduce(jnp.logical_or, hits)


def _token(tree):
  """A scalar read from the first leaf of `tree`."""
  return jax.tree.leaves(tree)[0].reshape(-1)[0]


def chain(call, dep, data_dep, calls):
  """fn(state, fixed, flag, rotated) -> (state, (done, outs)): `calls` calls of `call`
  unrolled in order, call i on rotated[i % R], so one dispatch covers many calls
  without a device loop. Stateful calls are chained by their state (donated, updated
  in place). A stateless call's arguments pass through an optimization barrier
  together with the previous call's outputs: an HLO dependency that XLA keeps through
  fusion and scheduling (no overlap, no horizontal fusion, no CSE of the calls that
  share an input set) and that costs nothing at run time. With data_dep they also take
  a run-time dependency: argument `dep` of call i+1 gets + flag, which call i's outputs
  decide (always False), at the cost of one tiny fusion per call. That is the default
  (Sizes.data_dep): XLA drops optimization barriers before its CSE, so without it the
  calls that share an input set merge (measured on the CPU backend: 9 calls over 3
  input sets compiled to 3), and the H200 rows of a barrier-only chain that returned
  only its last outputs came out below the bandwidth floor. The last call's outputs are
  returned (with the dependency every earlier call is live; returning all of them made
  the dispatch of a run as long as the run). `done` is a scalar to wait on (all outputs of a run
  are ready together)."""
  def fn(state, fixed, flag, rotated):
    prev = None
    for i in range(calls):
      args = rotated[i % len(rotated)]
      if state is None:
        if data_dep and dep is not None:
          args = args[:dep] + (args[dep] + flag.astype(args[dep].dtype),) + args[dep + 1:]
        if prev is not None:
          prev, args = lax.optimization_barrier((prev, args))
      state, outs = call(state, fixed, args)
      if data_dep and dep is not None:
        flag = _sentinel(outs)
      prev = outs
    # Not a read of the state: XLA would copy a state that is read besides being updated.
    done = ~flag if state is not None else _token(prev)
    return state, (done, prev)
  return fn


CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax_cache")


def use_cache(path, min_compile_s=0.5):
  """jax's persistent compilation cache in `path` ('' = off): a rerun loads the compiled
  executables, skipping the compile and XLA's autotuning (its kernel launches too)."""
  if path:
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)


def compile_fn(fn, *args, options=()):
  """(compiled, lowered text, seconds): jit with argument 0 (the state) donated, compiled
  with the XLA options ((name, value), ...: Sizes.compiler_options)."""
  t0 = time.perf_counter()
  lowered = jax.jit(fn, donate_argnums=0).lower(*args)
  compiled = lowered.compile(dict(options) or None)
  return compiled, lowered.as_text(), time.perf_counter() - t0


def temp_bytes(compiled):
  """The executable's temporary buffer bytes (None where XLA does not say)."""
  try:
    return compiled.memory_analysis().temp_size_in_bytes
  except Exception:                                        # noqa: BLE001
    return None


def time_runs(fn, state, rest, sizes):
  """(state, seconds per run, host seconds per dispatch) of fn(state, *rest) ->
  (state, (done, outs)), run warmup + reps times, each run dispatched before waiting
  for the previous one (one run always queued, so the device never waits for the
  host while a run takes longer than a dispatch); seconds per run = the median
  interval between run completions, the first two dropped (their device may idle)."""
  state, (done, _) = fn(state, *rest)
  done.block_until_ready()
  stamps, dispatch = [time.perf_counter()], []
  for _ in range(sizes.warmup + sizes.reps):
    t0 = time.perf_counter()
    state, (nxt, _) = fn(state, *rest)
    dispatch.append(time.perf_counter() - t0)
    done.block_until_ready()
    stamps.append(time.perf_counter())
    done = nxt
  done.block_until_ready()
  stamps.append(time.perf_counter())
  return state, statistics.median(np.diff(stamps)[2:]), statistics.median(dispatch)


def amortised(call, state, fixed, rotated, dep, sizes, calls=None, max_calls=None):
  """Seconds per call of `call`: a chain (above) of N calls cycling the R = len(rotated)
  input sets, timed by time_runs; per call = seconds per run / N. N is `calls` if
  given, else it grows from R (in at most two more compiles) until a run takes
  >= sizes.run_s, so the host dispatch hides behind the device; at most max_calls
  (default sizes.max_calls). Returns (s, state, info)."""
  flag = jnp.zeros((), jnp.bool_)
  r = len(rotated)
  cap = max(r, min(max_calls or sizes.max_calls, sizes.max_calls))
  n, compile_s = calls or r, 0.0
  for _ in range(3):
    fn, _, seconds = compile_fn(chain(call, dep, sizes.data_dep, n), state, fixed, flag,
                                rotated, options=sizes.compiler_options)
    compile_s += seconds
    state, run, dispatch = time_runs(fn, state, (fixed, flag, rotated), sizes)
    bound = host_bound(dispatch, run)
    # A host-bound run says nothing of the device time: its dispatch (which grows with
    # the R input sets, not with N) is what took >= run_s. Grow N 4x then.
    grow = -(-max(int(np.ceil(n * 1.2 * sizes.run_s / run)), 4 * n if bound else 0) // r) * r
    if calls or (run >= sizes.run_s and not bound) or n >= cap or min(grow, cap) <= n:
      break
    n = min(grow, cap)
  info = dict(compile_s=compile_s, temp=temp_bytes(fn), calls=n, R=r,
              dispatch_us=dispatch * 1e6, run_us=run * 1e6)
  return run / n, state, info


def host_bound(dispatch, run):
  """A run whose host dispatch takes over half of it is (nearly) host-bound: its time
  per call is an upper bound on the device's (H200, 2026-11-30: a chain of 64 calls
  over 64 input sets of 4 arrays took 1.4 ms to dispatch, 22 µs per call)."""
  return dispatch > 0.5 * run


def host_note(info):
  """The row note of a host-bound run (None otherwise): info has dispatch_us and run_us."""
  if "dispatch_us" not in info or not host_bound(info["dispatch_us"], info["run_us"]):
    return None
  return (f"host-bound (dispatch {info['dispatch_us']:.0f} of {info['run_us']:.0f} µs per "
          "run): an upper bound")


def run_steps(step, state, steps, *args):
  """(state, [each step's outputs]): steps 0..steps-1 of step(state, k, *args) -> (state,
  outs), back to back (traced into one executable), the state threaded."""
  outs = []
  for k in range(steps):
    state, out = step(state, k, *args)
    outs.append(out)
  return state, outs


def time_step(step, state, args, sizes, units=1, steps=1):
  """Seconds per unit of a whole jitted step, e.g. a decode step of 11 layers with
  units=11 for µs per layer. step(state, k, *args) -> (state, outs) is step k of
  `steps` run back to back inside one executable (the state threaded, donated), so
  the host's per-dispatch cost (as long as a 1K-context step of 11 layers on the
  H200) is paid once per `steps` steps. Step k must read inputs of its own (e.g.
  args[0][k]): steps on the same inputs share their stateless work (XLA's CSE; a
  first H200 run of 4 identical steps read 6.6 µs per layer). Runs are timed by
  time_runs (back to back, one queued; info's dispatch_us says how long a dispatch
  took). Returns (s, state, info)."""
  flag = jnp.zeros((), jnp.bool_)

  def fn(state, flag, *args):
    # every step's outputs: an output nothing reads is dead code to XLA
    state, outs = run_steps(step, state, steps, *args)
    return state, (~flag, outs)

  compiled, _, seconds = compile_fn(fn, state, flag, *args, options=sizes.compiler_options)
  state, run, dispatch = time_runs(compiled, state, (flag, *args), sizes)
  info = dict(compile_s=seconds, temp=temp_bytes(compiled), dispatch_us=dispatch * 1e6,
              run_us=run * 1e6, steps=steps)
  return run / (units * steps), state, info


def grow_passes(probe, sizes):
  """Passes per timed run of a replayed graph (the Triton variant): from 1 until
  probe(passes) (seconds of one run) takes >= sizes.run_s, in a few probes."""
  n = 1
  for _ in range(4):
    t = probe(n)
    if t >= sizes.run_s or n >= sizes.max_passes:
      break
    n = int(min(sizes.max_passes, np.ceil(n * 1.5 * sizes.run_s / t)))
  return n


def _bits(a):
  """Floats as their bit patterns (NaN == NaN, -0 != 0); other dtypes as they are."""
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return lax.bitcast_convert_type(a, _UINT[a.dtype.itemsize])
  return a


@jax.jit
def same_bits(a, b):
  return jnp.array_equal(_bits(a), _bits(b))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def single_call(work, state):
  """(lowered text, result leaves, wall s per call) of one call of a Workload from
  `state` (a copy: the state itself stays valid)."""
  fn = lambda st, f, a: work.call(st, f, a)
  compiled, text, _ = compile_fn(fn, state, work.fixed, work.rotated[0])
  st, outs = compiled(_copy(state), work.fixed, work.rotated[0])
  if work.mask is not None:
    outs = work.mask(work.rotated[0], outs)
  result = jax.tree.leaves(st) + list(outs)
  jax.block_until_ready(result)
  st, times = _copy(state), []
  for _ in range(3):
    t0 = time.perf_counter()
    st, outs = compiled(st, work.fixed, work.rotated[0])
    jax.block_until_ready((st, outs))
    times.append(time.perf_counter() - t0)
  return text, result, min(times)


def not_in_place(temp, state):
  """A note when the chain needs temporaries the size of a state buffer (a cache
  copied instead of updated in place), else None."""
  big = max((a.nbytes for a in jax.tree.leaves(state)), default=0)
  if temp is None or big < 1 << 20 or temp < big // 2:
    return None
  return f"not in place: {size_text(temp)} of temporaries for a {size_text(big)} state"
