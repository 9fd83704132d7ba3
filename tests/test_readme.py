"""The README's usage snippet runs as written."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def snippets():
  return re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(),
                    re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_usage_snippet_runs():
  """In a fresh interpreter (nothing of the test process leaks in), from the repository
  root as a reader would; it prints one line per decode step."""
  code = "\n".join(snippets())      # the serving snippet continues the first one
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
