"""`python -m bench` end to end at --cpu-smoke sizes (on the CPU backend): every row is
measured (no error rows), the variants it can run here are exact, and the report and
--render agree. The GPU numbers themselves come from the H200 runs, never from tests."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, env):
  done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, f"{cmd[2:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_bench_cpu_smoke(tmp_path):
  out, md = tmp_path / "b.json", tmp_path / "b.md"
  cmd = [sys.executable, "-m", "bench", "--quick", "--cpu-smoke",
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
  # every op row comes from an unrolled chain of >= R calls (no device loop)
  assert all(r["calls"] >= r["R"] >= 1 for r in rows if r["op"] != "calibration"), rows
  variants = {(r["op"], r["variant"]) for r in rows}
  assert {("upcast_logits", "pallas"),
          ("indexer_projection_fused", "reference, three dots")} <= variants
  # every variant but the three dots (another GEMM) gives the reference's bits
  assert all(r["exact"] for r in rows
             if r["op"] != "calibration" and r["variant"] != "reference, three dots")
  assert "empty Pallas call" in md.read_text()
  md2 = tmp_path / "again.md"
  _run([sys.executable, "-m", "bench", "--render", str(out),
        "--md", str(md2), "--plot", str(tmp_path / "again.png")], env)
  assert md2.read_text().split("### ")[1:] == md.read_text().split("### ")[1:]


def test_time_step_threads_state():
  """harness.time_step times a whole jitted step (state donated and threaded from run
  to run) and divides by its units: the timer the stage groups use."""
  import jax.numpy as jnp

  from bench.harness import time_step
  from bench.sizes import sizes_for

  sizes = sizes_for(True, True)
  step = lambda state, k, xs: (state + xs[k], (state.sum(),))
  xs = [jnp.ones(1024), 2 * jnp.ones(1024)]
  sec, state, info = time_step(step, jnp.zeros(1024), (xs,), sizes, units=11, steps=2)
  runs = 1 + sizes.warmup + sizes.reps
  assert float(state[0]) == 3 * runs
  assert 0 < sec * 22 <= info["run_us"] * 1e-6 * 1.0001 and info["dispatch_us"] > 0


@pytest.mark.slow
def test_stage_update_only_step_is_the_stages_update_part():
  """bench.stage's "update part only" step: every layer's caches and w_out exactly as
  the whole stage leaves and returns them (the selection left out), on two layers."""
  import numpy as np
  import jax
  import jax.numpy as jnp

  import glm5_jax
  from bench import stage

  config = stage._config(1024, glm5_jax.Routing())
  weights, caches, xs, qrs, batch = stage._state(2, 1024, 2, seed=3)
  copy = lambda: [jax.tree.map(jnp.copy, c) for c in caches]  # noqa: E731
  got_caches, got = jax.jit(stage._step(config, update_only=True, consume=False),
                            static_argnums=1)(copy(), 1, weights, xs, qrs, batch)
  _, scalar = jax.jit(stage._step(config, update_only=True), static_argnums=1)(
      copy(), 1, weights, xs, qrs, batch)
  # Chained layers (--stage-chained) read the last layer's output, times 0: the same bits.
  _, chained = jax.jit(stage._step(config, update_only=True, consume=False, chained=True),
                       static_argnums=1)(copy(), 1, weights, xs, qrs, batch)
  for g, c in zip(got, chained, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
  # --stage-chain-barrier: the order through one more optimization barrier a layer (the
  # stage has its own), no arithmetic.
  def barriers(**chain):
    step = jax.jit(stage._step(config, update_only=True, consume=False, **chain),
                   static_argnums=1)
    return step, step.lower(copy(), 1, weights, xs, qrs, batch).as_text().count(
        "stablehlo.optimization_barrier")
  barrier, count = barriers(chained=True, barrier=True)
  assert count - barriers(chained=True)[1] == len(weights)
  for g, c in zip(got, barrier(copy(), 1, weights, xs, qrs, batch)[1], strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
  firsts = []
  for layer, (w, c) in enumerate(zip(weights, copy())):
    out, c = glm5_jax.indexer_stage(w, c, xs[1][layer], qrs[1][layer], batch, config=config)
    np.testing.assert_array_equal(np.asarray(got[layer]), np.asarray(out.w_out))
    for g, want in zip(jax.tree.leaves(got_caches[layer]), jax.tree.leaves(c)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
    firsts.append(float(np.asarray(out.w_out, np.float32).reshape(-1)[0]))
  # The timed step returns one scalar that reads every layer's output (stage.consumed).
  assert float(scalar) == np.float32(firsts[0]) + np.float32(firsts[1]) != 0


@pytest.mark.slow
def test_bench_prefill_group_cpu_smoke(tmp_path):
  """`python -m bench --groups prefill --cpu-smoke`: a row per prompt and one for the
  mixed batch, each timed, with its floor from the bytes and FLOPs of one call."""
  out = tmp_path / "b.json"
  _run([sys.executable, "-m", "bench", "--groups", "prefill", "--cpu-smoke", "--cache-dir", "",
        "--out", str(out), "--md", str(tmp_path / "b.md"), "--plot", str(tmp_path / "b.png")],
       dict(os.environ, JAX_PLATFORMS="cpu"))
  rows = [r for r in json.loads(out.read_text()) if r["op"] == "prefill"]
  assert [r["shape"] for r in rows] == ["prompt=300", "prompt=1200", "prompt=300+1200"]
  assert all(r["device_us"] > 0 and r["floor_us"] > 0 and r["variant"] == "reference"
             for r in rows), rows
  from bench.prefill import prefill_bytes
  assert rows[2]["min_bytes"] == prefill_bytes((300, 1200), 4)
  assert "### prefill" in (tmp_path / "b.md").read_text()


def test_prefill_floor_bytes():
  """The prefill floor: weights once, x, 132 B per completed pool, 512 B per tail row
  of each request's last (up to 4) tokens."""
  from bench.prefill import prefill_bytes
  from bench.sizes import HIDDEN, W_ROWS
  weights = W_ROWS * HIDDEN * 2 + 2 * 128 * 4 + 4 * 128 * 4
  assert prefill_bytes((6,), 4) == weights + 6 * HIDDEN * 2 + 1 * 132 + 4 * 512
  assert prefill_bytes((2, 9), 4) == weights + 11 * HIDDEN * 2 + 2 * 132 + 6 * 512


