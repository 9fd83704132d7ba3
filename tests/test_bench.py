"""bench/bench.py end to end at --cpu-smoke sizes (on the CPU backend): every row is
measured (no error rows), the variants it can run here are exact, and the report and
--render agree. The GPU numbers themselves come from the H200 runs, never from tests."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, env):
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, f"{cmd[2:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_bench_cpu_smoke(tmp_path):
  out, md = tmp_path / "b.json", tmp_path / "b.md"
  cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--quick", "--cpu-smoke",
         "--ops", "upcast_logits,expand_and_remap,indexer_projection_fused", "--cache-dir", "",
         "--out", str(out),
         "--md", str(md), "--plot", str(tmp_path / "b.png")]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  _run(cmd, env)
  rows = json.loads(out.read_text())
  assert {r["op"] for r in rows} == {"calibration", "upcast_logits", "expand_and_remap",
                                     "indexer_projection_fused"}
  assert all(r["device_us"] and r["device_us"] > 0 for r in rows), \
      [r for r in rows if not r["device_us"]]
  variants = {(r["op"], r["variant"]) for r in rows}
  assert {("upcast_logits", "pallas"),
          ("indexer_projection_fused", "reference, three dots")} <= variants
  # every variant but the three dots (another GEMM) gives the reference's bits
  assert all(r["exact"] for r in rows
             if r["op"] != "calibration" and r["variant"] != "reference, three dots")
  assert "empty Pallas call" in md.read_text()
  md2 = tmp_path / "again.md"
  _run([sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--render", str(out),
        "--md", str(md2), "--plot", str(tmp_path / "again.png")], env)
  assert md2.read_text().split("### ")[1:] == md.read_text().split("### ")[1:]
