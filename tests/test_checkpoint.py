"""glm5_jax.load_indexer_weights: a synthetic two-shard checkpoint loads into the same
IndexerWeights (and stage outputs) as prepare_weights on its arrays, fp8 block-quantised
tensors are dequantised, bad checkpoints are named, and one layer reads only its bytes."""
import ctypes
import json
import mmap
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import jax
import ml_dtypes
import pytest

# The README's install line brings safetensors (glm5_jax[checkpoint]): these tests always run.
import safetensors  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import glm5_jax
from glm5_jax import checkpoint, synthetic

CONFIG = glm5_jax.IndexerConfig(heads=4, max_pools=256)
DIMS = dict(hidden=256, q_lora=192)        # q_lora: a partial 128-column block for fp8
LAYERS = (3, 7, 11)                          # DSA layers are not numbered 0..n-1
PARTS = list(checkpoint.INDEXER_TENSORS)
STEP = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))


def name(part, layer):
  return checkpoint.INDEXER_TENSORS[part].format(layer=layer)


def write(path, **kw):
  kw = {"layers": LAYERS, **DIMS, **kw}
  return synthetic.write_checkpoint(path, np.random.default_rng(0), CONFIG, **kw)


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      x.dtype == y.dtype and x.shape == y.shape
      and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
      for x, y in zip(la, lb))


def stage_outputs(weights, use_reference):
  """The stage's outputs and updated cache for three requests (one of them completes a
  pool) on `weights`."""
  rng = np.random.default_rng(1)
  cache, pt, bt = synthetic.decode_cache(rng, 3, 600, page=16, spare_pages=2)
  batch = synthetic.decode_batch(np.array([[7], [300], [555]]), cache, pt, bt)
  x, qr = synthetic.inputs(rng, 3, **DIMS)
  return STEP(weights, cache, x, qr, batch, config=CONFIG, use_reference=use_reference)


def test_two_shards_load_bit_for_bit(tmp_path):
  tensors = write(tmp_path)
  index = json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())["weight_map"]
  # Both shards hold indexer tensors, and a layer straddles them.
  shards_of = {layer: {index[name(p, layer)] for p in PARTS} for layer in LAYERS}
  assert len(set().union(*shards_of.values())) == 2
  assert any(len(files) == 2 for files in shards_of.values())
  loaded = glm5_jax.load_indexer_weights(tmp_path, config=CONFIG)
  assert len(loaded) == len(LAYERS)
  for layer, got in zip(LAYERS, loaded):
    want = glm5_jax.prepare_weights(*(tensors[name(p, layer)] for p in PARTS))
    assert leaves_equal(got, want), layer
    for use_reference in (True, False):
      assert leaves_equal(stage_outputs(got, use_reference), stage_outputs(want, use_reference))
  # The layers differ (the comparison above can tell a layer from another).
  assert not leaves_equal(loaded[0], loaded[1])
  # One layer by number, a list of layers in the asked order, the index JSON as path.
  one = glm5_jax.load_indexer_weights(tmp_path, 7, CONFIG)
  assert isinstance(one, glm5_jax.IndexerWeights) and leaves_equal(one, loaded[1])
  two = glm5_jax.load_indexer_weights(tmp_path / checkpoint.INDEX_FILE, [11, 3], CONFIG)
  assert leaves_equal(two, [loaded[2], loaded[0]])


def test_single_file_and_names_override(tmp_path):
  tensors = write(tmp_path, shards=1)
  assert not (tmp_path / checkpoint.INDEX_FILE).exists()
  want = glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG)
  assert leaves_equal(want, glm5_jax.prepare_weights(*(tensors[name(p, 3)] for p in PARTS)))
  # Another checkpoint's names for the gate and the norm: renamed, loaded through `names`.
  renamed = {k.replace("index_kpool_compress_gate", "kpool_gate.weight")
              .replace("k_norm", "key_norm"): v for k, v in tensors.items()}
  other = tmp_path / "renamed"
  other.mkdir()
  save_file(renamed, other / checkpoint.SINGLE_FILE)
  names = {"gate": "model.layers.{layer}.self_attn.indexer.kpool_gate.weight",
           "norm_weight": "model.layers.{layer}.self_attn.indexer.key_norm.weight",
           "norm_bias": "model.layers.{layer}.self_attn.indexer.key_norm.bias"}
  assert leaves_equal(glm5_jax.load_indexer_weights(other, 3, CONFIG, names=names), want)
  with pytest.raises(ValueError, match=r"layer 3: model\.layers\.3\.self_attn\.indexer\."
                                       r"index_kpool_compress_gate \(gate\) is missing"):
    glm5_jax.load_indexer_weights(other, 3, CONFIG)


