"""Several processes and hosts: the decode step under JAX's multi-controller runtime.

A deployment that outgrows one host runs one process per host (or per GPU), all of them
running the same program over one global mesh (jax.distributed). glm5_jax.sharding's
forms need nothing more there: data_parallel_step / data_parallel_advance, indexer_stage
under plain jit (the ops' partitioning rules) and context_parallel_stage / _select take
global jax.Arrays whose shards live in several processes, and their collectives (the
context-parallel candidates' all-gather; none in the data-parallel step) cross processes
(NCCL on GPUs, gloo on the CPU). What changes is where the arguments come from: each
process holds only its devices' shards, so it feeds its own requests and their caches
(`from_local`) and reads back its own block (`to_local`).

  distributed.initialize()          # every process, first (reads GLM5_JAX_* below)
  mesh = distributed.global_mesh(("data",))
  mine = distributed.local_indexes(mesh)     # this process's devices: a block of the mesh
  specs = glm5_jax.sharding.request_specs("data")
  cache = distributed.from_local(mesh, specs.cache, my_caches)   # my requests' block
  out, cache = glm5_jax.sharding.data_parallel_stage(mesh)(weights, cache, x, qr, batch)
  mine_out = distributed.to_local(out)

Every process runs the same jitted calls in the same order (SPMD); a process that calls
one the others do not waits in the collective until the heartbeat timeout ends the run.

Environment (initialize's defaults; `launch` sets them for the processes it starts):
GLM5_JAX_COORDINATOR host:port of process 0 (it serves the coordinator there; the other
hosts must reach that address), GLM5_JAX_PROCESSES the number of processes,
GLM5_JAX_PROCESS_ID this one's (0 .. N-1). JAX_LOCAL_DEVICE_IDS (jax's own) picks this
process's GPUs where several processes share a host.

Failures end the run, never hang it: initialize gives up after `timeout_s` with an error
saying who was missing (exit status EXIT_TIMEOUT); once running, a process that dies
stops its heartbeats and jax's coordination service terminates the others within
`heartbeat_s` ("the JAX distributed service detected fatal errors ... another task
died"); `launch` kills what is left after that and says which process failed first.
"""
import inspect
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding

COORDINATOR_ENV = "GLM5_JAX_COORDINATOR"
PROCESSES_ENV = "GLM5_JAX_PROCESSES"
PROCESS_ID_ENV = "GLM5_JAX_PROCESS_ID"
# initialize's exit status when the processes did not all connect in time (EX_TEMPFAIL:
# a retry may succeed).
EXIT_TIMEOUT = 75
# jax's own initialization timeout exceeds ours by this much: the watchdog below speaks
# first, with the reason, before jax aborts with a bare DEADLINE_EXCEEDED.
_JAX_MARGIN_S = 30


def _env_int(name, value):
  if value is not None:
    return int(value)
  text = os.environ.get(name)
  return int(text) if text else None


def _reachable(address, seconds=1.0):
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds):
      return True
  except OSError:
    return False


