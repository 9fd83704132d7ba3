"""The op declaration (`Op`) that turns into a JAX primitive, and the routing value
(`Routing`) that decides, when a primitive is lowered for CUDA, whether it runs its
kernel.

Each op gets: abstract evaluation that validates shapes and dtypes at trace
time, a CPU (default) lowering through the pure-JAX reference, a CUDA lowering
to its FFI target (operand/output aliasing for in-place caches, attributes cast to
their declared types) or to the reference when it has no kernel, the kernel does
not support the shapes or the routing turns it off, a batching rule, an error
under differentiation, and (`Split`) a partitioning rule for plain jax.jit on
arguments split over requests across devices (module glm5_jax.sharding).
"""
import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _compat, _ffi

KERNELS_ENV, PDL_ENV = "GLM5_JAX_KERNELS", "GLM5_JAX_PDL"
# Every GLM5_JAX_* variable the project reads (the package, its build, tests and scripts):
# any other is a misspelling, which Routing.from_env warns about once per name.
KNOWN_ENV = frozenset({KERNELS_ENV, PDL_ENV, "GLM5_JAX_ENABLE_CUDA", "GLM5_JAX_REQUIRE_GPU",
                       "GLM5_JAX_REQUIRE_CUDA_BUILD", "GLM5_JAX_TEST_WORKERS",
                       "GLM5_JAX_TEST_SECONDS"})
_warned_env = set()
# The numpy scalar types an FFI attribute may have: the C++ handler binds bool, int32_t,
# int64_t or float of the same name.
ATTRIBUTE_TYPES = (np.bool_, np.int32, np.int64, np.float32)
# The groups an operand's or result's dim 0 may belong to under Split: rows (the op's
# row-indexed arrays: token rows, or requests of an [B, N] grid; all of an op's rows
# dims have one size), requests (rows of a per-request table), pages (K-cache pages),
# blocks (tail-ring blocks).
SPLIT_GROUPS = ("rows", "requests", "pages", "blocks")


def _warn_unknown_env(environ):
  """Warns once per name about a GLM5_JAX_* variable the project does not read (a misspelt
  GLM5_JAX_KERNEL=0 would otherwise leave every kernel on without a word)."""
  for name in sorted(environ):
    if name.startswith("GLM5_JAX_") and name not in KNOWN_ENV and name not in _warned_env:
      _warned_env.add(name)
      warnings.warn(f"glm5_jax: {name} is not a glm5_jax variable and is ignored; the "
                    f"variables are {', '.join(sorted(KNOWN_ENV))}", stacklevel=4)


class Split(NamedTuple):
  """How an op runs under plain jax.jit with its arguments split over requests: every
  dim 0 named by a group is split in contiguous, equal blocks over the same mesh axes
  (device i holds block i of each group, glm5_jax.sharding.request_specs), the other
  operands replicated, and each device runs the op on its blocks alone, so XLA moves
  nothing between devices.

  operands, results: per operand / result, its dim 0's group (SPLIT_GROUPS) or None
  (replicated). localize(index, *operands) -> operands: device `index`'s operands
  (local shapes) with the global ids they hold (pages, slots, tail slots, requests)
  made local with local_ids; None where the op holds no ids. An id outside the
  device's block becomes out of range there (SPEC D4: as the unsharded op treats an
  out-of-range id), so a device never touches another device's memory.
  """
  operands: tuple
  results: tuple
  localize: Callable | None = None


def local_ids(ids, index, size):
  """Global ids -> device `index`'s, whose block is [index * size, (index + 1) * size):
  ids in the block less its start; negative ids unchanged (they keep their meaning: no
  slot, a pad); other ids `size`, out of range on the device."""
  first = index * size
  inside = (ids >= first) & (ids < first + size)
  return jnp.where(ids < 0, ids, jnp.where(inside, ids - first, size)).astype(ids.dtype)


def _dim0_axes(sharding):
  """The mesh axes splitting dim 0 of a NamedSharding (None: not split, or unknown)."""
  spec = tuple(getattr(sharding, "spec", ()))
  return spec[0] if spec else None


def _spans_devices(ctx):
  """Whether this lowering is of an array program over several devices that XLA's
  partitioner splits (not one device, not the body of a jax.shard_map)."""
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, _compat.SPMDAxisContext):
    # a shard_map body (manual axes): each device's operands are already its own
    return (not axis_context.manual_axes
            and axis_context.mesh.size > 1)
  if isinstance(axis_context, _compat.ShardingContext):
    devices = axis_context.device_assignment
    return devices is not None and len(devices) > 1
  return False


