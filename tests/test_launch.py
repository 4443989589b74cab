"""python -m jaxdist.launch: a 2-process cluster gives the serial result (DataParallel,
Zero2Parallel with micro-batches, pipelines and an evaluation that follows one, the train
example resumed from a checkpoint), and its processes agree on plans and tuning picks that
could differ between them."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from jaxdist import models
from helpers import dropout_key_step

HERE = os.path.dirname(__file__)


def _launch(*cmd, timeout=180):
  return subprocess.run([sys.executable, "-m", "jaxdist.launch", "--num-processes", "2",
                         "--devices-per-process", "4", "--timeout", str(timeout), "--", *cmd],
                        capture_output=True, text=True, timeout=timeout + 30)


def _result(worker: str, process: int, *args: str) -> tuple[dict, str]:
  """Launches ``worker`` (with ``args``) on 2 processes; returns the JSON ``process``
  printed, and stdout."""
  proc = _launch(sys.executable, os.path.join(HERE, worker), *args)
  assert proc.returncode == 0, proc.stdout[-3000:]
  return _result_from(proc.stdout, process)


def _result_from(stdout: str, process: int) -> tuple[dict, str]:
  prefix = f"[{process}] RESULT "
  lines = [l for l in stdout.splitlines() if l.startswith(prefix)]
  assert len(lines) == 1, stdout[-3000:]
  return json.loads(lines[0][len(prefix):]), stdout


def _serial_mlp_steps():
  """Two serial steps of the workers' MLP: (losses, the first kernel's sum)."""
  model = models.MLP(hidden=64, num_layers=2)
  batch = models.regression_batch(32, 16)
  state = models.create_state(model, batch["x"], tx=optax.sgd(0.1, momentum=0.9))
  step = jax.jit(models.regression_step())
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses, float(state.params["params"]["Dense_0"]["kernel"].sum())


def test_two_process_data_parallel_matches_single_process():
  result, stdout = _result("dp_worker.py", 0)
  assert result["processes"] == 2 and result["devices"] == 8
  assert any(l.startswith("[1] mean") for l in stdout.splitlines())  # both streamed
  losses, kernel_sum = _serial_mlp_steps()  # the same two steps (see dp_worker.py)
  for name in ("dp", "zero2_k2"):
    np.testing.assert_allclose(result[name]["losses"], losses, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(result[name]["kernel_sum"], kernel_sum, rtol=1e-5, err_msg=name)
  step, make_state, batch = dropout_key_step()  # (its key placed on every process)
  np.testing.assert_allclose(result["dropout_key"], jax.jit(step)(make_state(), batch)[1],
                             rtol=1e-5)


def _serial_gpt_steps():
  """Two serial steps of pipeline_worker.py's GPT: (losses, every parameter's sum after
  them, the evaluation loss then)."""
  config = models.GPTConfig(vocab=64, width=16, heads=2, depth=2, seq_len=16)
  batch = models.token_batch(16, config)
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=tx)
  step = jax.jit(models.lm_step())
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  sums = [float(np.asarray(x).sum()) for x in jax.tree.leaves(state.params)]
  logits = state.apply_fn(state.params, batch["tokens"][:, :-1])
  eval_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
  return losses, sums, eval_loss


def test_two_process_pipelines_with_one_stage_per_process_match_serial():
  # The loss is made on process 1's last stage; process 0, where training loops log,
  # reads it too.
  result, stdout = _result("pipeline_worker.py", 1)
  first, _ = _result_from(stdout, 0)
  assert result["stage_processes"] == [[0], [1]]
  assert first["losses"] == result["losses"]
  # Each process compiles its own stage's programs only.
  assert (first["compiled_stages"], result["compiled_stages"]) == ([0], [1])
  losses, sums, eval_loss = _serial_gpt_steps()
  for run in (result, first):
    np.testing.assert_allclose(run["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(run["eval_loss"], eval_loss, rtol=1e-5)
    np.testing.assert_allclose(run["param_sums"], sums, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_two_process_spmd_pipeline_matches_serial():
  """The SPMD runtime: one program over a (2 stages, 4 data) mesh, a stage per process."""
  result, stdout = _result("pipeline_worker.py", 1, "spmd")
  first, _ = _result_from(stdout, 0)
  losses, sums, _ = _serial_gpt_steps()
  for run in (result, first):
    assert run["spmd_mesh"] == [2, 4]
    np.testing.assert_allclose(run["spmd_losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(run["spmd_param_sums"], sums, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_tied_embedding_on_unequal_stages_across_processes_matches_serial():
  # Read by the first and last of three unequal stages (4 devices on process 0, 2 and 2
  # on process 1).
  result, stdout = _result("pipeline_worker.py", 1, "tied")
  first, _ = _result_from(stdout, 0)
  config = models.GPTConfig(vocab=64, width=16, heads=2, depth=2, seq_len=16,
                            tied_embedding=True)
  batch = models.token_batch(16, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                              tx=optax.sgd(0.1, momentum=0.9))
  step = jax.jit(models.lm_step())
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  table = float(np.asarray(state.params["params"]["Embed_0"]["embedding"]).sum())
  for run in (result, first):
    assert run["tied_stages"] == [[4, [0]], [2, [1]], [2, [1]]]
    np.testing.assert_allclose(run["tied_losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(run["tied_embedding_sum"], table, rtol=1e-5, atol=1e-5)


def test_processes_agree_on_plans_and_picks_that_could_differ():
  """Process 1's ILP returns another plan (as a solve stopped by its time limit may) and
  each process measures a different tuning candidate as the slow one: both compile
  process 0's plan, train as the serial step does, and tune picks process 0's best."""
  first, stdout = _result("agree_worker.py", 0)
  second, _ = _result_from(stdout, 1)
  assert second["solver_differed"] is True  # the test does make process 1 see another plan
  assert first["plan"] == second["plan"]
  losses, _ = _serial_mlp_steps()
  for run in (first, second):
    np.testing.assert_allclose(run["losses"], losses, rtol=1e-5)
  assert first["best"] == second["best"] == "DataParallel"
  assert first["times"] == second["times"]


def test_a_failing_process_fails_the_launch():
  code = "import os, sys; sys.exit(3 if os.environ['JAXDIST_PROCESS_ID'] == '1' else 0)"
  proc = _launch(sys.executable, "-c", code, timeout=60)
  assert proc.returncode == 3


# Two launches of the example (about a minute): `make test-all`. The tests above cover two
# processes against one; tests/test_state.py covers checkpoints across layouts.
@pytest.mark.slow
def test_train_example_resumes_from_a_two_process_checkpoint(tmp_path):
  """examples/train_gpt.py (sharded creation, ShardParallel, FollowParallel evaluation,
  orbax checkpoints): 6 steps on 2 processes with checkpoints at 2, 4 and 6; the last
  is lost (as if preempted before it was saved), and the run resumed on 2 processes from
  step 4 prints the same step-6 report. (Two processes against one: the tests above.)"""
  example = os.path.join(HERE, "..", "examples", "train_gpt.py")
  ckpt = tmp_path / "ckpt"
  flags = ["--steps", "6", "--every", "2", "--checkpoints", str(ckpt)]
  whole = _launch(sys.executable, example, *flags)
  assert whole.returncode == 0, whole.stdout[-3000:]
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4", "6"]
  shutil.rmtree(ckpt / "6")
  resumed = _launch(sys.executable, example, "--resume", *flags)
  assert resumed.returncode == 0, resumed.stdout[-3000:]

  def reports(stdout):
    return [l for l in stdout.splitlines() if l.startswith("[0] step ")]

  assert len(reports(whole.stdout)) == 3
  assert reports(resumed.stdout) == reports(whole.stdout)[-1:]