def test_kernel_times_parses_a_subset_of_the_ops():
  """bench.kernel_times --parse reads ncu's CSV in launch order: with --ops pool_topk one
  kernel per shape; select_pools' two kernels are listed as two entries; a CSV whose
  kernel count does not match the ops run is refused."""
  from bench import kernel_times
  from bench.sizes import sizes_for
  sizes = sizes_for(False, True)
  labels = [label for _, label in kernel_times.calls(sizes, ("pool_topk",))]
  def csv(values):
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    return "==PROF== noise\n" + head + "".join(
        f'"{i}","k","gpu__time_duration.sum","nsecond","{v:,}"\n' for i, v in enumerate(values))
  table = kernel_times.parse(csv([1000 * (i + 1) for i in range(len(labels))]), sizes,
                             ("pool_topk",))
  assert table == {"pool_topk": {label: [float(i + 1)] for i, label in enumerate(labels)}}
  both = kernel_times.parse(csv([1500] * (3 * len(labels))), sizes, ("pool_topk", "select_pools"))
  assert all(v == [1.5, 1.5] for v in both["select_pools"].values())
  with pytest.raises(SystemExit, match="expected"):
    kernel_times.parse(csv([1000]), sizes, ("pool_topk",))


@pytest.mark.slow
def test_stage_chained_steps_read_the_step_before():
  """--stage-chained: the first layer's inputs read the last layer's tail ring as the step
  before left it (+ 0 * its first element), so no two steps' GEMMs are independent (XLA's
  GPU dot merger joined them). A NaN there reaches every layer's w_out (which reads only
  x and the weights) when chained, none when not: the dependency is in the compiled step,
  not folded away."""
  import dataclasses

  import numpy as np
  import jax
  import jax.numpy as jnp

  import glm5_jax
  from bench import stage

  config = stage._config(1024, glm5_jax.Routing())
  weights, caches, xs, qrs, batch = stage._state(2, 1024, 2, seed=3)
  last = caches[-1]
  caches[-1] = dataclasses.replace(last, tail=last.tail.at[0, 0, 0, 0].set(jnp.nan))
  for chained in (False, True):
    copy = [jax.tree.map(jnp.copy, c) for c in caches]
    _, outs = jax.jit(stage._step(config, update_only=True, consume=False, chained=chained),
                      static_argnums=1)(copy, 0, weights, xs, qrs, batch)
    assert [bool(np.isnan(np.asarray(o, np.float32)).all()) for o in outs] == [chained] * 2