class Op:
  """A glm5_jax primitive, declared once: everything about the op, its kernel and
  where that kernel runs is here (OPS, KERNEL_TARGETS, `python -m glm5_jax.info`
  and the tests derive from `Op.registry`).

  name: the op; reference: pure-JAX function of the operands and static params
  returning a tuple; shapes: validates avals and params, returns [(shape, dtype)] of
  the results; aliases: {operand: result} updated in place; rows: per-operand row
  axis (None = shared) and per-result row axis, when examples can be folded into
  the rows under vmap (otherwise vmap maps the op over the examples).

  The CUDA kernel: kernel: its FFI target (glm5_<name>; None = no kernel, the
  reference everywhere); attributes: {name: numpy scalar type}, the FFI attributes
  its handler binds besides `pdl` (np.bool_, which every kernel takes from the
  Routing); attribute_values: (avals, params) -> {name: value} for attributes that
  are not a static param of the same name (derived from shapes or other params);
  kernel_supports: (avals, params) -> whether the kernel handles these shapes (like
  `shapes`; otherwise the reference), described by kernel_limits; kernel_off: why the
  kernel is off unless the routing names it (the BENCHMARKS.json rows it lost);
  kernel_default: (avals, params) -> whether it runs at these shapes when the routing
  does not name the op (glm5_jax.plan.kernel_default: its plan.KERNEL_ROWS), described by
  kernel_default_note; kernel_params: (avals, params) -> params the kernel runs with
  that depend on the whole call's shapes (a tactic chosen by row count), so that a
  device running the op on its block under `split` runs what the whole call would.
  otherwise: what the op's function runs where its kernel is not chosen, in words, when
  that is not the reference (a composition of other ops; None = the reference).

  split: a `Split` (partitioning under plain jit over devices; None = XLA's default,
  which gathers the operands of the call).
  """

  registry = {}     # name -> Op, in declaration order

  def __init__(self, name, reference, shapes, *, aliases=None, rows=None, kernel=None,
               attributes=None, attribute_values=None, kernel_supports=None,
               kernel_limits=None, kernel_off=None, kernel_default=None,
               kernel_default_note=None, kernel_params=None, split=None, otherwise=None):
    if name in Op.registry:
      raise ValueError(f"glm5_jax: op {name!r} is declared twice")
    attributes = dict(attributes or {})
    if kernel is None and (attributes or attribute_values or kernel_supports or kernel_off
                           or kernel_default):
      raise ValueError(f"glm5_jax: op {name!r} describes a kernel but declares none")
    for attr, typ in attributes.items():
      if typ not in ATTRIBUTE_TYPES or attr == "pdl":
        raise ValueError(f"glm5_jax: op {name!r} attribute {attr!r}: want one of "
                         f"{[t.__name__ for t in ATTRIBUTE_TYPES]} (pdl is implicit)")
    self.name, self.reference, self.shapes = name, reference, shapes
    self.aliases = aliases or {}
    self.rows = rows
    self.kernel = kernel
    self._attributes = attributes
    self.attribute_values = attribute_values or (lambda *avals, **params: {})
    self.kernel_supports = kernel_supports or (lambda *avals, **params: True)
    self.kernel_limits = kernel_limits
    self.kernel_off = kernel_off
    self.kernel_default = kernel_default or (lambda *avals, **params: True)
    self.kernel_default_note = kernel_default_note
    self.kernel_params = kernel_params or (lambda *avals, **params: {})
    self.otherwise = otherwise or "the reference"
    if split is not None and any(g is not None and g not in SPLIT_GROUPS
                                 for g in split.operands + split.results):
      raise ValueError(f"glm5_jax: op {name!r} split groups must be in {SPLIT_GROUPS}")
    self.split = split
    Op.registry[name] = self
    prim = self.primitive = Primitive(f"glm5_{name}")
    prim.multiple_results = True
    prim.def_impl(lambda *args, **params: xla.apply_primitive(prim, *args, **params))
    prim.def_abstract_eval(self._abstract_eval)
    lower_ref = mlir.lower_fun(self._reference, multiple_results=True)
    mlir.register_lowering(prim, self._split_lowering(lower_ref))
    mlir.register_lowering(prim, self._split_lowering(self._cuda_lowering(lower_ref)),
                           platform="cuda")
    if split is not None:
      _compat.require_devices_during_lowering(prim)
    batching.primitive_batchers[prim] = self._batch
    ad.primitive_jvps[prim] = self._jvp

  def __call__(self, *args, routing=None, **params):
    """Binds the primitive; routing None = Routing.from_env() (at trace time)."""
    return self.primitive.bind(*args, routing=Routing.resolve(routing, self.name), **params)

  @property
  def attributes(self):
    """{name: numpy type} of every FFI attribute of a kernel call, pdl included."""
    return {**self._attributes, "pdl": np.bool_} if self.kernel else {}

  # Routing ----------------------------------------------------------------------------

  def kernel_on(self, routing: "Routing") -> bool:
    """Whether `routing` lets the kernel run at shapes it supports: the routing's word on
    the op, or else the op's default (every kernel but those with kernel_off)."""
    if self.kernel is None:
      return False
    word = routing.word(self.name)
    return self.kernel_off is None if word is None else word

  def kernel_chosen(self, routing: "Routing", avals, params) -> bool:
    """Whether `routing` chooses the kernel at these avals and static params, whatever
    the platform: the routing's word on the op (else kernel_off), the kernel's support of
    the shapes, and where the routing names nothing, kernel_default. The op's own shape rule
    runs first, so that bad arguments raise naming this op, not a part whose rule
    kernel_supports reads (indexer_update's projection, say), whoever asks."""
    if not self.kernel_on(routing):
      return False
    self.shapes(*avals, **params)
    if not self.kernel_supports(*avals, **params):
      return False
    return routing.word(self.name) is not None or bool(self.kernel_default(*avals, **params))

  def runs_kernel(self, routing: "Routing", avals, params) -> bool:
    """Whether the CUDA lowering at these avals and static params calls the kernel."""
    if not self.kernel_chosen(routing, avals, params):
      return False
    # Without the built module the target is still used when lowering for a GPU this
    # process does not have (jax.export); on a real GPU the op falls back to the reference.
    if not _ffi.register_targets() and _ffi.local_cuda():
      if _ffi._glm5_cuda is None:     # (a refused GPU has warned in _supported_gpu)
        _ffi.warn_once("glm5_jax: the CUDA module is not built (rebuild with "
                       "GLM5_JAX_ENABLE_CUDA=ON); every op runs its pure-JAX reference")
      return False
    return True

  def kernel_attributes(self, routing, avals, params):
    """The FFI attributes of a kernel call, each cast to its declared numpy type."""
    values = {**params, **self.attribute_values(*avals, **params), "pdl": routing.pdl}
    return {name: typ(values[name]) for name, typ in self.attributes.items()}

  # Primitive rules --------------------------------------------------------------------

  def _reference(self, *args, routing, **params):
    out = self.reference(*args, **params)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)

  def _abstract_eval(self, *avals, routing, **params):
    return [jax.core.ShapedArray(s, d) for s, d in self.shapes(*avals, **params)]

  def _cuda_lowering(self, lower_ref):
    def lowering(ctx, *args, routing, **params):
      if not self.runs_kernel(routing, ctx.avals_in, params):
        return lower_ref(ctx, *args, routing=routing, **params)
      rule = jax.ffi.ffi_lowering(self.kernel, operand_output_aliases=self.aliases)
      return rule(ctx, *args, **self.kernel_attributes(routing, ctx.avals_in, params))
    return lowering

  # Partitioning (Split) ---------------------------------------------------------------

  def _split_lowering(self, lower):
    """`lower` where the call runs on one device (or inside a shard_map); over several
    devices under XLA's partitioner, a custom partitioning of the call by `split`."""
    def lowering(ctx, *args, **params):
      if self.split is None or not _spans_devices(ctx):
        return lower(ctx, *args, **params)
      rule = self._sharding_rule(ctx.avals_in, ctx.avals_out)
      if rule is None:
        return lower(ctx, *args, **params)
      avals = ctx.avals_in
      fn = custom_partitioning(lambda *a: tuple(self.primitive.bind(*a, **params)))
      fn.def_partition(
          functools.partial(self._partition, avals, params), sharding_rule=rule)
      return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return lowering

  def _sharding_rule(self, avals_in, avals_out):
    """The Shardy rule of a call: dim 0 of each operand and result of one group is one
    factor (results aliased to an operand share all its factors), every other dim its
    own; None where the dims of a group differ in size (not partitionable)."""
    sizes = {}
    for aval, group in zip(list(avals_in) + list(avals_out),
                           self.split.operands + self.split.results):
      if group is not None and sizes.setdefault(group, aval.shape[0]) != aval.shape[0]:
        return None
    def dims(aval, group, own):
      return " ".join(group if d == 0 and group else f"{own}_{d}"
                      for d in range(len(aval.shape)))
    operands = [dims(a, g, f"i{i}") for i, (a, g) in
                enumerate(zip(avals_in, self.split.operands))]
    aliased = {r: i for i, r in self.aliases.items()}
    results = [operands[aliased[j]] if j in aliased else dims(a, g, f"o{j}")
               for j, (a, g) in enumerate(zip(avals_out, self.split.results))]
    return ", ".join(operands) + " -> " + ", ".join(results)

  def _partition(self, avals, params, mesh, arg_shapes, result_shape):
    """Each device runs the op on its blocks (Split), when every split operand's dim 0
    is split over the same mesh axes and each group divides over them; otherwise the
    call runs whole on every device (XLA gathers its operands)."""
    split = self.split
    firsts = {_dim0_axes(a.sharding) for a, g in zip(arg_shapes, split.operands)
              if g is not None}
    axes = firsts.pop() if len(firsts) == 1 else None
    devices = (int(np.prod([mesh.shape[a] for a in
                            (axes if isinstance(axes, tuple) else (axes,))]))
               if axes is not None else 1)
    if devices > 1 and any(a.shape[0] % devices for a, g in zip(avals, split.operands)
                           if g is not None):
      axes = None
    sharding = lambda group, ndim: NamedSharding(
        mesh, P(axes if group is not None else None, *(None,) * (ndim - 1)))
    arg_shardings = tuple(sharding(g, len(a.shape)) for a, g in zip(arg_shapes, split.operands))
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    result_shardings = tuple(sharding(g, len(r.shape)) for r, g in zip(results, split.results))
    local = self._local_params(avals, params)

    def lower_fn(*args):
      if axes is not None and split.localize is not None:
        args = split.localize(lax.axis_index(axes), *args)
      return tuple(self.primitive.bind(*args, **local))

    return mesh, lower_fn, result_shardings, arg_shardings

  def _local_params(self, avals, params):
    """The params a device's block runs with: the routing's decision (kernel or
    reference) and the kernel's params taken at the whole call's shapes, so that each
    block computes what the whole call computes for its rows."""
    if self.kernel is None:
      return params
    routing, p = params["routing"], {k: v for k, v in params.items() if k != "routing"}
    on = self.kernel_chosen(routing, avals, p)
    if on:
      p.update(self.kernel_params(*avals, **p))
    return dict(p, routing=dataclasses.replace(routing, ops={**dict(routing.ops),
                                                             self.name: bool(on)}))

  def _jvp(self, primals, tangents, **params):
    raise TypeError(f"glm5_jax.{self.name} is not differentiable (a decode-time op)")

  def _batch(self, args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = self._fold(args, dims, size, params)
    if folded is not None:
      return folded
    # Any placement: map the op over the examples (correct, sequential).
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
      full = list(args)
      for i, x in zip(mapped, xs):
        full[i] = x
      return tuple(self.primitive.bind(*full, **params))

    outs = lax.map(one, tuple(jnp.moveaxis(args[i], dims[i], 0) for i in mapped))
    return list(outs), [0] * len(outs)

  def _fold(self, args, dims, size, params):
    """Examples become extra rows when every batched operand has a row axis."""
    if self.rows is None:
      return None
    in_rows, out_rows = self.rows
    if any(d is not None and r is None for d, r in zip(dims, in_rows)):
      return None
    counts = {a.shape[r if d is None or d > r else r + 1]
              for a, d, r in zip(args, dims, in_rows) if r is not None}
    if len(counts) != 1:
      return None
    (n,) = counts
    full = []
    for a, d, r in zip(args, dims, in_rows):
      if r is not None:
        a = (jnp.moveaxis(a, d, r) if d is not None
             else jnp.broadcast_to(jnp.expand_dims(a, r), a.shape[:r] + (size,) + a.shape[r:]))
        a = a.reshape(a.shape[:r] + (size * n,) + a.shape[r + 2:])
      full.append(a)
    outs = self.primitive.bind(*full, **params)
    return ([o.reshape(o.shape[:r] + (size, n) + o.shape[r + 1:])
             for o, r in zip(outs, out_rows)], list(out_rows))


_KERNELS_FORMS = "0, 1, all=0, all=1, <op>=0, <op>=1 (comma-separated; later entries win)"


@dataclasses.dataclass(frozen=True)
class Routing:
  """Where the ops run on CUDA: one hashable value, a static param of every primitive
  (so a jit cache entry never outlives the routing it was lowered with).

  kernels: True = every kernel at every shape it supports, False = every op runs its
  pure-JAX reference, None = each op's default (Op.kernel_off, Op.kernel_default).
  ops: {op: bool} overriding `kernels` for single ops (stored as sorted pairs).
  pdl: programmatic dependent launch, the FFI attribute `pdl` of every kernel call.

  Routing() is the built-in default. Routing.from_env() reads GLM5_JAX_KERNELS and
  GLM5_JAX_PDL; it is what a public op (routing=None) and IndexerConfig use when not
  given one. Routing only chooses among implementations with the same outputs (within
  the tolerances SPEC D2 allows the kernels).
  """
  kernels: bool | None = None
  ops: Mapping[str, bool] | tuple[tuple[str, bool], ...] = ()
  pdl: bool = True

  def __post_init__(self):
    if self.kernels is not None and not isinstance(self.kernels, bool):
      raise TypeError(f"glm5_jax.Routing: kernels must be True, False or None, "
                      f"got {self.kernels!r}")
    if not isinstance(self.pdl, bool):
      raise TypeError(f"glm5_jax.Routing: pdl must be a bool, got {self.pdl!r}")
    ops = dict(self.ops)
    for name, on in ops.items():
      if name not in Op.registry:
        raise ValueError(f"glm5_jax.Routing: unknown op {name!r}; ops: "
                         f"{', '.join(Op.registry)}")
      if not isinstance(on, bool):
        raise TypeError(f"glm5_jax.Routing: ops[{name!r}] must be a bool, got {on!r}")
    object.__setattr__(self, "ops", tuple(sorted(ops.items())))

  def word(self, op: str) -> bool | None:
    """The routing's word on `op`: True or False where it names the op (or every op),
    None where it does not (the op's default applies)."""
    return dict(self.ops).get(op, self.kernels)

  @classmethod
  def resolve(cls, routing: "Routing | None", op: str) -> "Routing":
    """A routing keyword's value: None = Routing.from_env() (read now, so that the
    result can key a jit cache); anything but a Routing is a TypeError naming `op`."""
    if routing is None:
      return cls.from_env()
    if not isinstance(routing, cls):
      raise TypeError(f"glm5_jax.{op}: routing must be a glm5_jax.Routing or None, "
                      f"got {type(routing).__name__}")
    return routing

  @classmethod
  def from_env(cls, environ: Mapping[str, str] | None = None) -> "Routing":
    """The routing GLM5_JAX_KERNELS and GLM5_JAX_PDL ask for (unset: Routing()).

    GLM5_JAX_KERNELS: "0" every op on its reference, "1" every kernel wherever it
    supports the shapes, "<op>=0" / "<op>=1" one op ("all=" every op), comma-separated,
    later entries win (e.g. "0,kpool_update=1"). GLM5_JAX_PDL: "1" (default) or "0".
    Anything else raises ValueError: a misspelt kill switch must not leave kernels on.
    """
    environ = os.environ if environ is None else environ
    _warn_unknown_env(environ)
    raw = environ.get(KERNELS_ENV, "")
    kernels, ops = None, {}
    for entry in filter(None, raw.replace(" ", "").split(",")):
      name, eq, value = entry.rpartition("=")
      if value not in ("0", "1") or (eq and name not in ("all", *Op.registry)):
        raise ValueError(f"{KERNELS_ENV}={raw!r}: bad entry {entry!r}; valid forms: "
                         f"{_KERNELS_FORMS}, <op> one of {', '.join(Op.registry)}")
      if name in ("", "all"):
        kernels, ops = value == "1", {}
      else:
        ops[name] = value == "1"
    pdl = environ.get(PDL_ENV, "").strip()
    if pdl not in ("", "0", "1"):
      raise ValueError(f"{PDL_ENV}={pdl!r}: valid forms: 1 (default) or 0")
    return cls(kernels=kernels, ops=ops, pdl=pdl != "0")

