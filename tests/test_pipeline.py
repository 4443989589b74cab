"""PipeshardParallel: stages and schedules against the serial step, driver statistics, errors.

Numerics: SGD + momentum, rtol 1e-5 / atol 1e-6 (only summation order differs: the
micro-batch gradients are added up stage by stage).
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist import errors, models
from jaxdist.pipeline import timeline
from jaxdist.shard.planner import path_matches
from helpers import assert_trees_close, contrastive, outside_gradient_step, to_host


def _gpt(mark_boundaries=True, batch_size=32):
  config = models.GPTConfig(vocab=256, width=32, heads=4, depth=4, seq_len=32,
                            mark_boundaries=mark_boundaries)
  batch = models.token_batch(batch_size, config)
  make = lambda: models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                                     tx=optax.sgd(0.1, momentum=0.9))
  return make, batch


@functools.cache
def _serial_twice():
  """Two serial steps of _gpt() from its initial state, on the host."""
  make, batch = _gpt()
  serial = jax.jit(models.lm_step())
  s1, m1 = serial(make(), batch)
  return to_host((s1, m1)), to_host(serial(s1, batch))


def _check_timeline(exe, tmp_path):
  """The recorded spans of the step just run follow its schedule, and draw."""
  spans = exe.stats["timeline"]
  order = [(i.kind, i.stage, i.micro_batch) for i in exe.schedule.instructions
           if i.kind != "U"]
  assert sorted((s.kind, s.stage, s.micro_batch) for s in spans) == sorted(order)
  for g in {s.group for s in spans}:  # a group's programs run one after another, in its order
    mine = [s for s in spans if s.group == g]
    assert [(s.kind, s.stage, s.micro_batch) for s in mine] == [
        o for o in order if o[1] == g]
    assert all(0 <= a.start <= a.end <= b.start <= b.end for a, b in zip(mine, mine[1:]))
  assert max(s.end for s in spans) <= exe.stats["dispatch_s"] + 5.0  # times in seconds, not ns
  assert 0 <= timeline.bubble_fraction(spans) < 1
  timeline.draw(spans, str(tmp_path / "t.png"))
  assert (tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.parametrize("method,in_flight", [
    # embedding + 2 blocks | 2 blocks + head: unequal stages, from the model's boundaries
    # (slow, as the next: 1F1B runs in the fast suite as tests/test_examples.py's nnx
    # pipeline, and interleaved below)
    pytest.param(jd.PipeshardParallel(num_micro_batches=4,
                                      stage_option=jd.UniformStageOption(num_stages=2)),
                 [2, 1], marks=pytest.mark.slow),
    pytest.param(jd.PipeshardParallel(num_micro_batches=4,
                                      layer_option=jd.AutoLayerOption(layer_num=4)),
                 [4, 3, 2, 1], marks=pytest.mark.slow),
    (jd.PipeshardParallel(num_micro_batches=4, layer_option=jd.AutoLayerOption(layer_num=4),
                          pipeline_schedule="gpipe", runtime="mpmd"), [4, 4, 4, 4]),
    # the stage DP chooses stages and sub-mesh sizes (on this small GPT: 1, 2, 4, 1 devices)
    (jd.PipeshardParallel(num_micro_batches=4, layer_option=jd.AutoLayerOption(layer_num=4),
                          stage_option="auto"), None),
], ids=["manual-2-stages-1f1b", "auto-4-stages-1f1b", "auto-4-stages-gpipe", "auto-stages"])
def test_pipeline_matches_serial_twice_in_a_row(method, in_flight, tmp_path):
  make, batch = _gpt()
  expected = _serial_twice()
  state = make()
  exe = jd.parallelize(models.lm_step(jd.value_and_grad), method=method).get_executable(state,
                                                                                         batch)
  p1, n1 = exe(state, batch)
  # (Copies: a numpy view of p1's buffers would keep the next call from reusing them.)
  first = to_host(jax.tree.map(jnp.copy, (p1, n1)))
  exe.record_timeline = True
  p2, n2 = exe(p1, batch)
  assert_trees_close((first, to_host((p2, n2))), expected, rtol=1e-5, atol=1e-6)
  _check_timeline(exe, tmp_path)
  # The state was donated (donate_argnums="auto"): each stage's update reused its buffers.
  alive = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(
      (p1.params, p1.opt_state)) if x.ndim and not x.is_deleted()]
  assert not alive, alive
  in_flight_given = in_flight is not None
  if in_flight is None:  # chosen by the stage DP: 1F1B's bound for what it chose
    assert any("auto stages: predicted" in note for note in exe.plan.notes), exe.plan.notes
    in_flight = [min(len(exe.stages) - s, 4) for s in range(len(exe.stages))]
  assert exe.stats["max_in_flight"] == in_flight
  assert exe.stats["dispatched"] == 2 * len(in_flight) * 4
  # The host time splits into the programs' calls, the moves and the driver's own Python.
  assert 0 < exe.stats["call_s"] and 0 < exe.stats["move_s"]
  assert exe.stats["call_s"] + exe.stats["move_s"] < exe.stats["dispatch_s"]
  stage_devices = [frozenset(d.id for d in st.mesh.devices) for st in exe.stages]
  assert set().union(*stage_devices) == set(range(8)) and sum(map(len, stage_devices)) == 8
  # State lives on its stage's sub-mesh: every parameter and its momentum on one stage.
  for tree in (p1.params, p1.opt_state):
    homes = {frozenset(d.id for d in x.sharding.device_set) for x in jax.tree.leaves(tree)
             if x.ndim}
    assert homes == set(stage_devices), homes
  reductions = sum(st.reduce is not None for st in exe.stages)  # per-device stages
  assert len(exe.get_hlo_text()) == 2 * len(in_flight) + reductions + len(in_flight) + 1
  report = exe.stage_report(repeats=1)
  assert [r.layers for r in report] == [st.layers for st in exe.stages]
  assert all(r.forward_s > 0 and r.backward_s > 0 and r.bytes_per_device > 0 for r in report)
  assert all((r.predicted_s is None) == (in_flight_given) for r in report)
  gathered = exe.gather(p2)
  assert all(x.sharding.device_set == set(jax.devices()) for x in jax.tree.leaves(gathered))
  assert_trees_close(to_host(gathered), to_host(p2), rtol=0, atol=0)
  with pytest.raises(errors.InvalidArgumentError, match=r"was deleted: its buffer was donated"):
    exe(p1, batch)


def _two_stage_step(grad_fn, pass_on):
  """SGD on a two-layer function cut in two stages; the first passes on ``pass_on(w, h)``."""

  def step(params, batch):
    def loss_fn(p):
      h = jnp.tanh(batch["x"] @ p["w"])
      passed = pass_on(p["w"], h)
      jd.mark_pipeline_boundary()
      out = jnp.tanh(h @ p["v"]) @ passed
      return jnp.mean((out - batch["y"]) ** 2)

    loss, g = grad_fn(loss_fn)(params)
    return jax.tree.map(lambda w, d: w - 0.1 * d, params, g), loss

  return step


def test_by_default_an_unmarked_model_is_cut_into_two_layers():
  """The default layer_option (None) takes the model's boundaries where it marks any, else
  Alpa's AutoLayerOption(layer_num=2); it was 'manual', so a model without marks raised."""
  make, batch = _gpt(mark_boundaries=False)
  step = jd.parallelize(models.lm_step(jd.value_and_grad),
                        method=jd.PipeshardParallel(num_micro_batches=4))
  exe = step.get_executable(make(), batch)
  assert len(exe.stages) == 2
  s1, m1 = step(make(), batch)
  first = to_host((s1, m1))
  expected = _serial_twice()
  assert_trees_close((first, to_host(step(s1, batch))), expected, rtol=1e-5, atol=1e-6)


