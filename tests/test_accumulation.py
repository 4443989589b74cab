"""Gradient accumulation: numerics, one reduction per step, memory, markers, errors.

Tolerances as in test_numerics.py (SGD + momentum: only summation order differs).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax import value_and_grad as bound_value_and_grad  # jax's own, bound at import

import jaxdist as jd
from jaxdist import errors, models, rng
from helpers import (assert_trees_close, contrastive, dropout_key_step, outside_gradient_step,
                     squared_error_step, to_host)

METHODS = [jd.DataParallel, jd.Zero2Parallel, jd.Zero3Parallel]


def _gpt_setup(batch_size=32, depth=2, width=64, seq_len=32):
  config = models.GPTConfig(vocab=256, width=width, heads=4, depth=depth, seq_len=seq_len)
  batch = models.token_batch(batch_size, config)
  make = lambda: models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                                     tx=optax.sgd(0.1, momentum=0.9))
  return make, batch


def _mlp_setup():
  batch = models.regression_batch(64, 32)
  model = models.MLP(hidden=64, num_layers=3)
  make = lambda: models.create_state(model, batch["x"], tx=optax.sgd(0.05, momentum=0.9))
  return make, batch


def _two_steps(step, state, batch):
  s1, m1 = step(state, batch)
  first = to_host((s1, m1))
  return first, to_host(step(s1, batch))


@pytest.mark.parametrize("method_cls", METHODS)
@pytest.mark.parametrize("setup,step_fn", [(_mlp_setup, models.regression_step),
                                           (_gpt_setup, models.lm_step)], ids=["mlp", "gpt"])
def test_four_micro_batches_equal_the_full_batch_step(method_cls, setup, step_fn):
  make, batch = setup()
  expected = _two_steps(jax.jit(step_fn()), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method_cls(num_micro_batches=4))
  actual = _two_steps(step, make(), batch)
  assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)
  assert step.get_executable(make(), batch).plan.num_micro_batches == 4


@pytest.mark.parametrize("method_cls", METHODS)
def test_gradients_are_reduced_once_per_step(method_cls):
  make, batch = _mlp_setup()
  wire = {}
  for k in (1, 4):
    step = jd.parallelize(models.regression_step(jd.value_and_grad),
                          method=method_cls(num_micro_batches=k))
    comm = step.get_executable(make(), batch).communication()
    wire[k] = {kind: s.wire_bytes for kind, s in comm.items() if kind != "all-gather"}
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(make().params))
  assert sum(wire[1].values()) >= 7 / 8 * param_bytes  # the gradients do cross devices
  for kind in wire[4]:
    assert wire[4][kind] <= 1.1 * wire[1][kind], (kind, wire)
  if method_cls is jd.DataParallel:
    assert set(wire[4]) == {"all-reduce"}
  else:  # ZeRO: the gradients are reduce-scattered, only the loss is all-reduced
    assert wire[4]["reduce-scatter"] == pytest.approx(7 / 8 * param_bytes, rel=0.01)


def token_weighted_setup(batch_size=32, seq_len=16, tx=None, clamped=False):
  """A GPT whose loss is a token-weighted mean, ``(l * mask).sum() / mask.sum()``, with
  padding that differs per example (rows 0 and 1 are all padding). ``clamped``: the mask
  is boolean and the loss ``where(mask, l, 0).sum() / maximum(mask.sum(), 1)``."""
  config = models.GPTConfig(vocab=128, width=32, heads=4, depth=2, seq_len=seq_len)
  batch = models.token_batch(batch_size, config)
  lengths = (jnp.arange(batch_size) * 5) % 13 * (jnp.arange(batch_size) > 1)
  batch["mask"] = (jnp.arange(seq_len)[None, :] < lengths[:, None]).astype(jnp.float32)
  make = lambda: models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                                     tx=tx or optax.sgd(0.1, momentum=0.9))

  def step_fn(value_and_grad=jax.value_and_grad):
    def train_step(state, batch):
      def loss_fn(params):
        logits = state.apply_fn(params, batch["tokens"][:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        if clamped:
          mask = batch["mask"] > 0
          return jnp.where(mask, loss, 0.0).sum() / jnp.maximum(mask.sum(), 1)
        return (loss * batch["mask"]).sum() / batch["mask"].sum()

      loss, grads = value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step

  return make, batch, step_fn


@pytest.mark.parametrize("method", [
    jd.Zero3Parallel(num_micro_batches=2),
    pytest.param(jd.ShardParallel(logical_mesh_shape=(2, 4), num_micro_batches=2),
                 marks=pytest.mark.slow)],  # (ShardParallel's weighting: the next test)
    ids=["zero3-k2", "shard-2x4-k2"])
def test_token_weighted_losses_accumulate_to_the_full_batch_step(method):
  """Each micro-batch on each device divides by its own token count; combined weighted
  by those counts they give the whole batch's loss and gradients (a plain mean of the
  micro-batch losses was 27% off in the update). A share of only padding (count 0)
  adds nothing."""
  make, batch, step_fn = token_weighted_setup()
  expected = _two_steps(jax.jit(step_fn()), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method)
  assert_trees_close(_two_steps(step, make(), batch), expected, rtol=1e-5, atol=1e-6)
  notes = step.get_executable(make(), batch).plan.notes
  assert not any("mixes examples" in note for note in notes), notes


@pytest.mark.parametrize("method", [
    jd.DataParallel(num_micro_batches=2),
    jd.ShardParallel(logical_mesh_shape=(2, 4), num_micro_batches=2)],
    ids=["dp-k2", "shard-2x4-k2"])
def test_a_clamped_token_count_accumulates_to_the_full_batch_step(method):
  """``maximum(mask.sum(), 1)`` (the guard against 0 / 0) clamps no count of a boolean
  mask but 0, so weighting by the count is still exact. Before, such a loss counted as
  mixing examples: each micro-batch divided by its own count and the means were averaged
  (the first loss 7% and the update 34% off serial on this batch)."""
  make, batch, step_fn = token_weighted_setup(clamped=True)
  expected = _two_steps(jax.jit(step_fn()), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method)
  assert_trees_close(_two_steps(step, make(), batch), expected, rtol=1e-5, atol=1e-6)
  notes = step.get_executable(make(), batch).plan.notes
  assert not any("mixes examples" in note for note in notes), notes


def _sum_loss_setup():
  """A GPT (boundaries after each block) whose loss is a negated sum over every token's
  log-likelihood divided by a constant that is not the batch size plus another sum over
  the batch, with a float aux that sums over the batch (a token count read from the
  batch) and one that is a mean."""
  config = models.GPTConfig(vocab=64, width=32, heads=2, depth=4, seq_len=16,
                            mark_boundaries=True)
  batch = models.token_batch(16, config)
  make = lambda: models.create_state(models.GPT(config), batch["tokens"][:, :-1],
                                     tx=optax.sgd(1e-3))

  def step_fn(value_and_grad=jax.value_and_grad):
    def train_step(state, batch):
      tokens = batch["tokens"]

      def loss_fn(params):
        logp = jax.nn.log_softmax(state.apply_fn(params, tokens[:, :-1]))
        ll = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)
        counted = jnp.sum((tokens[:, 1:] >= 0).astype(jnp.float32))
        loss = -jnp.sum(ll) / 100.0 + 1e-3 * jnp.sum(jnp.square(logp[..., 0]))
        return loss, {"tokens": counted, "mean_ll": jnp.mean(ll)}

      (loss, aux), grads = value_and_grad(loss_fn, has_aux=True)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss, **aux}

    return train_step

  return make, batch, step_fn


@pytest.mark.parametrize("method", [
    jd.DataParallel(),
    pytest.param(jd.ShardParallel(logical_mesh_shape=(2, 4), num_micro_batches=2),
                 marks=pytest.mark.slow),  # (ShardParallel's part scales: the clamped test)
    jd.PipeshardParallel(num_micro_batches=2, layer_option="manual", runtime="mpmd"),
    jd.PipeshardParallel(num_micro_batches=4, runtime="spmd", pipeline_schedule="1f1b")],
    ids=["dp", "shard-2x4-k2", "mpmd-pipeline", "spmd-1f1b"])
def test_a_loss_that_sums_over_the_batch_is_summed_over_its_parts(method):
  """A device's share and a micro-batch of ``-sum(ll) / 100`` weigh 1 in the whole
  batch's loss, not 1 / parts as a mean's do (``coupling.part_scale``): the parts' losses,
  gradients and summed aux add up. Before, every method but ShardParallel without
  micro-batches averaged them: the loss came back 1/8 of serial and the update was off."""
  make, batch, step_fn = _sum_loss_setup()
  expected = _two_steps(jax.jit(step_fn()), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method)
  assert_trees_close(_two_steps(step, make(), batch), expected, rtol=1e-5, atol=1e-5)


def test_a_sum_plus_a_penalty_runs_as_one_program_or_warns():
  """``sum(l) + penalty(params)``: no weight per part gives the whole batch's value (the
  parts' sums add up, their penalties must not). DataParallel without micro-batches runs
  it as one whole-batch program, which is exact (before: 1/8 of the loss); with
  micro-batches it warns that the parts are averaged."""
  batch = models.regression_batch(32, 16)
  make = lambda: models.create_state(models.MLP(hidden=32, num_layers=2), batch["x"],
                                     tx=optax.sgd(0.01))

  def step_fn(value_and_grad=jax.value_and_grad):
    def train_step(state, batch):
      def loss_fn(params):
        err = state.apply_fn(params, batch["x"]) - batch["y"]
        return jnp.sum(err ** 2) + 1e-2 * sum(jnp.sum(w ** 2) for w in jax.tree.leaves(params))

      loss, grads = value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step

  expected = _two_steps(jax.jit(step_fn()), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=jd.DataParallel())
  assert_trees_close(_two_steps(step, make(), batch), expected, rtol=1e-5, atol=1e-5)
  notes = step.get_executable(make(), batch).plan.notes
  assert any("adds a sum over the batch" in note for note in notes), notes
  with pytest.warns(errors.JaxdistWarning, match="adds a sum over the batch"):
    jd.parallelize(step_fn(jd.value_and_grad), method=jd.DataParallel(
        num_micro_batches=2)).get_executable(make(), batch)


@pytest.mark.parametrize("method", [
    jd.DataParallel(num_micro_batches=2),
    jd.ShardParallel(logical_mesh_shape=(2, 4), num_micro_batches=2),
    jd.PipeshardParallel(num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2))],
    ids=["dp-k2", "shard-2x4-k2", "mpmd-pipeline-k2"])
def test_a_step_that_mixes_examples_warns_when_split_into_micro_batches(method):
  """A contrastive loss's negatives are the rest of the batch: micro-batches see fewer of
  them, so the step is not the single-device one. That was only a plan note (none at all
  in a pipeline); it is a JaxdistWarning, every time the step is compiled."""
  step, make_state, batch = contrastive()
  for _ in range(2):  # the second compile hits the plan cache
    with pytest.warns(errors.JaxdistWarning, match="mixes examples"):
      jd.parallelize(step, method=method).get_executable(make_state(), batch)


def test_rows_of_random_bits_are_the_whole_draws_rows():
  key = jax.random.fold_in(jax.random.key(3), 7)
  for width, dtype in ((32, jnp.uint32), (16, jnp.uint16)):
    full = jax.random.bits(key, (8, 5, 6), dtype)
    assert rng.supported(key, width, (8, 5, 6))
    for dim, size, offset in ((0, 2, 6), (1, 1, 3), (2, 3, 3)):
      got = rng.rows(key, width, (8, 5, 6), dim, size, jnp.int32(offset))
      assert (got == jax.lax.slice_in_dim(full, offset, offset + size, axis=dim)).all()


class _DenseDropout(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(64)(x)))


class _ScannedDropout(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return _DenseDropout()(x), None


class _Dropout(nn.Module):
  @nn.compact
  def __call__(self, x):
    for layer in range(2):  # the second rematerialized: its draws sit in its body
      x = (nn.remat(_DenseDropout) if layer == 1 else _DenseDropout)()(x)
    # Draws in a scan body, rematerialized as transformer stacks are (the second step is
    # traced on arrays the first placed: their mesh must not reach the jaxpr's types).
    scan = nn.scan(nn.remat(_ScannedDropout), variable_axes={"params": 0}, length=2,
                   split_rngs={"params": True, "dropout": True})
    x, _ = scan()(x, None)
    return nn.Dense(8)(x)


@pytest.mark.parametrize("method", [
    jd.DataParallel(), jd.Zero3Parallel(num_micro_batches=2),
    jd.ShardParallel(logical_mesh_shape=(2, 4), num_micro_batches=2)],
    ids=["dp", "zero3-k2", "shard-2x4-k2"])
def test_dropout_masks_are_the_full_batch_steps(method):
  """Each device's micro-batch draws its rows of the whole batch's dropout masks; before,
  every device and micro-batch drew the first rows' masks (the same mask on every device;
  an encoder-decoder's first loss was 0.2% off the serial step's)."""
  _check_dropout_matches_serial(method, jax.random.key)


@pytest.mark.parametrize("method", [jd.DataParallel(), jd.Zero3Parallel(num_micro_batches=2)],
                         ids=["dp", "zero3-k2"])
def test_dropout_from_an_rbg_key_matches_the_serial_step_and_warns(method):
  """An rbg key's bits for a part of the shape are not the whole draw's rows: each device
  draws the whole batch's bits and keeps its rows (before, its own draw: 1e-2 off serial)."""
  with pytest.warns(errors.JaxdistWarning, match="drawn whole"):
    _check_dropout_matches_serial(method, functools.partial(jax.random.key, impl="rbg"))


