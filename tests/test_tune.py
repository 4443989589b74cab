"""jd.tune: trials classified (ok, oom by budget, oom at run time, skipped by estimate,
error, time budget), saved (CSV, JSON, plot) and reproducible; `jaxdist tune`."""

import csv
import json

import jax
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist import cli, errors, executable, models
from jaxdist.tune import walk
from jaxdist.tune.report import COLUMNS
from helpers import make_step_script


def _workload():
  data = models.regression_batch(32, 128, out=128)
  state = models.create_state(models.MLP(hidden=128, num_layers=3, out=128), data["x"],
                              tx=optax.adam(1e-3))
  return models.regression_step(jd.value_and_grad), state, data


def _dp_bytes(step, state, data):
  return jd.parallelize(step, method=jd.DataParallel()).get_executable(
      state, data).get_total_allocation_size()


def test_trials_are_classified_against_the_budget():
  step, state, data = _workload()
  dp = _dp_bytes(step, state, data)
  before = jax.tree.map(np.asarray, (state, data))
  # DataParallel's estimate is within the skip margin of this budget, so it compiles and
  # is over it: oom without running. ZeRO-3 fits.
  report = jd.tune(step, state, data, memory_budget_per_device=0.9 * dp, steps=1,
                   candidates=[jd.DataParallel(), jd.Zero3Parallel()], progress=False)
  dp_trial, z3 = report.trials
  assert dp_trial.status == "oom" and "budget" in dp_trial.reason
  assert dp_trial.memory_bytes == dp and dp_trial.step_time_s is None
  assert z3.status == "ok" and z3.step_time_s > 0 and z3.memory_bytes <= 0.9 * dp
  assert report.best_trial is z3 and isinstance(report.best_method, jd.Zero3Parallel)
  # The caller's arguments are untouched (copied per trial, never donated).
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, (state, data)))
  # Far over the budget by its estimate: skipped without compiling.
  report = jd.tune(step, state, data, memory_budget_per_device=0.5 * dp, steps=1,
                   candidates=[jd.DataParallel()], progress=False)
  (trial,) = report.trials
  assert trial.status == "skipped" and "estimated" in trial.reason
  assert trial.compile_s is None and trial.estimated_memory_bytes == pytest.approx(dp, rel=0.02)


def test_the_guide_skips_a_candidate_estimated_much_slower_than_the_fastest(monkeypatch):
  """Links with a 1 ms latency: ZeRO's 17 collectives a step are estimated about 4x
  DataParallel's one all-reduce; the walk does not compile them. Given as candidates, they
  run (a user's list is measured whole)."""
  step, state, data = _workload()
  slow = jd.LogicalMesh((8,), alpha=1e-3, beta=1e-9)
  methods = [jd.DataParallel(devices=slow), jd.Zero2Parallel(devices=slow)]
  monkeypatch.setattr(walk, "_guide", lambda w, devices: [(walk._name(c), c) for c in methods])
  dp, z2 = jd.tune(step, state, data, steps=1, progress=False).trials
  assert dp.status == "ok" and z2.status == "skipped" and z2.compile_s is None
  ratio = z2.estimated_step_time_s / dp.estimated_step_time_s
  assert ratio > walk.SLOWER_SKIP and f"{ratio:.1f}x the estimate for DataParallel" in z2.reason
  dp, z2 = jd.tune(step, state, data, steps=1, progress=False, candidates=methods).trials
  assert dp.status == z2.status == "ok"


def test_runtime_out_of_memory_and_compile_errors_are_classified(monkeypatch):
  step, state, data = _workload()

  def exhausted(self, leaves):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                     "allocate 1.00GiB.")

  monkeypatch.setattr(executable.Executable, "call_flat", exhausted)
  (trial,) = jd.tune(step, state, data, steps=1, candidates=[jd.DataParallel()],
                     progress=False).trials
  assert trial.status == "oom" and "RESOURCE_EXHAUSTED" in trial.reason
  assert trial.memory_bytes is not None
  monkeypatch.undo()

  def broken(step, layout, timings=None):
    raise RuntimeError("INTERNAL: the compiler failed\nsecond line")

  monkeypatch.setattr("jaxdist.api.compile_layout", broken)
  report = jd.tune(step, state, data, steps=1, candidates=[jd.Zero2Parallel()], progress=False)
  (trial,) = report.trials
  assert trial.status == "error" and trial.reason == "RuntimeError: INTERNAL: the compiler failed"
  assert report.best_trial is None