def block_dequantized(w_fp8, scale):
  """bf16(f32(w) * scale) block by block (the loader's dequantisation, written per block)."""
  out = np.empty(w_fp8.shape, ml_dtypes.bfloat16)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      rows, cols = slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128)
      out[rows, cols] = (w_fp8[rows, cols].astype(np.float32) * scale[i, j]).astype(out.dtype)
  return out


def test_fp8_block_quantised_tensors_are_dequantised(tmp_path):
  tensors = write(tmp_path, fp8=("wq_b", "wk"))
  for layer, got in zip(LAYERS, glm5_jax.load_indexer_weights(tmp_path, config=CONFIG)):
    parts = []
    for p in PARTS:
      t = tensors[name(p, layer)]
      if p in ("wq_b", "wk"):
        assert t.dtype == ml_dtypes.float8_e4m3fn
        scale = tensors[name(p, layer) + "_scale_inv"]
        assert scale.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        # The scales matter: blocks have their own, none of them 1.
        assert len(np.unique(scale)) > 1 and not np.any(scale == 1)
        t = block_dequantized(t, scale)
      parts.append(t)
    assert leaves_equal(got, glm5_jax.prepare_weights(*parts))
  # The dequantised weights are the bf16 ones within fp8 e4m3's rounding (3 mantissa bits).
  original = synthetic.layer_arrays(np.random.default_rng(0), CONFIG, **DIMS)
  first = glm5_jax.load_indexer_weights(tmp_path, LAYERS[0], CONFIG)
  wq_b, ref = np.asarray(first.wq_b, np.float32), np.asarray(original[0], np.float32)
  within = lambda w: np.all(np.abs(w - ref) <= 2.0 ** -4 * np.abs(ref) + 1e-3 * np.abs(ref).max())
  assert within(wq_b)
  assert np.abs(wq_b - ref).max() > 0         # quantised: not the bf16 weights themselves
  # The bound tells a missed scale: the fp8 values themselves are far off.
  assert not within(tensors[name("wq_b", LAYERS[0])].astype(np.float32))


def rewrite(path, tensors, config=True):
  """Writes `tensors` as one model.safetensors (and the synthetic config.json, where
  config) into `path`."""
  path.mkdir(exist_ok=True)
  save_file(tensors, path / checkpoint.SINGLE_FILE)
  if not config and (path / checkpoint.CONFIG_FILE).exists():
    (path / checkpoint.CONFIG_FILE).unlink()


def edited(tensors, layer, part, value=None, suffix=""):
  """`tensors` with layer's `part` (+ suffix) replaced by `value` (None: dropped)."""
  out = dict(tensors)
  key = name(part, layer) + suffix
  if value is None:
    del out[key]
  else:
    out[key] = value
  return out


def _bf16(shape):
  return np.ones(shape, ml_dtypes.bfloat16)


