"""Around the train step: state born in its layout (create_state, CreateStateParallel), an
evaluation step that follows the train step's layout (FollowParallel), and orbax
checkpoints restored into any plan."""

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxdist as jd
from jaxdist import errors, models
from helpers import assert_trees_close

CONFIG = models.GPTConfig(vocab=256, width=64, heads=4, depth=2, seq_len=32)
BATCH = models.token_batch(16, CONFIG)
MODEL = models.GPT(CONFIG)


def init_fn(key):
  params = MODEL.init(key, BATCH["tokens"][:, :-1])
  return train_state.TrainState.create(apply_fn=MODEL.apply, params=params,
                                       tx=optax.sgd(0.1, momentum=0.9))


def eval_fn(state, batch):
  tokens = batch["tokens"]
  logits = state.apply_fn(state.params, tokens[:, :-1])
  return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()}


KEY = jax.random.key(0)


@pytest.mark.parametrize("method", [
    jd.DataParallel(), jd.Zero3Parallel(), jd.ShardParallel(logical_mesh_shape=(2, 4)),
    pytest.param(jd.PipeshardParallel(num_micro_batches=2,
                                      layer_option=jd.AutoLayerOption(layer_num=2)),
                 marks=pytest.mark.slow)],  # (a pipeline's state: the checkpoint test below)
    ids=["dp", "zero3", "shard", "pipeshard"])
def test_state_is_born_in_the_step_layout(method):
  step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
  state = step.create_state(init_fn, KEY, batch=BATCH)
  exe = step.get_executable(state, BATCH)
  assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(exe.input_shardings[0])
  serial = jax.jit(init_fn)(KEY)
  # The same random bits; an initializer's arithmetic on a shard may round differently
  # (ZeRO-3's (8, 32, 256) attention kernels split on their heads: 6e-8 apart at most).
  assert_trees_close(state, serial, rtol=1e-6, atol=1e-7)
  expected = jax.jit(models.lm_step(jd.value_and_grad))(serial, BATCH)
  assert_trees_close(step(state, BATCH), expected, rtol=2e-4, atol=2e-5)


def test_create_state_parallel_and_its_per_device_share():
  """Alpa's spelling; and with ZeRO-3 each device holds its 1/8 of the state while it is
  created, plus temporaries (random bits, initializer arithmetic) under two of the
  largest leaf: nothing is ever whole on one device."""
  step = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.Zero3Parallel())
  create = jd.parallelize(init_fn, method=jd.CreateStateParallel(step, BATCH))
  state = create(KEY)
  exe = step.get_executable(state, BATCH)
  shardings = exe.input_shardings[0]
  leaves = jax.tree.leaves(jax.jit(init_fn)(KEY))
  full, largest = sum(x.nbytes for x in leaves), max(x.nbytes for x in leaves)
  analysis = jax.jit(init_fn, out_shardings=shardings).lower(KEY).compile().memory_analysis()
  assert analysis.output_size_in_bytes <= full / 8 * 1.01
  assert analysis.temp_size_in_bytes <= 2 * largest
  assert sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state)) <= full / 8 * 1.01
  with pytest.raises(errors.InvalidArgumentError, match="train_step"):
    jd.CreateStateParallel(init_fn, BATCH)


@pytest.mark.parametrize("method", [jd.ShardParallel(), jd.Zero3Parallel()], ids=["shard", "zero3"])
def test_evaluation_follows_the_train_layout(method):
  train = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
  state = train.create_state(init_fn, KEY, batch=BATCH)
  state, _ = train(state, BATCH)
  evaluate = jd.parallelize(eval_fn, method=jd.FollowParallel(train))
  exe = evaluate.get_executable(state, BATCH)
  # The state arrives in exactly the layout the evaluation takes: nothing moves.
  assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(exe.input_shardings[0])
  assert exe.plan.mesh_shape == train.get_executable(state, BATCH).plan.mesh_shape
  metrics = evaluate(state, BATCH)
  expected = jax.jit(eval_fn)(jax.device_get(state), BATCH)
  np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=1e-5)
  with pytest.raises(errors.InvalidArgumentError, match="compiled"):
    fresh = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
    jd.parallelize(eval_fn, method=jd.FollowParallel(fresh))(state, BATCH)