def test_a_candidate_that_does_not_apply_is_skipped_and_the_time_budget_stops_the_walk():
  step, state, data = _workload()
  report = jd.tune(step, state, data, steps=1, progress=False,
                   candidates=[jd.DataParallel(num_micro_batches=3)])
  (trial,) = report.trials
  assert trial.status == "skipped" and "num_micro_batches=3" in trial.reason
  report = jd.tune(step, state, data, steps=1, time_budget_s=0.0, progress=False,
                   candidates=[jd.DataParallel(), jd.Zero2Parallel()])
  assert [t.status for t in report.trials] == ["skipped", "skipped"]
  assert all("time_budget_s" in t.reason for t in report.trials)


def test_reports_save_load_plot_and_reproduce(tmp_path):
  step, state, data = _workload()
  report = jd.tune(step, state, data, steps=1, progress=False, candidates=[
      jd.DataParallel(), jd.ShardParallel(logical_mesh_shape=(2, 4)),
      jd.Zero2Parallel(num_micro_batches=3)])
  assert [t.name for t in report.trials] == ["DataParallel", "ShardParallel(2x4)",
                                             "Zero2Parallel k=3"]
  report.to_csv(tmp_path / "all.csv")
  report.failures_csv(tmp_path / "failures.csv")
  with open(tmp_path / "all.csv") as f:
    rows = list(csv.DictReader(f))
  assert tuple(rows[0]) == COLUMNS and len(rows) == 3
  assert float(rows[1]["memory_bytes"]) > 0 and rows[1]["mesh_shape"] == "2x4"
  assert rows[2]["status"] == "skipped" and rows[2]["step_time_s"] == ""
  with open(tmp_path / "failures.csv") as f:
    assert [r["name"] for r in csv.DictReader(f)] == ["Zero2Parallel k=3"]
  report.to_json(tmp_path / "report.json")
  loaded = jd.TuneReport.load(tmp_path / "report.json")
  assert [(t.name, t.status, t.step_time_s) for t in loaded.trials] == [
      (t.name, t.status, t.step_time_s) for t in report.trials]
  report.plot(tmp_path / "report.png")
  assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
  # The ShardParallel trial's method carries its plan: compiling it again (from the
  # loaded report too) gives the same shardings without a search.
  shard = report.trials[1]
  for method in (shard.method, loaded.trials[1].method):
    assert method.plan is not None
    exe = jd.parallelize(step, method=method).get_executable(state, data)
    assert exe.plan.inputs == method.plan.inputs


def test_the_guide_walks_every_stage_in_order(monkeypatch):
  """The walk's order and names (trials stubbed: this checks the candidates, not XLA)."""
  seen = []

  def record(self, name, method):
    seen.append(name)
    ok = name in ("Zero2Parallel", "ShardParallel(2x4)",
                  "PipeshardParallel(layers=4, stages=4, k=4)")
    return jd.Trial(name, method, "ok" if ok else "oom", step_time_s=1.0 + len(seen) if ok
                    else None, memory_bytes=1.0)

  monkeypatch.setattr(walk._Walk, "_trial", record)
  monkeypatch.setattr(walk._Walk, "param_paths", lambda self: [
      "state.params['params']['MultiHeadDotProductAttention_0']['query']['kernel']"])
  monkeypatch.setattr(walk._Walk, "forward_matmuls", lambda self: 4)
  report = jd.tune(lambda s, b: (s, b), {}, {}, progress=False)
  assert seen == ["DataParallel", "Zero2Parallel", "Zero3Parallel", "ShardParallel(8)",
                  "ShardParallel(2x4)", "ShardParallel(4x2)",
                  "ShardParallel(2x4, megatron_attention)",
                  "ShardParallel(4x2, megatron_attention)", "Zero2Parallel k=2",
                  "Zero2Parallel k=4", "Zero2Parallel k=8",
                  "PipeshardParallel(layers=2, stages=2, k=4)",
                  "PipeshardParallel(layers=4, stages=2, k=4)",
                  "PipeshardParallel(layers=4, stages=4, k=4)",
                  "PipeshardParallel(layers=4, stages=auto, k=4)",
                  "PipeshardParallel(spmd, k=4)",
                  "PipeshardParallel(layers=4, stages=4, k=8)"]
  assert len(report.trials) == len(seen)
  # A forward pass with 2 matrix multiplications is not cut into 4 layers.
  seen.clear()
  monkeypatch.setattr(walk._Walk, "forward_matmuls", lambda self: 2)
  report = jd.tune(lambda s, b: (s, b), {}, {}, progress=False)
  skipped = [t.name for t in report.trials if "matrix multiplications" in t.reason]
  assert skipped == ["PipeshardParallel(layers=4, stages=2, k=4)",
                     "PipeshardParallel(layers=4, stages=4, k=4)",
                     "PipeshardParallel(layers=4, stages=auto, k=4)"]
  assert all(t.status == "skipped" for t in report.trials if t.name in skipped)
  # Nothing compiled: accumulation runs on DataParallel, and its trials say so (they
  # were named "k=2", "k=4", "k=8").
  seen.clear()
  monkeypatch.setattr(walk._Walk, "_trial", lambda self, name, method: (
      seen.append(name), jd.Trial(name, method, "error"))[1])
  jd.tune(lambda s, b: (s, b), {}, {}, progress=False)
  assert [n for n in seen if "k=" in n and "Pipeshard" not in n] == [
      "DataParallel k=2", "DataParallel k=4", "DataParallel k=8"]


