"""Project tooling: one version source, the GPU capability guard of the kernels, the
profiling script that maps ncu's stall samples to source lines, the order conftest gives
pytest-xdist, the changes that wait for a GPU (gpu_runs/variants)."""
import glob
import importlib.util
import os
import re
import subprocess
import tomllib
import types
import warnings

import jax
import pytest

import glm5_jax
from glm5_jax import _ffi
from glm5_testing.sass import parse_listing as parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_has_one_source():
  """pyproject.toml reads the version from glm5_jax/__init__.py (no second copy)."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    meta = tomllib.load(f)
  assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
  source = meta["tool"]["scikit-build"]["metadata"]["version"]
  assert source["input"] == "glm5_jax/__init__.py"
  assert re.fullmatch(r"\d+\.\d+\.\d+\S*", glm5_jax.__version__)


def _devices(*caps):
  return lambda backend=None: [types.SimpleNamespace(compute_capability=c) for c in caps]


@pytest.mark.parametrize("caps", [("8.0",), ("9.0", "10.0"), ("12.0",)])
def test_kernels_refused_on_other_gpus(monkeypatch, caps):
  monkeypatch.setattr(jax, "devices", _devices(*caps))
  with pytest.warns(RuntimeWarning, match=r"need compute capability 9\.0.*reference"):
    assert not _ffi._supported_gpu.__wrapped__()


def test_kernels_accepted_on_hopper(monkeypatch):
  monkeypatch.setattr(jax, "devices", _devices("9.0", "9.0"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _ffi._supported_gpu.__wrapped__()


# Two cuobjdump -sass listings of one kernel built from two trees: nvcc names the anonymous
# namespace after the source path (…_9_q_gemm_cu_<hash>), so the names differ; the second
# listing's third instruction differs too.
_LISTING = """
\t\tFunction : _ZN4glm541_GLOBAL__N__{hash}_9_q_gemm_cu_{tail}2wg22indexer_q_wgmma_kernelILi64EEEv
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
                                                                           /* 0x000e2e0000002100 */
        /*0020*/              @!P0 BRA {target} ;                          /* 0x00000000001079c3 */
\t\tFunction : _ZN4glm57kernel_without_namespaceEv
        /*0000*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_sass_listing_parse_across_trees():
  """glm5_testing.sass (scripts/sass_diff.py, tests/test_sass.py): instructions
  without their encodings, kernels of anonymous namespaces named by their file whatever
  tree built them, so that only real changes differ; a name twice in a listing raises."""
  a = parse(_LISTING.format(hash="786699b8", tail="6f838c90", target="0x70"))
  b = parse(_LISTING.format(hash="0badf00d", tail="12345678", target="0x70"))
  c = parse(_LISTING.format(hash="0badf00d", tail="12345678", target="0x80"))
  assert a == b and a != c
  name = "_ZN4glm541_GLOBAL__N__q_gemm_cu_2wg22indexer_q_wgmma_kernelILi64EEEv"
  assert a == {name: ["LDC R1, c[0x0][0x28]", "S2R R0, SR_TID.X", "@!P0 BRA 0x70"],
               "_ZN4glm57kernel_without_namespaceEv": ["EXIT"]}
  with pytest.raises(ValueError, match="two functions named"):
    parse(_LISTING.format(hash="0badf00d", tail="12345678", target="0x70") * 2)


def _ncu_source(tmp_path):
  """(scripts/ncu_source.py as a module, a listing of kernel `kern`, its ncu source CSV)."""
  spec = importlib.util.spec_from_file_location(
      "ncu_source", os.path.join(ROOT, "scripts", "ncu_source.py"))
  ncu_source = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ncu_source)
  dis = tmp_path / "k.dis"
  dis.write_text("\n".join([
      ".text.other:",
      '\t//## File "/x/a.cuh", line 1',
      "        /*0000*/                   NOP ;",
      "//--------------------- .text.kern --------------------------",
      ".text.kern:",
      '\t//## File "/x/a.cuh", line 7',
      "        /*0000*/                   LDG.E R1, desc[UR4][R2.64] ;",
      "        /*0010*/                   STS [R3], R1 ;",
      '\t//## File "/x/b.cuh", line 9',
      "        /*0020*/                   BAR.SYNC 0x0 ;",
      "//--------------------- .text.next --------------------------",
      '\t//## File "/x/a.cuh", line 99',
      "        /*0030*/                   NOP ;"]))
  table = tmp_path / "k.csv"
  table.write_text("\n".join([
      '"Kernel Name","kern"',
      '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb",'
      '"stall_barrier","stall_long_sb (Not Issued)","Instructions Executed"',
      '"0x7f00","LDG","1","0","0","9","1,980"',
      '"0x7f10","STS","5","5","0","9","20"',
      '"0x7f20","BAR","3","0","3","9",""']))
  return ncu_source, str(dis), str(table)


