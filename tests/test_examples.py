"""The examples users copy, run as tests. examples/nnx_gpt.py: flax nnx steps as users write
them (model and nnx.Optimizer split into one state, nnx.value_and_grad over the parameters,
a pipeline boundary inside the model) under every method, against the serial step: losses
and the whole new state within 1e-5 (cross-device summation order). SGD with momentum:
Adam's first step turns the summation noise of a zero gradient (attention's key bias)
into ±learning rate. examples/moe.py: expert parallelism from the preset.
examples/equinox_mlp.py: an equinox model's arrays as the state, every method's losses."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxdist as jd

HERE = os.path.dirname(__file__)


def _example(name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(HERE, "..", "examples", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


nnx_gpt = _example("nnx_gpt")
CONFIG = dict(vocab=128, width=32, heads=4, depth=2, seq_len=16)


@pytest.mark.parametrize("name", list(nnx_gpt.methods()))
def test_nnx_gpt_matches_serial(name):
  method, boundaries = nnx_gpt.methods()[name]
  graphdef, state = nnx_gpt.create(**CONFIG, tx=optax.sgd(0.1, momentum=0.9))
  batch = nnx_gpt.token_batch(16, CONFIG["seq_len"], CONFIG["vocab"])
  serial = jax.jit(nnx_gpt.make_step(graphdef, jax.value_and_grad))
  want_state, want = serial(state, batch)
  step = jd.parallelize(nnx_gpt.make_step(graphdef, boundaries=boundaries), method=method)
  got_state, got = step(jax.tree.map(jnp.copy, state), batch)
  assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-5
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    assert jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)).max() <= 1e-5
  exe = step.get_executable(jax.tree.map(jnp.copy, state), batch)
  if isinstance(method, jd.PipeshardParallel):
    assert len(exe.stages) == 2  # the boundary inside the nnx model was found
  if isinstance(method, jd.ShardParallel):
    assert tuple(exe.plan.mesh_shape) == (2, 4)


def test_moe_example_expert_parallel_matches_serial():
  """examples/moe.py's expert-parallel method: experts split over the model axis, tokens
  moved by all-to-all, the first step equal to serial."""
  moe = _example("moe")
  from jaxdist import models

  model = models.MoELM(moe.CONFIG, num_experts=8)
  batch = models.token_batch(16, moe.CONFIG)
  state = models.create_state(model, batch["tokens"][:, :-1], tx=optax.sgd(0.1))
  _, want = jax.jit(models.lm_step())(state, batch)
  step = jd.parallelize(models.lm_step(jd.value_and_grad),
                        method=moe.methods()["expert parallel (2 x 4)"])
  new_state, got = step(state, batch)
  assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-5
  assert tuple(new_state.params["params"]["block_0"]["MoE_0"]["w_in"].sharding.spec) == ("model",)
  assert "all-to-all" in step.get_executable(new_state, batch).communication()


equinox_mlp = _example("equinox_mlp")


@pytest.mark.parametrize("name", list(equinox_mlp.METHODS))
def test_equinox_example_matches_serial(name):
  """An equinox MLP (arrays partitioned from the rest) under each method of the example:
  two steps' losses and the new parameters equal serial's."""
  params, static, opt_state, batch = equinox_mlp.make()
  serial = jax.jit(equinox_mlp.make_step(static))
  step = jd.parallelize(equinox_mlp.make_step(static),
                        method=equinox_mlp.METHODS[name], batch_argnums=(2,))
  got_params, _, got_opt, _ = equinox_mlp.make()  # a copy: the step donates what it updates
  for _ in range(2):
    params, opt_state, want = serial(params, opt_state, batch)
    got_params, got_opt, got = step(got_params, got_opt, batch)
    assert abs(float(got) - float(want)) <= 1e-6
  want_params = params
  for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
    assert jnp.abs(a - b).max() <= 1e-5
