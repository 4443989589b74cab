"""Shared helpers: the serial reference step, tree comparisons, a dropout model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jaxdist as jd


def serial(step, *args):
  """The plain single-device step (jax.jit; inputs live on device 0)."""
  return jax.jit(step)(*args)


def to_host(tree):
  """A numpy snapshot keyed by leaf path (take it before a later step donates the arrays)."""
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_trees_close(actual, expected, rtol, atol):
  """Leaf-by-leaf allclose, matched by path (treedefs may differ in static metadata)."""
  actual, expected = to_host(actual), to_host(expected)
  assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
  for path, e in expected.items():
    np.testing.assert_allclose(actual[path], e, rtol=rtol, atol=atol, err_msg=path)


def squared_error_step(model, tx):
  """``step((params, opt_state), batch) -> (state, loss)``: ``model``'s mean squared error
  on batch["x"] / batch["y"], through ``jax.value_and_grad`` and ``tx``."""

  def step(state, batch):
    params, opt = state
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2))(params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss

  return step


MAKE_STEP_SCRIPT = """\
import optax
import jaxdist as jd
from jaxdist import models

def make_step():
  data = models.regression_batch(32, 64, out=64)
  state = models.create_state(models.MLP(hidden=64, num_layers=2, out=64), data['x'],
                              tx=optax.sgd(0.1))
  return models.regression_step(jd.value_and_grad), (state, data)
