"""Loading a layer's indexer from a Hugging Face-style safetensors checkpoint.

A checkpoint is a directory holding `model.safetensors.index.json` (its "weight_map":
tensor name -> shard file) and the shards, or one `model.safetensors`. Each layer's
indexer is seven tensors, named as vLLM's GLM-5-Next `Indexer` module names them
(INDEXER_TENSORS; pass `names` to load_indexer_weights for another checkpoint's names).
Only the asked layers' indexer tensors are read, each from its file's memory map.

Needs the `safetensors` package: pip install 'glm5_jax[checkpoint]'.
"""
import json
import math
import os
import re
import struct

import numpy as np
import ml_dtypes

from .reference.numerics import DIM, POOL
from .stage import IndexerConfig, IndexerWeights, prepare_weights

OP = "load_indexer_weights"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# The indexer's parts (prepare_weights' arguments, in its order) -> tensor name in the
# checkpoint, "{layer}" the layer number. The defaults are vLLM's GLM-5-Next names (the
# kpool gate and ape are parameters of their own: no ".weight").
INDEXER_TENSORS = {
    "wq_b": "model.layers.{layer}.self_attn.indexer.wq_b.weight",
    "wk": "model.layers.{layer}.self_attn.indexer.wk.weight",
    "weights_proj": "model.layers.{layer}.self_attn.indexer.weights_proj.weight",
    "gate": "model.layers.{layer}.self_attn.indexer.index_kpool_compress_gate",
    "norm_weight": "model.layers.{layer}.self_attn.indexer.k_norm.weight",
    "norm_bias": "model.layers.{layer}.self_attn.indexer.k_norm.bias",
    "ape": "model.layers.{layer}.self_attn.indexer.index_kpool_compress_ape",
}
# The matrices: bf16, or fp8 e4m3 block-quantised with a scale tensor (the parts the
# stage runs as bf16 GEMMs; dequantised here, once). The vectors: f32 (bf16 widens exactly).
MATRICES = ("wq_b", "wk", "weights_proj", "gate")
# An fp8 tensor's scale: its name + SCALE_SUFFIX (DeepSeek-V3-style checkpoints:
# "...wq_b.weight_scale_inv", f32[ceil(rows / 128), ceil(cols / 128)], the factor that
# dequantises each 128 x 128 block: w = f32(w_fp8) * scale).
SCALE_SUFFIX = "_scale_inv"
QUANT_BLOCK = 128
# safetensors dtype names (the header's) of the dtypes a part may have.
BF16, F32, F8 = "BF16", "F32", "F8_E4M3"
NUMPY_DTYPES = {BF16: ml_dtypes.bfloat16, F32: np.float32, F8: ml_dtypes.float8_e4m3fn}


def _fail(layer, part, name, message, error=ValueError):
  where = f"layer {layer}: " if layer is not None else ""
  what = f"{name} ({part})" if part else name
  raise error(f"glm5_jax.{OP}: {where}{what} {message}")


def _safetensors():
  try:
    import safetensors
    import safetensors.numpy  # noqa: F401 (synthetic.write_checkpoint's save_file)
  except ImportError as e:
    raise ImportError(f"glm5_jax.{OP} needs the safetensors package, an optional "
                      "dependency: pip install 'glm5_jax[checkpoint]' (or pip install "
                      "safetensors)") from e
  return safetensors