BAD = {
    # case: (edit of the bf16 checkpoint's tensors, error, message pattern)
    "missing": (lambda t: edited(t, 7, "wk"), ValueError,
                r"layer 7: model\.layers\.7\.self_attn\.indexer\.wk\.weight \(wk\) is missing"),
    "shape": (lambda t: edited(t, 7, "ape", np.zeros((3, 128), np.float32)), ValueError,
              r"layer 7: .*indexer\.index_kpool_compress_ape \(ape\) must have shape "
              r"\(4, 128\), got \(3, 128\)"),
    "hidden": (lambda t: edited(t, 7, "gate", _bf16((128, 255))), ValueError,
               r"layer 7: .*index_kpool_compress_gate \(gate\) must have shape \(128, 256\) "
               r"\(hidden = 256, the width of this layer's wk\), got \(128, 255\)"),
    "dtype": (lambda t: edited(t, 7, "wk", np.ones((128, 256), np.float32)), TypeError,
              r"layer 7: .*indexer\.wk\.weight \(wk\) must be BF16 \(or F8_E4M3 with a "
              r"_scale_inv scale\), got F32"),
    "vector dtype": (lambda t: edited(t, 7, "norm_bias", np.ones(128, np.float16)), TypeError,
                     r"layer 7: .*indexer\.k_norm\.bias \(norm_bias\) must be F32 \(or BF16\), "
                     r"got F16"),
    "heads": (lambda t: edited(t, 7, "weights_proj", _bf16((8, 256))), ValueError,
              r"layer 7: .*indexer\.weights_proj\.weight \(weights_proj\) has 8 heads "
              r"\(shape \(8, 256\)\), which disagrees with config\.heads = 4"),
    "fp8 without scale": (
        lambda t: edited(t, 7, "wk", np.zeros((128, 256), ml_dtypes.float8_e4m3fn)),
        ValueError, r"layer 7: .*indexer\.wk\.weight \(wk\) is F8_E4M3 but the checkpoint has "
                    r"no model\.layers\.7\.self_attn\.indexer\.wk\.weight_scale_inv"),
    "fp8 scale shape": (
        lambda t: edited(edited(t, 7, "wk", np.zeros((128, 256), ml_dtypes.float8_e4m3fn)),
                         7, "wk", np.ones((1, 1), np.float32), "_scale_inv"),
        ValueError, r"layer 7: .*indexer\.wk\.weight_scale_inv \(wk\) must have shape \(1, 2\) "
                    r"\(one scale per 128 x 128 block"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_names_layer_and_tensor(tmp_path, monkeypatch, case):
  edit, error, pattern = BAD[case]
  tensors = write(tmp_path / "good", shards=1)
  bad = tmp_path / "bad"
  # Without config.json: the tensors alone say what disagrees.
  rewrite(bad, edit(tensors), config=False)
  counting = CountingOpen(safetensors.safe_open)
  monkeypatch.setattr(safetensors, "safe_open", counting)
  with pytest.raises(error, match=pattern):
    glm5_jax.load_indexer_weights(bad, config=CONFIG)
  assert counting.read == {}          # found from the headers, before any tensor is read
  # The unedited tensors load (the edit is what the error is about).
  rewrite(tmp_path / "same", tensors, config=False)
  glm5_jax.load_indexer_weights(tmp_path / "same", config=CONFIG)


def test_config_disagreement(tmp_path):
  write(tmp_path)
  # The heads of the IndexerConfig, the sizes asked: against config.json.
  with pytest.raises(ValueError, match=r"config\.json gives index_n_heads = 4, which "
                                       r"disagrees with config\.heads = 8"):
    glm5_jax.load_indexer_weights(tmp_path, 3, glm5_jax.IndexerConfig(heads=8))
  with pytest.raises(ValueError, match=r"hidden_size = 256, which disagrees with hidden = 512"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG, hidden=512)
  # A config.json that disagrees with the tensors: the error says where the size came from.
  config_json = json.loads((tmp_path / checkpoint.CONFIG_FILE).read_text())
  (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps({**config_json, "hidden_size": 512}))
  with pytest.raises(ValueError, match=r"layer 3: .*indexer\.wk\.weight \(wk\) must have shape "
                                       r"\(128, 512\) \(hidden = 512, config\.json's "
                                       r"hidden_size\), got \(128, 256\)"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG)
  # Without config.json, against the tensors.
  (tmp_path / checkpoint.CONFIG_FILE).unlink()
  with pytest.raises(ValueError, match=r"layer 3: .*indexer\.wq_b\.weight \(wq_b\) has 4 heads "
                                       r"\(shape \(512, 192\)\), which disagrees with "
                                       r"config\.heads = 8"):
    glm5_jax.load_indexer_weights(tmp_path, 3, glm5_jax.IndexerConfig(heads=8))
  with pytest.raises(ValueError, match=r"layer 3: .*indexer\.wq_b\.weight \(wq_b\) must have "
                                       r"shape \(512, 256\), got \(512, 192\)"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG, q_lora=256)
  glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG, **DIMS)     # the right sizes load


def test_missing_shard_and_bad_index(tmp_path):
  write(tmp_path)
  index_path = tmp_path / checkpoint.INDEX_FILE
  index = json.loads(index_path.read_text())
  shard = index["weight_map"][name("wq_b", 11)]
  # A tensor the index puts in the wrong shard.
  moved = {**index["weight_map"], name("ape", 3): shard}
  index_path.write_text(json.dumps({"weight_map": moved}))
  other = index["weight_map"][name("ape", 3)]
  assert other != shard
  with pytest.raises(ValueError, match=rf"layer 3: .*index_kpool_compress_ape \(ape\) is "
                                       rf"missing from {shard}"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG)
  index_path.write_text(json.dumps(index))
  (tmp_path / shard).unlink()
  with pytest.raises(FileNotFoundError, match=rf"layer 11: .*indexer\.wq_b\.weight \(wq_b\) is "
                                              rf"in the shard {shard}.*which is not in"):
    glm5_jax.load_indexer_weights(tmp_path, 11, CONFIG)
  index_path.write_text('{"weight_map": {"a": ')
  with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG)
  index_path.write_text('{"weight_map": ["a"]}')
  with pytest.raises(ValueError, match=r"must hold a \"weight_map\" object"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG)
  index_path.unlink()
  with pytest.raises(FileNotFoundError, match=r"holds neither model\.safetensors\.index\.json "
                                              r"nor model\.safetensors"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG)
  with pytest.raises(ValueError, match=r"names has unknown parts \['wq'\]"):
    glm5_jax.load_indexer_weights(tmp_path, 3, CONFIG, names={"wq": "x"})


