"""glm5_jax._compat, the one module that uses jax internals: the behaviour each use relies
on, pinned on 2 host CPU devices (in a process of its own: jax reads XLA_FLAGS when it
first starts a backend) so that a jax release that changes it fails here, not in a sharded
serving step. glm5_jax._primitive._spans_devices decides from these contexts whether an
op's lowering partitions itself (Split) or lowers as is."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Two fresh primitives that record, when lowered, the type of their axis context, its
# devices or mesh and manual axes, and what _spans_devices makes of it: `marked` passes
# through _compat.require_devices_during_lowering, `plain` does not.
SCRIPT = r"""
import json
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glm5_jax import _compat
from glm5_jax._primitive import _spans_devices

seen = []

def primitive(name, marked):
  prim = Primitive(name)
  prim.def_abstract_eval(lambda x: x)
  def lowering(ctx, x):
    context = ctx.module_context.axis_context
    record = {"primitive": name, "context": type(context).__name__,
              "spans_devices": _spans_devices(ctx)}
    if isinstance(context, _compat.ShardingContext):
      devices = context.device_assignment
      record["devices"] = None if devices is None else len(devices)
    if isinstance(context, _compat.SPMDAxisContext):
      record["manual_axes"] = sorted(context.manual_axes)
      record["mesh_size"] = context.mesh.size
    seen.append(record)
    return [x]
  mlir.register_lowering(prim, lowering)
  if marked:
    _compat.require_devices_during_lowering(prim)
  return prim

marked, plain = primitive("compat_marked", True), primitive("compat_plain", False)
mesh = Mesh(jax.devices()[:2], ("x",))
x = jax.device_put(jnp.zeros((4, 8), jnp.float32), NamedSharding(mesh, P("x")))
one = jnp.zeros((4, 8), jnp.float32)
for label, prim in (("marked", marked), ("plain", plain)):
  seen.append(label + " jit, 2 devices")
  jax.jit(prim.bind).lower(x)
  seen.append(label + " jit, 1 device")
  jax.jit(prim.bind).lower(one)
seen.append("shard_map")
body = jax.shard_map(marked.bind, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                     check_vma=False)
jax.jit(body).lower(x)
print(json.dumps(seen))
"""


def lowerings():
  """{label: [record, ...]} of SCRIPT's lowerings on 2 host CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-4000:]
  out, label = {}, None
  for item in json.loads(done.stdout.splitlines()[-1]):
    if isinstance(item, str):
      label = item
      out[label] = []
    else:
      out[label].append(item)
  return out


def test_axis_contexts_and_the_device_assignment():
  """jit over 2 devices: a ShardingContext that holds the 2 devices only for the primitive
  marked by require_devices_during_lowering (None for the other: the marking is what gives
  a self-partitioning lowering its devices), and _spans_devices true for it alone; on 1
  device a ShardingContext of 1 device, not spanning; in a shard_map body an
  SPMDAxisContext whose manual axes are the map's and whose mesh has the 2 devices, not
  spanning (each device's operands are its own)."""
  got = lowerings()
  sharding = lambda name, devices, spans: [{
      "primitive": name, "context": "ShardingContext", "spans_devices": spans,
      "devices": devices}]
  assert got["marked jit, 2 devices"] == sharding("compat_marked", 2, True)
  assert got["plain jit, 2 devices"] == sharding("compat_plain", None, False)
  assert got["marked jit, 1 device"] == sharding("compat_marked", 1, False)
  assert got["plain jit, 1 device"] == sharding("compat_plain", None, False)
  assert got["shard_map"] == [{
      "primitive": "compat_marked", "context": "SPMDAxisContext", "spans_devices": False,
      "manual_axes": ["x"], "mesh_size": 2}]
