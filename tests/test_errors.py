"""Bad input raises a typed error before compute, naming argument, value and remedy."""

import jax
import optax
import pytest

import jaxdist as jd
from jaxdist import errors, models


@pytest.fixture
def counted_step():
  traces = []
  inner = models.regression_step()

  def step(state, batch):
    traces.append(1)
    return inner(state, batch)

  return step, traces


def _state(features=32):
  batch = models.regression_batch(64, features)
  return models.create_state(models.MLP(hidden=16, num_layers=1), batch["x"],
                             tx=optax.sgd(0.1)), batch


def test_batch_argnums_out_of_range(counted_step):
  step, traces = counted_step
  state, batch = _state()
  with pytest.raises(errors.BatchArgnumsError, match=r"batch_argnums=\(3,\).*0\.\.1"):
    jd.parallelize(step, batch_argnums=3)(state, batch)
  assert not traces


def _labels_apart(state):
  def step(state, x, y):
    def loss_fn(params):
      return jax.numpy.mean((state.apply_fn(params, x) - y) ** 2)
    loss, grads = jd.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  return step


@pytest.mark.parametrize("method", [jd.DataParallel(), jd.DataParallel(num_micro_batches=2),
                                    jd.ShardParallel(), jd.PipeshardParallel(num_micro_batches=2)],
                         ids=["dp", "dp-k2", "shard", "pipeshard"])
def test_labels_left_out_of_batch_argnums(method):
  """Labels passed beside the inputs, with the default batch_argnums=(1,): methods that
  cut the batch per device would pair a part of the inputs with all the labels (a shape
  error deep in the step, or under DataParallel with 2 micro-batches a silent broadcast
  and a wrong loss). It is named before anything is planned."""
  state, batch = _state()
  step = jd.parallelize(_labels_apart(state), method=method)
  with pytest.raises(errors.BatchArgnumsError,
                     match=r"argument 2 \(y\) has dim 0 = 64.*batch_argnums=\(1, 2\)"):
    step(state, batch["x"], batch["y"])
  _, loss = jd.parallelize(_labels_apart(state), method=method, batch_argnums=(1, 2))(
      state, batch["x"], batch["y"])
  assert abs(float(loss) - float(jax.jit(_labels_apart(state))(state, batch["x"], batch["y"])[1])) < 1e-5


def test_a_batch_sized_argument_that_does_not_meet_the_batch_only_warns():
  """A (64, 8) table on a batch of 64 whose rows the step reads as weights is not batch
  data: the step still traces on half the batch, so it is only named in a warning."""
  state, batch = _state()

  def step(state, x, w):
    def loss_fn(params):
      return jax.numpy.mean(state.apply_fn(params, x)) + jax.numpy.mean(x @ w[:32])
    loss, grads = jd.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  w = jax.numpy.ones((64, 8))
  with pytest.warns(errors.JaxdistWarning, match=r"argument 2 \(w\).*batch_argnums=\(1, 2\)"):
    jd.parallelize(step, method=jd.DataParallel()).get_executable(state, batch["x"], w)


def test_batch_that_does_not_divide_over_devices():
  state, batch = _state()
  batch = {k: v[:30] for k, v in batch.items()}
  with pytest.raises(errors.BatchDivisibilityError,
                     match=r"batch\['x'\].*\(30, 32\).*30.*8 devices.*multiple of 8"):
    jd.parallelize(models.regression_step(), method=jd.DataParallel())(state, batch)


def test_a_leaf_with_no_row_per_example_in_the_batch_is_named():
  """A random key's data put in the batch dict (shape (2,) beside 64 examples) is split
  as examples too: the error says that it can be an argument of its own (it said only
  "use a batch size that is a multiple of 8")."""
  state, batch = _state()
  batch = {**batch, "key": jax.random.key_data(jax.random.key(0))}
  with pytest.raises(errors.BatchDivisibilityError,
                     match=r"batch\['key'\].*\(2,\).*such as batch\['x'\], dim 0 = 64.*random "
                           r"key's data.*argument of its own"):
    jd.parallelize(models.regression_step(), method=jd.DataParallel())(state, batch)