def test_interleaved_stages_share_device_groups_and_match_serial():
  """virtual_stages=2: four stages (model chunks) on two groups of four devices, stage c on
  group c mod 2, run by interleaved 1F1B: equal to serial, bubble (p - 1) / (v m)."""
  make, batch = _gpt()
  method = jd.PipeshardParallel(num_micro_batches=4, stage_option=jd.UniformStageOption(
      num_stages=4), virtual_stages=2)
  step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
  assert_trees_close(to_host(step(make(), batch)), _serial_twice()[0], rtol=1e-5, atol=1e-6)
  exe = step.get_executable(make(), batch)
  groups = [frozenset(d.id for d in st.mesh.devices) for st in exe.stages]
  assert groups[0] == groups[2] and groups[1] == groups[3] and not groups[0] & groups[1]
  assert len(groups[0]) == 4
  # A group's devices hold both of its stages' arguments (parameters, accumulators).
  peaks = exe.device_peaks()
  held = sum(exe.stages[s].backward.memory_analysis().argument_size_in_bytes for s in (0, 2))
  assert peaks["stage 0"] == peaks["stage 2"] > held
  busy = 2 * 2 * 4  # each group: v * m forwards and as many backwards
  assert (exe.schedule.num_clocks - 1 - busy) / busy == (2 - 1) / (2 * 4)
  with pytest.raises(errors.InvalidArgumentError, match="virtual_stages=2"):
    jd.PipeshardParallel(virtual_stages=2, pipeline_schedule="gpipe")


def test_bytes_per_device_count_what_a_stage_s_devices_hold():
  """``get_total_allocation_size`` is the busiest devices' peak: a stage's backward program
  plus the optimizer state its devices keep and its inputs held for the micro-batches in
  flight (it was the largest program alone: 5.01 MB per device for the demo's 4-stage
  pipeline, 6.20 MB counted so)."""
  config = models.GPTConfig(vocab=256, width=32, heads=4, depth=4, seq_len=32,
                            mark_boundaries=True)
  batch = models.token_batch(32, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  method = jd.PipeshardParallel(num_micro_batches=4)
  exe = jd.parallelize(models.lm_step(jd.value_and_grad), method=method).get_executable(
      state, batch)
  own = lambda a: (a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
                   + a.temp_size_in_bytes)
  peaks = exe.device_peaks()
  in_flight = exe.schedule.max_in_flight()
  assert in_flight[0] > 1
  for s, st in enumerate(exe.stages):
    assert peaks[f"stage {s}"] >= own(st.backward.memory_analysis()) + exe.optimizer_bytes(st)
    assert exe.optimizer_bytes(st) > 0
  largest = max(own(a) for a in exe.memory_analysis())
  assert exe.get_total_allocation_size() == int(max(largest, *peaks.values())) > largest


@pytest.mark.parametrize("pass_on,k,per_device", [
    (lambda w, h: w.T * 2.0, 4, True),        # a parameter passed on: its cotangent summed
    (lambda w, h: jnp.diag(h.mean(0)), 1, False),  # a batch statistic: stays on its plan
], ids=["parameter-passed-on", "batch-statistic-passed-on"])
def test_data_parallel_stages_reduce_gradients_once_per_step(pass_on, k, per_device):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32),
            "v": jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)}
  expected = jax.jit(_two_stage_step(jax.value_and_grad, pass_on))(params, batch)
  # 8x8 parameters: left alone the planner rightly computes them redundantly (no
  # collective at all), so the data-parallel stage layout is asked for.
  method = jd.PipeshardParallel(
      num_micro_batches=k, stage_option=jd.UniformStageOption(2),
      default_auto_sharding_option=jd.AutoShardingOption(force_data_parallel=True))
  step = jd.parallelize(_two_stage_step(jd.value_and_grad, pass_on), method=method,
                        donate_argnums=())
  exe = step.get_executable(params, batch)
  assert_trees_close(step(params, batch), expected, rtol=1e-5, atol=1e-6)
  assert [st.reduce is not None for st in exe.stages] == [per_device] * 2, exe.plan.notes
  if not per_device:  # (the loss's coupling is found before the exchanged statistic)
    assert "the loss mixes examples" in exe.stages[0].note, exe.stages[0].note