def _check_dropout_matches_serial(method, make_key):
  model, data = _Dropout(), models.regression_batch(32, 16)
  key = make_key(0)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init({"params": key, "dropout": key}, data["x"]),
      tx=optax.sgd(0.1, momentum=0.9))

  def step_fn(value_and_grad):
    def train_step(state, batch):
      rngs = {"dropout": jax.random.fold_in(make_key(1), state.step)}
      def loss_fn(params):
        return jnp.mean((state.apply_fn(params, batch["x"], rngs=rngs) - batch["y"]) ** 2)
      loss, grads = value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}
    return train_step

  expected = _two_steps(jax.jit(step_fn(jax.value_and_grad)), state, data)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method)
  assert_trees_close(_two_steps(step, state, data), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setup,step_fn,mesh_shape", [
    (_mlp_setup, models.regression_step, None),       # mesh shape searched
    pytest.param(_gpt_setup, models.lm_step, (2, 4),  # model axis auto inside the loop
                 marks=pytest.mark.slow),
], ids=["mlp", "gpt-2x4"])
def test_shard_parallel_four_micro_batches_equal_the_full_batch_step(setup, step_fn, mesh_shape):
  make, batch = setup()
  expected = _two_steps(jax.jit(step_fn()), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=jd.ShardParallel(
      num_micro_batches=4, logical_mesh_shape=mesh_shape))
  actual = _two_steps(step, make(), batch)
  assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)
  exe = step.get_executable(make(), batch)
  assert exe.plan.num_micro_batches == 4
  batch_spec = next(e.spec for e in exe.plan.inputs if e.role == "batch")
  assert batch_spec[0] is not None  # micro-batches run over the axes splitting the batch


