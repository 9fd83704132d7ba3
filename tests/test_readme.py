"""The README: its snippets run as written (with docs/serving.md's, which continue them),
its generated tables match the op registry and BENCHMARKS.json, it stays short, and CI
runs its two commands."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import readme_ops  # noqa: E402

README = (ROOT / "README.md").read_text()


def snippets(path, until=None):
  """The ```python blocks of `path` (those before the heading `until`, where given)."""
  text = (ROOT / path).read_text()
  text = text if until is None else text[:text.index(until)]
  return re.findall(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)


def commands_of_readme():
  """The README's indented shell commands that start with `python`, in order."""
  return re.findall(r"^    (python .*)$", README, re.MULTILINE)


@pytest.mark.slow
def test_usage_snippets_run():
  """In a fresh interpreter (nothing of the test process leaks in), from the repository
  root as a reader would: the README's decode snippet, then docs/serving.md's serving
  snippets, which continue it; each prints one line per decode step."""
  code = "\n".join(snippets("README.md") + snippets("docs/serving.md", until="## 7. "))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-4000:]
  steps = re.findall(r"^step (\d+): selected tokens \[\s*(\d+)\s+(\d+)\]", run.stdout, re.M)
  # request 0 (300 tokens) selects all of them; request 1 (2500) 2048 + its tail pool.
  assert steps == [("0", "301", "2049"), ("1", "302", "2050"), ("2", "303", "2051")], run.stdout
  assert re.search(r"^packed step: selected tokens \[\s*304\s+2048\]", run.stdout, re.M), run.stdout
  advanced = re.findall(r"^advanced step: selected tokens \[\s*(\d+)\s+(\d+)\]", run.stdout,
                        re.M)
  # positions 304 and 2504, then 305 and 2505: 2503 completed a pool, the tail restarts
  assert advanced == [("305", "2049"), ("306", "2050")], run.stdout


def test_generated_tables_in_sync():
  """The op table is the registry's and the stage table BENCHMARKS.json's."""
  assert readme_ops.synced(README) == README, (
      f"README.md's generated tables are out of sync: run `{readme_ops.COMMAND}`")


def test_op_table_lists_every_op_and_no_figures():
  table = readme_ops.op_table()
  names = [re.match(r"\| `(\w+)` \|", row).group(1) for row in table[2:]]
  assert names == list(readme_ops.Op.registry)
  assert not [row for row in table if re.search(r"µs|\d+(\.\d+)?x\b|H[12]00", row)]


def test_sync_check_catches_a_stale_table():
  """The check is not vacuous: a README whose op table lost a row reads out of sync."""
  row = next(line for line in README.splitlines() if line.startswith("| `pool_topk` |"))
  stale = README.replace(row + "\n", "")
  assert stale != README and readme_ops.synced(stale) == README


def test_readme_is_short():
  assert len(README.splitlines()) <= 200


def test_ci_runs_the_readme_commands():
  """Each command of .ci/run's "README" steps is in the README as written (CI's build-dir
  option aside): CI runs what a reader runs."""
  steps, title = {}, None
  for line in (ROOT / ".ci" / "run").read_text().splitlines():
    if m := re.match(r'echo "== (.*)"$', line):
      title = m.group(1)
    elif title and line.strip() and not line.startswith("#"):
      steps.setdefault(title, []).append(line.replace(' "${build[@]}"', ""))
  commands = [c for title, lines in steps.items() if title.startswith("README") for c in lines]
  assert any("pytest" in c for c in commands) and any("pip install" in c for c in commands)
  readme = (ROOT / "README.md").read_text()
  for command in commands:
    assert command in readme, command
  install, tests = commands_of_readme()
  assert tests == 'python -m pytest -q -n 2 -m "not slow"' and tests in commands
  assert "pytest-xdist" in install and install in commands
