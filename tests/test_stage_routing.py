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
import sys

import pytest

from glm5_jax import IndexerConfig, Routing
from glm5_jax.info import stage_args, stage_lowering

GOLDEN = pathlib.Path(__file__).parent / "golden" / "stage_lowering.json"
ROWS = (1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 256)
# 131,076 tokens: a pool past one CTA's top-k row; 1,048,580: one past the cluster's (chunks).
CONTEXTS = (1024, 8192, 32768, 131072, 131076, 202752, 1048576, 1048580)


def case_name(rows, next_n, context, **config):
  """The record's key of a case (tests/test_stage_gpu.py looks its targets up by it)."""
  return f"M{rows}-n{next_n}-ctx{context}" + "".join(f"-{k}={v}" for k, v in config.items())


def _case(rows, next_n, context, **config):
  return (case_name(rows, next_n, context, **config),
          dict(rows=rows, next_n=next_n, context=context, config=config))


def _grid():
  """The default config at every rows x next_n x context; each non-default option (scale
  format, fused, update path, w_out dtype, 64 heads, every kernel, PDL off) at rows that
  cross each routing boundary."""
  cases = [_case(m, n, c) for m, n, c in itertools.product(ROWS, (1, 2, 3, 4), CONTEXTS)
           if m % n == 0]
  options = ({"scale_format": "ue8m0"}, {"fused": True}, {"update": "ops"},
             {"update": "fused"}, {"w_out_dtype": "bfloat16"}, {"heads": 64},
             {"kernels": True}, {"kernels": False}, {"pdl": False})
  for option, m in itertools.product(options, (1, 2, 16, 17, 64, 65, 128, 129, 256)):
    cases += [_case(m, 1, c, **option) for c in (8192, 1048580)]
  cases += [_case(m, 4, 32768, **o) for o in options[:4] for m in (16, 64, 128)]
  return dict(cases)


GRID = _grid()


def lowering(rows, next_n, context, config):
  """glm5_jax.info.stage_lowering at these shapes (info.stage_args: GLM-5.3-Flash's hidden
  and q_lora, 64-entry pages): {"calls": [[target, {attribute: value}]], "sort": n,
  "dot_general": n}."""
  config = dict(config)
  routing = Routing(kernels=config.pop("kernels", None), pdl=config.pop("pdl", True))
  cfg = IndexerConfig(max_pools=context // 4, routing=routing, **config)
  return stage_lowering(cfg, stage_args(rows, next_n, context, cfg))


@pytest.fixture(scope="module")
def golden():
  return json.loads(GOLDEN.read_text())


def test_grid_is_the_golden_grid(golden):
  """Every case is pinned, and the record holds no case the grid lost."""
  assert sorted(golden) == sorted(GRID)


@pytest.mark.parametrize("case", sorted(GRID))
def test_stage_lowering_is_pinned(case, golden):
  assert lowering(**GRID[case]) == golden[case]


@pytest.mark.parametrize("case", sorted(GRID))
def test_kernels_leave_no_xla_sort(case, golden):
  """Wherever the stage runs its kernels (every case but kernels=False) no top-k is XLA code:
  every context up to 1M tokens selects with the kernels (plan.topk_chunks past the top-k
  kernel's width). The kernels=False cases are the control: the reference's top-k is XLA's
  sort there, and no glm5_ call runs, so a sort is what the record would show."""
  if "kernels=False" in case:
    assert golden[case]["sort"] > 0 and golden[case]["calls"] == []
  else:
    assert golden[case]["sort"] == 0
    assert any(target in ("glm5_expand_and_remap", "glm5_select_slots",
                          "glm5_indexer_update_select") for target, _ in golden[case]["calls"])


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