def test_shard_parallel_reduces_gradients_once_per_step():
  make, batch = _gpt_setup()
  wire, comm = {}, {}
  for k in (1, 4):
    step = jd.parallelize(models.lm_step(jd.value_and_grad),
                          method=jd.ShardParallel(num_micro_batches=k, logical_mesh_shape=(8,)))
    comm[k] = step.get_executable(make(), batch).communication()
    wire[k] = sum(s.wire_bytes for kind, s in comm[k].items()
                  if kind in ("all-reduce", "reduce-scatter"))
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(make().params))
  assert wire[1] >= 7 / 8 * param_bytes  # the gradients do cross devices
  # At most one all-reduce of every gradient (2 (n-1)/n of its bytes on the wire), not
  # one per micro-batch. (The k=1 plan may reduce less: it splits the embedding on its
  # hidden dim, whose gradient is then scattered locally, with no reduction at all.)
  assert wire[4] <= 1.1 * 2 * 7 / 8 * param_bytes, comm


def test_only_one_micro_batch_of_activations_is_live():
  make, batch = _gpt_setup(batch_size=64, depth=2, width=32, seq_len=64)
  temp = {}
  for k in (1, 4):
    step = jd.parallelize(models.lm_step(jd.value_and_grad),
                          method=jd.DataParallel(num_micro_batches=k))
    temp[k] = step.get_executable(make(), batch).memory_analysis().temp_size_in_bytes
  assert temp[4] <= 0.5 * temp[1], temp