"""


def make_step_script(directory) -> str:
  """Writes a script for `jaxdist estimate` / `jaxdist tune` (a small MLP's step) and
  returns its ``path:make_step`` target."""
  script = directory / "make.py"
  script.write_text(MAKE_STEP_SCRIPT)
  return f"{script}:make_step"


class DropoutBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
    h = nn.Dropout(0.1, deterministic=False)(nn.gelu(h))
    return x + nn.Dense(x.shape[-1])(h)


class DropoutNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(4):
      x = DropoutBlock()(x)
    return nn.Dense(1)(x)


def dropout_net():
  """(step, state, batch): 4 residual MLP blocks with dropout (width 128, batch 64 x 32
  positions), SGD + momentum, the step drawing its dropout key from the step count."""
  x = jax.random.normal(jax.random.key(0), (64, 32, 128))
  batch = {"x": x, "y": jnp.zeros((64, 32, 1))}
  model = DropoutNet()
  state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(
      jax.random.key(1), x), tx=optax.sgd(0.1, momentum=0.9))

  def step(state, batch):
    rngs = {"dropout": jax.random.fold_in(jax.random.key(2), state.step)}

    def loss_fn(params):
      return jnp.mean((state.apply_fn(params, batch["x"], rngs=rngs) - batch["y"]) ** 2)

    loss, grads = jd.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return step, state, batch


class _DropoutHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(64)(x)))
    return nn.Dense(8)(x)


def dropout_key_step():
  """(step, make_state, batch): a dropout MLP whose key is in the batch dict
  (``batch["key"] = jax.random.key(5)``, a scalar the whole batch shares), SGD +
  momentum; the step returns (state, loss)."""
  batch = {"x": jax.random.normal(jax.random.key(0), (64, 32)),
           "y": jax.random.normal(jax.random.key(1), (64, 8)), "key": jax.random.key(5)}
  model = _DropoutHead()
  make_state = lambda: train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(1), batch["x"]),
      tx=optax.sgd(0.05, momentum=0.9))

  def step(state, batch):
    def loss_fn(params):
      out = state.apply_fn(params, batch["x"], rngs={"dropout": batch["key"]})
      return jnp.mean((out - batch["y"]) ** 2)

    loss, grads = jd.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return step, make_state, batch


def clip_loss(a, b):
  """CLIP's loss over two batches of embeddings: each example's pair is its positive, the
  batch's other examples its negatives."""
  a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
  b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
  logits = 10.0 * a @ b.T
  labels = jnp.arange(logits.shape[0])
  return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
          + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


def contrastive():
  """(step, make_state, batch): two linear encoders trained with a CLIP-style loss over
  the batch's similarity matrix (every example is a negative of every other: the step
  mixes examples beyond the loss's mean), Adam."""
  batch = {"a": jax.random.normal(jax.random.key(1), (32, 32)),
           "b": jax.random.normal(jax.random.key(2), (32, 24))}
  tx = optax.adam(1e-2)

  def make_state():
    ka, kb = jax.random.split(jax.random.key(0))
    params = {"a": jax.random.normal(ka, (32, 16)) * 0.2,
              "b": jax.random.normal(kb, (24, 16)) * 0.2}
    return {"params": params, "opt": tx.init(params)}

  def step(state, batch):
    def loss_fn(params):
      return clip_loss(batch["a"] @ params["a"], batch["b"] @ params["b"])

    loss, grads = jd.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

  return step, make_state, batch


def budgeted_gpt(vocab: int, width: int, fraction: float):
  """A 2-block GPT (Adam, batch 32, k=4) on one NVLink node's costs, with ShardParallel
  under a budget of ``fraction`` x DataParallel's compiled bytes: (step, state, batch,
  the parallelized step, the budget)."""
  from jaxdist import models
  config = models.GPTConfig(vocab=vocab, width=width, heads=4, depth=2, seq_len=32)
  batch = models.token_batch(32, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  step = models.lm_step(jd.value_and_grad)
  mesh = jd.LogicalMesh((8,), alpha=10e-6, beta=1 / 450e9)
  dp = jd.parallelize(step, method=jd.DataParallel(devices=mesh, num_micro_batches=4))
  budget = fraction * dp.get_executable(state, batch).get_total_allocation_size()
  f = jd.parallelize(step, method=jd.ShardParallel(
      devices=mesh, num_micro_batches=4, auto_sharding_option=jd.AutoShardingOption(
          memory_budget_per_device=budget, plan_cache=False)))
  return step, state, batch, f, budget


class _ResidualLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(128)(nn.relu(nn.Dense(512)(nn.LayerNorm()(x)))), None


class ScannedMLP(nn.Module):
  """Six residual layers (width 128, hidden 512) stacked by ``nn.scan``, optionally
  under ``nn.remat``."""

  remat: bool = False

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(_ResidualLayer) if self.remat else _ResidualLayer
    x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=6)()(nn.Dense(128)(x), None)
    return nn.Dense(10)(x)


def outside_gradient_step(apply_fn, lm: bool = False):
  """``step(state, batch)`` (MSE regression, or next-token cross entropy with ``lm``)
  whose gradient function is built by ``jax.value_and_grad`` before jaxdist traces the
  step: jaxdist cannot mark it (XLA reduces its gradients)."""
  def loss_fn(params, batch):
    if lm:
      logits = apply_fn(params, batch["tokens"][:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["tokens"][:, 1:]).mean()
    return jnp.mean((apply_fn(params, batch["x"]) - batch["y"]) ** 2)

  grad_fn = jax.value_and_grad(loss_fn)

  def step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return step


class ViT(nn.Module):
  """A small ViT: patches of 4x4 pixels, a learned class token and positions, pre-norm
  attention blocks, an MLP."""
  width: int = 128
  depth: int = 4

  @nn.compact
  def __call__(self, images):
    b, h, w, c = images.shape
    x = images.reshape(b, h // 4, 4, w // 4, 4, c).transpose(0, 1, 3, 2, 4, 5)
    x = nn.Dense(self.width)(x.reshape(b, -1, 16 * c))
    token = self.param("cls", nn.initializers.zeros, (1, 1, self.width))
    x = jnp.concatenate([jnp.broadcast_to(token, (b, 1, self.width)), x], 1)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.width))
    for _ in range(self.depth):
      h_ = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h_, h_)
    x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))
    return nn.Dense(8)(x[:, 0])
