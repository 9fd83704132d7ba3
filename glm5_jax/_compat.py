"""Every use of jax internals (jax._src), here alone, each for lack of a public API.
tests/test_compat.py pins the behaviour each relies on, so a jax release that changes it
fails there; tests/test_package.py that nothing else imports jax._src."""
from jax._src import dispatch as _dispatch
from jax._src import sharding_impls as _sharding_impls

# The axis context of a lowering (ctx.module_context.axis_context), as jax's own
# custom-partitioned cuDNN ops read it: a shard_map body (manual axes) or XLA's
# partitioner over a device assignment. No public type says which.
SPMDAxisContext = _sharding_impls.SPMDAxisContext
ShardingContext = _sharding_impls.ShardingContext


def require_devices_during_lowering(primitive):
  """Lowers `primitive` with its device assignment: a primitive that partitions itself
  (custom_partitioning inside its lowering) gets none otherwise, and jax has no public
  switch for it (its cuDNN ops add themselves to this set too)."""
  _dispatch.prim_requires_devices_during_lowering.add(primitive)
