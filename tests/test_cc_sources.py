"""The CUDA sources in cc/: their limits generated from glm5_jax/limits.py, files a reader can
take in, comments without measurement history. CPU only: text, no build."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_jax import limits

ROOT = Path(__file__).resolve().parents[1]
CC = ROOT / "cc"
HEADER = CC / "limits.h"
SOURCES = sorted(p for p in CC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cc"))
# Product code says why, not what was measured when: no session numbers, dates, H200
# anecdotes or µs figures (the figures live in BENCHMARKS.json and docs/).
HISTORY = re.compile(r"session|twenty|H200|[0-9]+(\.[0-9]+)? ?µs", re.IGNORECASE)


# The SPEC's sizes, which the header carries from glm5_jax.reference.numerics.
SPEC_SIZES = ("DIM", "POOL")


def _limit_names():
  return [name for name in vars(limits)
          if name.isupper() and not name.startswith("_") and name != "COMMAND"]


def test_limits_header_is_generated():
  """cc/limits.h is, byte for byte, what glm5_jax/limits.py generates."""
  assert HEADER.read_bytes() == limits.header().encode(), (
      f"cc/limits.h differs from glm5_jax/limits.py: regenerate it with `{limits.COMMAND}`")


def test_limits_header_script_checks(tmp_path):
  """scripts/limits_header.py --check agrees that the checked-in header is current."""
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  done = subprocess.run([sys.executable, str(ROOT / "scripts" / "limits_header.py"), "--check"],
                        capture_output=True, text=True, env=env, cwd=tmp_path)
  assert done.returncode == 0 and "up to date" in done.stdout, done.stdout + done.stderr


def test_limits_header_follows_the_declaration(monkeypatch):
  """A changed limit changes the header (the comparison above can fail), and every limit,
  tactic and array element is in it under its C++ name."""
  text = limits.header()
  assert text.startswith(f"// Generated from glm5_jax/limits.py by `{limits.COMMAND}`")
  for line in ("inline constexpr int kTopkMaxPools = 262144;  // TOPK_MAX_POOLS",
               "inline constexpr int kLogitsHeads[] = {32, 64};  // LOGITS_HEADS",
               "inline constexpr int kQMma = 0;  // Q_TACTICS[0]",
               "inline constexpr int kQWgmma = 1;  // Q_TACTICS[1]",
               "inline constexpr int kWgmmaSplit = -1;  // WGMMA_SPLIT",
               "inline constexpr int kMaxStages = 1048576;  // MAX_STAGES",
               "inline constexpr int kDim = 128;  // DIM"):
    assert line in text.splitlines()
  declared = re.findall(r"  // ([A-Z_0-9]+)", text)
  assert sorted(set(declared)) == sorted(_limit_names())
  monkeypatch.setattr(limits, "TOPK_MAX_POOLS", 16384)
  changed = limits.header()
  assert changed != HEADER.read_text()
  assert "inline constexpr int kTopkMaxPools = 16384;  // TOPK_MAX_POOLS" in changed


def test_limits_declared_once_in_python():
  """No module of the op layer assigns a limit's name but glm5_jax/limits.py (the op modules
  import them)."""
  from glm5_jax.reference import numerics
  assert all(getattr(limits, n) is getattr(numerics, n) for n in SPEC_SIZES)
  names = "|".join(n for n in _limit_names() if n not in SPEC_SIZES)
  assignment = re.compile(rf"^(?:\w+, )*({names})(?:, \w+)* *=[^=]", re.MULTILINE)
  modules = [p for p in sorted((ROOT / "glm5_jax").rglob("*.py"))
             if p.name != "limits.py"]
  found = [(p.name, m.group(1)) for p in modules for m in assignment.finditer(p.read_text())]
  assert found == []
  from glm5_jax import expand, indexer, logits, update
  assert (indexer.TILE_ROWS, indexer.Q_TACTICS, logits.TOPK_MAX_POOLS, logits.LOGITS_HEADS,
          update.RAW_HEADS_MULTIPLE, expand.REMAP_GROUPS) == (
              limits.TILE_ROWS, limits.Q_TACTICS, limits.TOPK_MAX_POOLS, limits.LOGITS_HEADS,
              limits.RAW_HEADS_MULTIPLE, limits.REMAP_GROUPS)


@pytest.mark.parametrize("value", ["32768", "at most 8192", "1 << 20", "32 or 64"])
def test_cc_states_no_generated_limit_by_hand(value):
  """The select and remap handlers build their messages and checks from the generated
  constants: the limits' values appear in cc/ only in limits.h."""
  found = [p.name for p in SOURCES if p != HEADER and value in p.read_text()]
  assert found == []


def test_cc_files_under_800_lines():
  long = {p.name: n for p in SOURCES if (n := len(p.read_text().splitlines())) >= 800}
  assert long == {}


def test_cc_comments_carry_no_measurement_history():
  found = [f"{p.name}:{i}: {line.strip()}" for p in SOURCES
           for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
  assert found == []


def test_history_pattern_finds_what_it_must():
  """The pattern above matches each kind of history it bans (so its silence means something)."""
  for line in ("// twenty-sixth session", "// on the H200", "// 3.39 µs", "// 12µs"):
    assert HISTORY.search(line), line
  assert not HISTORY.search("// one warpgroup per CTA, 64 rows")