def test_evaluation_follows_a_pipeline_train_step():
  """The driver keeps each stage's state on its sub-mesh: the evaluation runs over all the
  devices, every leaf a stage holds split over them (none whole on a device), and the
  state moves there per call (the train step's own arrays stay usable)."""
  train = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
      num_micro_batches=2, stage_option=jd.UniformStageOption(num_stages=2),
      layer_option=jd.AutoLayerOption(layer_num=2)))
  state, _ = train(init_fn(KEY), BATCH)
  homes = [x.sharding.device_set for x in jax.tree.leaves(state.params)]
  assert len(set(map(frozenset, homes))) == 2  # the parameters sit on two stages
  evaluate = jd.parallelize(eval_fn, method=jd.FollowParallel(train))
  exe = evaluate.get_executable(state, BATCH)
  assert exe.plan.mesh_shape == (8,)
  for x, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(exe.input_shardings[0].params)):
    assert sharding.device_set == set(jax.devices())
    if any(d % 8 == 0 for d in x.shape):
      assert sharding.shard_shape(x.shape) != x.shape, (x.shape, sharding.spec)
  expected = jax.jit(eval_fn)(jax.device_get(state), BATCH)
  for _ in range(2):
    np.testing.assert_allclose(evaluate(state, BATCH)["loss"], expected["loss"], rtol=1e-5)
  state, _ = train(state, BATCH)  # training goes on with the same arrays


def test_checkpoints_resume_bit_identically_and_restore_into_another_plan(tmp_path):
  dp = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.DataParallel())
  state = dp.create_state(init_fn, KEY, batch=BATCH)
  state, _ = dp(state, BATCH)
  jd.checkpoint.save(tmp_path, state, step=1)
  continued, metrics = dp(state, BATCH)
  assert jd.checkpoint.latest_step(tmp_path) == 1
  abstract = jax.eval_shape(init_fn, KEY)
  restored = jd.checkpoint.restore(tmp_path, like=abstract,
                                   executable=dp.get_executable(state, BATCH))
  saved = jax.device_get(restored)
  resumed, again = dp(restored, BATCH)  # (donates restored)
  assert_trees_close((resumed, again), (continued, metrics), rtol=0, atol=0)
  # Into a ShardParallel run on a 2x4 mesh: values equal, born in that plan's layout.
  shard = jd.parallelize(models.lm_step(jd.value_and_grad),
                         method=jd.ShardParallel(logical_mesh_shape=(2, 4)))
  exe = shard.get_executable(abstract, BATCH)
  into = jd.checkpoint.restore(tmp_path, like=abstract, executable=exe)
  assert [x.sharding for x in jax.tree.leaves(into)] == jax.tree.leaves(exe.input_shardings[0])
  assert_trees_close(into, saved, rtol=0, atol=0)
  with pytest.raises(errors.InvalidArgumentError, match="nothing saved"):
    jd.checkpoint.restore(tmp_path / "none", like=abstract)


def test_pipeline_checkpoints_resume_and_cross_with_data_parallel(tmp_path):
  """A PipeshardParallel state (its leaves on the stages' sub-meshes) saves and resumes
  bit-identically, restores into a DataParallel run, and a DataParallel checkpoint
  restores into the pipeline's layout."""
  pipe = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.PipeshardParallel(
      num_micro_batches=2, layer_option=jd.AutoLayerOption(layer_num=2),
      stage_option=jd.UniformStageOption(num_stages=2)))
  state = pipe.create_state(init_fn, KEY, batch=BATCH)
  state, _ = pipe(state, BATCH)
  homes = {frozenset(x.sharding.device_set) for x in jax.tree.leaves(state)}
  assert len(homes) > 1, homes  # the state really is spread over the stages' sub-meshes
  jd.checkpoint.save(tmp_path / "pipe", state, step=1)
  continued, metrics = pipe(state, BATCH)
  abstract = jax.eval_shape(init_fn, KEY)
  exe = pipe.get_executable(abstract, BATCH)
  restored = jd.checkpoint.restore(tmp_path / "pipe", like=abstract, executable=exe)
  assert [x.sharding for x in jax.tree.leaves(restored)] == jax.tree.leaves(exe.input_shardings[0])
  saved = jax.device_get(restored)
  assert_trees_close(pipe(restored, BATCH), (continued, metrics), rtol=0, atol=0)
  dp = jd.parallelize(models.lm_step(jd.value_and_grad), method=jd.DataParallel())
  into_dp = jd.checkpoint.restore(tmp_path / "pipe", like=abstract,
                                  executable=dp.get_executable(abstract, BATCH))
  assert_trees_close(into_dp, saved, rtol=0, atol=0)
  # And back: the DataParallel copy saved, restored into the pipeline's layout.
  jd.checkpoint.save(tmp_path / "dp", into_dp)
  into_pipe = jd.checkpoint.restore(tmp_path / "dp", like=abstract, executable=exe)
  assert [x.sharding for x in jax.tree.leaves(into_pipe)] == jax.tree.leaves(exe.input_shardings[0])
  assert_trees_close(into_pipe, saved, rtol=0, atol=0)