def test_step_times_splits_sections_at_the_markers():
  """bench.step_times --parse: each section's launches lie between two marker kernels;
  per section the median of its runs' summed µs, per layer, and each kernel name's µs
  per step; what lies outside the sections (autotuning, warm-up) is dropped; a CSV
  whose marker count or launch count does not fit is refused."""
  from bench import step_times
  order = step_times.sections((1024,), (1, 16), ("kernel",))
  assert order == [("M=1,ctx=1024", "kernel"), ("M=16,ctx=1024", "kernel")]
  # MTP rows (--next-n) named as the stage group's rows are.
  assert step_times.sections((1024,), (16,), ("kernel",), next_n=4) == [
      ("M=16,next_n=4,ctx=1024", "kernel")]
  def csv(names_us):
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    return "==PROF== noise\n" + head + "".join(
        f'"{i}","{n}","gpu__time_duration.sum","nsecond","{v:,}"\n'
        for i, (n, v) in enumerate(names_us))
  mark = ("wrapped_cosine", 900)
  body = [("autotune", 5), mark, ("gemm", 2000), ("topk", 1000), ("gemm", 4000),
          ("topk", 1000), ("gemm", 3000), ("topk", 1000), mark, ("warmup", 7), mark,
          ("graph", 10000), ("graph", 12000), ("graph", 11000), mark]
  table = step_times.parse(csv(body), order, runs=3, layers=2)
  assert [(r["shape"], r["step_us"], r["layer_us"], r["launches"]) for r in table] == [
      ("M=1,ctx=1024", 4.0, 2.0, 2), ("M=16,ctx=1024", 11.0, 5.5, 1)]
  assert table[0]["kernels"] == {"gemm": 3.0, "topk": 1.0}
  with pytest.raises(SystemExit, match="markers"):
    step_times.parse(csv(body[:-1]), order, runs=3, layers=2)
  with pytest.raises(SystemExit, match="launches"):
    step_times.parse(csv(body), order, runs=2, layers=2)