def test_a_stage_s_outputs_are_not_held_after_they_are_handed_over(monkeypatch):
  """Two stages, 8 micro-batches of 4 rows: under 1F1B the first stage holds at most 2
  micro-batches. Its outputs are moved to the second stage at the end of the clock that
  made them and then dropped; before, the driver kept every micro-batch's outputs on the
  first stage's devices until the step ended (8 at its last backward)."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(6, 16)) / 3, jnp.float32),
            "v": jnp.asarray(rng.normal(size=(16, 2)) / 3, jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(32, 6)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(32, 2)), jnp.float32)}

  def step(params, batch):
    def loss_fn(p):
      h = jnp.tanh(batch["x"] @ p["w"])
      jd.mark_pipeline_boundary()
      return jnp.mean((h @ p["v"] - batch["y"]) ** 2)

    loss, g = jd.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, d: w - 0.1 * d, params, g), loss

  exe = jd.parallelize(step, method=jd.PipeshardParallel(
      num_micro_batches=8, stage_option=jd.UniformStageOption(2)),
      donate_argnums=()).get_executable(params, batch)
  first = frozenset(exe.stages[0].mesh.devices)
  held = []
  backward = type(exe.stages[0]).run_backward

  def counting(stage, *args):
    held.append(sum(x.shape == (4, 16) and x.sharding.device_set == first
                    for x in jax.live_arrays()))
    return backward(stage, *args)

  monkeypatch.setattr(type(exe.stages[0]), "run_backward", counting)
  assert_trees_close(exe(params, batch), jax.jit(step)(params, batch), rtol=1e-5, atol=1e-6)
  assert exe.stats["max_in_flight"] == [2, 1]
  # (a cotangent of the first stage's output waits there for its backward)
  assert len(held) == 16 and max(held) <= 2, held


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_an_activation_read_by_two_later_stages_matches_serial(schedule):
  """The first stage's output is read by the second and the third stage (a skip
  connection), on sub-meshes of 2, 2 and 4 devices: the driver moves it to both readers
  and adds the two cotangents they send back."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32) for k in "abc"}
  batch = {"x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)}

  def step(params, batch, grad_fn=jd.value_and_grad):
    def loss_fn(p):
      h0 = jnp.tanh(batch["x"] @ p["a"])
      jd.mark_pipeline_boundary()
      h1 = jnp.tanh(h0 @ p["b"])
      jd.mark_pipeline_boundary()
      return jnp.mean((jnp.tanh(h1 @ p["c"]) + h0 - batch["y"]) ** 2)

    loss, g = grad_fn(loss_fn)(params)
    return jax.tree.map(lambda w, d: w - 0.1 * d, params, g), loss

  method = jd.PipeshardParallel(
      num_micro_batches=4, pipeline_schedule=schedule, runtime="mpmd",
      stage_option=jd.ManualStageOption([[0], [1], [2]], [(1, 2), (1, 2), (1, 4)]))
  exe = jd.parallelize(step, method=method, donate_argnums=()).get_executable(params, batch)
  assert [len(st.acts_in) for st in exe.stages] == [0, 1, 2]
  expected = jax.jit(functools.partial(step, grad_fn=jax.value_and_grad))(params, batch)
  assert_trees_close(exe(params, batch), expected, rtol=1e-5, atol=1e-6)


def test_a_per_device_stage_adds_into_its_donated_accumulator_in_place():
  # Each device's gradients are one block of the stacked accumulator, added to as they
  # are: XLA writes the sums into the donated buffers. With a row dimension of one per
  # device instead, it copied every sum into the outputs (3 MiB more per device on the
  # first of 2 stages of bench/estimate.py's MLP).
  data = models.regression_batch(32, 64, out=64)
  make_state = lambda: models.create_state(models.MLP(hidden=64, num_layers=4, out=64),
                                           data["x"], tx=optax.adam(1e-3))
  method = jd.PipeshardParallel(
      num_micro_batches=2, stage_option=jd.UniformStageOption(2),
      default_auto_sharding_option=jd.AutoShardingOption(force_data_parallel=True))
  step = jd.parallelize(models.regression_step(jd.value_and_grad), method=method)
  exe = step.get_executable(make_state(), data)
  for st in exe.stages:
    assert st.reduce is not None, exe.plan.notes
    entry = st.backward.as_text().split("\nENTRY ")[1]
    copies = {line.split("=")[0].strip().lstrip("%") for line in entry.splitlines()
              if " copy(" in line}
    root = next(line for line in entry.splitlines() if line.lstrip().startswith("ROOT"))
    operands = root.split("tuple(")[1].split(")")[0].replace("%", "").split(", ")
    assert not copies & set(operands), root
  expected = jax.jit(models.regression_step())(make_state(), data)
  assert_trees_close(step(make_state(), data), expected, rtol=1e-5, atol=1e-6)


def _rmse():
  """(step, make_state, batch): an MLP trained on the root of the mean squared error, a
  loss that is no affine function of sums over the batch."""
  batch = models.regression_batch(32, 16)
  make_state = lambda: models.create_state(models.MLP(hidden=32, num_layers=2), batch["x"],
                                           tx=optax.sgd(0.05))

  def step(state, batch):
    def loss_fn(params):
      return jnp.sqrt(jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2))

    loss, grads = jd.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return step, make_state, batch


