"""The decode step under JAX's multi-process runtime (glm5_jax.distributed): 2 processes
x 2 host CPU devices (gloo collectives, a coordinator on 127.0.0.1), each running
tests/multiprocess_checks.py; a process that dies or a coordinator that cannot be
reached ends the run with a clear error within a timeout. On two GPUs, one process per
GPU: test_two_gpus_one_process_each."""
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from glm5_jax import distributed

SCRIPT = pathlib.Path(__file__).with_name("multiprocess_checks.py")
ROOT = str(SCRIPT.parent.parent)


def environment(cpu=True):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  if cpu:
    env["JAX_PLATFORMS"] = "cpu"      # host CPU devices, also on a GPU machine
  else:
    # This process's jax may hold most of each GPU's memory already: allocate as needed.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return env


def launch(*args, processes=2, cpu=True, timeout_s=240, **kw):
  return distributed.launch([sys.executable, str(SCRIPT), *args], processes,
                            env=environment(cpu), timeout_s=timeout_s, **kw)


def assert_checks_pass(finished, checks):
  """Every process exited 0, and each check was compared by its OWNER process."""
  owner = {"data": 0, "context": 1, "jit": 0}
  for f in finished:
    assert f.returncode == 0, f"process {f.process_id}:\n{f.stdout}\n{f.stderr[-4000:]}"
  for name in checks:
    out = finished[owner[name] % len(finished)].stdout
    assert f"ok {name} (compared with one device here" in out, out


def test_two_processes_equal_one_device():
  """2 processes x 2 CPU devices, one global mesh, each process feeding its own
  requests: the data-parallel decode loop (data_parallel_step, caches and packed
  metadata donated, serving.advance on the devices) and context_parallel_stage (each
  request's pools over all 4 devices, the candidates gathered across the processes):
  every step's outputs and the final caches equal the same requests on one device bit
  for bit (multiprocess_checks.py's data and context checks)."""
  assert_checks_pass(launch("data", "context"), ["data", "context"])


@pytest.mark.slow
def test_plain_jit_over_two_processes():
  """serving.indexer_step under plain jax.jit on global ids over 2 processes x 2 CPU
  devices (the ops' partitioning rules on a global mesh) equals one device bit for
  bit."""
  assert_checks_pass(launch("jit"), ["jit"])


def test_a_dead_process_ends_the_others():
  """The last process exits after a first collective: jax's coordination service ends
  the other one within the heartbeat timeout (5 s here) while it runs collectives, with
  an error saying a task died, and launch names the process that failed first."""
  t0 = time.monotonic()
  with pytest.raises(distributed.ProcessesFailed) as failed:
    launch("--heartbeat", "5", "die", grace_s=60, timeout_s=120)
  seconds = time.monotonic() - t0
  assert str(failed.value).startswith(
      "glm5_jax.distributed.launch: process 1 of 2 failed first (exit status 3)"), failed.value
  survivor, dead = failed.value.finished
  assert dead.returncode == 3 and "exiting" in dead.stdout, dead
  assert "collective: 4" in survivor.stdout, survivor.stdout
  assert "still running" not in survivor.stderr, survivor.stderr
  assert survivor.returncode != 0 and not survivor.killed, (survivor.returncode, seconds)
  assert "JAX distributed service detected fatal errors" in survivor.stderr, \
      survivor.stderr[-3000:]
  assert seconds < 60, seconds


def test_unreachable_coordinator_and_missing_processes_are_named():
  """initialize's timeout (3 s here): process 1 with no coordinator listening says the
  coordinator is unreachable; process 0 with nobody joining says the others did not
  connect; both exit with EXIT_TIMEOUT, never waiting on."""
  # Two jobs of one process each, at two addresses (with one address, process 0 would
  # serve the coordinator process 1 is looking for): nothing listens at the first.
  addresses = [f"127.0.0.1:{distributed.free_port()}" for _ in range(2)]
  procs = []
  for process_id, coordinator in zip((1, 0), addresses):
    env = dict(environment(), GLM5_JAX_PROCESSES="2", GLM5_JAX_PROCESS_ID=str(process_id),
               GLM5_JAX_COORDINATOR=coordinator)
    procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--timeout", "3"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outputs = [p.communicate(timeout=90) for p in procs]
  (worker, worker_err), (served, served_err) = [
      (p.returncode, err) for p, (_, err) in zip(procs, outputs)]
  assert worker == distributed.EXIT_TIMEOUT, (worker, worker_err)
  assert (f"process 1 of 2 gave up after 3 s: the coordinator at {addresses[0]} is "
          "unreachable") in worker_err, worker_err
  assert served == distributed.EXIT_TIMEOUT, (served, served_err)
  assert ("process 0 of 2 gave up after 3 s: the other processes did not all connect to "
          f"the coordinator it serves at {addresses[1]}") in served_err, served_err


def test_initialize_refuses_a_bad_process_id():
  with pytest.raises(ValueError, match=r"process_id must be in 0 \.\. 1"):
    distributed.initialize("127.0.0.1:1", 2, 2)
  with pytest.raises(ValueError, match="coordinator must be 'host:port'"):
    distributed.initialize("localhost", 2, 0)
  assert distributed.initialize(processes=1) is False


@pytest.mark.gpu
@pytest.mark.two_gpus
def test_two_gpus_one_process_each():
  """The same checks (data, context and plain jit) with one process per GPU, each seeing
  only its own GPU (JAX_LOCAL_DEVICE_IDS), NCCL across the processes. Needs 2 GPUs."""
  finished = launch("--devices", "1", "data", "context", "jit", cpu=False, local_devices=1,
                    timeout_s=600)
  assert_checks_pass(finished, ["data", "context", "jit"])


@pytest.mark.slow
def test_decode_loop_demo_over_two_processes():
  """`examples/decode_loop.py --processes 2 --devices 2 --metadata device` (the script
  starting its processes) prints the digest of `--devices 4` in one process with host
  metadata (the whole final caches and last outputs, gathered), and each process's
  devices' shards equal their one-device reference runs."""
  demo = [sys.executable, "examples/decode_loop.py", "--steps", "3", "--layers", "1",
          "--contexts", "30,2100,700,900,5"]
  env = environment()
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  runs = [subprocess.run(demo + args, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
          for args in (["--processes", "2", "--devices", "2", "--metadata", "device"],
                       ["--devices", "4"])]
  for done in runs:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  digests = [re.findall(r"digest: sha256 (\w+)", done.stdout) for done in runs]
  assert len(digests[0]) == 2 and len(set(digests[0] + digests[1])) == 1, digests
  for d in range(4):
    assert (f"[{d // 2}] device {d}: check: every step's selected slots"
            in runs[0].stdout), runs[0].stdout
  assert "in 2 processes; this one, 1, holds devices 2..3" in runs[0].stdout