def test_step_times_timeline_reads_spans_gaps_and_overlap():
  """bench.step_times --timeline: from a jax.profiler trace only the GPU's stream lines are
  read (not the host, not the device's derived XLA Ops line); per section the median step
  span, the time some kernel ran, the idle rest, and per kernel name µs a step and the gaps
  before it (negative where it started before the kernel before it ended: PDL)."""
  from bench import step_times
  order = step_times.sections((1024,), (1,), ("kernel", "kernel, q in epilogue"))
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
          dict(ph="M", pid=7, name="process_name", args=dict(name="/device:GPU:0 (NVIDIA)")),
          dict(ph="M", pid=7, tid=3, name="thread_name", args=dict(name="Stream #3(Compute)")),
          dict(ph="M", pid=7, tid=9, name="thread_name", args=dict(name="XLA Ops")),
          dict(ph="M", pid=1, tid=3, name="thread_name", args=dict(name="python"))]
  def k(name, ts, dur, tid=3, pid=7):
    return dict(ph="X", pid=pid, tid=tid, ts=ts, dur=dur, name=name)
  runs_a = [[("gemm", 0, 4), ("topk", 6, 2)], [("gemm", 0, 4), ("topk", 5, 2)],
            [("gemm", 0, 4), ("topk", 7, 2)]]           # spans 8, 7, 9; busy 6; idle 2
  runs_b = [[("q", 0, 5), ("epi", 4, 3)]] * 3            # overlapped by 1: span 7, busy 7
  events, t = [k("autotune", 0, 1), k("cosine_fusion", 10, 1)], 100
  for name, ts, dur in (r for run in runs_a for r in run):
    events.append(k(name, t + ts, dur))
    t += 10 if name == "topk" else 0
  events += [k("cosine_fusion", 500, 1), k("warmup", 600, 3), k("cosine_fusion", 700, 1)]
  t = 1000
  for run in runs_b:
    events += [k(name, t + ts, dur) for name, ts, dur in run]
    t += 10
  events += [k("cosine_fusion", 2000, 1), k("fusion.7", 100, 999, tid=9),
             k("python_call", 100, 999, pid=1)]
  trace = dict(traceEvents=meta + events[::-1])          # the parser orders them by start
  table = step_times.timeline(step_times.gpu_kernels(trace), order, runs=3, layers=2)
  a, b = table
  assert (a["step_us"], a["layer_us"], a["busy_us"], a["idle_us"], a["launches"]) == (
      8, 4, 6, 2, 2)
  assert a["kernels"] == {"gemm": [4, 0], "topk": [2, 2]}
  assert (b["step_us"], b["busy_us"], b["idle_us"]) == (7, 7, 0)
  assert b["kernels"] == {"q": [5, 0], "epi": [3, -1]}
  # Two decode steps a run: the same spans, gaps and kernels, per step.
  a2 = step_times.timeline(step_times.gpu_kernels(trace), order, runs=3, layers=2,
                           steps_per_run=2)[0]
  assert (a2["step_us"], a2["layer_us"], a2["busy_us"], a2["launches"]) == (4, 2, 3, 1)
  assert a2["kernels"] == {"gemm": [2, 0], "topk": [1, 1]}
  with pytest.raises(SystemExit, match="no GPU stream line"):
    step_times.gpu_kernels(dict(traceEvents=meta[:2] + events))


@pytest.mark.slow
def test_step_times_runs_the_sections_in_the_parsers_order():
  """bench.step_times runs every section (CPU smoke shapes) in the order its parser
  splits the CSV by (sections()): the sections' names come from that order alone."""
  from bench import step_times
  from bench.sizes import sizes_for
  timed = step_times.run(sizes_for(False, True), (1024,), (1, 2), step_times.VARIANTS,
                         runs=1, layers=2, steps_per_run=2)
  assert timed == step_times.sections((1024,), (1, 2), step_times.VARIANTS)
  assert len(timed) == 2 * len(step_times.VARIANTS)


@pytest.mark.slow
def test_skip_variants_apply_to_the_whole_step_groups(tmp_path):
  """--skip-variants names variants of every group: the stage and prefill groups build
  their variant lists through Bench.kept, as the per-op groups do (an H200 call ran
  the stage's reference compiles that it was told to skip). Both groups run the reference
  and, where the CUDA module is built, the kernels: skipping both leaves no row on either
  backend."""
  from bench import __main__ as cli
  from bench import prefill, stage
  from bench.driver import Bench
  from bench.sizes import sizes_for
  args = cli.parser().parse_args(["--skip-variants", "reference", "kernel", "kernel, PDL off",
                                  "--stage-contexts", "1024", "--stage-rows", "1",
                                  "--prefill-prompts", "300", "--cache-dir", "",
                                  "--out", str(tmp_path / "b.json")])
  bench = Bench(sizes_for(False, True), args)
  assert bench.kept(["kernel", "reference", "kernel, PDL off", "kernel, update part only"]) \
      == ["kernel, update part only"]
  stage.run(bench)
  prefill.run(bench)
  assert bench.rows == []


