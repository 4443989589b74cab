"""parallelize's contract: caching, outputs, donation, devices, roles, plans."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxdist as jd
from jaxdist import errors, models
from helpers import assert_trees_close, serial


def _mlp_setup(batch_size=64, tx=None):
  batch = models.regression_batch(batch_size, 32)
  state = models.create_state(models.MLP(hidden=64, num_layers=2), batch["x"],
                              tx=tx or optax.adam(1e-3))
  return state, batch


def test_second_call_does_not_retrace_and_new_shape_compiles_anew():
  traces = []
  inner = models.regression_step()

  def step(state, batch):
    traces.append(1)
    return inner(state, batch)

  f = jd.parallelize(step, method=jd.DataParallel())
  state, batch = _mlp_setup()
  state, _ = f(state, batch)
  state, _ = f(state, batch)
  state, _ = f(state, {k: np.asarray(v) for k, v in batch.items()})  # numpy: same signature
  assert len(traces) == 1
  state, _ = f(state, models.regression_batch(128, 32))
  assert len(traces) == 2
  state, _ = f(state, batch)
  assert len(traces) == 2


@pytest.mark.parametrize("user_gc", [True, False])
def test_tracing_and_planning_pause_the_cycle_collector_and_restore_it(user_gc):
  import gc
  seen = []
  inner = models.regression_step()

  def step(state, batch):
    seen.append(gc.isenabled())
    return inner(state, batch)

  state, batch = _mlp_setup()
  (gc.enable if user_gc else gc.disable)()
  try:
    jd.parallelize(step, method=jd.ShardParallel()).get_executable(state, batch)
    jd.estimate(step, state, batch, method=jd.DataParallel())
    after = gc.isenabled()
  finally:
    gc.enable()
  assert seen and not any(seen)
  assert after == user_gc


def test_outputs_keep_structure_and_are_named_shardings():
  state, batch = _mlp_setup()
  f = jd.parallelize(models.regression_step(), method=jd.Zero2Parallel())
  new_state, metrics = f(state, batch)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for leaf in jax.tree.leaves((new_state, metrics)):
    assert isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
  again, _ = f(new_state, batch)  # feeds straight back
  assert int(again.step) == 2


def test_auto_donation_reuses_state_not_batch_and_keeps_callers_arrays():
  state, batch = _mlp_setup()
  f = jd.parallelize(models.regression_step(), method=jd.DataParallel())
  exe = f.get_executable(state, batch)
  assert exe._step.donated_argnums == (0,)
  s1, _ = f(state, batch)
  # The caller's own arrays were moved onto the mesh by copy, so they survive donation.
  assert not any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
  placed_batch = jax.tree.map(lambda x, s: jax.device_put(x, s), batch, exe.input_shardings[1])
  s2, _ = f(s1, placed_batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(s1))  # donated
  assert not any(x.is_deleted() for x in jax.tree.leaves(placed_batch))
  assert jd.parallelize(models.regression_step(), donate_argnums=()).get_executable(
      state, batch)._step.donated_argnums == ()


def test_roles_come_from_data_flow_not_names():
  # Deliberately misleading names: "params" holds a momentum buffer, "opt" the weights.
  def step(state, batch):
    def loss_fn(w):
      return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(state["opt"])
    velocity = 0.9 * state["params"] + g
    return {"opt": state["opt"] - 0.1 * velocity, "params": velocity}, loss

  state = {"opt": jnp.ones((32, 8)), "params": jnp.zeros((32, 8))}
  batch = models.regression_batch(64, 32)
  exe = jd.parallelize(step, method=jd.Zero2Parallel()).get_executable(state, batch)
  roles = {leaf.path: leaf.role for leaf in exe._step.inputs}
  assert roles["state['opt']"] == "param"
  assert roles["state['params']"] == "optimizer"
  assert exe.plan.spec_of("state['params']") == P("devices")
  assert exe.plan.spec_of("state['opt']") == P()



def test_an_updated_state_read_again_stands_for_its_leaf():
  # A GAN's step: the generator's loss reads the discriminator's updated weights, which
  # depend on the discriminator's momentum; that momentum is optimizer state, not a
  # parameter of the loss (it was, so ZeRO-2 kept it whole).
  def step(state, batch):
    d_loss, dg = jax.value_and_grad(lambda d: jnp.mean((batch["x"] @ d) ** 2))(state["d"])
    d_mom = 0.9 * state["d_mom"] + dg
    d = state["d"] - 0.1 * d_mom
    g_loss, gg = jax.value_and_grad(lambda g: jnp.mean((batch["x"] @ g @ d.T) ** 2))(state["g"])
    g_mom = 0.9 * state["g_mom"] + gg
    new = {"d": d, "d_mom": d_mom, "g": state["g"] - 0.1 * g_mom, "g_mom": g_mom}
    return new, (d_loss, g_loss)

  state = {"d": jnp.ones((32, 8)) / 32, "d_mom": jnp.zeros((32, 8)),
           "g": jnp.ones((32, 8)) / 32, "g_mom": jnp.zeros((32, 8))}
  batch = models.regression_batch(64, 32)
  expected = serial(step, state, batch)
  f = jd.parallelize(step, method=jd.Zero2Parallel())
  exe = f.get_executable(state, batch)
  roles = {leaf.path: leaf.role for leaf in exe._step.inputs}
  assert roles == {"state['d']": "param", "state['g']": "param", "state['d_mom']": "optimizer",
                   "state['g_mom']": "optimizer", "batch['x']": "batch", "batch['y']": "batch"}
  assert exe.plan.spec_of("state['d_mom']") == P("devices")
  assert_trees_close(f(state, batch), expected, rtol=1e-5, atol=1e-6)

def test_zero_layouts_and_memory_order():
  state, batch = _mlp_setup(tx=optax.adam(1e-3))
  sizes = {}
  for cls in (jd.DataParallel, jd.Zero2Parallel, jd.Zero3Parallel):
    exe = jd.parallelize(models.regression_step(), method=cls()).get_executable(state, batch)
    sizes[cls.__name__] = exe.get_total_allocation_size()
    kernel = "state.params['params']['Dense_0']['kernel']"
    mu = "state.opt_state[0].mu['params']['Dense_0']['kernel']"
    # The (32, 64) kernel is split on its first dimension that divides: contiguous shards
    # (no transposing copy around the reduce-scatter and all-gather).
    expect = {"DataParallel": (P(), P()), "Zero2Parallel": (P(), P("devices")),
              "Zero3Parallel": (P("devices"), P("devices"))}[cls.__name__]
    assert (exe.plan.spec_of(kernel), exe.plan.spec_of(mu)) == expect
    if cls is not jd.DataParallel:
      assert any("state.step" in note for note in exe.plan.notes)  # scalar stays replicated
  assert sizes["Zero3Parallel"] < sizes["Zero2Parallel"] < sizes["DataParallel"]


def test_zero3_streams_parameters_through_the_step():
  """With jaxdist.value_and_grad each sharded parameter is gathered anew before each
  equation reading it (forward and backward), so no whole gathered copy of the
  parameters lives at once."""
  batch = models.regression_batch(64, 256)
  state = models.create_state(models.MLP(hidden=256, num_layers=6), batch["x"],
                              tx=optax.sgd(0.1, momentum=0.9))
  step = models.regression_step(jd.value_and_grad)
  f = jd.parallelize(step, method=jd.Zero3Parallel(), donate_argnums=())
  exe = f.get_executable(state, batch)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
  kernels = 7
  assert exe.communication()["all-gather"].count >= 2 * kernels  # forward and backward
  assert exe.memory_analysis().temp_size_in_bytes < 0.5 * param_bytes
  assert_trees_close(f(state, batch), serial(step, state, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_zero3_splits_a_frozen_backbone_passed_beside_the_state(k):
  """LoRA-style fine-tuning: frozen kernels are an argument of their own (neither state nor
  batch); ZeRO-3 splits and streams them as it does parameters (they stayed whole on
  every device: 0.91 MB per device against 0.48 MB now, on a smaller model)."""
  width, rank = 256, 4
  keys = jax.random.split(jax.random.key(0), 8)
  frozen = [jax.random.normal(keys[i], (width, width)) / 16 for i in range(3)]
  adapters = [(0.02 * jax.random.normal(keys[3 + i], (width, rank)), jnp.zeros((rank, width)))
              for i in range(3)]
  tx = optax.adam(1e-3)

  def step(state, frozen, batch):
    params, opt = state

    def loss(params):
      h = batch["x"]
      for w, (a, b) in zip(frozen, params):
        h = jnp.tanh(h @ w + (h @ a) @ b)
      return jnp.mean((h - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), value

  batch = {"x": jax.random.normal(keys[6], (64, width)),
           "y": jax.random.normal(keys[7], (64, width))}
  state = (adapters, tx.init(adapters))
  f = jd.parallelize(step, method=jd.Zero3Parallel(num_micro_batches=k), batch_argnums=(2,))
  exe = f.get_executable(state, frozen, batch)
  assert [e.spec for e in exe.plan.inputs if e.path.startswith("frozen")] == [P("devices")] * 3
  assert all(e.role == "input" for e in exe.plan.inputs if e.path.startswith("frozen"))
  assert not [line for line in exe.check_communication() if "DIFFERS" in line]
  frozen_bytes = sum(w.nbytes for w in frozen)
  assert exe.get_total_allocation_size() < 0.6 * frozen_bytes
  est = jd.estimate(step, state, frozen, batch, method=jd.Zero3Parallel(num_micro_batches=k),
                    batch_argnums=(2,))
  assert 0.9 < est.memory_per_device / exe.get_total_allocation_size() < 1.1
  assert_trees_close(f(state, frozen, batch), serial(step, state, frozen, batch),
                     rtol=1e-5, atol=1e-6)


def test_zero3_keeps_an_index_table_whole_and_splits_float_inputs_read_by_the_update():
  """An integer input (a permutation the loss indexes with) stays whole: XLA gathers it
  once for all its readers, where one gather per reader was predicted (6 predicted, 4
  compiled). Per-parameter learning-rate multipliers, read by the update only, are split
  like the parameters and never gathered."""
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(keys[0], (32, 64)) / 8,
            "w2": jax.random.normal(keys[1], (48, 8)) / 8}
  mult = {"w1": jnp.full((32, 64), 0.5), "w2": jnp.full((48, 8), 2.0)}
  table = jnp.arange(48, dtype=jnp.int32)[::-1]
  batch = {"x": jax.random.normal(keys[2], (64, 32)), "y": jax.random.normal(keys[3], (64, 8))}

  def step(params, mult, table, batch):
    def loss_fn(p):
      h = jnp.tanh(batch["x"] @ p["w1"])[:, table]
      return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g, m: a - 0.1 * m * g, params, grads, mult), loss

  for k in (1, 2):
    f = jd.parallelize(step, method=jd.Zero3Parallel(num_micro_batches=k), batch_argnums=(3,))
    exe = f.get_executable(params, mult, table, batch)
    assert exe.plan.spec_of("table") == P()
    assert exe.plan.spec_of("mult['w1']") == P("devices")
    assert not [line for line in exe.check_communication() if "DIFFERS" in line]
    assert_trees_close(f(params, mult, table, batch), serial(step, params, mult, table, batch),
                       rtol=1e-5, atol=1e-6)


def test_data_parallel_communicates_one_gradient_all_reduce():
  state, batch = _mlp_setup()
  exe = jd.parallelize(models.regression_step(), method=jd.DataParallel()).get_executable(
      state, batch)
  comm = exe.communication()
  assert set(comm) == {"all-reduce"}
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
  n = 8
  # Gradients plus the scalar loss, each all-reduced once over 8 devices.
  assert comm["all-reduce"].wire_bytes == pytest.approx(2 * (n - 1) / n * (param_bytes + 4))


@pytest.mark.parametrize("devices,mesh_shape,batch_spec", [
    (lambda: jax.devices()[:4], (4,), P("devices")),
    (lambda: Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "x")), (2, 4), P(("dp", "x"))),
    (lambda: jd.LogicalMesh((2, 2), axis_names=("a", "b"), devices=jax.devices()[4:]), (2, 2),
     P(("a", "b"))),
])
def test_devices_argument_forms(devices, mesh_shape, batch_spec):
  state, batch = _mlp_setup(tx=optax.sgd(0.1))
  f = jd.parallelize(models.regression_step(), method=jd.DataParallel(devices=devices()))
  exe = f.get_executable(state, batch)
  assert exe.plan.mesh_shape == mesh_shape
  assert exe.plan.spec_of("batch['x']") == batch_spec
  expected = serial(models.regression_step(), state, batch)
  actual = f(state, batch)
  assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)
  used = {d for leaf in jax.tree.leaves(actual) for d in leaf.sharding.device_set}
  assert len(used) == np.prod(mesh_shape)


def test_keyword_arguments_take_their_parameters_positions():
  """``step(state, batch=batch)`` as with jax.jit (it raised TypeError), on the
  parallelized step and on its executable: keywords go to their parameters' positions,
  so batch_argnums=(1,) still names the batch, and a parameter skipped before one takes
  its default."""
  state, batch = _mlp_setup()

  def step(state, batch, scale=1.0, shift=0.0):
    def loss_fn(params):
      return scale * jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2) + shift
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  f = jd.parallelize(step, method=jd.DataParallel())
  exe = f.get_executable(state, batch=batch)
  assert exe is f.get_executable(state, batch)
  assert exe.plan.spec_of("batch['x']") == P("devices")
  assert_trees_close(exe(state, batch=batch), serial(step, state, batch), rtol=1e-5, atol=1e-6)
  assert_trees_close(f(state, batch=batch, shift=1.0), serial(step, state, batch, 1.0, 1.0),
                     rtol=1e-5, atol=1e-6)
  with pytest.raises(errors.UnknownArgumentError, match="rate"):
    f(state, batch, rate=0.1)

  def keyword_only(state, batch, *, scale):
    return step(state, batch, scale)

  with pytest.raises(errors.InvalidArgumentError, match=r"\['scale'\].*functools.partial"):
    jd.parallelize(keyword_only)(state, batch, scale=2.0)


def test_python_floats_are_traced_other_python_values_static_and_arrays_inputs():
  """A learning rate passed as a Python float is traced once, as jax.jit does (it was
  static: every new value traced, planned and compiled the step again); an int is static,
  and new values that keep recompiling the step warn; a float the step branches on in
  Python is made static instead of failing to trace."""
  traces = []

  def step(state, batch, scale, key, power):
    traces.append(scale)
    noise = jax.random.normal(key, batch["x"].shape) * 0.0
    loss, g = jax.value_and_grad(
        lambda w: jnp.mean(((batch["x"] + noise) @ w - batch["y"]) ** 2))(state)
    return state - scale ** power * g, loss

  w = jnp.ones((32, 8))
  batch = models.regression_batch(64, 32)
  key = jax.random.key(0)
  f = jd.parallelize(step, method=jd.DataParallel())
  exe = f.get_executable(w, batch, 0.5, key, 1)
  assert [leaf.role for leaf in exe._step.inputs if leaf.path == "key"] == ["input"]
  traced = len(traces)  # (per-device gradients: the step is traced at a device's batch too)
  w1, _ = f(w, batch, 0.5, key, 1)
  w2, _ = f(w, batch, 0.25, key, 1)
  assert len(traces) == traced and len(f._executables) == 1, traces
  # w - w1 cancels digits of w ~ 1: compare at one float32 ulp of 1.0.
  np.testing.assert_allclose(np.asarray(w - w1), 2 * np.asarray(w - w2), rtol=1e-5, atol=1e-6)
  f(w, batch, 0.5, key, 2)
  with pytest.warns(jd.errors.JaxdistWarning, match="compiled 3 times .* argument 4 = 3"):
    f(w, batch, 0.5, key, 3)

  def branching(state, batch, rate):
    h = batch["x"] @ state
    if rate > 0:  # Python control flow on the float
      h = h * (1 - rate)
    return state, jnp.mean(h)

  g = jd.parallelize(branching, method=jd.DataParallel())
  np.testing.assert_allclose(float(g(w, batch, 0.5)[1]), float(jnp.mean(batch["x"] @ w) * 0.5),
                             rtol=1e-5)  # (a mean over 8 devices' partial sums)


def test_default_method_is_shard_parallel():
  state, batch = _mlp_setup()
  exe = jd.parallelize(models.regression_step()).get_executable(state, batch)
  assert exe.plan.method == "ShardParallel" and exe.plan.mesh_objectives


def test_plan_round_trips_through_json(tmp_path):
  state, batch = _mlp_setup()
  plan = jd.parallelize(models.regression_step(), method=jd.Zero3Parallel()).get_executable(
      state, batch).plan
  plan.save(tmp_path / "plan.json")
  loaded = jd.Plan.load(tmp_path / "plan.json")
  assert loaded == plan
  summary = loaded.summary()
  assert "Zero3Parallel" in summary and "state.params['params']['Dense_0']['kernel']" in summary
  with pytest.raises(jd.errors.PlanMismatchError, match="format_version"):
    jd.Plan.from_json(plan.to_json().replace('"format_version": 1', '"format_version": 99'))