def initialize(coordinator: str | None = None, processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None, timeout_s: int = 120,
               heartbeat_s: int = 30) -> bool:
  """jax.distributed.initialize for the decode loop, before any other jax call.

  coordinator "host:port" (default $GLM5_JAX_COORDINATOR): process 0 serves the
  coordination service on that port, the others connect to it; processes (default
  $GLM5_JAX_PROCESSES, else 1) and process_id (default $GLM5_JAX_PROCESS_ID);
  local_device_ids: this process's GPUs (default: jax's, $JAX_LOCAL_DEVICE_IDS or all).
  On the CPU the collectives across processes run on gloo (jax's CPU collectives).

  timeout_s: the time every process has to connect. Past it this process writes why to
  stderr (the coordinator unreachable, or processes missing) and exits with EXIT_TIMEOUT:
  jax aborts a connection that fails, so the reason is told before that, not raised.
  heartbeat_s: a process silent this long counts as dead, and the coordination service
  then terminates every other process (a dead peer never leaves them waiting in a
  collective). Returns False, doing nothing, for a single process."""
  op = "glm5_jax.distributed.initialize"
  processes = _env_int(PROCESSES_ENV, processes) or 1
  if processes == 1:
    return False
  process_id = _env_int(PROCESS_ID_ENV, process_id)
  coordinator = coordinator or os.environ.get(COORDINATOR_ENV)
  if process_id is None or not 0 <= process_id < processes:
    raise ValueError(f"{op}: process_id must be in 0 .. {processes - 1} (argument or "
                     f"${PROCESS_ID_ENV}), got {process_id}")
  if not coordinator or ":" not in coordinator:
    raise ValueError(f"{op}: coordinator must be 'host:port' of process 0 (argument or "
                     f"${COORDINATOR_ENV}), got {coordinator!r}")
  if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  who = f"process {process_id} of {processes}"
  if local_device_ids is None and os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    local_device_ids = [int(i) for i in os.environ["JAX_LOCAL_DEVICE_IDS"].split(",")]

  def expire():
    if process_id == 0:
      why = (f"the other processes did not all connect to the coordinator it serves at "
             f"{coordinator} (are all {processes} started, with this address?)")
    elif not _reachable(coordinator):
      why = (f"the coordinator at {coordinator} is unreachable (is process 0 running, is "
             "the address right and its port open to this host?)")
    else:
      why = (f"the coordinator at {coordinator} answers, but not all {processes} "
             "processes connected")
    print(f"{op}: {who} gave up after {timeout_s} s: {why}", file=sys.stderr, flush=True)
    os._exit(EXIT_TIMEOUT)

  watchdog = threading.Timer(timeout_s, expire)
  watchdog.daemon = True
  watchdog.start()
  # Only the options this jax has (their names are those of jax 0.10 and 0.11).
  options = dict(initialization_timeout=int(timeout_s) + _JAX_MARGIN_S,
                 heartbeat_timeout_seconds=int(heartbeat_s))
  try:
    known = inspect.signature(jax.distributed.initialize).parameters
    if missing := sorted(set(options) - set(known)):
      warnings.warn(f"{op}: jax {jax.__version__} has no {missing}: its defaults apply",
                    RuntimeWarning, stacklevel=2)
    jax.distributed.initialize(coordinator, processes, process_id,
                               local_device_ids=local_device_ids,
                               **{k: v for k, v in options.items() if k in known})
  finally:
    watchdog.cancel()
  return True


def global_mesh(axes=("data",), shape=None) -> Mesh:
  """A mesh of every process's devices (jax.devices()), process-major: each process's
  devices are one contiguous block of the mesh's flat order, so the requests it feeds
  (its block of every split dim, `from_local`) sit on its own devices. shape: the mesh
  shape (default: all devices on the one axis of `axes`)."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  shape = (len(devices),) if shape is None else tuple(shape)
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), tuple(axes))


def local_indexes(mesh: Mesh) -> list[int]:
  """The flat positions in `mesh` of this process's devices, ascending (device d of
  glm5_jax.sharding's layouts for each). They are one contiguous block with
  global_mesh's order; another order is refused: a process's block of a split dim would
  not be contiguous."""
  flat = list(mesh.devices.flat)
  mine = [i for i, d in enumerate(flat) if d.process_index == jax.process_index()]
  if mine != list(range(mine[0], mine[0] + len(mine))):
    raise ValueError(f"glm5_jax.distributed.local_indexes: process {jax.process_index()}'s "
                     f"devices are at {mine} of the mesh, not one block (use global_mesh)")
  return mine


def _is_spec(x):
  return isinstance(x, jax.sharding.PartitionSpec)


def from_local(mesh: Mesh, specs, tree):
  """Global jax.Arrays, laid out as the spec tree `specs` on `mesh`, from this process's
  part of `tree` (host arrays): along each split dim the block of this process's devices
  (e.g. glm5_jax.sharding.assemble of their per-device trees), replicated leaves whole
  and equal in every process. jax.make_array_from_process_local_data, leaf by leaf; with
  one process, the whole arrays placed."""
  def one(spec, sub):
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), sub)
  return jax.tree.map(one, specs, tree, is_leaf=_is_spec)


def to_local(tree):
  """This process's block of each global jax.Array of `tree` as host numpy: its
  addressable shards joined where they lie (the inverse of from_local); replicated dims
  whole."""
  def one(a):
    shards = a.addressable_shards
    spans = [[s.index[d].indices(a.shape[d])[:2] for s in shards] for d in range(a.ndim)]
    first = [min(lo for lo, _ in dim) for dim in spans]
    shape = [max(hi for _, hi in dim) - lo for dim, lo in zip(spans, first)]
    out = np.empty(shape, a.dtype)
    for s in shards:
      at = tuple(slice(ix.indices(n)[0] - lo, ix.indices(n)[1] - lo)
                 for ix, n, lo in zip(s.index, a.shape, first))
      out[at] = np.asarray(s.data)
    return out
  return jax.tree.map(one, tree)


def gather(mesh: Mesh, tree):
  """Every leaf of `tree` (global jax.Arrays on `mesh`) whole, as host numpy, in every
  process: one jitted program that replicates them all (all-gathers across processes),
  then this process's copy. For checks and digests: a step never needs it."""
  whole = NamedSharding(mesh, jax.sharding.PartitionSpec())
  return to_local(jax.jit(lambda t: t, out_shardings=whole)(tree))


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port free on `host` now (for a coordinator on this host)."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class Finished(NamedTuple):
  """One process `launch` started: its id, exit status (negative: the signal that ended
  it), whether launch killed it, and its output."""
  process_id: int
  returncode: int
  killed: bool
  stdout: str
  stderr: str