@pytest.mark.slow
def test_skip_variants_are_checked_names_and_may_drop_the_reference(tmp_path, capsys):
  """A name that is no variant is a command-line error, not a silently full run; every group
  takes --skip-variants reference (a focused kernel-vs-Triton run on the H200 spends no
  device time on the reference's compiles), and the op rows it leaves read unchecked
  (exact None), not exact."""
  from bench import __main__ as cli
  from bench import per_op
  from bench.driver import Bench
  from bench.sizes import sizes_for
  from bench.workloads import WORKLOADS
  with pytest.raises(SystemExit):
    cli.parser().parse_args(["--skip-variants", "kernels"])
  assert "invalid choice: 'kernels'" in capsys.readouterr().err
  # The kernel variants are skipped too, so that pallas is the one row on every backend
  # (on a GPU, triton's row would still be checked against the kernel's).
  args = cli.parser().parse_args(["--skip-variants", "reference", "kernel", "kernel, PDL off",
                                  "triton", "--cache-dir", "", "--out", str(tmp_path / "b.json")])
  bench = Bench(sizes_for(True, True), args, ["upcast_logits"])
  shape = WORKLOADS["upcast_logits"][1](bench.s)[0][0]
  per_op.run_op(bench, "upcast_logits", {shape})
  assert bench.variants("upcast_logits") == ["pallas"]
  assert [(r["shape"], r["variant"], r["exact"]) for r in bench.rows] == [
      (shape, "pallas", None)]
  assert bench.rows[0]["device_us"] > 0


def test_stage_select_ops_variant_routes_the_two_ops():
  """--stage-select-ops adds "kernel, select as two ops": its stage step lowers (CUDA) to
  select_pools + expand_and_remap where the default step calls select_slots' kernel once
  (inside indexer_update_select's call, plan.one_call)."""
  import re

  import jax
  from jax import export

  import glm5_jax
  from bench import __main__ as cli
  from bench import stage, step_times
  from bench.variants import KERNEL, SELECT_OPS, VARIANTS

  assert SELECT_OPS in VARIANTS and SELECT_OPS in step_times.VARIANTS
  assert cli.parser().parse_args(["--stage-select-ops"]).stage_select_ops
  weights, caches, xs, qrs, batch = stage._state(2, 1024, 1, seed=0)
  select = ("glm5_indexer_update_select", "glm5_select_slots", "glm5_select_pools",
            "glm5_expand_and_remap")
  calls = {}
  for variant in (KERNEL, SELECT_OPS):
    step = stage._step(stage._config(1024, stage.ROUTINGS[variant]))
    text = export.export(jax.jit(lambda c, *a, step=step: step(c, 0, *a)), platforms=["cuda"],
                         disabled_checks=glm5_jax.export_checks())(
        caches, weights, xs, qrs, batch).mlir_module()
    calls[variant] = [c for c in re.findall(r"custom_call @(glm5_\w+)", text) if c in select]
  assert calls == {KERNEL: ["glm5_indexer_update_select"],
                   SELECT_OPS: ["glm5_select_pools", "glm5_expand_and_remap"]}


def test_xla_option_values_are_typed_as_xla_takes_them():
  """--xla-option NAME=VALUE: XLA's option setter rejects "false" as a string (H200,
  jaxlib 0.11.2), so booleans and integers are converted; enum names stay strings."""
  from bench.__main__ import _option_value

  assert _option_value("false") is False and _option_value("True") is True
  assert _option_value("16") == 16 and isinstance(_option_value("16"), int)
  assert _option_value("SKIP_TEMP") == "SKIP_TEMP"


def test_host_note_marks_runs_whose_dispatch_passes_half_the_run():
  """One rule for the ops and the stage rows: a run whose host dispatch takes over half of
  it is an upper bound, and its row says so with both times."""
  from bench.harness import host_note
  assert host_note(dict(dispatch_us=500.0, run_us=1000.0)) is None
  assert host_note(dict(run_us=1000.0)) is None
  assert host_note(dict(dispatch_us=806.4, run_us=843.0)) == (
      "host-bound (dispatch 806 of 843 µs per run): an upper bound")