def test_a_step_that_takes_the_batch_size_as_a_constant():
  """A step that reshapes its batch to a size written in it traces on the whole batch
  only (it raised a bare TypeError from jax's reshape): DataParallel runs it as one
  whole-batch program with a warning, a pipeline of one micro-batch runs its stages over
  all of it; micro-batches, which cannot, raise a typed error."""
  state, batch = _state()
  inner = models.regression_step(jd.value_and_grad)

  def step(state, batch):
    x = batch["x"].reshape(64, 4, 8).reshape(64, 32)
    return inner(state, {**batch, "x": x})

  f = jd.parallelize(step, method=jd.DataParallel())
  with pytest.warns(errors.JaxdistWarning, match=r"1/8 of its batch \(64 -> 8.*constant"):
    exe = f.get_executable(state, batch)
  assert exe.layout.grad_reduce_specs is None
  assert any("does not trace" in n for n in exe.plan.notes)
  want, got = jax.jit(step)(state, batch), f(state, batch)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(abs(a - b).max()) < 1e-6
  with pytest.raises(errors.BatchDivisibilityError, match=r"1/16 of its batch.*reshape"):
    jd.parallelize(step, method=jd.DataParallel(num_micro_batches=2))(state, batch)
  # A one-micro-batch pipeline runs its stages over the whole micro-batch instead.
  pipe = jd.parallelize(step, method=jd.PipeshardParallel(
      num_micro_batches=1, layer_option=jd.AutoLayerOption(layer_num=2)))
  exe = pipe.get_executable(state, batch)
  notes = [st.note for st in exe.stages if st.mesh.num_devices > 1]
  assert notes and all("does not trace" in note for note in notes), notes
  for a, b in zip(jax.tree.leaves(pipe(state, batch)), jax.tree.leaves(want)):
    assert float(abs(a - b).max()) < 1e-6


def test_mesh_shape_must_multiply_to_device_count():
  with pytest.raises(errors.MeshShapeError, match=r"shape=\(2, 3\).*6 positions but 8 devices"):
    jd.LogicalMesh((2, 3), devices=jax.devices())


def test_more_devices_than_exist():
  with pytest.raises(errors.DeviceCountError, match=r"needs 16 devices; only 8 exist"):
    jd.LogicalMesh((4, 4))


def test_non_array_leaf(counted_step):
  step, traces = counted_step
  state, batch = _state()
  state = state.replace(params={"params": state.params["params"], "name": "mlp"})
  with pytest.raises(errors.NonArrayLeafError, match=r"state\.params\['name'\].*str"):
    jd.parallelize(step)(state, batch)
  assert not traces


def test_batch_argument_without_arrays():
  state, _ = _state()
  with pytest.raises(errors.NonArrayLeafError, match="batch argument 1"):
    jd.parallelize(models.regression_step())(state, "not a batch")


def test_a_batch_argument_without_arrays_names_the_argument_that_looks_like_one():
  """step(params, opt_state, batch) with SGD (its state holds no arrays) and the default
  batch_argnums=(1,)."""
  state, batch = _state()
  tx = optax.sgd(0.1)

  def step(params, opt_state, batch):
    return params, opt_state

  with pytest.raises(errors.NonArrayLeafError, match=r"batch_argnums=\(2,\) if argument 2"):
    jd.parallelize(step)(state.params, tx.init(state.params), batch)


def test_unknown_method_arguments():
  with pytest.raises(errors.UnknownArgumentError, match=r"'num_stages'.*valid arguments are: "
                     r"devices, num_micro_batches"):
    jd.Zero2Parallel(num_stages=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_num_micro_batches_must_be_positive_int(bad):
  with pytest.raises(errors.InvalidArgumentError, match=rf"num_micro_batches={bad!r}"):
    jd.DataParallel(num_micro_batches=bad)


def test_method_must_be_a_method_object():
  with pytest.raises(errors.InvalidArgumentError, match=r"method='dp'.*DataParallel"):
    jd.parallelize(lambda s, b: s, method="dp")


def test_bad_devices_argument():
  with pytest.raises(errors.InvalidArgumentError, match="devices=.*not valid"):
    jd.parallelize(models.regression_step(), method=jd.DataParallel(devices="gpu"))(*_state())


def test_errors_are_also_builtin_types():
  assert issubclass(errors.BatchDivisibilityError, ValueError)
  assert issubclass(errors.NonArrayLeafError, TypeError)
  assert issubclass(errors.UnknownArgumentError, TypeError)


def test_reusing_a_donated_state_raises_instead_of_crashing():
  state, batch = _state()
  step = jd.parallelize(models.regression_step(), method=jd.DataParallel())
  s1, _ = step(state, batch)
  step(s1, batch)
  with pytest.raises(errors.InvalidArgumentError, match=r"state\.step was deleted.*donated.*donate_argnums"):
    step(s1, batch)