def _two_views():
  """(step, make_state, batch): SimCLR's loss over two noisy views of the batch, stacked:
  each row's softmax over the similarities to every other row (one direction only, so no
  transpose of the similarity matrix shows the pairing)."""
  batch = {"x": jax.random.normal(jax.random.key(1), (32, 16)),
           "noise": jax.random.normal(jax.random.key(2), (32, 2, 16))}
  make_state = lambda: {"w": jax.random.normal(jax.random.key(0), (16, 8)) / 4}

  def step(state, batch):
    def loss_fn(w):
      views = jnp.concatenate([batch["x"] + 0.1 * batch["noise"][:, i] for i in range(2)])
      z = jnp.tanh(views @ w)
      z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
      n = z.shape[0] // 2
      sim = jnp.where(jnp.eye(2 * n, dtype=bool), -1e9, z @ z.T / 0.5)
      labels = jnp.concatenate([jnp.arange(n) + n, jnp.arange(n)])
      return optax.softmax_cross_entropy_with_integer_labels(sim, labels).mean()

    loss, grad = jd.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": loss}

  return step, make_state, batch


def _centered(wrap):
  """(step, make_state, batch): an MLP whose hidden layer is centered on the batch's mean
  inside ``wrap`` (a checkpointed function, a conditional's branch): the pipeline's loss
  is traced forward only, where such calls stay closed."""
  batch = models.regression_batch(32, 16)
  make_state = lambda: {"w": jax.random.normal(jax.random.key(0), (16, 8)) / 4}

  def step(state, batch):
    def loss_fn(w):
      h = wrap(lambda h: h - h.mean(0))(batch["x"] @ w)
      return jnp.mean((jnp.tanh(h) - batch["y"]) ** 2)

    loss, grad = jd.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": loss}

  return step, make_state, batch


def _prototypes():
  """(step, make_state, batch): a prototypical network's loss: each class's prototype is
  the mean of the batch's examples of that class (``segment_sum`` over the batch), each
  example classified by its distances to them."""
  batch = {"x": jax.random.normal(jax.random.key(1), (32, 16)),
           "y": jax.random.randint(jax.random.key(2), (32,), 0, 4)}
  make_state = lambda: {"w": jax.random.normal(jax.random.key(0), (16, 8)) / 4}

  def step(state, batch):
    def loss_fn(w):
      z = jnp.tanh(batch["x"] @ w)
      sums = jax.ops.segment_sum(z, batch["y"], num_segments=4)
      counts = jax.ops.segment_sum(jnp.ones(z.shape[0]), batch["y"], num_segments=4)
      centers = sums / jnp.maximum(counts, 1)[:, None]
      distances = jnp.sum((z[:, None] - centers[None]) ** 2, -1)
      return optax.softmax_cross_entropy_with_integer_labels(-distances, batch["y"]).mean()

    loss, grad = jd.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": loss}

  return step, make_state, batch


@pytest.mark.parametrize("workload", [
    contrastive, _two_views, _rmse, lambda: _centered(jax.checkpoint),
    lambda: _centered(lambda f: lambda h: jax.lax.cond(True, f, lambda h: h, h)), _prototypes],
    ids=["contrastive", "two-views", "rmse", "checkpointed", "branch", "prototypes"])
def test_a_loss_that_mixes_examples_runs_no_stage_per_device(workload):
  """A contrastive loss or an RMSE in one micro-batch: a stage run per device would compute
  it on each device's share (the contrastive loss was 2.2 off serial, SimCLR's over two
  views 0.35, a centering inside jax.checkpoint or a cond's branch 1e-2, all without a
  word; class prototypes summed over the batch 4.8e-2 at k=2 with no warning); the stages keep
  their shard plans, over the whole micro-batch, and the plan says why. Split into
  micro-batches, the RMSE's forward shows no batch statistic, and it warns all the same."""
  step, make_state, batch = workload()
  expected = jax.jit(step)(make_state(), batch)
  parallel = jd.parallelize(step, method=jd.PipeshardParallel(
      num_micro_batches=1, layer_option=jd.AutoLayerOption(layer_num=2)))
  assert_trees_close(parallel(make_state(), batch), expected, rtol=1e-5, atol=1e-6)
  exe = parallel.get_executable(make_state(), batch)
  assert all(st.reduce is None for st in exe.stages), exe.plan.notes
  assert any("the loss mixes examples" in note for note in exe.plan.notes), exe.plan.notes
  with pytest.warns(jd.errors.JaxdistWarning, match="mixes examples"):
    jd.parallelize(step, method=jd.PipeshardParallel(
        num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2))).get_executable(
            make_state(), batch)


def test_gpt_stages_reduce_gradients_once_per_step():
  """The GPT's data-parallel stages: 4 micro-batches move the collective bytes of one."""
  make, batch = _gpt()
  wire = {}
  for k in (1, 4):
    exe = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
        num_micro_batches=k, stage_option=jd.UniformStageOption(num_stages=2))).get_executable(
            make(), batch)
    assert all(st.reduce is not None for st in exe.stages), exe.plan.notes
    wire[k] = sum(c.wire_bytes for c in exe.communication().values())
    # Predicted over the driver's programs: each micro-batch's loss all-reduce, one
    # gradient sum per stage and step.
    lines = exe.check_communication()
    assert lines and not [line for line in lines if "DIFFERS" in line], lines
    assert exe.plan.predicted_collectives["all-reduce"]["count"] == k + 2, lines
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(make().params))
  assert wire[4] <= 1.1 * wire[1], wire
  assert wire[1] >= params, (wire, params)  # the gradients are reduced, once