def test_max_sets_and_calls_bound_the_chains(capsys):
  """--max-sets / --max-calls cap R and N (the H200's 64-set, 1024-call chains of the
  projection were host-bound where 32-set, 256-call ones were not); they must be >= 1."""
  from bench import __main__ as cli
  p = cli.parser()
  args = p.parse_args(["--max-sets", "32", "--max-calls", "256", "--cpu-smoke"])
  sizes = cli.sizes_from(p, args)
  assert (sizes.r_max, sizes.max_calls) == (32, 256)
  default = cli.sizes_from(p, p.parse_args(["--cpu-smoke"]))
  assert (default.r_max, default.max_calls) != (32, 256)
  with pytest.raises(SystemExit):
    cli.sizes_from(p, p.parse_args(["--max-sets", "0"]))
  assert "--max-sets must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_q_times_each_tactic_that_tiles(tmp_path, monkeypatch):
  """--sweep-q: one indexer_q row per tactic of Q_TACTICS that tiles the model's wq_b, per
  shape, named "kernel <tactic>" (on the CPU the op runs its reference; the rows' names and
  their count are what is checked here)."""
  from bench import __main__ as cli
  from bench import sweep
  from bench.driver import Bench
  from glm5_jax.indexer import Q_TACTICS
  parser = cli.parser()
  args = parser.parse_args(["--sweep-q", "--rows", "1,3", "--quick", "--cpu-smoke",
                            "--cache-dir", "", "--out", str(tmp_path / "b.json")])
  bench = Bench(cli.sizes_from(parser, args), args)
  monkeypatch.setattr(bench, "has_kernel", lambda op: op == "indexer_q")
  sweep.run(bench)
  got = sorted((r["shape"], r["variant"]) for r in bench.rows)
  assert got == sorted((f"M={m}", f"kernel {t}") for m in (1, 3) for t in Q_TACTICS), got
  assert all(r["device_us"] and r["device_us"] > 0 for r in bench.rows), bench.rows


def test_select_sizes_and_mtp_stage_rows(tmp_path):
  """--select-pools / --select-rows set the select ops' shapes (widths past the top-k
  kernel's, up to 1M tokens' 262,144 pools), and --stage-next-n times M rows as M / N
  requests of N consecutive positions, the row labelled with its next_n."""
  from bench import __main__ as cli
  from bench import stage
  from bench.driver import Bench
  p = cli.parser()
  sizes = cli.sizes_from(p, p.parse_args(["--cpu-smoke", "--select-pools", "50688,262144",
                                          "--select-rows", "1,16"]))
  assert (sizes.select_pools, sizes.select_rows) == ((50688, 262144), (1, 16))
  args = p.parse_args(["--stage-contexts", "1024", "--stage-rows", "4", "--stage-next-n", "2",
                       "--skip-variants", "kernel", "--cache-dir", "",
                       "--out", str(tmp_path / "b.json")])
  bench = Bench(cli.sizes_from(p, p.parse_args(["--cpu-smoke"])), args)
  stage.run(bench)
  assert [(r["shape"], r["variant"]) for r in bench.rows] == [
      ("M=4,next_n=2,ctx=1024", "reference")]
  assert bench.rows[0]["device_us"] > 0
  _, _, _, _, batch = stage._state(4, 1024, 1, seed=0, steps=1, next_n=2)
  assert batch.positions.tolist() == [[1022, 1023], [1022, 1023]]
  assert batch.req_ids.tolist() == [0, 0, 1, 1]