class Checkpoint:
  """A checkpoint's tensor map (tensor name -> file), read from the index JSON or the one
  file's header; tensors are read only by read()."""

  def __init__(self, path):
    path = os.fspath(path)
    if os.path.isdir(path):
      index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
      if os.path.exists(index):
        path = index
      elif os.path.exists(single):
        path = single
      else:
        raise FileNotFoundError(f"glm5_jax.{OP}: {path} holds neither {INDEX_FILE} nor "
                                f"{SINGLE_FILE}")
    elif not os.path.exists(path):
      raise FileNotFoundError(f"glm5_jax.{OP}: no checkpoint at {path}")
    self.root = os.path.dirname(os.path.abspath(path))
    self.config_json = _read_config(os.path.join(self.root, CONFIG_FILE))
    if path.endswith(".json"):
      self.weight_map = _read_index(path)
    else:
      safe_open = _safetensors().safe_open
      with safe_open(path, "numpy") as f:
        self.weight_map = dict.fromkeys(f.keys(), os.path.basename(path))

  def layers(self, names):
    """The layers whose `wq_b` (names["wq_b"]) the checkpoint holds, ascending."""
    pattern = re.compile(re.escape(names["wq_b"]).replace(re.escape("{layer}"), r"(\d+)"))
    layers = sorted({int(m.group(1)) for m in map(pattern.fullmatch, self.weight_map) if m})
    if not layers:
      raise ValueError(f"glm5_jax.{OP}: {self.root} holds no tensor named {names['wq_b']}")
    return layers

  def file(self, name, where):
    """The path of the shard holding `name` (`where`: the layer and part it is)."""
    path = os.path.join(self.root, self.weight_map[name])
    if not os.path.exists(path):
      _fail(*where, name, f"is in the shard {self.weight_map[name]} (named by {INDEX_FILE}), "
            f"which is not in {self.root}", FileNotFoundError)
    return path

  def _by_file(self, wanted):
    by_file = {}
    for name, where in wanted.items():
      by_file.setdefault(self.file(name, where), []).append(name)
    return by_file.items()

  def headers(self, wanted):
    """{name: (safetensors dtype, shape)} of the tensors `wanted` (name -> (layer, part)),
    from their files' headers: no tensor data read."""
    safe_open = _safetensors().safe_open
    out = {}
    for path, names in self._by_file(wanted):
      with safe_open(path, "numpy") as f:
        held = set(f.keys())
        for name in names:
          if name not in held:
            _fail(*wanted[name], name, f"is missing from {os.path.basename(path)}, the shard "
                  f"{INDEX_FILE} names for it")
          tensor = f.get_slice(name)
          out[name] = tensor.get_dtype(), tuple(tensor.get_shape())
    return out

  def read(self, wanted, dtypes):
    """{name: numpy array} of the tensors `wanted` (name -> (layer, part)), `dtypes` their
    safetensors dtypes: each file opened once (safe_open, memory-mapped), only these
    tensors copied out of it."""
    safe_open = _safetensors().safe_open
    out = {}
    for path, names in self._by_file(wanted):
      header = None
      with safe_open(path, "numpy") as f:
        for name in names:
          if dtypes[name] != F8:
            out[name] = f.get_tensor(name)
            continue
          # safetensors' numpy backend has no fp8 dtype: fp8 tensors are mapped from the
          # file at the offsets of its header (the safetensors format) instead.
          header = header or _header(path)
          out[name] = _mapped(path, header, name)
    return out


def _read_config(path):
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"glm5_jax.{OP}: {path} is not valid JSON: {e}") from e
  return config if isinstance(config, dict) else {}


def _read_index(path):
  try:
    with open(path) as f:
      index = json.load(f)
  except ValueError as e:
    raise ValueError(f"glm5_jax.{OP}: {path} is not valid JSON: {e}") from e
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise ValueError(f"glm5_jax.{OP}: {path} must hold a \"weight_map\" object of tensor "
                     "name -> shard file name")
  return weight_map


def _header(path):
  """(data offset, header) of the safetensors file `path`: a u64 header length, the JSON
  header, then the tensors' data at the header's data_offsets."""
  with open(path, "rb") as f:
    size, = struct.unpack("<Q", f.read(8))
    return 8 + size, json.loads(f.read(size))