def test_without_safetensors():
  """The package imports without safetensors; the loader then names the extra."""
  code = ("import sys; sys.modules['safetensors'] = None; import glm5_jax\n"
          "try:\n  glm5_jax.load_indexer_weights('.', 0)\n"
          "except ImportError as e:\n  print(e)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout
  assert "glm5_jax.load_indexer_weights needs the safetensors package" in out
  assert "pip install 'glm5_jax[checkpoint]'" in out


class CountingOpen:
  """safetensors.safe_open, counting the bytes and names of the tensors read."""

  def __init__(self, real):
    self.real, self.read = real, {}

  def __call__(self, *args, **kwargs):
    counter = self

    class Handle:
      def __init__(self):
        self.handle = counter.real(*args, **kwargs)

      def __enter__(self):
        self.handle.__enter__()
        return self

      def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

      def __getattr__(self, attr):
        return getattr(self.handle, attr)

      def get_tensor(self, key):
        t = self.handle.get_tensor(key)
        counter.read[key] = counter.read.get(key, 0) + t.nbytes
        return t
    return Handle()


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident(path):
  """bool[pages] of `path`: whether each page is in the page cache (mincore)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert LIBC.mincore(addr, size, vec) == 0, ctypes.get_errno()
    LIBC.munmap(addr, size)
  finally:
    os.close(fd)
  return np.frombuffer(vec.raw, np.uint8) & 1 == 1


def evict(path):
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def byte_ranges(path):
  """{name: (begin, end)} of each tensor's bytes in the safetensors file `path`."""
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
  return {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
          for k, v in header.items() if k != "__metadata__"}


def test_one_layer_reads_only_its_bytes(tmp_path, monkeypatch):
  """One layer of a many-layer checkpoint: the loader asks safetensors for that layer's
  indexer tensors only (counted), and the pages of the files brought into memory hold
  none of another layer's indexer tensors (the page cache, emptied first: mincore)."""
  layers = range(6)
  # Each layer's indexer (~0.9 MB) then 16 MB of the model's other weights: more than
  # the kernel's read-ahead around a page fault.
  tensors = write(tmp_path, layers=layers, hidden=1024, q_lora=512, other_bytes=16 << 20)
  config = CONFIG
  counting = CountingOpen(safetensors.safe_open)
  monkeypatch.setattr(safetensors, "safe_open", counting)
  layer = 4
  mine = {name(p, layer) for p in PARTS}
  wanted = sum(tensors[n].nbytes for n in mine)
  # The other layers' indexer matrices (their f32 vectors, a few hundred bytes each, share
  # the file's pages with this layer's: safetensors stores the f32 tensors together).
  others = {name(p, i) for i in layers if i != layer for p in checkpoint.MATRICES}
  files = sorted(tmp_path.glob("*.safetensors"))
  ranges = {f: byte_ranges(f) for f in files}
  for f in files:
    evict(f)
  evictable = not any(resident(f).any() for f in files)
  glm5_jax.load_indexer_weights(tmp_path, layer, config, hidden=1024, q_lora=512)
  assert counting.read == {n: tensors[n].nbytes for n in mine}
  if evictable:
    read = 0
    for f in files:
      pages = resident(f)
      read += int(pages.sum()) * mmap.PAGESIZE
      for n, (begin, end) in ranges[f].items():
        on_pages = pages[begin // mmap.PAGESIZE:-(-end // mmap.PAGESIZE)]
        if n in mine:
          assert on_pages.all(), n
        elif n in others:
          assert not on_pages.any(), f"{n}: a page of another layer's indexer was read"
    # The layer's bytes, the headers and the pages the kernel reads ahead: far from all.
    total = sum(t.nbytes for t in tensors.values())
    assert wanted <= read < total / 3
  # The control: every layer reads every layer's indexer tensors (the counter and the
  # page cache see them).
  counting.read.clear()
  for f in files:
    evict(f)
  glm5_jax.load_indexer_weights(tmp_path, config=config)
  everyone = {name(p, i) for i in layers for p in PARTS}
  assert counting.read == {n: tensors[n].nbytes for n in everyone}
  # Where the page cache cannot be emptied (posix_fadvise DONTNEED refused by the
  # filesystem), the counted reads are the whole check; the pages are measured elsewhere.
  if evictable:
    for f in files:
      pages = resident(f)
      for n, (begin, end) in ranges[f].items():
        if n in everyone:
          assert pages[begin // mmap.PAGESIZE:-(-end // mmap.PAGESIZE)].all(), n


def test_indexer_sizes(tmp_path):
  write(tmp_path)
  want = {"layers": list(LAYERS), "heads": CONFIG.heads, **DIMS}
  assert checkpoint.indexer_sizes(tmp_path) == want
  (tmp_path / checkpoint.CONFIG_FILE).unlink()          # from the tensors' shapes
  assert checkpoint.indexer_sizes(tmp_path) == want


@pytest.mark.slow
def test_decode_loop_demo_on_a_checkpoint(tmp_path):
  """`examples/decode_loop.py --checkpoint DIR`, small: the first layer of a synthetic
  fp8 checkpoint (GLM-5.3-Flash's 32 heads, reduced hidden and q_lora) runs and its check
  against the reference passes."""
  synthetic.write_checkpoint(tmp_path, np.random.default_rng(0), glm5_jax.IndexerConfig(),
                             layers=(3, 7), hidden=512, q_lora=256, fp8=("wq_b", "wk"))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "examples/decode_loop.py", "--checkpoint",
                         str(tmp_path), "--layers", "1", "--contexts", "30,2100", "--steps", "3"],
                        cwd=root, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=root))
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert (f"weights: layers [3] of the checkpoint {tmp_path} (hidden 512, q_lora 256, 32 heads)"
          in done.stdout)
  assert "check:" in done.stdout and done.stdout.rstrip().endswith("ok")


def test_docs_snippet_runs(tmp_path):
  """docs/serving.md's "Loading real weights" snippet, on a synthetic checkpoint."""
  text = (pathlib.Path(__file__).parent.parent / "docs" / "serving.md").read_text()
  section = text[text.index("Loading real weights\n"):]
  code = re.search(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE).group(1)
  placeholder = 'path = "/models/GLM-5.3-Flash"'
  assert placeholder in code
  write(tmp_path)
  scope = {}
  exec(code.replace(placeholder, f"path = {str(tmp_path)!r}"), scope)
  assert scope["sizes"] == {"layers": list(LAYERS), "heads": CONFIG.heads, **DIMS}
  assert len(scope["weights"]) == len(LAYERS)
  assert leaves_equal(scope["weights"], glm5_jax.load_indexer_weights(tmp_path, config=CONFIG))
