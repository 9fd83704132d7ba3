"""Synthetic GLM-5.3-Flash-shaped layers, caches, prefill and decode batches for demos,
tests and benchmarks (random weights; valid fp8 cache contents), and small checkpoints in
the layout glm5_jax.load_indexer_weights reads."""
import json
import math
import os

import numpy as np
import jax.numpy as jnp
import ml_dtypes

from . import checkpoint
from .prefill import PrefillBatch
from .reference.numerics import DIM, FP8_MAX, POOL
from .serving import token_slots
from .stage import DecodeBatch, IndexerCache, prepare_weights

HIDDEN, Q_LORA = 4096, 1536     # GLM-5.3-Flash (SPEC §9)


def _normal(rng, shape, scale, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def layer(rng, config, hidden=HIDDEN, q_lora=Q_LORA):
  """Random IndexerWeights of one layer."""
  return prepare_weights(*layer_arrays(rng, config, hidden, q_lora))


def layer_arrays(rng, config, hidden=HIDDEN, q_lora=Q_LORA):
  """prepare_weights' arguments for a random layer, as host numpy arrays: wq_b
  bf16[heads*128, q_lora], wk bf16[128, hidden], weights_proj bf16[heads, hidden], gate
  bf16[128, hidden], norm_weight f32[128], norm_bias f32[128], ape f32[4, 128]."""
  h = config.heads
  host = lambda a: np.asarray(a)
  return (host(_normal(rng, (h * DIM, q_lora), q_lora ** -0.5)),
          host(_normal(rng, (DIM, hidden), hidden ** -0.5)),
          host(_normal(rng, (h, hidden), hidden ** -0.5)),
          host(_normal(rng, (DIM, hidden), hidden ** -0.5)),
          np.float32(1 + 0.1 * rng.standard_normal(DIM)),
          np.float32(0.1 * rng.standard_normal(DIM)),
          np.float32(0.5 * rng.standard_normal((POOL, DIM))))


def quantize_fp8(w):
  """(w_fp8 e4m3[rows, cols], scale f32[ceil(rows / 128), ceil(cols / 128)]) of w
  bf16[rows, cols]: per 128 x 128 block, scale = amax / 448 (1 for an all-zero block) and
  w_fp8 = e4m3(f32(w) / scale), as fp8 block-quantised checkpoints store weights."""
  w = np.asarray(w, np.float32)
  rows, cols = w.shape
  block = checkpoint.QUANT_BLOCK
  nr, nc = -(-rows // block), -(-cols // block)
  padded = np.zeros((nr * block, nc * block), np.float32)
  padded[:rows, :cols] = w
  amax = np.abs(padded.reshape(nr, block, nc, block)).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / np.float32(FP8_MAX), 1).astype(np.float32)
  full = np.repeat(np.repeat(scale, block, 0), block, 1)[:rows, :cols]
  return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def write_checkpoint(path, rng, config, layers=(0, 1, 2), *, hidden=256, q_lora=256,
                     shards=2, fp8=(), other_bytes=0):
  """Writes a checkpoint of random indexers for `layers` into the directory `path`, in
  the layout of a Hugging Face model (glm5_jax.checkpoint): the tensors named as
  checkpoint.INDEXER_TENSORS, split in file order over `shards` files
  model-0000i-of-0000n.safetensors of about equal bytes (a layer may straddle two) with
  model.safetensors.index.json, or one model.safetensors where shards == 1; and a
  config.json with the indexer's sizes. fp8: the matrix parts ("wq_b", "wk",
  "weights_proj", "gate") stored F8_E4M3 with their "_scale_inv" block scales
  (quantize_fp8). other_bytes: each layer also gets a tensor of that many bytes that is
  not the indexer's (model.layers.{layer}.mlp.down_proj.weight), as a model's other
  weights. Returns {name: numpy array} of every tensor written."""
  bad = set(fp8) - set(checkpoint.MATRICES)
  if bad:
    raise ValueError(f"write_checkpoint: fp8 parts must be among {checkpoint.MATRICES}, "
                     f"got {sorted(bad)}")
  tensors = {}
  for layer_id in layers:
    arrays = layer_arrays(rng, config, hidden, q_lora)
    for (part, template), array in zip(checkpoint.INDEXER_TENSORS.items(), arrays):
      name = template.format(layer=layer_id)
      if part in fp8:
        array, tensors[name + checkpoint.SCALE_SUFFIX] = quantize_fp8(array)
      tensors[name] = array
    if other_bytes:
      tensors[f"model.layers.{layer_id}.mlp.down_proj.weight"] = np.zeros(
          (-(-other_bytes // 256), 128), ml_dtypes.bfloat16)
  save_file = checkpoint._safetensors().numpy.save_file
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, checkpoint.CONFIG_FILE), "w") as f:
    json.dump(dict(hidden_size=hidden, q_lora_rank=q_lora, index_n_heads=config.heads,
                   index_head_dim=DIM, index_kpool=POOL, qk_rope_head_dim=0,
                   num_hidden_layers=max(layers) + 1), f, indent=1)
  if shards == 1:
    save_file(tensors, os.path.join(path, checkpoint.SINGLE_FILE))
    return tensors
  # Contiguous groups of about total / shards bytes each, in file order (a tensor in the
  # group where it begins).
  ends = np.cumsum([a.nbytes for a in tensors.values()])
  shard_of = (ends - [a.nbytes for a in tensors.values()]) * shards // ends[-1]
  files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
  weight_map = {name: files[s] for name, s in zip(tensors, shard_of)}
  for file in files:
    save_file({n: a for n, a in tensors.items() if weight_map[n] == file},
              os.path.join(path, file))
  with open(os.path.join(path, checkpoint.INDEX_FILE), "w") as f:
    json.dump(dict(metadata=dict(total_size=int(ends[-1])), weight_map=weight_map), f,
              indent=1)
  return tensors


def inputs(rng, rows, hidden=HIDDEN, q_lora=Q_LORA):
  """(x bf16[rows, hidden], qr bf16[rows, q_lora])."""
  return _normal(rng, (rows, hidden), 1.0), _normal(rng, (rows, q_lora), 1.0)


def layer_inputs(rng, rows, layers, hidden=HIDDEN, q_lora=Q_LORA):
  """([x of layer l], [qr of layer l]) for `layers` layers, each pair from inputs().

  Every layer gets its own x and qr, as in a model (each layer's hidden state): given one
  x and qr for all layers, XLA merged the layers' q GEMMs into one that first copied
  their wq_b together, a cost no model pays (docs/performance.md, Method)."""
  drawn = [inputs(rng, rows, hidden, q_lora) for _ in range(layers)]
  return [x for x, _ in drawn], [qr for _, qr in drawn]


def ring_size(next_n):
  """RING = 4 * next_pow2(ceil((4 + spec) / 4)), spec = next_n - 1 (SPEC §0.2)."""
  return POOL * 2 ** math.ceil(math.log2(math.ceil((POOL + next_n - 1) / POOL)))


def decode_cache(rng, requests, max_context, *, next_n=1, page=64, block_size=128,
                 spare_pages=0):
  """(IndexerCache, page_table i32[B, MP], block_table i32[B, MB]) for
  `requests` requests of up to max_context tokens: pages of valid fp8 entries
  (power-of-two scales), a random tail ring, shuffled page and block tables."""
  pages_per_req = math.ceil((max_context // POOL + 1) / page)
  pages = requests * pages_per_req + spare_pages
  page_table = rng.permutation(pages)[:requests * pages_per_req]
  data = np.clip(rng.standard_normal((pages, page, DIM)) * 64, -448, 448)
  data = np.asarray(jnp.asarray(data, jnp.float8_e4m3fn)).view(np.uint8)
  scales = np.exp2(rng.integers(-12, -4, (pages, page))).astype(np.float32).view(np.uint8)
  kv = np.concatenate([data.reshape(pages, -1), scales.reshape(pages, -1)], 1)
  tail = _normal(rng, (requests, 2, ring_size(next_n), DIM), 1.0)
  blocks_per_req = math.ceil((max_context + 1) / block_size)
  block_table = rng.permutation(requests * blocks_per_req)
  cache = IndexerCache(jnp.asarray(kv.reshape(pages, page, DIM + 4)), tail)
  return (cache, jnp.asarray(page_table.reshape(requests, -1), jnp.int32),
          jnp.asarray(block_table.reshape(requests, -1), jnp.int32))


def _slots(pos, req, cache, page_table):
  """(loc, tslot) of positions `pos` of requests `req` (request r owns tail block r)."""
  return token_slots(pos, req, req, page_table, page=cache.kv_cache.shape[1],
                     ring=cache.tail.shape[2])


def prefill_batch(starts, lengths, cache, page_table, rows=None):
  """PrefillBatch of request r's positions starts[r] .. starts[r] + lengths[r] - 1,
  request-major (request r owns tail block r), padded to `rows` rows (None: no pads).
  Returns (batch, req_ids i32[rows]: each row's request, -1 pads)."""
  req = np.concatenate([np.full(n, r) for r, n in enumerate(lengths)] + [np.zeros(0, int)])
  pos = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)] + [req[:0]])
  pad = (len(pos) if rows is None else rows) - len(pos)
  if pad < 0:
    raise ValueError(f"prefill_batch: rows {rows} < the {len(pos)} tokens")
  req, pos = np.pad(req, (0, pad), constant_values=-1), np.pad(pos, (0, pad), constant_values=-1)
  loc, tslot = _slots(pos, np.maximum(req, 0), cache, page_table)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  return PrefillBatch(i32(pos), i32(loc), i32(tslot)), i32(req)


def decode_batch(positions, cache, page_table, block_table):
  """DecodeBatch of positions i32[B, N] (request b owns tail block b): pool
  slots for the tokens that complete a pool, tail slots for every token."""
  pos = np.asarray(positions)
  b, n = pos.shape
  loc, tslot = _slots(pos, np.arange(b)[:, None], cache, page_table)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  return DecodeBatch(i32(pos), i32(loc), i32(tslot), i32(np.repeat(np.arange(b), n)),
                     page_table, block_table)
