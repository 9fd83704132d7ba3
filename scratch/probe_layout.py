"""Probe: mqa_logits at 64 x 32768 on different K-cache footprints and page orders.
Run under ncu (kernel durations, L2 flushed); prints the configs in launch order."""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
import glm5_jax

m, p, page = 64, 32768, 64
per_row = p // page
need = m * per_row
rng = np.random.default_rng(0)
q = jnp.asarray(np.clip(rng.standard_normal((m, 32, 128)) * 8, -448, 448), jnp.float8_e4m3fn)
w = jnp.asarray(rng.random((m, 32)), jnp.float32)
lens = jnp.full((m,), p, jnp.int32)
fn = jax.jit(functools.partial(glm5_jax.mqa_logits, max_pools=p))
configs = [("exact, sequential", need, "seq"), ("exact, random", need, "perm"),
           ("4x, random", 4 * need, "perm"), ("16x, random", 16 * need, "perm"),
           ("16x, sequential", 16 * need, "seq")]
for name, pages, order in configs:
  data = jax.random.bits(jax.random.key(1), (pages, page * 128), jnp.uint8) & 0xBF
  scale = np.tile(np.float32(2.0 ** -8).reshape(1).view(np.uint8), page)
  kv = jnp.concatenate([data, jnp.broadcast_to(jnp.asarray(scale), (pages, page * 4))],
                       1).reshape(pages, page, 132)
  table = np.arange(need) if order == "seq" else rng.permutation(pages)[:need]
  table = jnp.asarray(table.reshape(m, per_row).astype(np.int32))
  for _ in range(2):
    jax.block_until_ready(fn(q, w, kv, table, lens))
  print(name, pages * page * 132 / 1e9, "GB", file=sys.stderr)
  del kv, data