def _mlp_stages(batch_size: int, num_stages: int):
  """A 4-layer Adam MLP cut into ``num_stages`` uniform stages, 2 micro-batches."""
  data = models.regression_batch(batch_size, 64)
  state = models.create_state(models.MLP(hidden=64, num_layers=4), data["x"],
                              tx=optax.adam(1e-3))
  return jd.parallelize(models.regression_step(jd.value_and_grad), method=jd.PipeshardParallel(
      num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=num_stages),
      stage_option=jd.UniformStageOption(num_stages=num_stages))).get_executable(state, data)


def test_pipeline_predictions_count_what_stages_hand_over():
  """Four MLP stages, three run per device and the last as planned: the driver's
  prediction adds each stage program's plan, the per-device sums and the reshards that
  return activations and cotangents in their readers' layouts (a per-device output
  gathered for the planned stage, its cotangent sent back split)."""
  exe = _mlp_stages(batch_size=8, num_stages=4)
  assert [st.per_device is not None for st in exe.stages] == [True, True, True, False]
  assert exe.stages[2].handover and exe.stages[3].handover
  lines = exe.check_communication()
  assert not [line for line in lines if "DIFFERS" in line], lines
  assert {line.split(":")[0] for line in lines} == {"all-gather", "all-reduce", "all-to-all"}


def test_a_stage_backward_predicts_only_what_it_computes():
  """A stage's backward recomputes its forward through ``jax.vjp`` and returns only
  cotangents: the forward's outputs are dead there, and XLA drops them with the
  resharding that laid them out for the next stage. Before, the backward's plan predicted
  that all-to-all too (2 per step beyond the 2 compiled). Its ILP still prices them: they
  stand in for the forward program, which the same plan lays out."""
  exe = _mlp_stages(batch_size=32, num_stages=2)
  assert all(st.per_device is None for st in exe.stages)
  lines = exe.check_communication()
  assert not [line for line in lines if "DIFFERS" in line], lines


def test_model_parallel_stages_reduce_gradients_once_per_step():
  """A stage planned with its batch on one axis and its MLP kernels split over the other
  (Megatron's layout) runs manual over the batch axis only: each shard adds its partial
  gradients (kept split as planned) into its block, summed once per step; the kernels stay
  split. Before, such a stage all-reduced its gradients in every micro-batch."""
  make, batch = _gpt()
  option = jd.AutoShardingOption(
      force_batch_dim_to_mesh_dim=0,
      partition_constraints={"*Dense_0*kernel*": P(None, "mesh_1"),
                             "*Dense_1*kernel*": P("mesh_1", None)})
  method = jd.PipeshardParallel(
      num_micro_batches=4, default_auto_sharding_option=option,
      stage_option=jd.ManualStageOption([[0, 1, 2], [3, 4, 5]], [(2, 2), (2, 2)]))
  step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
  exe = step.get_executable(make(), batch)
  first = exe.stages[0]
  assert first.note.startswith("per shard of the batch over ('mesh_0',)"), first.note
  kernel = next(k for k, p in enumerate(first.operands)
                if path_matches("*block_1*Dense_0*kernel*", exe._operand_paths[p]))
  assert first.operand_avals[kernel].sharding.spec == P(None, "mesh_1")
  # One block per batch shard, stacked along the kernel's rows; each block split as planned.
  rows = first.grad_avals[first.diff.index(kernel)]
  shape = first.operand_avals[kernel].shape
  assert rows.shape == (2 * shape[0], shape[1]), rows
  assert rows.sharding.spec == P("mesh_0", "mesh_1"), rows
  assert first.reduce is not None
  # XLA partitions each shard's programs over the other axes as the stage's plan says:
  # the plan's collectives over those axes are predicted (before: not predicted at all).
  lines = exe.check_communication()
  assert {line.split(":")[0] for line in lines} >= {"all-reduce", "all-gather"}, lines
  assert not [line for line in lines if "DIFFERS" in line or "not predicted" in line], lines
  p1, n1 = exe(make(), batch)
  assert_trees_close((to_host((p1, n1)), to_host(exe(p1, batch))), _serial_twice(),
                     rtol=1e-5, atol=1e-6)


def test_pipeline_with_aux_and_a_batch_slice_outside_the_loss():
  """Values computed before the loss are split into micro-batches: from the batch, and
  what only its shape sizes (a diffusion step's per-example timesteps drawn from a key:
  PipeshardParallel raised InvalidArgumentError at k=2 on such a step)."""
  data = models.regression_batch(32, 16)
  model = models.MLP(hidden=32, num_layers=4)
  make = lambda: models.create_state(model, data["x"], tx=optax.sgd(0.05, momentum=0.9))

  def step(state, batch, grad_fn):
    t = jax.random.uniform(jax.random.key(3), (batch["x"].shape[0], 1))
    x = batch["x"] * 2.0  # computed before the loss: split into micro-batches all the same

    def loss_fn(p):
      err = state.apply_fn(p, x) * t - batch["y"]
      return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err))}

    (loss, aux), g = grad_fn(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=g), {"loss": loss, **aux}

  expected = to_host(jax.jit(lambda s, b: step(s, b, jax.value_and_grad))(make(), data))
  method = jd.PipeshardParallel(num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2))
  actual = jd.parallelize(lambda s, b: step(s, b, jd.value_and_grad), method=method)(make(), data)
  assert_trees_close(to_host(actual), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", [
    jd.PipeshardParallel(num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2)),
    jd.PipeshardParallel(num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2),
                         runtime="spmd", pipeline_schedule="1f1b")], ids=["mpmd", "spmd-1f1b"])