def test_marker_is_an_identity_outside_parallelize():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
  w, x = jnp.ones((4, 3)) * 0.1, jnp.arange(8.0).reshape(2, 4)
  assert_trees_close(jd.grad(f)(w, x), jax.grad(f)(w, x), rtol=0, atol=0)
  assert_trees_close(jax.jit(jd.value_and_grad(f))(w, x), jax.value_and_grad(f)(w, x),
                     rtol=1e-6, atol=0)
  batched = jax.vmap(jd.grad(f), in_axes=(None, 0))(w, x[:, None])
  assert_trees_close(batched, jax.vmap(jax.grad(f), in_axes=(None, 0))(w, x[:, None]),
                     rtol=1e-6, atol=0)
  aux = jd.value_and_grad(lambda w: (f(w, x), {"n": 3}), has_aux=True)(w)
  assert aux[0][1] == {"n": 3}


def test_aux_is_averaged_and_a_jitted_helper_is_looked_into():
  make, batch = _mlp_setup()

  def step(state, batch):
    @jax.jit
    def grads(params):
      def loss_fn(p):
        err = state.apply_fn(p, batch["x"]) - batch["y"]
        return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err))}
      return jd.value_and_grad(loss_fn, has_aux=True)(params)
    (loss, aux), g = grads(state.params)
    return state.apply_gradients(grads=g), {"loss": loss, **aux}

  expected = jax.jit(step)(make(), batch)
  actual = jd.parallelize(step, method=jd.DataParallel(num_micro_batches=2))(make(), batch)
  assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_metrics_outside_grad_warn_and_stay_correct():
  make, batch = _mlp_setup()

  def step(state, batch):
    loss, g = jd.value_and_grad(
        lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(state.params)
    pred = state.apply_fn(state.params, batch["x"])  # a second forward, outside the marker
    return state.apply_gradients(grads=g), {"loss": loss, "pred_mean": pred.mean()}

  expected = jax.jit(step)(make(), batch)
  with pytest.warns(errors.JaxdistWarning, match="outside jaxdist.grad"):
    actual = jd.parallelize(step, method=jd.DataParallel(num_micro_batches=2))(make(), batch)
  assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_micro_batches_must_divide_the_batch():
  make, batch = _mlp_setup()  # batch 64 = 8 devices x 8
  step = jd.parallelize(models.regression_step(jd.value_and_grad),
                        method=jd.DataParallel(num_micro_batches=3))
  with pytest.raises(errors.BatchDivisibilityError,
                     match=r"batch\['x'\].*\(64, 32\).*num_micro_batches=3.*multiple of 24"):
    step(make(), batch)


def test_a_step_made_by_a_factory_handed_jax_value_and_grad_is_marked():
  """``make_step(jax.value_and_grad)``: jax's transform sits in the step's closure, where
  jaxdist did not look (micro-batches raised GradientMarkerError; under ZeRO-2 XLA
  reduced the gradients, 0.65x of DataParallel's bytes where the mark gives 0.33x). It
  is marked like a call of ``jax.value_and_grad`` in the step, and put back after."""
  make, batch = _mlp_setup()
  step = models.regression_step(jax.value_and_grad)
  expected = to_host(jax.jit(step)(make(), batch))
  got = jd.parallelize(step, method=jd.Zero2Parallel(num_micro_batches=2))(make(), batch)
  assert_trees_close(to_host(got), expected, rtol=1e-5, atol=1e-6)
  assert [c.cell_contents for c in step.__closure__ if callable(c.cell_contents)] == [
      jax.value_and_grad]


def test_micro_batches_need_jaxdist_grad():
  make, batch = _mlp_setup()
  step = jd.parallelize(outside_gradient_step(make().apply_fn),
                        method=jd.Zero2Parallel(num_micro_batches=2))
  with pytest.raises(errors.GradientMarkerError, match=r"num_micro_batches=2.*jaxdist.grad"):
    step(make(), batch)

  def two_gradients(w, batch):  # a GAN's step: the second loss reads the first update
    w = w - 0.1 * jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
    return w - 0.1 * jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(w)

  step = jd.parallelize(two_gradients, method=jd.DataParallel(num_micro_batches=2))
  with pytest.raises(errors.GradientMarkerError, match=r"the step's 2 jax.grad / value_and_grad "
                                                       r"calls cannot be split"):
    step(jnp.ones((32, 8)), batch)


@pytest.mark.parametrize("method", [
    jd.DataParallel(), jd.Zero3Parallel(num_micro_batches=2),
    jd.ShardParallel(logical_mesh_shape=(2, 4), num_micro_batches=2),
    jd.PipeshardParallel(num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2))],
    ids=["dp", "zero3-k2", "shard-2x4-k2", "mpmd-pipeline"])
