"""One helper that turns an op description into a JAX primitive.

Each op gets: abstract evaluation that validates shapes and dtypes at trace
time, a CPU (default) lowering through the pure-JAX reference, a CUDA lowering
to its FFI target (operand/output aliasing for in-place caches) or to the
reference when it has no kernel, the kernel does not support the shapes or
GLM5_JAX_KERNELS turns it off, a batching rule, and an error under
differentiation.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla

from . import _ffi


class Op:
  """A glm5_jax primitive.

  name: the op (FFI target glm5_<name>); reference: pure-JAX function of the
  operands and static params returning a tuple; shapes: validates avals and
  params, returns [(shape, dtype)] of the results; aliases: {operand: result}
  updated in place; rows: per-operand row axis (None = shared) and per-result
  row axis, when examples can be folded into the rows under vmap (otherwise
  vmap maps the op over the examples); attributes: static params -> FFI
  attributes with exact C++ types; kernel_supports: (avals, params) -> whether
  the kernel handles these shapes (like `shapes`; otherwise the CUDA lowering
  uses the reference), described for diagnostics by kernel_limits;
  kernel_default: (avals, params) -> whether the kernel runs at these shapes when
  GLM5_JAX_KERNELS does not name the op (where the H200 measured it faster than
  the reference), described by kernel_default_note.
  """

  registry = {}     # name -> Op

  def __init__(self, name, reference, shapes, *, aliases=None, rows=None,
               attributes=None, kernel_supports=None, kernel_limits=None,
               kernel_default=None, kernel_default_note=None):
    self.name, self.reference, self.shapes = name, reference, shapes
    self.aliases = aliases or {}
    self.rows = rows
    self.attributes = attributes or (lambda **params: {})
    self.kernel_supports = kernel_supports or (lambda *avals, **params: True)
    self.kernel_limits = kernel_limits
    self.kernel_default = kernel_default or (lambda *avals, **params: True)
    self.kernel_default_note = kernel_default_note
    Op.registry[name] = self
    prim = self.primitive = Primitive(f"glm5_{name}")
    prim.multiple_results = True
    prim.def_impl(lambda *args, **params: xla.apply_primitive(prim, *args, **params))
    prim.def_abstract_eval(self._abstract_eval)
    lower_ref = mlir.lower_fun(self._reference, multiple_results=True)
    mlir.register_lowering(prim, lower_ref)
    mlir.register_lowering(prim, self._cuda_lowering(lower_ref), platform="cuda")
    batching.primitive_batchers[prim] = self._batch
    ad.primitive_jvps[prim] = self._jvp

  def __call__(self, *args, **params):
    return self.primitive.bind(*args, **params)

  def _reference(self, *args, **params):
    out = self.reference(*args, **params)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)

  def _abstract_eval(self, *avals, **params):
    return [jax.core.ShapedArray(s, d) for s, d in self.shapes(*avals, **params)]

  def _cuda_lowering(self, lower_ref):
    def lowering(ctx, *args, **params):
      target = _ffi.kernel_target(self.name)
      if (target is None or not self.kernel_supports(*ctx.avals_in, **params)
          or (_ffi.kernel_switch(self.name) is None
              and not self.kernel_default(*ctx.avals_in, **params))):
        return lower_ref(ctx, *args, **params)
      rule = jax.ffi.ffi_lowering(target, operand_output_aliases=self.aliases)
      return rule(ctx, *args, **self.attributes(**params))
    return lowering

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