def _mapped(path, header, name):
  """A tensor of `path` (its _header) as a numpy array on the file's memory map."""
  data, header = header
  entry = header[name]
  begin, end = entry["data_offsets"]
  dtype = np.dtype(NUMPY_DTYPES[entry["dtype"]])
  return np.memmap(path, dtype, "r", offset=data + begin,
                   shape=(end - begin) // dtype.itemsize).reshape(entry["shape"])


def dequantize(w_fp8, scale):
  """bf16[rows, cols] of w_fp8 e4m3[rows, cols] and its block scale f32[ceil(rows / 128),
  ceil(cols / 128)]: bf16(f32(w) * scale of the 128 x 128 block), on the host."""
  rows, cols = w_fp8.shape
  full = np.repeat(np.repeat(np.asarray(scale, np.float32), QUANT_BLOCK, 0), QUANT_BLOCK, 1)
  w = np.asarray(w_fp8).astype(np.float32) * full[:rows, :cols]
  return w.astype(ml_dtypes.bfloat16)


def _shape_str(shape):
  dims = ["*" if d is None else str(d) for d in shape]
  return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _expected(config, hidden, q_lora):
  """part -> expected shape (None: any)."""
  return {"wq_b": (config.heads * DIM, q_lora), "wk": (DIM, hidden),
          "weights_proj": (config.heads, hidden), "gate": (DIM, hidden),
          "norm_weight": (DIM,), "norm_bias": (DIM,), "ape": (POOL, DIM)}


def _check_config_json(ckpt, config, hidden, q_lora):
  """The checkpoint's config.json (where present) against the IndexerConfig and the asked
  dims; returns (hidden, q_lora) with those config.json gives where the caller gave none."""
  cj = ckpt.config_json
  where = os.path.join(ckpt.root, CONFIG_FILE)
  for key, want, what in (("index_n_heads", config.heads, "config.heads"),
                          ("index_head_dim", DIM, "the indexer's head dim"),
                          ("index_kpool", POOL, "the indexer's pool size"),
                          ("qk_rope_head_dim", config.rope_dim, "config.rope_dim"),
                          ("hidden_size", hidden, "hidden"),
                          ("q_lora_rank", q_lora, "q_lora")):
    if key in cj and want is not None and cj[key] != want:
      raise ValueError(f"glm5_jax.{OP}: {where} gives {key} = {cj[key]}, which disagrees "
                       f"with {what} = {want}")
  return (cj.get("hidden_size") if hidden is None else hidden,
          cj.get("q_lora_rank") if q_lora is None else q_lora)


def _check(layer, part, name, header, expected, config, inferred):
  """One part's dtype and shape (from the header) against what the stage needs."""
  dtype, shape = header
  if part in MATRICES:
    if dtype not in (BF16, F8):
      _fail(layer, part, name, f"must be BF16 (or F8_E4M3 with a {SCALE_SUFFIX} scale), got "
            f"{dtype}", TypeError)
  elif dtype not in (F32, BF16):
    _fail(layer, part, name, f"must be F32 (or BF16), got {dtype}", TypeError)
  if len(shape) == len(expected) and all(w is None or w == d for w, d in zip(expected, shape)):
    return
  # Where only the heads differ, the config is what disagrees with the checkpoint.
  per_head = {"wq_b": DIM, "weights_proj": 1}.get(part)
  if (per_head and len(shape) == 2 and shape[1:] == expected[1:] and shape[0] % per_head == 0):
    _fail(layer, part, name, f"has {shape[0] // per_head} heads (shape {shape}), which "
          f"disagrees with config.heads = {config.heads}")
  _fail(layer, part, name, f"must have shape {_shape_str(expected)}{inferred}, got {shape}")


def _check_scale(layer, part, name, header, headers):
  """An fp8 part's block scale: present, f32, one per 128 x 128 block."""
  scale_name = name + SCALE_SUFFIX
  if scale_name not in headers:
    _fail(layer, part, name, f"is F8_E4M3 but the checkpoint has no {scale_name} (its block "
          "scale): the indexer needs bf16 weights, and an fp8 tensor without its scale "
          "cannot be dequantised")
  scale_dtype, scale_shape = headers[scale_name]
  want = tuple(math.ceil(d / QUANT_BLOCK) for d in header[1])
  if scale_dtype != F32:
    _fail(layer, part, scale_name, f"must be F32, got {scale_dtype}", TypeError)
  if scale_shape != want:
    _fail(layer, part, scale_name, f"must have shape {want} (one scale per 128 x 128 block "
          f"of {name}, shape {header[1]}), got {scale_shape}")


def indexer_sizes(path, names: dict | None = None) -> dict:
  """What the checkpoint at `path` holds for the indexer, read from its index (or header)
  and config.json, no tensor data: {"layers": the layers whose wq_b it holds, ascending;
  "heads", "hidden", "q_lora": config.json's index_n_heads, hidden_size, q_lora_rank,
  else the shapes of the first layer's wq_b and wk}. Build the IndexerConfig with
  heads=sizes["heads"] for load_indexer_weights."""
  _safetensors()
  names = {**INDEXER_TENSORS, **(names or {})}
  ckpt = Checkpoint(path)
  layers = ckpt.layers(names)
  cj = ckpt.config_json
  wq_b, wk = (names[part].format(layer=layers[0]) for part in ("wq_b", "wk"))
  headers = ckpt.headers({wq_b: (layers[0], "wq_b"), wk: (layers[0], "wk")})
  wq_b, wk = headers[wq_b][1], headers[wk][1]
  return {"layers": layers, "heads": cj.get("index_n_heads", wq_b[0] // DIM),
          "hidden": cj.get("hidden_size", wk[-1]), "q_lora": cj.get("q_lora_rank", wq_b[-1])}


def load_indexer_weights(path, layers=None, config: IndexerConfig | None = None, *,
                         hidden: int | None = None, q_lora: int | None = None,
                         names: dict | None = None
                         ) -> IndexerWeights | list[IndexerWeights]:
  """The indexers of `layers` of the checkpoint at `path`, as IndexerWeights.

  path: a checkpoint directory (model.safetensors.index.json and its shards, or one
  model.safetensors), or the index JSON or one .safetensors file itself. layers: a layer
  number (returns one IndexerWeights), a sequence of them (returns a list, in that
  order), or None (every layer whose wq_b the checkpoint holds, ascending; a list).
  config: the IndexerConfig the weights are for (IndexerConfig() if None): its heads
  fix wq_b bf16[heads * 128, q_lora] and weights_proj bf16[heads, hidden]. hidden,
  q_lora: the model's sizes, checked where given (else taken from the checkpoint's
  config.json where it has hidden_size / q_lora_rank, else from the tensors, each layer
  then agreeing with its own wk). names: overrides of INDEXER_TENSORS (part -> name,
  "{layer}" the layer number).

  Reads only the indexer tensors of the asked layers (each shard opened once, tensors
  copied out of its memory map). Parts: wq_b, wk, weights_proj, gate bf16[rows, cols]
  or F8_E4M3 with a "<name>_scale_inv" f32[ceil(rows / 128), ceil(cols / 128)] block
  scale (dequantised to bf16 here: bf16(f32(w) * scale)); norm_weight, norm_bias
  f32[128] and ape f32[4, 128] (bf16 widened). Raises, naming the layer and the tensor,
  where a tensor is missing (ValueError), has another shape (ValueError), dtype
  (TypeError) or head count than config.heads (ValueError); where a shard file is
  missing (FileNotFoundError) or the index JSON is malformed (ValueError).
  """
  _safetensors()               # a missing dependency first, before any file is looked at
  config = IndexerConfig() if config is None else config
  if not isinstance(config, IndexerConfig):
    raise TypeError(f"glm5_jax.{OP}: config must be a glm5_jax.IndexerConfig, "
                    f"got {type(config).__name__}")
  unknown = set(names or ()) - set(INDEXER_TENSORS)
  if unknown:
    raise ValueError(f"glm5_jax.{OP}: names has unknown parts {sorted(unknown)}; the parts "
                     f"are {list(INDEXER_TENSORS)}")
  names = {**INDEXER_TENSORS, **(names or {})}
  ckpt = Checkpoint(path)
  # Where config.json gave hidden or q_lora, the shape errors say so.
  notes = {}
  for key, arg, given in (("hidden_size", "hidden", hidden), ("q_lora_rank", "q_lora", q_lora)):
    if given is None and key in ckpt.config_json:
      notes[arg] = f" ({arg} = {ckpt.config_json[key]}, {CONFIG_FILE}'s {key})"
  hidden, q_lora = _check_config_json(ckpt, config, hidden, q_lora)
  one = isinstance(layers, (int, np.integer))
  if layers is None:
    layers = ckpt.layers(names)
  layers = [int(layers)] if one else [int(layer) for layer in layers]
  wanted = {}
  for layer in layers:
    for part, template in names.items():
      name = template.format(layer=layer)
      if name not in ckpt.weight_map:
        _fail(layer, part, name, f"is missing from the checkpoint {path}")
      wanted[name] = (layer, part)
  # The scales of the fp8 matrices: read with the tensors where the checkpoint has them.
  scale_names = {name + SCALE_SUFFIX: where for name, where in wanted.items()
                 if where[1] in MATRICES and name + SCALE_SUFFIX in ckpt.weight_map}
  # Every dtype and shape checked from the headers before any tensor is read.
  headers = ckpt.headers({**wanted, **scale_names})
  for layer in layers:
    layer_names = {part: template.format(layer=layer) for part, template in names.items()}
    # hidden and q_lora: the caller's (or config.json's), else this layer's wk's and wq_b's.
    wk, wq_b = headers[layer_names["wk"]][1], headers[layer_names["wq_b"]][1]
    layer_hidden, layer_q_lora = hidden, q_lora
    inferred = {part: notes["hidden"] for part in ("wk", "weights_proj", "gate")
                if "hidden" in notes}
    if "q_lora" in notes:
      inferred["wq_b"] = notes["q_lora"]
    if hidden is None and len(wk) == 2:
      layer_hidden = wk[1]
      note = f" (hidden = {layer_hidden}, the width of this layer's wk)"
      inferred.update(weights_proj=note, gate=note)
    if q_lora is None and len(wq_b) == 2:
      layer_q_lora = wq_b[1]
    expected = _expected(config, layer_hidden, layer_q_lora)
    for part, name in layer_names.items():
      _check(layer, part, name, headers[name], expected[part], config, inferred.get(part, ""))
      if headers[name][0] == F8:
        _check_scale(layer, part, name, headers[name], headers)
  tensors = ckpt.read({**wanted, **scale_names}, {n: h[0] for n, h in headers.items()})
  out = []
  for layer in layers:
    parts = []
    for part in INDEXER_TENSORS:
      name = names[part].format(layer=layer)
      fp8 = headers[name][0] == F8
      parts.append(dequantize(tensors[name], tensors[name + SCALE_SUFFIX]) if fp8
                   else tensors[name])
    out.append(prepare_weights(*parts))
  return out[0] if one else out