def test_per_example_aux_comes_back_in_batch_order(method):
  """An aux output with a batch dimension (the predictions, returned for metrics: flax's
  usual train step) is concatenated over micro-batches and devices in batch order, and
  metrics computed from it after the gradient equal serial. Before, DataParallel, ZeRO
  and ShardParallel with micro-batches refused it and pipelines failed mid-step."""
  make, batch = _mlp_setup()

  def step_fn(value_and_grad):
    def step(state, batch):
      def loss_fn(p):
        pred = state.apply_fn(p, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), pred
      (loss, pred), g = value_and_grad(loss_fn, has_aux=True)(state.params)
      close = jnp.mean(jnp.abs(pred - batch["y"]) < 1.0)
      return state.apply_gradients(grads=g), {"loss": loss, "pred": pred, "close": close}
    return step

  expected = _two_steps(jax.jit(step_fn(jax.value_and_grad)), make(), batch)
  step = jd.parallelize(step_fn(jd.value_and_grad), method=method)
  assert_trees_close(_two_steps(step, make(), batch), expected, rtol=1e-5, atol=1e-6)
  if isinstance(method, jd.ShardParallel):  # the rows are not reduced: none predicted
    exe = step.get_executable(make(), batch)
    predicted, compiled = exe.plan.predicted_collectives, exe.communication()
    assert set(predicted) == set(compiled), (predicted, compiled)
    for kind, c in compiled.items():
      assert abs(predicted[kind]["result_bytes"] - c.result_bytes) <= 0.1 * c.result_bytes