def test_token_weighted_losses_and_clipping_match_serial(method):
  """A token-weighted loss: each micro-batch's loss and gradients count by its share of
  the tokens (the stage dividing by the count stays on its plan, not per device).

  The optimizer clips by the global norm, so every parameter's update reads a norm over
  all stages' gradients. The norm crosses as scalars (each stage's sums of squares,
  summed over all devices, the clip factor sent back), so on the MPMD driver each
  stage's parameters and optimizer state stay on its sub-mesh; before, the whole update
  ran replicated on every device and the state lived there (3.8x the memory on an
  encoder-decoder with 4 stages). A micro-batch of padding only adds nothing (it made
  the step NaN under both runtimes). The first block is frozen (``set_to_zero``): on the
  driver no stage differentiates it (a 4-block model with its first block frozen: that
  stage's backward did 1.24x the flops) and its ``p + 0`` update stays on its stage."""
  from test_accumulation import token_weighted_setup
  frozen = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if "block_0" in jax.tree_util.keystr(path) else "train", params)
  tx = optax.multi_transform({"train": optax.chain(optax.clip_by_global_norm(0.05),
                                                   optax.sgd(0.1, momentum=0.9)),
                              "frozen": optax.set_to_zero()}, frozen)
  make, batch, step_fn = token_weighted_setup(tx=tx)
  batch["mask"] = batch["mask"].at[:16].set(0.0)  # micro-batch 0 is padding only: 0 / 0
  serial = jax.jit(step_fn())
  s1, m1 = serial(make(), batch)
  expected = to_host((s1, m1)), to_host(serial(s1, batch))
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method)
  p1, n1 = step(make(), batch)
  first = to_host((p1, n1))
  p2, n2 = step(p1, batch)
  assert_trees_close((first, to_host((p2, n2))), expected, rtol=1e-5, atol=1e-6)
  if method.runtime == "spmd":
    return
  for path, x in jax.tree_util.tree_leaves_with_path((p2.params, p2.opt_state)):
    if x.ndim:
      assert len(x.sharding.device_set) == 4, (jax.tree_util.keystr(path), x.sharding)
  exe = step.get_executable(p2, batch)
  trained = [x for path, x in jax.tree_util.tree_leaves_with_path(p2.params)
             if "block_0" not in jax.tree_util.keystr(path)]
  assert sum(len(st.diff) for st in exe.stages) == len(trained)


def test_an_evaluation_step_runs_as_shard_parallel_over_the_pipeline_devices():
  """A step that differentiates nothing (evaluation) has no stages: it runs as
  ShardParallel over the same devices and says so; before, GradientMarkerError."""
  make, batch = _gpt()

  def eval_step(state, batch):
    logits = state.apply_fn(state.params, batch["tokens"][:, :-1])
    labels = batch["tokens"][:, 1:]
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
            "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}

  method = jd.PipeshardParallel(num_micro_batches=2, layer_option="manual")
  step = jd.parallelize(eval_step, method=method)
  assert_trees_close(to_host(step(make(), batch)), to_host(jax.jit(eval_step)(make(), batch)),
                     rtol=1e-5, atol=1e-6)
  exe = step.get_executable(make(), batch)
  assert exe.plan.method == "ShardParallel" and "evaluation step" in exe.plan.notes[0]
  assert exe.plan.mesh_shape in ((8,), (2, 4), (4, 2))


class _DenseDropout(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dropout(0.3, deterministic=False)(nn.Dense(32)(x))


@pytest.mark.parametrize("option", [None, jd.AutoShardingOption(force_zero_stage_3=True)],
                         ids=["per-device", "sharded"])
def test_dropout_masks_in_a_pipeline_are_the_full_batch_steps(option):
  """Each micro-batch (and each device of a per-device stage) draws its rows of the whole
  batch's dropout masks, also inside a rematerialized block, so two steps equal the
  single-device step's; before, every micro-batch drew the same masks."""
  model = nn.Sequential([nn.Dense(32), lambda x: nn.Dropout(0.5, deterministic=False)(x),
                         nn.remat(_DenseDropout)(), nn.Dense(8)])
  data = models.regression_batch(16, 8)
  key = jax.random.key(0)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init({"params": key, "dropout": key}, data["x"]),
      tx=optax.sgd(0.1))

  def step_fn(value_and_grad):
    def step(state, batch):
      rngs = {"dropout": jax.random.fold_in(jax.random.key(1), state.step)}
      def loss_fn(params):
        return jnp.mean((state.apply_fn(params, batch["x"], rngs=rngs) - batch["y"]) ** 2)
      loss, grads = value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss
    return step

  serial = jax.jit(step_fn(jax.value_and_grad))
  s1, l1 = serial(state, data)
  expected = to_host((l1, serial(s1, data)))
  step = jd.parallelize(step_fn(jd.value_and_grad), method=jd.PipeshardParallel(
      num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2),
      default_auto_sharding_option=option))
  p1, n1 = step(state, data)
  assert_trees_close(to_host((n1, step(p1, data))), expected, rtol=1e-5, atol=1e-6)
  exe = step.get_executable(p1, data)
  per_device = ["per device" in st.note for st in exe.stages]
  assert per_device == [option is None] * 2, [st.note for st in exe.stages]
  assert not any("same bits" in n for n in exe.plan.notes), exe.plan.notes


