"""The stock op order as Triton kernels (glm5_testing/triton_oracle.py, torch +
triton with CUDA only): the "triton" variant, timed as a torch CUDA graph."""
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from glm5_jax.reference.numerics import DIM

from .harness import grow_passes
from .sizes import BLOCK, CONFIG, HEADS, WIDTH


@functools.cache
def triton_oracle():
  """glm5_testing/triton_oracle.py (stock-op-order Triton kernels) when torch + triton
  with CUDA are importable, else None."""
  try:
    from glm5_testing import triton_oracle as t
  except ImportError:
    return None
  return t.load()


def _compact(out, counts):
  """The column-preserving remap layout -> the compacted one (valid slots are >= 0)."""
  order = jnp.argsort(out < 0, axis=1, stable=True)
  return jnp.take_along_axis(out, order, 1), counts


def stock_query(T, q, key_raw, head_w, norm_weight, norm_bias):
  """The stock order of indexer_query (H = padded): torch's LayerNorm of the key,
  the Triton oracle's Hadamard + FP8 (the stock op's own kernel takes 4.9-5.9 µs
  on the H200)."""
  import torch.nn.functional as F
  codes, w_out = T.query(q, head_w, CONFIG.scale)
  key = F.layer_norm(key_raw.float(), (DIM,), norm_weight, norm_bias, CONFIG.eps)
  return codes, w_out, key.to(key_raw.dtype)


def stock_prologue(T, x, w_cat, q, norm_weight, norm_bias):
  """The stock order of indexer_projection_fused: one cuBLAS GEMM of the concatenated
  weights (bf16 out, as the stock linear layers), then stock_query."""
  y = x @ w_cat.T
  key_raw, head_w, gate = y[:, :DIM], y[:, DIM:DIM + HEADS].float(), y[:, DIM + HEADS:]
  return (*stock_query(T, q, key_raw.contiguous(), head_w.contiguous(), norm_weight,
                       norm_bias), gate.contiguous())


# op -> call(T, state, fixed, args) on torch tensors -> (state, outs), as Workload.call;
# the ops' stock kernels: one decode-update kernel, expand, expand + convert
# (column-preserving, compacted for the check), the bf16 -> f32 convert.
TRITON_CALLS = {
    "kpool_update": lambda T, st, f, a: (T.decode_update(
        st[0], st[1], a[0], a[1], a[2], f[0], a[3], a[4]), ()),
    "expand_pools": lambda T, st, f, a: (st, (T.expand(*a, seq_offset=1, width=WIDTH),)),
    "expand_and_remap": lambda T, st, f, a: (st, T.convert(
        f[0], a[2], T.expand(a[0], a[1], seq_offset=1, width=WIDTH), block_size=BLOCK,
        stride_rows=BLOCK)),
    "upcast_logits": lambda T, st, f, a: (st, (T.upcast(*a),)),
    "indexer_query": lambda T, st, f, a: (st, stock_query(T, *a, *f)),
    "indexer_projection_fused": lambda T, st, f, a: (st, stock_prologue(T, *a, *f)),
}
TRITON_CHECK = {"expand_and_remap": _compact}     # outputs -> the kernel's layout


def _torch(tree, clone=False):
  import torch
  return jax.tree.map(lambda a: (torch.from_dlpack(a).clone() if clone
                                 else torch.from_dlpack(a)), tree)


def triton_single_call(work, state):
  """Result leaves (as jax arrays) of one Triton call from a copy of `state`."""
  T = triton_oracle()
  st, outs = TRITON_CALLS[work.op](T, _torch(state, clone=True), _torch(work.fixed),
                                   _torch(work.rotated[0]))
  outs = tuple(jnp.array(jnp.from_dlpack(o)) for o in outs)
  outs = TRITON_CHECK.get(work.op, lambda *o: o)(*outs)
  if work.mask is not None:
    outs = work.mask(work.rotated[0], outs)
  return [jnp.array(jnp.from_dlpack(t)) for t in jax.tree.leaves(st)] + list(outs)


def triton_amortised(work, state, r, calls, sizes):
  """Seconds per call of the Triton variant: a torch CUDA graph of `calls` calls
  cycling the first r rotated input sets (as the JAX chain; state: a copy, updated in
  place), replayed `passes` times per run (passes grows until a run takes >=
  sizes.run_s); median run over reps. Returns (s, info) as amortised()."""
  import torch
  T, call = triton_oracle(), TRITON_CALLS[work.op]
  st, fixed = _torch(state, clone=True), _torch(work.fixed)
  rotated = [_torch(a) for a in work.rotated[:r]]
  t0 = time.perf_counter()
  for a in rotated:                                     # compile + warm up
    st, _ = call(T, st, fixed, a)
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for i in range(calls):
      st, _ = call(T, st, fixed, rotated[i % r])
  compile_s = time.perf_counter() - t0
  start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))

  def run(n):
    start.record()
    for _ in range(n):
      graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3

  n = grow_passes(run, sizes)
  times = [run(n) for _ in range(sizes.warmup + sizes.reps)][sizes.warmup:]
  return statistics.median(times) / (n * calls), dict(
      compile_s=compile_s, temp=None, passes=n, calls=calls, R=r)