def test_an_aux_batch_dimension_other_than_dim_0_is_rejected():
  make, batch = _mlp_setup()

  def step(state, batch):
    def loss_fn(p):
      pred = state.apply_fn(p, batch["x"])
      return jnp.mean((pred - batch["y"]) ** 2), pred.T
    (loss, pred), g = jd.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=g), loss

  with pytest.raises(errors.InvalidArgumentError, match=r"aux.*\(8, 64\).*must be dim 0"):
    jd.parallelize(step, method=jd.DataParallel(num_micro_batches=2))(make(), batch)


class _ResidualBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(x))), None


class _ScannedRematStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32)(x)
    x, _ = nn.scan(nn.remat(_ResidualBlock), variable_axes={"params": 0}, length=3,
                   split_rngs={"params": True})()(x, None)
    return nn.Dense(8)(x)


def test_a_scanned_remat_stack_is_traced_again_on_the_arrays_it_placed():
  """A new static argument (here the step number; a train flag, another batch size)
  traces the step again, on the arrays the first step placed: their mesh reached the
  jaxpr's types through a scan of rematerialized blocks, and evaluating it per device
  (inside shard_map) failed with 'Mesh for all inputs should be equal'."""
  model, data = _ScannedRematStack(), models.regression_batch(32, 8)
  params = model.init(jax.random.key(0), data["x"])
  tx = optax.adam(1e-3)

  def step_fn(value_and_grad):
    def step(params, opt_state, batch, number):
      loss, g = value_and_grad(
          lambda p: jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2))(params)
      loss = loss + 0 * number
      updates, opt_state = tx.update(g, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return step

  def twice(step):
    p, o, first = step(params, tx.init(params), data, 0)
    return to_host(first), to_host(step(p, o, data, 1))

  expected = twice(jax.jit(step_fn(jax.value_and_grad), static_argnums=3))
  step = jd.parallelize(step_fn(jd.value_and_grad), method=jd.DataParallel(),
                        batch_argnums=(2,))
  assert_trees_close(twice(step), expected, rtol=1e-5, atol=1e-6)


class _Recurrent(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.RNN(nn.OptimizedLSTMCell(32))(x)[:, -1])[:, 0]


def _recurrent_setup(tx):
  x = jax.random.normal(jax.random.key(0), (32, 8, 4))
  batch = {"x": x, "y": jnp.sum(x, (1, 2))}
  params = _Recurrent().init(jax.random.key(1), x)
  return (lambda: (params, tx.init(params))), batch


def test_a_step_calling_jax_value_and_grad_gets_jaxdist_gradients():
  """``jax.value_and_grad`` called in the step is jaxdist's while the step is traced:
  an LSTM's DataParallel step all-reduced its weight gradients in every backward time
  step (9 all-reduces, 8x the gradient bytes), and global-norm clipping under ZeRO-2
  chained 20 all-reduces on a llama-style model; now each reduces once per step, and
  ``num_micro_batches`` works without ``jaxdist.value_and_grad``. (The LSTM's hidden size
  is its batch size: its weight gradients, divided by their global norm after the
  marker, were taken for per-example values mixed with a batch statistic, and the step
  ran as one whole-batch program.)"""
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  make, batch = _recurrent_setup(tx)
  step = squared_error_step(_Recurrent(), tx)

  plain_grad = jax.value_and_grad
  expected = _two_steps(jax.jit(step), make(), batch)
  for method in (jd.DataParallel(), jd.Zero2Parallel(num_micro_batches=2)):
    f = jd.parallelize(step, method=method)
    exe = f.get_executable(make(), batch)
    assert exe.traced_step.marker_index is not None
    assert not [c for c in exe.check_communication() if "DIFFERS" in c], exe.check_communication()
    if isinstance(method, jd.DataParallel):
      assert exe.communication()["all-reduce"].count == 1
    assert_trees_close(_two_steps(f, make(), batch), expected, rtol=2e-5, atol=2e-6)
  assert jax.value_and_grad is plain_grad  # jax's own again outside the trace


class _ForwardAlgorithm(nn.Module):
  """A linear-chain CRF's log partition (a CTC loss's shape): a recursion over 40 time
  steps of the emissions, with a parameter transition matrix."""

  @nn.compact
  def __call__(self, x):
    emissions = nn.Dense(8)(nn.tanh(nn.Dense(32)(x)))  # (batch, time, states)
    transitions = self.param("transitions", nn.initializers.normal(0.1), (8, 8))

    def step(alpha, e):
      return jax.nn.logsumexp(alpha[:, :, None] + transitions, axis=1) + e, None

    alpha, _ = jax.lax.scan(step, emissions[:, 0], jnp.swapaxes(emissions[:, 1:], 0, 1))
    return jax.nn.logsumexp(alpha, axis=-1)


def test_a_loop_over_time_stays_a_loop_with_micro_batches():
  """With micro-batches a ShardParallel step compiles its planned scans unrolled; a
  recursion over time unrolled made XLA's compile time explode (a CTC loss over 40
  steps: 77 s, 1.6 s as a loop). Such a scan (long, scanning no stacked weights) stays
  a loop, planned replicated and pinned so, and the results and predictions hold."""
  x = jax.random.normal(jax.random.key(0), (16, 41, 6))
  batch = {"x": x, "y": jnp.sum(x, (1, 2)) * 0.1}
  tx = optax.sgd(1e-3)
  params = _ForwardAlgorithm().init(jax.random.key(1), x)
  step = squared_error_step(_ForwardAlgorithm(), tx)
  expected = _two_steps(jax.jit(step), (params, tx.init(params)), batch)
  f = jd.parallelize(step, method=jd.ShardParallel(logical_mesh_shape=(2, 4),
                                                   num_micro_batches=2))
  exe = f.get_executable((params, tx.init(params)), batch)
  assert any("2 x recursion of 40 steps" in n for n in exe.plan.notes), exe.plan.notes
  # the micro-batch loop and the recursion, forward and backward, inside it
  assert exe.get_hlo_text().count(" while(") == 3
  assert not [c for c in exe.check_communication() if "DIFFERS" in c], exe.check_communication()
  assert_trees_close(_two_steps(f, (params, tx.init(params)), batch), expected,
                     rtol=1e-4, atol=1e-5)


def test_a_name_bound_by_from_jax_import_is_jaxdist_s_while_tracing():
  """``from jax import value_and_grad`` binds jax's function in the step's module; while
  the step is traced that name is jaxdist's too. Left to XLA, ZeRO-2 all-reduced this
  MLP's whole gradients (43808 B per device) where a reduce-scatter leaves each device its
  eighth (5476 B), and micro-batches raised GradientMarkerError."""
  make, batch = _mlp_setup()

  def step(state, batch):
    def loss_fn(params):
      return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads = bound_value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  bound = bound_value_and_grad
  expected = _two_steps(jax.jit(step), make(), batch)
  for method in (jd.Zero2Parallel(), jd.Zero2Parallel(num_micro_batches=2)):
    f = jd.parallelize(step, method=method)
    exe = f.get_executable(make(), batch)
    assert exe.traced_step.marker_index is not None
    assert "reduce-scatter" in exe.communication()
    assert not [c for c in exe.check_communication() if "DIFFERS" in c], exe.check_communication()
    assert_trees_close(_two_steps(f, make(), batch), expected, rtol=2e-5, atol=2e-6)
  assert bound_value_and_grad is bound  # jax's own again outside the trace


def test_plain_gradients_jaxdist_cannot_own_are_left_to_xla():
  """Two top-level ``jax.grad`` calls (a loss and a penalty's gradient), one inside a
  loop, one with respect to the examples (a saliency map: no partial sum of devices), or
  one per example (under jax.vmap): the step is traced again as written and XLA reduces
  its gradients, silently."""
  make, batch = _mlp_setup()

  def loss_fn(params, x, y):
    return jnp.mean((models.MLP(hidden=64, num_layers=3).apply(params, x) - y) ** 2)

  def two_calls(state, batch):
    grads = jax.grad(loss_fn)(state.params, batch["x"], batch["y"])
    decay = jax.grad(lambda p: 1e-3 * sum(jnp.sum(w ** 2) for w in jax.tree.leaves(p)))(
        state.params)
    return state.apply_gradients(grads=jax.tree.map(jnp.add, grads, decay)), None

  def in_a_loop(state, batch):
    def body(acc, xy):
      return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(state.params, *xy)), None
    halves = jax.tree.map(lambda a: a.reshape(2, -1, *a.shape[1:]), (batch["x"], batch["y"]))
    grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, state.params), halves)
    return state.apply_gradients(grads=jax.tree.map(lambda g: g / 2, grads)), None

  def of_the_examples(state, batch):  # one call, with respect to the inputs
    gx = jax.grad(lambda x: loss_fn(state.params, x, batch["y"]))(batch["x"])
    return state, jnp.mean(gx ** 2, axis=1)

  def per_example(state, batch):  # DP-SGD: each example's gradient clipped (it raised)
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(
        state.params, batch["x"][:, None], batch["y"][:, None])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1)
                         for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
    clipped = jax.tree.map(lambda g: jnp.mean(g * scale.reshape(-1, *[1] * (g.ndim - 1)), 0),
                           grads)
    return state.apply_gradients(grads=clipped), None

  for step in (two_calls, in_a_loop, of_the_examples, per_example):
    expected = _two_steps(jax.jit(step), make(), batch)
    f = jd.parallelize(step, method=jd.DataParallel())
    with warnings.catch_warnings():
      warnings.simplefilter("error", errors.JaxdistWarning)
      exe = f.get_executable(make(), batch)
    assert exe.traced_step.num_markers == 0
    assert_trees_close(_two_steps(f, make(), batch), expected, rtol=2e-5, atol=2e-6)