def test_jaxdist_tune_command(tmp_path, capsys):
  target = make_step_script(tmp_path)
  code = cli.main(["tune", target, "--methods", "dp,zero3", "--steps", "1",
                   "--budget", "10MB", "--json", str(tmp_path / "r.json"), "--csv",
                   str(tmp_path / "r.csv"), "--quiet"])
  out = capsys.readouterr().out
  assert code == 0 and "<- best" in out and "budget 10.0 MB" in out
  data = json.loads((tmp_path / "r.json").read_text())
  assert [t["name"] for t in data["trials"]] == ["DataParallel", "Zero3Parallel"]


def test_a_candidate_that_is_not_a_method_is_refused_before_any_trial():
  step, state, data = _workload()
  with pytest.raises(errors.InvalidArgumentError, match="candidates"):
    jd.tune(step, state, data, candidates=[jd.DataParallel(), "zero3"], progress=False)
  with pytest.raises(errors.InvalidArgumentError, match=r"memory_budget_per_device=-5.*positive"):
    jd.tune(step, state, data, memory_budget_per_device=-5, progress=False)
  with pytest.raises(errors.InvalidArgumentError, match=r"time_budget_s=-1.*>= 0"):
    jd.tune(step, state, data, time_budget_s=-1, progress=False)


def test_a_candidate_that_changes_the_step_s_results_is_picked_only_if_no_exact_one_ran(tmp_path):
  """Micro-batches of a BatchNorm step compute each micro-batch's own statistics: the
  trial is marked inexact (its reason says why), and the best trial is an exact one
  even where the inexact one is faster; before, the fastest won, whatever it computed."""
  import dataclasses

  from jaxdist.bench import wresnet
  config = wresnet.WResNetConfig(image_size=8, base_width=4, width_factor=2)
  report = jd.tune(wresnet.train_step(jd.value_and_grad), wresnet.create_state(config),
                   wresnet.batch(16, config), steps=1, progress=False,
                   candidates=[jd.DataParallel(), jd.DataParallel(num_micro_batches=2)])
  whole, split = report.trials
  assert whole.status == split.status == "ok"
  assert whole.exact and not split.exact
  assert "mixes examples beyond the loss's mean" in split.reason
  faster = dataclasses.replace(report, trials=(
      dataclasses.replace(whole, step_time_s=2.0), dataclasses.replace(split, step_time_s=1.0)))
  assert faster.best_trial.name == "DataParallel"
  assert "[results differ]" in faster.summary().splitlines()[2]
  alone = dataclasses.replace(report, trials=(dataclasses.replace(whole, status="oom"), split))
  assert alone.best_trial is split
  assert "no exact trial ran" in alone.summary()
  report.to_json(tmp_path / "report.json")
  assert [t.exact for t in jd.TuneReport.load(tmp_path / "report.json").trials] == [True, False]