def test_each_stage_is_shard_parallel_on_its_sub_mesh():
  """Stage programs are planned by the shard ILP on the given sub-mesh shapes; the
  options apply per stage (ZeRO-3: every parameter sharded; a partition constraint on
  the parameters it matches), and the state lives sharded as the stage's programs read it."""
  make, batch = _gpt()
  expected = _serial_twice()
  pattern = "*block_3*Dense_0*kernel*"
  option = jd.AutoShardingOption(force_zero_stage_3=True,
                                 partition_constraints={pattern: P(None, "mesh_1")})
  method = jd.PipeshardParallel(
      num_micro_batches=2, default_auto_sharding_option=option,
      stage_option=jd.ManualStageOption([[0, 1, 2], [3, 4, 5]], [(2, 2), (1, 4)]))
  step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
  state = make()
  exe = step.get_executable(state, batch)
  assert [st.mesh.shape for st in exe.stages] == [(2, 2), (1, 4)]
  p1, n1 = exe(state, batch)
  assert_trees_close((to_host((p1, n1)), to_host(exe(p1, batch))), expected, rtol=1e-5, atol=1e-6)
  leaves = jax.tree_util.tree_leaves_with_path(p1.params)
  for path, x in leaves:
    name = jax.tree_util.keystr(path)
    assert not x.sharding.is_fully_replicated, (name, x.sharding)  # ZeRO-3 within the stage
    assert len(x.sharding.device_set) == 4
    if path_matches(pattern, name):
      assert x.sharding.spec == P(None, "mesh_1"), (name, x.sharding)
  assert any(path_matches(pattern, jax.tree_util.keystr(p)) for p, _ in leaves)
  assert exe.auto_sharding_objective > 0
  assert any("as a (2, 2) mesh" in note for note in exe.plan.notes), exe.plan.notes

  bad = jd.AutoShardingOption(partition_constraints={"*block_3*Dense_0*kernel": P()})
  with pytest.raises(errors.InvalidArgumentError, match=r"kernel' matches no parameter.*mean "
                     r"'\*block_3\*Dense_0\*kernel\*'"):
    jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
        default_auto_sharding_option=bad)).get_executable(make(), batch)


def test_pipeline_errors():
  with pytest.raises(errors.InvalidArgumentError, match=r"pipeline_schedule='zigzag'"):
    jd.PipeshardParallel(pipeline_schedule="zigzag")
  with pytest.raises(errors.InvalidArgumentError, match=r"stage_option='best'"):
    jd.PipeshardParallel(stage_option="best")
  with pytest.raises(errors.InvalidArgumentError, match=r"max_pipeline_bubble_ratio=1.5"):
    jd.PipeshardParallel(max_pipeline_bubble_ratio=1.5)
  with pytest.raises(errors.InvalidArgumentError, match=r"max_pipeline_unbalance_ratio=0"):
    jd.PipeshardParallel(max_pipeline_unbalance_ratio=0)
  with pytest.raises(errors.InvalidArgumentError, match=r"layer_option='layers'"):
    jd.PipeshardParallel(layer_option="layers")

  make, batch = _gpt()
  run = lambda method, step_fn=models.lm_step(jd.value_and_grad): jd.parallelize(
      step_fn, method=method).get_executable(make(), batch)
  with pytest.raises(errors.InvalidArgumentError, match=r"8 stages but only 6 layers"):
    run(jd.PipeshardParallel(stage_option=jd.UniformStageOption(num_stages=8)))
  with pytest.raises(errors.InvalidArgumentError, match=r"submesh_shape=\(1, 2\).*have 4 each"):
    run(jd.PipeshardParallel(stage_option=jd.UniformStageOption(num_stages=2,
                                                                submesh_shape=(1, 2))))
  with pytest.raises(errors.InvalidArgumentError, match=r"3 equal sub-meshes do not tile the 8"):
    run(jd.PipeshardParallel(stage_option=jd.UniformStageOption(num_stages=3)))
  with pytest.raises(errors.InvalidArgumentError, match=r"submesh_shapes.*add up to the 8"):
    run(jd.PipeshardParallel(stage_option=jd.ManualStageOption([[0, 1, 2], [3, 4, 5]],
                                                               [(1, 4), (1, 2)])))
  with pytest.raises(errors.BatchDivisibilityError, match=r"\(32, 33\).*5 micro-batches"):
    run(jd.PipeshardParallel(num_micro_batches=5))
  # A scalar in the batch argument is shared by the whole batch (it raised an IndexError,
  # then BatchDivisibilityError).
  step = lambda state, b: models.lm_step(jd.value_and_grad)(state, b["batch"])
  shared = {"batch": batch, "n": jnp.int32(0)}
  expected = jax.jit(step)(make(), shared)[1]["loss"]
  actual = jd.parallelize(step, method=jd.PipeshardParallel(num_micro_batches=2))(make(), shared)
  np.testing.assert_allclose(actual[1]["loss"], expected, rtol=1e-5)
  with pytest.raises(errors.GradientMarkerError, match=r"jaxdist.value_and_grad instead"):
    run(jd.PipeshardParallel(), outside_gradient_step(make().apply_fn, lm=True))
  data = models.regression_batch(16, 8)
  mlp = models.create_state(models.MLP(hidden=8, num_layers=1), data["x"], tx=optax.sgd(0.1))
  mse = lambda p, x, y: jnp.mean((mlp.apply_fn(p, x) - y) ** 2)

  def per_example(state, batch):  # DP-SGD's gradients (was a NotImplementedError of jax's)
    grads = jax.vmap(jd.grad(lambda p, x, y: mse(p, x[None], y[None])), in_axes=(None, 0, 0))(
        state.params, batch["x"], batch["y"])
    return state.apply_gradients(grads=jax.tree.map(lambda g: g.mean(0), grads))

  def two_losses(state, batch):
    grads = jax.grad(mse)(state.params, batch["x"], batch["y"])
    again = jax.grad(mse)(state.params, batch["x"] * 2, batch["y"])
    return state.apply_gradients(grads=jax.tree.map(jnp.add, grads, again))

  for step, message in ((per_example, "under jax.vmap"), (two_losses, "none of its 2 jax.grad")):
    with pytest.raises(errors.GradientMarkerError, match=message):
      jd.parallelize(step, method=jd.PipeshardParallel()).get_executable(mlp, data)

  make, batch = _gpt(mark_boundaries=False)
  with pytest.raises(errors.InvalidArgumentError, match=r"marks no layer boundary"):
    run(jd.PipeshardParallel(layer_option="manual"))

  def marker_outside(state, batch):
    jd.mark_pipeline_boundary()
    return models.lm_step(jd.value_and_grad)(state, batch)

  with pytest.raises(errors.InvalidArgumentError, match=r"outside the function passed"):
    run(jd.PipeshardParallel(layer_option=jd.AutoLayerOption(layer_num=2)), marker_outside)