def test_plain_gradient_call_shapes():
  """``jax.grad(..., has_aux=True)`` whose aux is a Python constant (a literal in the
  jaxpr: it crashed the per-device reduction) is jaxdist's; options passed by position
  (``holomorphic``) leave the call jax's."""
  w, batch = jnp.ones((8, 4)), {"x": jnp.linspace(0, 1, 128).reshape(16, 8)}

  def constant_aux(w, batch):
    g, aux = jax.grad(lambda w: (jnp.mean(jnp.tanh(batch["x"] @ w)), 1.0), has_aux=True)(w)
    return w - 0.1 * g, aux

  def positional(w, batch):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(batch["x"] @ w)), 0, False,
                                 False)(w)
    return w - 0.1 * g, loss

  for step, marked in ((constant_aux, True), (positional, False)):
    f = jd.parallelize(step, method=jd.DataParallel())
    assert (f.get_executable(w, batch).traced_step.marker_index is not None) == marked
    assert_trees_close(to_host(f(w, batch)), to_host(jax.jit(step)(w, batch)), rtol=1e-6,
                       atol=1e-7)


@pytest.mark.parametrize("method", [jd.DataParallel(), jd.Zero3Parallel(num_micro_batches=2),
                                    jd.ShardParallel(num_micro_batches=2)],
                         ids=["dp", "zero3-k2", "shard-k2"])
def test_a_dropout_key_in_the_batch_dict_is_shared_by_the_whole_batch(method):
  """``batch = {"x": ..., "y": ..., "key": jax.random.key(5)}``: a scalar in a batch argument
  has no examples to split (it raised BatchDivisibilityError under every method but
  ShardParallel without micro-batches); the whole batch shares it, and each micro-batch
  draws its rows of the whole batch's dropout mask."""
  step, make, batch = dropout_key_step()
  expected = jax.jit(step)(make(), batch)
  actual = jd.parallelize(step, method=method)(make(), batch)
  assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)
