"""The stage's CUDA lowering pinned over the shapes serving produces: for every case of
GRID, the glm5_ FFI calls of jax.export(indexer_stage, platforms=["cuda"]) in order, with
every attribute each is called with (tactics, limits, flags), and the XLA sorts and GEMMs
around them. The record is tests/golden/stage_lowering.json; a change of routing is a
change of that file, made on purpose with

    python tests/test_stage_routing.py --regen

and read in review (`git diff tests/golden`). Abstract arguments only: nothing is
allocated, any machine lowers every context."""
import itertools
import json
import pathlib
import re
import sys

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import export

from glm5_jax import (
  DecodeBatch,
  IndexerCache,
  IndexerConfig,
  IndexerWeights,
  Routing,
  indexer_stage,
)
from glm5_jax._primitive import Op

GOLDEN = pathlib.Path(__file__).parent / "golden" / "stage_lowering.json"
HIDDEN, Q_LORA, PAGE = 4096, 1536, 64          # GLM-5.3-Flash (SPEC §9), 64-entry pages
ROWS = (1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 256)
CONTEXTS = (1024, 8192, 32768, 131072, 131076, 202752)


def _case(rows, next_n, context, **config):
  name = f"M{rows}-n{next_n}-ctx{context}" + "".join(f"-{k}={v}" for k, v in config.items())
  return name, dict(rows=rows, next_n=next_n, context=context, config=config)


def _grid():
  """The default config at every rows x next_n x context; each non-default option (scale
  format, fused, update path, w_out dtype, 64 heads, every kernel, PDL off) at rows that
  cross each routing boundary."""
  cases = [_case(m, n, c) for m, n, c in itertools.product(ROWS, (1, 2, 3, 4), CONTEXTS)
           if m % n == 0]
  cases.append(_case(1, 1, 1048576))
  options = ({"scale_format": "ue8m0"}, {"fused": True}, {"update": "ops"},
             {"update": "fused"}, {"w_out_dtype": "bfloat16"}, {"heads": 64},
             {"kernels": True}, {"kernels": False}, {"pdl": False})
  for option, m in itertools.product(options, (1, 2, 16, 17, 64, 65, 128, 129, 256)):
    cases += [_case(m, 1, c, **option) for c in (8192, 131076)]
  cases += [_case(m, 4, 32768, **o) for o in options[:4] for m in (16, 64, 128)]
  return dict(cases)


GRID = _grid()


def _stage_args(rows, next_n, context, config):
  """Abstract (weights, cache, x, qr, batch) of `rows` rows of `next_n` tokens per request
  at `context` tokens of cache."""
  s, i32 = jax.ShapeDtypeStruct, np.int32
  bf16, f32 = jnp.bfloat16, np.float32
  requests, heads = rows // next_n, config.heads
  weights = IndexerWeights(s((heads * 128, Q_LORA), bf16), s((256 + heads, HIDDEN), bf16),
                           s((128,), f32), s((128,), f32), s((4, 128), f32))
  pages = -(-(context // 4 + 1) // PAGE)
  cache = IndexerCache(s((requests * pages + 2, PAGE, 132), np.uint8),
                       s((requests, 2, 8, 128), bf16))
  grid = s((requests, next_n), i32)
  batch = DecodeBatch(grid, grid, grid, s((rows,), i32), s((requests, pages), i32),
                      s((requests, -(-(context + next_n) // 128)), i32))
  return weights, cache, s((rows, HIDDEN), bf16), s((rows, Q_LORA), bf16), batch


def lowering(rows, next_n, context, config):
  """{"calls": [[target, {attribute: value}]], "sort": n, "dot_general": n} of the stage's
  CUDA lowering at these shapes."""
  config = dict(config)
  routing = Routing(kernels=config.pop("kernels", None), pdl=config.pop("pdl", True))
  cfg = IndexerConfig(max_pools=context // 4, routing=routing, **config)
  args = _stage_args(rows, next_n, context, cfg)
  checks = [export.DisabledSafetyCheck.custom_call(op.kernel) for op in Op.registry.values()
            if op.kernel]
  step = jax.jit(lambda *a: indexer_stage(*a, config=cfg))
  text = export.export(step, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
  calls = []
  for line in text.splitlines():
    call = re.search(r"stablehlo.custom_call @(glm5_\w+)\(.*?mhlo.backend_config = \{([^}]*)\}",
                     line)
    if call:
      attrs = dict(a.strip().split(" = ", 1) for a in call.group(2).split(",") if a.strip())
      calls.append([call.group(1), attrs])
  return {"calls": calls, "sort": text.count("stablehlo.sort"),
          "dot_general": text.count("stablehlo.dot_general")}


@pytest.fixture(scope="module")
def golden():
  return json.loads(GOLDEN.read_text())


def test_grid_is_the_golden_grid(golden):
  """Every case is pinned, and the record holds no case the grid lost."""
  assert sorted(golden) == sorted(GRID)


@pytest.mark.parametrize("case", sorted(GRID))
def test_stage_lowering_is_pinned(case, golden):
  assert lowering(**GRID[case]) == golden[case]


def test_pin_sees_a_changed_attribute(golden):
  """Negative control: a lowering with one attribute changed (the projection's split), or a
  call missing, is not the record."""
  got = lowering(**GRID["M64-n1-ctx8192"])
  changed = json.loads(json.dumps(got))
  changed["calls"][0][1]["split"] = "8 : i32"
  assert got == golden["M64-n1-ctx8192"] and changed != golden["M64-n1-ctx8192"]
  assert dict(got, calls=got["calls"][1:]) != golden["M64-n1-ctx8192"]


if __name__ == "__main__":
  if sys.argv[1:] != ["--regen"]:
    sys.exit("usage: python tests/test_stage_routing.py --regen")
  record = {case: lowering(**spec) for case, spec in sorted(GRID.items())}
  GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
  print(f"{len(record)} cases -> {GOLDEN}")