def test_ncu_source_attributes_samples_to_lines(tmp_path):
  """scripts/ncu_source.py: an instruction's stall samples go to the source line the
  nvdisasm -g listing names before it (offsets from the kernel's first instruction), only
  the named kernel's lines count, and the CSV's stall columns split them by reason."""
  ncu_source, dis, table = _ncu_source(tmp_path)
  by_line, reasons = ncu_source.stalls_by_line(dis, "kern", table)
  assert by_line == {("a.cuh", 7): 6, ("b.cuh", 9): 3}
  assert reasons[("a.cuh", 7)] == {"long_sb": 5, "barrier": 0}
  assert reasons[("b.cuh", 9)] == {"long_sb": 0, "barrier": 3}


def test_ncu_source_counts_another_column(tmp_path):
  """--metric: any numeric column of the CSV per line instead of the stall samples (the
  instructions executed: where the instructions go), digits grouped by commas read whole,
  an empty cell as 0."""
  ncu_source, dis, table = _ncu_source(tmp_path)
  by_line, _ = ncu_source.stalls_by_line(dis, "kern", table, "Instructions Executed")
  assert by_line == {("a.cuh", 7): 2000, ("b.cuh", 9): 0}
  listing = ncu_source.instructions(dis, "kern", table, "Instructions Executed")
  assert [n for _, _, n, _ in listing] == [1980, 20, 0]


def test_ncu_source_sums_samples_between_offsets(tmp_path):
  """--split: the samples of each address range between the given offsets, by line (a
  wait inlined at several places is told apart by where it sits); --hot's listing keeps
  each instruction's offset, line and SASS text."""
  ncu_source, dis, table = _ncu_source(tmp_path)
  listing = ncu_source.instructions(dis, "kern", table)
  assert listing == [(0x0, ("a.cuh", 7), 1, "LDG"), (0x10, ("a.cuh", 7), 5, "STS"),
                     (0x20, ("b.cuh", 9), 3, "BAR")]
  (lo0, hi0, n0, lines0), (lo1, hi1, n1, lines1) = ncu_source.regions(listing, [0x10])
  assert (lo0, hi0, n0, dict(lines0)) == (0, 0x10, 1, {("a.cuh", 7): 1})
  assert (lo1, n1, dict(lines1)) == (0x10, 8, {("a.cuh", 7): 5, ("b.cuh", 9): 3})


@pytest.mark.parametrize("workers", [1, 3, 15])
def test_long_tests_past_the_first_wave_wait_behind_short_ones(workers):
  """conftest's order for pytest-xdist: the first `workers` long tests, as many short ones
  (queued behind them, one a worker), then the other long ones, the rest in collection
  order; nothing dropped or repeated."""
  import conftest

  def item(name, long):
    return types.SimpleNamespace(name=name, keywords={"long": True} if long else {})

  items = [item(f"s{i}", False) for i in range(20)] + [item(f"l{i}", True) for i in range(8)]
  config = types.SimpleNamespace(workerinput={"workercount": workers})
  if workers == 1:
    config = types.SimpleNamespace()          # no xdist: one worker
  conftest.pytest_collection_modifyitems(None, config, items)
  order = [i.name for i in items]
  longs, shorts = [f"l{i}" for i in range(8)], [f"s{i}" for i in range(20)]
  assert order == longs[:workers] + shorts[:workers] + longs[workers:] + shorts[workers:]
  assert sorted(order) == sorted(longs + shorts)
  if workers == 3:
    assert order[:11] == ["l0", "l1", "l2", "s0", "s1", "s2", "l3", "l4", "l5", "l6", "l7"]


VARIANTS = sorted(glob.glob(os.path.join(ROOT, "gpu_runs", "variants", "*.patch")))


@pytest.mark.parametrize("patch", VARIANTS, ids=os.path.basename)
def test_variant_patches_apply_and_say_how_to_run_them(patch):
  """A change waiting for a GPU (gpu_runs/variants.sh) still applies to this tree, so that a
  GPU session does not find it stale (variants.sh branch NAME refreshes one main has moved
  under), and says before its diff what it is for, how to run it and what to expect."""
  with open(patch) as f:
    text = f.read()
  note = text[:text.index("\ndiff --git ")]
  name = os.path.basename(patch)[: -len(".patch")]
  assert note.startswith(f"Variant {name}: ") and "\nRun" in note and "\nExpected: " in note
  run = subprocess.run(["git", "apply", "--check", patch], cwd=ROOT, capture_output=True,
                       text=True)
  assert run.returncode == 0, f"{name} no longer applies: {run.stderr}"
