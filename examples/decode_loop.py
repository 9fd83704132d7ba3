"""The glm5_jax demo: a serving engine's decode loop of the GLM-5.3-Flash indexer.

Synthetic GLM-5.3-Flash-shaped indexer weights for --layers layers, requests whose
prompts have mixed lengths (--contexts) prefilled into every layer's caches
(glm5_jax.indexer_prefill, --chunk rows per call; where this version has no prefill,
synthetic caches stand in and the demo says so), then --steps decode steps of one
jitted step (every layer's indexer_stage) with the caches donated (updated in place).
The step's metadata is one packed int32 array (glm5_jax.serving): with --metadata device
(the default on one device) it is sent once and then stays on the device, each step
computing the next one (serving.advance) and returning it donated with the caches; with
--metadata host it is built with numpy on the host every step (one host->device transfer
per step). Prints the compile time, the per-step latency (p50/p90, metadata + dispatch +
device, waited on) and steps/s;
then replays the same steps on the pure-JAX reference composition
(use_reference=True), prefill included, from the same initial caches and checks every
step's selected slots and the final caches against it.

  python examples/decode_loop.py [--layers N] [--contexts 300,1200,3000] [--steps 20]
                                 [--devices N] [--processes P] [--metadata device|host]
                                 [--checkpoint DIR]

Defaults: 2 layers, contexts 300,1200,3000 and 20 steps on the CPU (well under a
minute on two cores); 11 layers, 300,5000,30000 and 200 steps on a GPU.

--checkpoint DIR runs on real weights: the indexers of a Hugging Face-style safetensors
checkpoint (glm5_jax.load_indexer_weights; pip install 'glm5_jax[checkpoint]'), every
layer that has one (--layers N: the first N of them), x and qr at its hidden and q_lora
sizes and IndexerConfig(heads=) from it (glm5_jax.checkpoint.indexer_sizes).

--devices N (default 1) runs the loop data-parallel over N devices (glm5_jax.sharding,
mesh axis "data"): the requests in blocks, device d holding requests d*b .. d*b + b - 1
(b = ceil(requests / N)), the last devices filled up with pad requests (positions -1
at every step, no prompt); each device its own caches and tables with device-local
ids, prefilled on that device (indexer_prefill on its own requests); one jitted step
per decode step (every layer's sharding.data_parallel_step, no collective), its packed
metadata built per device with numpy and joined (sharding.assemble) every step, or with
--metadata device once, then advanced on the devices (sharding.data_parallel_advance).
The check then compares each device's shard with the single-device reference run of
that shard alone. On the CPU the script asks XLA for N host devices itself (XLA_FLAGS,
unless it already forces a count).

--processes P runs the same loop as one multi-process jax program (glm5_jax.distributed)
of P processes with --devices N each, P * N devices on one global mesh: started as is,
the script starts its P processes on this host (a coordinator on 127.0.0.1, each line of
output prefixed with its process); on several hosts, start one per host with
GLM5_JAX_COORDINATOR=host0:port GLM5_JAX_PROCESSES=P GLM5_JAX_PROCESS_ID=i set
(docs/serving.md). Each process builds and feeds only its devices' requests and caches
(distributed.from_local) and checks its own devices' shards; the digest, of the whole
gathered caches and outputs, is the one the same loop prints in one process over
P * N devices.

Every run prints the device memory in use (jax's memory_stats()["bytes_in_use"], summed
over the devices of the loop; the CPU backend reports none and the line says so) after
the prefill, the compile and the first decode step, and again after the last step, and
a digest: sha256 over the bytes of the final caches (every layer's kv_cache and tail)
and the last step's outputs (every layer's slots and counts), written with the memory
figures as JSON by --digest FILE. --endurance is the long-run mode (e.g. --steps 10000,
scripts/endurance.py runs it twice and compares): only the last step's outputs are
kept, the steps are dispatched back to back without waiting (one step in a hundred is
timed alone, the queue drained first), and there is no reference replay (what it checks
is that two runs give the same digest and that the memory stays flat).
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

# --devices is read before jax starts: XLA reads XLA_FLAGS once, when it first starts a
# backend. The flag only adds host CPU devices, so on a GPU machine it changes nothing.
DEVICES = argparse.ArgumentParser(add_help=False)
DEVICES.add_argument("--devices", type=int, default=1,
                     help="devices the requests are split over (data parallelism); with "
                          "--processes, each process's")
DEVICES.add_argument("--processes", type=int, default=1,
                     help="processes of one multi-process jax program (glm5_jax."
                          "distributed), --devices each; started here unless "
                          "GLM5_JAX_PROCESS_ID says this is one of them")
_FORCE = "--xla_force_host_platform_device_count"
_devices, _processes = (lambda a: (a.devices, a.processes))(DEVICES.parse_known_args()[0])
if _devices > 1 and _FORCE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                   f"{_FORCE}={_devices}"]))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import glm5_jax  # noqa: E402
from glm5_jax import checkpoint, distributed, serving, sharding, synthetic  # noqa: E402
from glm5_jax.reference.numerics import POOL  # noqa: E402

PAGE = 64             # K-cache entries per page (synthetic.decode_cache's default)
INPUT_SETS = 4        # distinct x/qr cycled over the steps (drawn once, on the device)
SAMPLES = 100         # --endurance: about this many steps timed alone, the rest not waited on
AXIS = "data"         # the mesh axis the requests are split over (--devices > 1)


def parse():
  gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[DEVICES])
  p.add_argument("--layers", type=int,
                 help="layers (default: 11 on a GPU, 2 on the CPU, a checkpoint's all)")
  p.add_argument("--contexts", default="300,5000,30000" if gpu else "300,1200,3000",
                 help="prompt length (tokens) of each request")
  p.add_argument("--steps", type=int, default=200 if gpu else 20)
  p.add_argument("--chunk", type=int, default=4096 if gpu else 1024,
                 help="prefill rows per call (prompts are cut into chunks of this many)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--checkpoint", metavar="DIR",
                 help="load the layers' indexer weights from this safetensors checkpoint "
                      "(its index JSON and shards, or one model.safetensors)")
  p.add_argument("--endurance", action="store_true",
                 help="long runs: keep only the last step's outputs, time one step in "
                      f"{SAMPLES} (the others not waited on), no reference replay")
  p.add_argument("--digest", metavar="FILE",
                 help="write the digest and the memory in use as JSON to FILE")
  p.add_argument("--metadata", choices=("device", "host"),
                 help="where each step's packed metadata comes from: advanced on the device "
                      "by the step itself (serving.advance, sharding.data_parallel_advance "
                      "over several devices; the default on one device) or built on the "
                      "host every step (the default over several devices)")
  args = p.parse_args()
  args.sizes = None
  if args.checkpoint:
    args.sizes = checkpoint.indexer_sizes(args.checkpoint)
    args.sizes["layers"] = args.sizes["layers"][:args.layers]
    args.layers = len(args.sizes["layers"])
  elif args.layers is None:
    args.layers = 11 if gpu else 2
  if args.metadata is None:
    args.metadata = "device" if args.devices * args.processes == 1 else "host"
  return args


def launch_processes():
  """--processes N here: this script started N times on this host as one multi-process
  jax program (glm5_jax.distributed.launch: a coordinator on 127.0.0.1, process i on
  GPUs i*devices .. on a GPU machine), their output prefixed "[i] "; exits with the
  first failure's status."""
  args = DEVICES.parse_known_args()[0]
  try:
    distributed.launch([sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                       args.processes, local_devices=args.devices, echo=True,
                       timeout_s=24 * 3600)
  except distributed.ProcessesFailed as e:
    raise SystemExit(str(e).split("\n")[0]) from None


def empty_caches(rng, layers, requests, longest):
  """Per layer, caches of `requests` requests with room for `longest` tokens each (the
  longest prompt and the decode steps; random valid fp8 contents, shuffled page and
  block tables; the prefill overwrites what the requests read), and the two tables
  (one set for all layers)."""
  caches = []
  for _ in range(layers):
    cache, page_table, block_table = synthetic.decode_cache(
        rng, requests, longest, page=PAGE, spare_pages=4)
    caches.append(cache)
  return caches, page_table, block_table


def prefill_chunks(contexts, chunk, cache, page_table, key, hidden):
  """[(PrefillBatch, x bf16[chunk, hidden])]: the prompts laid out request-major and
  cut into chunks of `chunk` rows (the last one padded), each chunk continuing the
  requests the one before left off; x random on the device."""
  ends = np.cumsum(contexts)
  begins = ends - contexts
  out = []
  for i, a in enumerate(range(0, int(ends[-1]), chunk)):
    lo, hi = np.clip(a, begins, ends), np.clip(a + chunk, begins, ends)
    batch, _ = synthetic.prefill_batch(lo - begins, hi - lo, cache, page_table, rows=chunk)
    x = jax.random.normal(jax.random.fold_in(key, i), (chunk, hidden), jnp.bfloat16)
    out.append((batch, x))
  return out


def prefill(weights, caches, chunks, config, use_reference=False):
  """Every layer's indexer_prefill over the chunks (jitted, caches donated)."""
  fn = jax.jit(glm5_jax.indexer_prefill, static_argnames=("config", "use_reference"),
               donate_argnames="cache")
  for batch, x in chunks:
    caches = [fn(w, c, x, batch, config=config, use_reference=use_reference)
              for w, c in zip(weights, caches)]
  return jax.block_until_ready(caches)


def model_step(config, use_reference=False, mesh=None, ring=None):
  """One decode step of every layer: each layer's indexer on its own weights, cache,
  x and qr (in a model, each layer's hidden state; random here, and never shared
  between layers: synthetic.layer_inputs says why), the same packed metadata and
  tables. With a mesh, each
  layer's step is data-parallel over its axis AXIS (arguments laid out as
  sharding.request_specs). With `ring` (the tail ring's rows) the step also returns the
  next step's packed metadata, computed on the device (serving.advance: every request
  one token further; sharding.data_parallel_advance with a mesh, each device from its
  own page-table rows), donated with the caches."""
  layer_step = serving.indexer_step if mesh is None else sharding.data_parallel_step(mesh,
                                                                                     AXIS)
  advance = serving.advance if mesh is None else sharding.data_parallel_advance(mesh, AXIS)

  def step(weights, caches, xs, qrs, packed, page_table, block_table):
    outs, new = [], []
    for w, c, x, qr in zip(weights, caches, xs, qrs):
      out, c = layer_step(w, c, x, qr, packed, page_table, block_table,
                          config=config, use_reference=use_reference)
      outs.append((out.slots, out.counts))
      new.append(c)
    if ring is None:
      return outs, new
    return outs, new, advance(packed, page_table, page=PAGE, ring=ring)
  return jax.jit(step, donate_argnums=1 if ring is None else (1, 4))


def bar(done, total, width=30):
  filled = width * done // total
  return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def memory_in_use(devices):
  """Bytes in use summed over `devices` (memory_stats()["bytes_in_use"]), or None where
  the backend reports no memory statistics (the CPU: memory_stats() is None)."""
  stats = [d.memory_stats() for d in devices]
  if any(not st or "bytes_in_use" not in st for st in stats):
    return None
  return sum(st["bytes_in_use"] for st in stats)


def run(step, weights, caches, inputs, metadata, page_table, block_table, progress,
        keep=True, sample=1, devices=(), advance=False):
  """The decode loop: (per-step outputs (only the last one's unless keep), final caches,
  seconds of the timed steps, wall seconds of the loop, bytes in use on `devices` after
  the first and after the last step (None: not reported)). Step s is timed when
  s % sample == 0: the queue drained first, then metadata, dispatch and device, waited
  on (a server waits for the step's result); the other steps are dispatched without a
  wait, so the host runs ahead of the device. advance: `step` threads the packed
  metadata (model_step's ring): only step 0's is built on the host and sent."""
  outs, seconds, out, first = [], [], None, None
  packed = jnp.asarray(metadata[0]()) if advance else None   # sent once, then advanced
  steps = len(metadata)
  tick = max(1, steps // 100)        # the bar redrawn 100 times at most: it costs no sync
  t_loop = time.perf_counter()
  for s in range(steps):
    timed = s % sample == 0
    if timed and out is not None:
      jax.block_until_ready(out)      # the steps before it done: time this one alone
    t0 = time.perf_counter()
    xs, qrs = inputs[s % len(inputs)]          # every layer's x and qr
    if advance:                                 # the device computes the next one
      out, caches, packed = step(weights, caches, xs, qrs, packed, page_table, block_table)
    else:                                       # numpy on the host, every step
      out, caches = step(weights, caches, xs, qrs, metadata[s](), page_table, block_table)
    if timed:
      jax.block_until_ready(out)
      seconds.append(time.perf_counter() - t0)
    if s == 0:
      jax.block_until_ready(caches)
      first = memory_in_use(devices)
    if keep:
      outs.append(out)
    if progress and ((s + 1) % tick == 0 or s + 1 == steps):
      print(f"\r  decode {bar(s + 1, steps)}", end="", file=sys.stderr, flush=True)
  jax.block_until_ready((out, caches))
  wall = time.perf_counter() - t_loop
  if progress:
    print(file=sys.stderr)
  return (outs if keep else [out]), caches, np.array(seconds), wall, (first,
                                                                      memory_in_use(devices))


def digest(tree):
  """sha256 (hex) over every leaf of `tree` in tree order: its dtype, shape and bytes."""
  h = hashlib.sha256()
  for a in jax.tree.leaves(jax.device_get(tree)):
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def mib(n):
  return f"{n / 2 ** 20:.1f} MiB"


def written_entries(metadata, chunks, pages):
  """Mask bool[pages * PAGE] of the K-cache entries the prefill and the decode steps
  wrote (loc >= 0)."""
  mask = np.zeros(pages * PAGE, bool)
  for loc in [m()[1] for m in metadata] + [np.asarray(b.loc) for b, _ in chunks]:
    mask[loc[loc >= 0]] = True
  return mask


def entry_bytes(kv):
  """u8[pages * PAGE, 132]: each entry's 128 data bytes then its 4 scale bytes (a
  page holds PAGE entries' data, then their scales)."""
  kv = np.asarray(kv).reshape(kv.shape[0], -1)
  pages = kv.shape[0]
  data = kv[:, :PAGE * 128].reshape(pages * PAGE, 128)
  scales = kv[:, PAGE * 128:].reshape(pages * PAGE, 4)
  return np.concatenate([data, scales], 1)


def check(outs, caches, want_outs, want_caches, metadata, chunks):
  """Raises SystemExit on a mismatch; returns the lines describing what was checked."""
  gpu = jax.default_backend() == "gpu"
  got, want = jax.device_get((outs, caches)), jax.device_get((want_outs, want_caches))
  (outs, caches), (want_outs, want_caches) = got, want
  bits = lambda t: [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(t)]
  exact = all(np.array_equal(a, b) for a, b in zip(bits((outs, caches)),
                                                    bits((want_outs, want_caches))))
  if not gpu:
    if not exact:
      raise SystemExit("mismatch: the jitted step differs from the reference composition")
    return ["check: every step's selected slots and counts and the final caches of every "
            "layer are bit-identical to the reference composition (use_reference=True; "
            f"{'prefill and decode' if chunks else 'decode'}).",
            "  On the CPU both run the same pure-JAX reference code (no CUDA kernels), so "
            "this checks the jitted loop (donation, packed metadata, layer threading), "
            "not the kernels."]
  # GPU: the kernels against the reference. The projection GEMM and the fp8 K-cache
  # rounding differ within SPEC D2 and the logits kernel sums in its own order, so
  # near-tied pools may swap at the top-k boundary (the kernels' rule: equal counts,
  # >= 99% of the selected slots).
  agree, total = 0, 0
  for step_out, step_want in zip(outs, want_outs):
    for (slots, counts), (want_slots, want_counts) in zip(step_out, step_want):
      if not np.array_equal(counts, want_counts):
        raise SystemExit("mismatch: selected-token counts differ from the reference")
      for r, c in enumerate(counts):
        agree += np.isin(slots[r, :c], want_slots[r, :c]).sum()
        total += c
  if agree < 0.99 * total:
    raise SystemExit(f"mismatch: only {agree / total:.2%} of the selected slots agree")
  written = written_entries(metadata, chunks, caches[0].kv_cache.shape[0])
  differ = 0
  for c, w in zip(caches, want_caches):
    g, r = entry_bytes(c.kv_cache), entry_bytes(w.kv_cache)
    if not np.array_equal(g[~written], r[~written]):
      raise SystemExit("mismatch: K-cache entries no step wrote changed")
    differ += int(np.any(g[written] != r[written], axis=1).sum())
  return [f"check: {'bit-identical' if exact else 'not bit-identical'} to the reference "
          f"composition (use_reference=True); selected-token counts equal at every step "
          f"and layer, {agree / max(total, 1):.3%} of the selected slots agree, unwritten "
          f"K-cache entries unchanged, {differ} of {int(written.sum()) * len(caches)} "
          f"written K-cache entries differ in some byte.",
          "  On a GPU this compares the CUDA kernels with the pure-JAX reference: they "
          "agree within SPEC D2 (docs/semantics.md), not bit for bit."]


def data_mesh(n):
  """The 1-D mesh (axis AXIS) of the first n devices; exits saying why if there are
  fewer."""
  devices = jax.devices()
  if len(devices) < n:
    why = ""
    if jax.default_backend() == "cpu":
      why = (f" (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: the script sets {_FORCE} "
             f"itself only where XLA_FLAGS does not already force a count)")
    raise SystemExit(f"--devices {n}: jax has only {len(devices)} "
                     f"{jax.default_backend()} device(s){why}")
  return jax.make_mesh((n,), (AXIS,), devices=devices[:n])


def main():
  # One of --processes' processes: joins the others before jax starts its backends.
  processes = jax.process_count() if distributed.initialize() else 1
  args = parse()
  contexts = np.array([int(c) for c in args.contexts.split(",")])
  n = args.devices * processes
  if n < 1:
    raise SystemExit(f"--devices must be >= 1, got {n}")
  if processes > 1 and jax.device_count() != n:
    raise SystemExit(f"--processes {processes} --devices {args.devices}: jax has "
                     f"{jax.device_count()} devices over the processes, not {n}")
  mesh = (distributed.global_mesh((AXIS,)) if processes > 1 else
          data_mesh(n) if n > 1 else None)
  # The devices of this process: mesh positions `mine` (all of them in one process).
  mine = distributed.local_indexes(mesh) if mesh else [0]
  devices = [mesh.devices.flat[d] for d in mine] if mesh else jax.devices()[:1]
  # Requests in blocks of b per device, pad requests (context -1) at the end: the
  # sharded rows are the requests in order, then the pads.
  b = -(-len(contexts) // n)
  shards = np.concatenate([contexts, np.full(b * n - len(contexts), -1)]).reshape(n, b)
  prompts = np.maximum(shards, 0)
  rng = np.random.default_rng(args.seed)
  longest = int(contexts.max()) + args.steps
  # The logits width of a deployment serving up to `longest` tokens, page-padded.
  sizes = args.sizes or dict(heads=glm5_jax.IndexerConfig.heads, hidden=synthetic.HIDDEN,
                             q_lora=synthetic.Q_LORA)
  config = glm5_jax.IndexerConfig(max_pools=max(math.ceil(longest / POOL / PAGE) * PAGE,
                                                glm5_jax.IndexerConfig.topk_tokens // POOL),
                                  heads=sizes["heads"])
  dims = dict(hidden=sizes["hidden"], q_lora=sizes["q_lora"])
  t0 = time.perf_counter()
  if args.checkpoint:
    weights = glm5_jax.load_indexer_weights(args.checkpoint, sizes["layers"], config, **dims)
  else:
    weights = [synthetic.layer(rng, config) for _ in range(args.layers)]
  # Per device: its caches (one per layer) and tables, device-local ids (as for one
  # device), and a copy of its caches for the reference replay.
  # (every device's drawn in every process, in order: the same caches as in one process)
  drawn = [empty_caches(rng, args.layers, b, longest) for _ in range(n)]
  local = [jax.device_put(drawn[d], dev) for d, dev in zip(mine, devices)]
  del drawn
  caches = [c for c, _, _ in local]
  page_tables = [pt for _, pt, _ in local]
  block_tables = [bt for _, _, bt in local]
  # The reference replay starts from a copy (none in --endurance: no replay).
  start = None if args.endurance else jax.tree.map(jnp.copy, caches)
  # Each set: every layer's x and qr, ([x of layer l], [qr of layer l]).
  inputs = [synthetic.layer_inputs(rng, b * n, args.layers, **dims)
            for _ in range(INPUT_SETS)]
  jax.block_until_ready((weights, caches, start, inputs))
  per_device = (f", data-parallel over {n} devices ({b} requests each, "
                f"{b * n - len(contexts)} pad request(s))" if mesh else "")
  if processes > 1:
    per_device += (f" in {processes} processes; this one, {jax.process_index()}, holds "
                   f"devices {mine[0]}..{mine[-1]}")
  print(f"glm5_jax {glm5_jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}): {args.layers} layers, {len(contexts)} requests, "
        f"prompts {contexts.tolist()} tokens, {args.steps} decode steps{per_device}")
  source = (f"layers {sizes['layers']} of the checkpoint {args.checkpoint} (hidden "
            f"{dims['hidden']}, q_lora {dims['q_lora']}, {config.heads} heads)"
            if args.checkpoint else "synthetic")
  print(f"setup {time.perf_counter() - t0:.1f} s (weights: {source}; caches)")
  device_weights = [jax.device_put(weights, dev) for dev in devices]
  chunks = [[] for _ in devices]
  if hasattr(glm5_jax, "indexer_prefill"):
    key = jax.random.key(args.seed)
    chunks = [jax.device_put(prefill_chunks(prompts[d], args.chunk, caches[k][0],
                                            page_tables[k],
                                            jax.random.fold_in(key, d) if mesh else key,
                                            dims["hidden"]), dev)
              for k, (d, dev) in enumerate(zip(mine, devices))]
    t0 = time.perf_counter()
    for k in range(len(mine)):
      caches[k] = prefill(device_weights[k], caches[k], chunks[k], config)
    print(f"prefill {time.perf_counter() - t0:.1f} s (compile included): "
          f"{int(contexts.sum())} prompt tokens in {sum(map(len, chunks))} chunks of "
          f"{args.chunk} rows x {args.layers} layers (glm5_jax.indexer_prefill"
          f"{', each device on its own requests' if mesh else ''})")
  else:
    print("prefill: glm5_jax.indexer_prefill is not in this version; the caches are "
          "synthetic (random valid fp8 pools and tail rings, not the prompts' keys)")

  # The engine's host copy of each device's page table: each step's metadata is built
  # from it.
  host_pages = [np.asarray(pt) for pt in page_tables]
  ring = caches[0][0].tail.shape[2]

  def metadata_of(k, s):
    requests = shards[mine[k]]
    return lambda: serving.decode_metadata(
        np.where(requests >= 0, requests + s, -1)[:, None], host_pages[k], page=PAGE,
        ring=ring)
  device_metadata = [[metadata_of(k, s) for s in range(args.steps)] for k in range(len(mine))]

  if mesh:
    # This process's devices' trees joined along their split dims and placed
    # (request_specs): its block of the global arrays (all of them in one process).
    specs = sharding.request_specs(AXIS)
    put = lambda spec, parts: distributed.from_local(mesh, spec, sharding.assemble(spec, parts))
    step_weights = distributed.from_local(mesh, [specs.weights] * args.layers, weights)
    step_caches = put([specs.cache] * args.layers, caches)
    page_table = put(specs.batch.page_table, page_tables)
    block_table = put(specs.batch.block_table, block_tables)
    rows = slice(mine[0] * b, (mine[-1] + 1) * b)      # this process's requests' rows
    step_inputs = [distributed.from_local(mesh, ([specs.rows] * args.layers,) * 2,
                                          jax.tree.map(lambda a: np.asarray(a)[rows], i))
                   for i in inputs]
    del caches                          # step_caches holds them now (a copy): free them

    def joined(s):
      return lambda: put(specs.packed, [m[s]() for m in device_metadata])
    metadata = [joined(s) for s in range(args.steps)]
  else:
    step_weights, step_caches, step_inputs = weights, caches[0], inputs
    page_table, block_table = page_tables[0], block_tables[0]
    metadata = device_metadata[0]

  advance = args.metadata == "device"
  step = model_step(config, mesh=mesh, ring=ring if advance else None)
  t0 = time.perf_counter()
  step = step.lower(step_weights, step_caches, *step_inputs[0], metadata[0](), page_table,
                    block_table).compile()
  compile_s = time.perf_counter() - t0
  sample = max(1, args.steps // SAMPLES) if args.endurance else 1
  outs, step_caches, sec, wall, memory = run(
      step, step_weights, step_caches, step_inputs, metadata, page_table, block_table,
      progress=True, keep=not args.endurance, sample=sample, devices=devices,
      advance=advance)
  ms = sec * 1e3
  p50, p90 = np.percentile(ms, 50), np.percentile(ms, 90)
  on = f" on {n} devices" if mesh else ""
  meta = ("metadata advanced on the device" if advance
          else "host metadata + transfer")
  timed = (f"per step ({meta} + {args.layers} layers{on}, waited on"
           + (f", 1 step in {sample} timed alone, the first included" if sample > 1 else "")
           + f"): p50 {p50:.2f} ms, p90 {p90:.2f} ms, min {ms.min():.2f} ms")
  print(f"compile {compile_s:.1f} s; {timed}; " + (
      f"{args.steps / wall:.1f} steps/s over the {args.steps} steps (dispatched back to "
      "back, only the timed ones waited on)" if sample > 1 else
      f"{len(ms) / sec.sum():.1f} steps/s (the first step included)"))
  # Across processes, the whole arrays gathered into each one (its own are a block).
  whole = (lambda t: distributed.gather(mesh, t)) if processes > 1 else (lambda t: t)
  counts = np.asarray(whole(outs[-1][0][1]))[:len(contexts)]        # the pads come last
  print(f"last step: positions {(contexts + args.steps - 1).tolist()} -> selected tokens "
        f"{counts.tolist()} (layer 0)")
  first, last = memory
  where = (f"summed over this process's {len(mine)} devices" if processes > 1 else
           f"summed over the {n} devices" if mesh else jax.devices()[0].device_kind)
  if first is None:
    print(f"device memory in use: not reported on the {jax.default_backend()} backend "
          "(memory_stats() is None)")
  else:
    held = ("the last step's outputs held" if args.endurance else
            f"all {args.steps} steps' outputs held for the check")
    print(f"device memory in use ({where}): {mib(first)} after the prefill, compile and "
          f"first step; {mib(last)} after step {args.steps} ({held}): "
          f"{last - first:+,d} bytes")
  # The final caches and the last step's outputs, pad requests included.
  sha = digest(whole((step_caches, outs[-1])))
  print(f"digest: sha256 {sha} (the final caches of {args.layers} layers and the last "
        "step's slots and counts)")
  if args.digest and jax.process_index() == 0:      # (the same digest in every process)
    with open(args.digest, "w") as f:
      json.dump(dict(sha256=sha, backend=jax.default_backend(),
                     device=jax.devices()[0].device_kind, steps=args.steps,
                     layers=args.layers, contexts=contexts.tolist(), devices=n,
                     processes=processes,
                     endurance=args.endurance, metadata=args.metadata,
                     memory_first=first, memory_last=last,
                     p50_ms=p50, steps_per_s=args.steps / wall), f, indent=1)
  if args.endurance:
    print("check: none against the reference (--endurance: run without it for that); "
          "two runs of the same seed must print the same digest (scripts/endurance.py)")
    print("ok")
    return

  # The reference: each device's shard replayed alone on one device (that device), from
  # the same initial caches, prefill included.
  reference = model_step(config, use_reference=True)
  t0 = time.perf_counter()
  wanted = []
  for k, (d, dev) in enumerate(zip(mine, devices)):
    if chunks[k]:
      start[k] = prefill(device_weights[k], start[k], chunks[k], config, use_reference=True)
    rows = slice(d * b, (d + 1) * b)
    device_inputs = jax.device_put([([x[rows] for x in xs], [qr[rows] for qr in qrs])
                                    for xs, qrs in inputs], dev)
    wanted.append(run(reference, device_weights[k], start[k], device_inputs,
                      device_metadata[k], page_tables[k], block_tables[k],
                      progress=False)[:2])
  alone = f", each of the {len(mine)} devices' shards alone" if mesh else ""
  print(f"reference replay {time.perf_counter() - t0:.1f} s (compile included{alone})")
  # This process's block of every split dim (dim 0 of every output and cache), then
  # device d's within it.
  got = distributed.to_local((outs, step_caches))
  for k, (d, (want_outs, want_caches)) in enumerate(zip(mine, wanted)):
    outs_d, caches_d = jax.tree.map(lambda a, k=k: np.split(a, len(mine))[k], got)
    lines = check(outs_d, caches_d, want_outs, want_caches, device_metadata[k], chunks[k])
    if not mesh:
      print("\n".join(lines))
    elif k == len(mine) - 1:
      print(f"device {d}: {lines[0]}")
      print("\n".join(lines[1:]))
      where = f" in each of {processes} processes" if processes > 1 else ""
      print(f"  With --devices {args.devices}{where}: the data-parallel step "
            "(sharding.data_parallel_step, one shard_map per layer) against each device's "
            "shard run alone on one device.")
    else:
      print(f"device {d}: {lines[0]}")
  print("ok")


if __name__ == "__main__":
  if _processes > 1 and distributed.PROCESS_ID_ENV not in os.environ:
    launch_processes()
  else:
    main()