def test_empty_plot_option_writes_no_plot(tmp_path, monkeypatch):
  """--plot '' (the device runs): the report names no plot and nothing is drawn, where a
  path was taken relative to the report before (ValueError after the whole measurement)."""
  import argparse

  from bench import report
  drawn = []
  monkeypatch.setattr(report, "plot", lambda rows, path: drawn.append(path))
  args = argparse.Namespace(plot="", md=str(tmp_path / "b.md"))
  assert report.plot_or_none([], args) is None and drawn == []
  args.plot = str(tmp_path / "b.png")
  assert report.plot_or_none([], args) == "b.png" and drawn == [args.plot]


@pytest.mark.parametrize("flags,envelope", [([], True), (["--stage-rows", "1"], False),
                                            (["--stage-contexts", "1024"], False),
                                            (["--stage-next-n", "2"], False)])
def test_stage_shapes_add_the_serving_envelope(flags, envelope):
  """The stage group's default run times the grid and the serving shapes past it
  (Sizes.stage_envelope: GLM-5's window at M 1/16/64, 1M tokens, MTP rows); a run narrowed
  by a shape flag times only what the flags name."""
  from bench import __main__ as cli
  from bench import stage
  from bench.driver import Bench
  from bench.sizes import sizes_for
  sizes = sizes_for(False, False)
  bench = Bench(sizes, cli.parser().parse_args(["--cache-dir", "", *flags]))
  got = dict(stage.stage_shapes(bench))
  extra = {"M=1,ctx=202752": (202752, 1, 1), "M=16,ctx=202752": (202752, 16, 1),
           "M=64,ctx=202752": (202752, 64, 1), "M=1,ctx=1048576": (1048576, 1, 1),
           "M=64,next_n=4,ctx=32768": (32768, 64, 4)}
  assert all(got.get(name) == args for name, args in extra.items()) is envelope
  if not flags:
    assert len(got) == len(sizes.stage_contexts) * len(sizes.stage_rows) + len(extra)


def test_stage_table_lists_mtp_rows_below_the_grid():
  """A stage row of next_n > 1 ("M=64,next_n=4,ctx=32768") is listed under the contexts x M
  grid as requests x next_n, not read as a context of the grid."""
  from bench.report import stage_table
  def row(shape, variant, us):
    return dict(op="stage", shape=shape, variant=variant, device_us=us, layers=11,
                notes="11 layers; layers and steps chained (each reads the output before it)")
  rows = [row("M=1,ctx=1024", "kernel", 15.0), row("M=1,ctx=1024", "reference", 60.0),
          row("M=64,next_n=4,ctx=32768", "kernel", 40.0),
          row("M=64,next_n=4,ctx=32768", "reference", 600.0)]
  lines = stage_table(rows)
  assert "| context | M=1 |" in lines
  assert [line for line in lines if line.startswith("| 1024 |")] == [
      "| 1024 | 15.00 / 60.00 (4.00×) |"]
  assert "| 16 x 4 (M=64) | 32768 | 40.00 / 600 (15.00×) |" in lines
  assert not any(line.startswith("| 4 |") or "next_n=4 |" in line for line in lines)


def test_stage_table_marks_rows_of_a_superseded_path():
  """A kernel row whose "superseded" field says the routing now takes another path at its
  shape is marked ‡ with that reason below the table; the others are not."""
  from bench.report import stage_table
  def row(shape, variant, us, **extra):
    return dict(op="stage", shape=shape, variant=variant, device_us=us, layers=11,
                notes="11 layers; layers and steps chained", **extra)
  why = "measured on the chunked top-k; the cluster runs these shapes now."
  rows = [row("M=1,ctx=1024", "kernel", 15.0), row("M=1,ctx=1024", "reference", 60.0),
          row("M=1,ctx=202752", "kernel", 35.0, superseded=why),
          row("M=1,ctx=202752", "reference", 219.0)]
  lines = stage_table(rows)
  assert "| 202752 | 35.00 / 219 (6.26×) ‡ |" in lines
  assert "| 1024 | 15.00 / 60.00 (4.00×) |" in lines
  assert f"‡ {why}" in lines
  assert not any("‡" in line for line in stage_table(rows[:2]))