class ProcessesFailed(RuntimeError):
  """Some of launch's processes failed (`finished`: every process, in id order)."""

  def __init__(self, message, finished):
    super().__init__(message)
    self.finished = finished


def launch(argv, processes: int, *, env=None, coordinator: str | None = None,
           local_devices: int | None = None, timeout_s: float = 600, grace_s: float = 60,
           echo: bool = False, check: bool = True) -> list[Finished]:
  """Runs `processes` copies of the command `argv` on this host as one multi-process jax
  program: process i gets GLM5_JAX_COORDINATOR (default 127.0.0.1 and a free port),
  GLM5_JAX_PROCESSES and GLM5_JAX_PROCESS_ID=i in its environment (`env`, default this
  one's), and, with local_devices=k, JAX_LOCAL_DEVICE_IDS = its k GPUs (i*k .. i*k+k-1).

  Never waits forever: once a process fails, the others get grace_s to end (the
  coordination service terminates them after its heartbeat timeout), then they are
  killed; after timeout_s all are. echo: each output line is also written to this
  process's stdout / stderr as it comes, prefixed "[i] ". Returns every process's
  Finished, in id order; with check, raises ProcessesFailed naming the first to fail
  where any did."""
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  base = dict(os.environ if env is None else env)
  procs = []
  for i in range(processes):
    child = dict(base, **{COORDINATOR_ENV: coordinator, PROCESSES_ENV: str(processes),
                          PROCESS_ID_ENV: str(i)})
    if local_devices:
      child["JAX_LOCAL_DEVICE_IDS"] = ",".join(
          str(i * local_devices + k) for k in range(local_devices))
    procs.append(subprocess.Popen(argv, env=child, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE))
  # Raw reads, never readline: a process may sit mid-line (a progress bar) for long.
  output = {(i, name): bytearray() for i in range(processes) for name in ("stdout", "stderr")}
  sel = selectors.DefaultSelector()
  for i, p in enumerate(procs):
    sel.register(p.stdout, selectors.EVENT_READ, (i, "stdout", sys.stdout))
    sel.register(p.stderr, selectors.EVENT_READ, (i, "stderr", sys.stderr))
  start, failed_at, first_failed, killed = time.monotonic(), None, None, set()
  while sel.get_map():
    for key, _ in sel.select(timeout=0.2):
      i, name, stream = key.data
      chunk = os.read(key.fileobj.fileno(), 1 << 16)
      if not chunk:
        sel.unregister(key.fileobj)
        continue
      text = output[i, name]
      if echo:          # the complete lines this chunk ends
        done = len(text) - len(text.split(b"\n")[-1])
        lines = (text[done:] + chunk).split(b"\n")[:-1]
        stream.write("".join(f"[{i}] {line.decode(errors='replace')}\n" for line in lines))
        stream.flush()
      text += chunk
    now = time.monotonic()
    for i, p in enumerate(procs):
      if p.poll() not in (None, 0) and failed_at is None:
        failed_at, first_failed = now, i
    late = now - start > timeout_s or (failed_at is not None and now - failed_at > grace_s)
    for i, p in enumerate(procs):
      if late and p.poll() is None:
        p.kill()
        killed.add(i)
  finished = [Finished(i, p.wait(), i in killed,
                       output[i, "stdout"].decode(errors="replace"),
                       output[i, "stderr"].decode(errors="replace"))
               for i, p in enumerate(procs)]
  if check and any(f.returncode for f in finished):
    if first_failed is None:      # none failed on its own: the whole run timed out
      raise ProcessesFailed(f"glm5_jax.distributed.launch: {processes} processes killed "
                            f"after {timeout_s} s", finished)
    f = finished[first_failed]
    tail = "\n".join(f.stderr.strip().splitlines()[-20:])
    raise ProcessesFailed(
        f"glm5_jax.distributed.launch: process {first_failed} of {processes} failed first "
        f"(exit status {f.returncode}); the others: "
        + ", ".join(f"{g.process_id}: {'killed' if g.killed else g.returncode}"
                    for g in finished if g.process_id != first_failed)
        + f"\nprocess {first_failed}'s stderr:\n{tail}", finished)
  return finished