class _Block(nn.Module):
  width: int
  mark: bool = False  # a boundary at the start of the block (inside the module)
  split: bool = False  # a boundary in the middle of the block

  @nn.compact
  def __call__(self, x):
    if self.mark:
      jd.mark_pipeline_boundary()
    h = jnp.tanh(nn.Dense(self.width)(x))
    if self.split:
      jd.mark_pipeline_boundary()
    return x + nn.Dense(self.width)(h)


class _Net(nn.Module):
  """Boundaries where users put them: in the model's __call__, inside blocks, inside
  remat'd blocks, inside jitted helpers."""
  mode: str

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32)(x)
    for i in range(4):
      if self.mode == "call" and i == 2:
        jd.mark_pipeline_boundary()
      if self.mode == "jit" and i == 2:
        jax.jit(jd.mark_pipeline_boundary)()
      if self.mode == "remat":
        x = nn.remat(_Block)(32, mark=i > 0)(x)
      elif self.mode == "remat-split":
        x = nn.remat(_Block)(32, split=i == 1)(x)
      else:
        x = _Block(32)(x)
    return nn.Dense(4)(x)


class _NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(16, 32, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(4)])
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for i, block in enumerate(self.blocks):
      if i == 2:
        jd.mark_pipeline_boundary()
      x = x + jnp.tanh(block(x))
    return self.out(x)


@pytest.mark.parametrize("mode,wrap,stages,remats", [
    ("call", False, 2, 0), ("call", True, 2, 0), ("jit", False, 2, 0),
    ("remat", False, 4, 4), ("remat", True, 4, 4), ("remat-split", False, 2, 5),
    ("nnx", False, 2, 0)])
def test_boundaries_inside_modules_remat_and_jit_are_found(mode, wrap, stages, remats):
  """Alpa's documented usage: mark_pipeline_boundary() inside the model, the loss
  optionally wrapped by manual_layer_construction, layer_option="manual"."""
  from flax.training import train_state

  x = jax.random.normal(jax.random.key(0), (32, 16))
  batch = {"x": x, "y": jax.random.normal(jax.random.key(1), (32, 4))}
  if mode == "nnx":
    graphdef, params = nnx.split(_NnxNet(nnx.Rngs(2)))
    apply = lambda p, xs: nnx.merge(graphdef, p)(xs)
  else:
    net = _Net(mode)
    params, apply = net.init(jax.random.key(2), x), net.apply
  state = train_state.TrainState.create(apply_fn=apply, params=params, tx=optax.sgd(0.1))

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

    f = jd.manual_layer_construction(loss_fn) if wrap else loss_fn
    loss, grads = jd.value_and_grad(f)(state.params)
    return state.apply_gradients(grads=grads), loss

  expected = to_host(jax.jit(step)(state, batch))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.JaxdistWarning)  # remat2 planned replicated
    exe = jd.parallelize(step, method=jd.PipeshardParallel(num_micro_batches=4)).get_executable(
        state, batch)
    got = to_host(exe(state, batch))
  assert len(exe.stages) == stages
  assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
  # Recomputation survives the hoisting: a remat'd block cut in the middle becomes two.
  from jaxdist.pipeline.layers import boundary_p, hoist_boundaries
  closed = hoist_boundaries(jax.make_jaxpr(lambda p: apply(p, x))(params))
  names = [e.primitive.name for e in closed.jaxpr.eqns]
  assert names.count("remat2") == remats
  assert names.count(boundary_p.name) == stages - 1


def test_automatic_layers_see_through_jitted_and_remat_models():
  """The whole model behind jax.jit, its blocks remat'd: AutoLayerOption still clusters
  the blocks (calls inlined, remat bodies counted by their flops)."""
  from flax.training import train_state

  x = jax.random.normal(jax.random.key(0), (32, 16))
  batch = {"x": x, "y": jax.random.normal(jax.random.key(1), (32, 4))}
  net = _Net("remat")
  state = train_state.TrainState.create(apply_fn=jax.jit(net.apply),
                                        params=net.init(jax.random.key(2), x), tx=optax.sgd(0.1))

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jd.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  expected = to_host(jax.jit(step)(state, batch))
  method = jd.PipeshardParallel(num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", errors.JaxdistWarning)
    exe = jd.parallelize(step, method=method).get_executable(state, batch)
    got = to_host(exe(state, batch))
  assert len(exe.stages) == 2
  assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)


def test_handover_counts_no_collective_over_one_device():
  """A stage on a (1, 2) sub-mesh returning a value split over its size-1 axis to a
  reader that takes it whole: XLA compiles nothing for the size-1 axis, so neither does
  the prediction; over the size-2 axis it is an all-gather."""
  from jaxdist.mesh import LogicalMesh
  from jaxdist.pipeline.partition import Stage
  from jaxdist.pipeline.runtime import _hand_over
  lmesh = LogicalMesh((1, 2), devices=jax.devices()[:2])
  stage = Stage((0, 1), (), lmesh, (), (), ())
  aval = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  whole = jax.sharding.NamedSharding(lmesh.mesh, P())
  _hand_over(stage, [(P("mesh_0"), whole, aval)])
  assert stage.handover == {}
  _hand_over(stage, [(P("mesh_1"), whole, aval)])
  assert stage.handover == {"all-gather": {"count": 1, "result_bytes": 128.0}}
