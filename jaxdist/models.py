"""Small reference models and ordinary single-device train steps.

They are what the demo, the examples, the tests and the benchmarks parallelize: plain
flax code with nothing jaxdist-specific except that the gradient function can be
passed in (``jax.value_and_grad`` or ``jaxdist.value_and_grad``), the loss can be
wrapped (``jaxdist.automatic_layer_construction``) and the GPT can mark pipeline
boundaries between its blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

from jaxdist.pipeline.layers import mark_pipeline_boundary


class MLP(nn.Module):
  """``num_layers`` ReLU Dense layers of ``hidden`` units and a linear head."""

  hidden: int = 512
  num_layers: int = 4
  out: int = 8

  @nn.compact
  def __call__(self, x):
    for _ in range(self.num_layers):
      x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.out)(x)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab: int = 512
  width: int = 128
  heads: int = 4
  depth: int = 2
  seq_len: int = 64
  mark_boundaries: bool = False  # jaxdist.mark_pipeline_boundary() after embedding and blocks
  mlp_ratio: int = 4  # the MLP's hidden width over the model's (Alpa's MoE benchmark: 8)
  # The blocks as one nn.scan over nn.remat (MaxText's layout: each weight stacked with a
  # leading layer dim, params["blocks"]["Block_0"]); no boundaries inside.
  scan_layers: bool = False
  # The LM head reuses the token embedding (GPT-2's tied output layer): no head kernel.
  tied_embedding: bool = False


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention and an MLP (``mlp_ratio``×)."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], dtype=jnp.int32))
    h = nn.MultiHeadDotProductAttention(num_heads=c.heads, qkv_features=c.width)(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(c.mlp_ratio * c.width)(h)
    h = nn.gelu(h)
    return x + nn.Dense(c.width)(h)


class ScanBlock(nn.Module):
  """A :class:`Block` as ``nn.scan`` calls it: ``(carry, x) -> (carry, None)``."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x, _):
    return Block(self.config)(x), None


def embed(module: nn.Module, c: GPTConfig, tokens, with_table: bool = False):
  """Token + learned position embedding, created in ``module``'s compact scope (as
  ``Embed_0`` and ``pos_embedding``); ``with_table``: also the ``nn.Embed`` (to tie)."""
  table = nn.Embed(c.vocab, c.width)
  pos = module.param("pos_embedding", nn.initializers.normal(0.02), (c.seq_len, c.width))
  x = table(tokens) + pos[: tokens.shape[1]]
  return (x, table) if with_table else x


class GPT(nn.Module):
  """A decoder-only language model: token + position embedding, blocks, LM head."""

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x, table = embed(self, c, tokens, with_table=True)
    if c.scan_layers:
      x, _ = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=c.depth)(c, name="blocks")(x, None)
    for i in range(0 if c.scan_layers else c.depth):
      if c.mark_boundaries:
        mark_pipeline_boundary()
      x = Block(c, name=f"block_{i}")(x)
    if c.mark_boundaries:
      mark_pipeline_boundary()
    x = nn.LayerNorm()(x)
    return table.attend(x) if c.tied_embedding else nn.Dense(c.vocab)(x)


class EncoderBlock(nn.Module):
  """BERT's post-LayerNorm encoder block: bidirectional self-attention and a 4x MLP."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    h = nn.MultiHeadDotProductAttention(num_heads=c.heads, qkv_features=c.width)(x, x)
    x = nn.LayerNorm()(x + h)
    h = nn.Dense(c.width)(nn.gelu(nn.Dense(4 * c.width)(x)))
    return nn.LayerNorm()(x + h)


class BERT(nn.Module):
  """An encoder (BERT-style: embeddings, LayerNorm, post-LN blocks) with a token head;
  trained here with :func:`lm_step`'s objective (each position predicts the next token)."""

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x = nn.LayerNorm()(embed(self, c, tokens))
    for i in range(c.depth):
      x = EncoderBlock(c, name=f"block_{i}")(x)
    return nn.Dense(c.vocab)(x)


class MoE(nn.Module):
  """A GShard mixture-of-experts MLP: top-2 gating with an expert capacity, dense
  dispatch and combine tensors, and expert weights stacked on a leading expert dim
  (``(experts, width, hidden)``), which expert parallelism splits."""

  num_experts: int = 8
  hidden: int = 256
  capacity_factor: float = 2.0

  @nn.compact
  def __call__(self, x):
    groups, tokens, width = x.shape  # each batch row is a dispatch group
    e = self.num_experts
    capacity = max(1, int(self.capacity_factor * tokens * 2 / e))
    gates = jax.nn.softmax(nn.Dense(e, use_bias=False, name="gate")(x), axis=-1)
    dispatch = jnp.zeros((groups, tokens, e, capacity), x.dtype)
    combine = jnp.zeros((groups, tokens, e, capacity), x.dtype)
    remaining = gates
    filled = jnp.zeros((groups, e), jnp.int32)
    for _ in range(2):  # top-2: the best expert, then the best of the rest
      choice = jax.nn.one_hot(jnp.argmax(remaining, axis=-1), e, dtype=jnp.int32)
      slot = jnp.cumsum(choice, axis=1) - 1 + filled[:, None, :]
      keep = choice * (slot < capacity)
      where = keep[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.int32)
      dispatch = dispatch + where.astype(x.dtype)
      combine = combine + where.astype(x.dtype) * (gates * keep)[..., None]
      filled = filled + keep.sum(axis=1)
      remaining = remaining * (1 - choice)
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (e, width, self.hidden))
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (e, self.hidden, width))
    expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, x)
    h = nn.gelu(jnp.einsum("egcm,emh->egch", expert_in, w_in))
    expert_out = jnp.einsum("egch,ehm->egcm", h, w_out)
    return jnp.einsum("gsec,egcm->gsm", combine, expert_out)


class MoEBlock(nn.Module):
  config: GPTConfig
  num_experts: int = 8

  @nn.compact
  def __call__(self, x):
    c = self.config
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], dtype=jnp.int32))
    x = x + nn.MultiHeadDotProductAttention(num_heads=c.heads, qkv_features=c.width)(h, h, mask=mask)
    return x + MoE(self.num_experts, c.mlp_ratio * c.width)(nn.LayerNorm()(x))


class MoELM(nn.Module):
  """The GPT above with the MLP of every ``moe_every``-th block (the first included) a
  :class:`MoE` of ``num_experts`` experts; Alpa's MoE benchmark model alternates
  (``moe_every=2``)."""

  config: GPTConfig
  num_experts: int = 8
  moe_every: int = 1

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x = embed(self, c, tokens)
    for i in range(c.depth):
      if i % self.moe_every == 0:
        x = MoEBlock(c, self.num_experts, name=f"block_{i}")(x)
      else:
        x = Block(c, name=f"block_{i}")(x)
    return nn.Dense(c.vocab)(nn.LayerNorm()(x))


def create_state(model: nn.Module, sample, tx=None, seed: int = 0) -> train_state.TrainState:
  """A flax TrainState with ``model``'s parameters initialized on ``sample``.

  The initialization runs jitted: op by op, a small GPT's took 6.5 s on CPU, mostly
  dispatching and compiling each operation (1.7-2.4 s jitted, one compile)."""
  params = jax.jit(model.init)(jax.random.key(seed), sample)
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=tx if tx is not None else optax.adam(1e-3))


def regression_step(value_and_grad: Callable = jax.value_and_grad):
  """``step(state, batch) -> (state, {"loss"})`` for MSE regression on batch["x"/"y"]."""

  def train_step(state, batch):
    def loss_fn(params):
      pred = state.apply_fn(params, batch["x"])
      return jnp.mean((pred - batch["y"]) ** 2)

    loss, grads = value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return train_step


def lm_step(value_and_grad: Callable = jax.value_and_grad,
            wrap_loss: Callable = lambda loss_fn: loss_fn):
  """``step(state, batch) -> (state, {"loss"})``: next-token cross entropy on batch["tokens"].

  ``wrap_loss`` is applied to the loss function before it is differentiated (layer
  construction, say).
  """

  def train_step(state, batch):
    tokens = batch["tokens"]

    def loss_fn(params):
      logits = state.apply_fn(params, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = value_and_grad(wrap_loss(loss_fn))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return train_step


def regression_batch(batch: int, features: int, out: int = 8, seed: int = 1) -> dict:
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (batch, features)),
          "y": jax.random.normal(ky, (batch, out))}


def token_batch(batch: int, config: GPTConfig, seed: int = 1) -> dict:
  # seq_len + 1 tokens: inputs are the first seq_len, targets the last seq_len.
  return {"tokens": jax.random.randint(jax.random.key(seed), (batch, config.seq_len + 1), 0,
                                       config.vocab)}


class NnxMLP(nnx.Module):
  """The MLP above written with flax nnx."""

  def __init__(self, features: int, hidden: int, num_layers: int, out: int, *, rngs: nnx.Rngs):
    sizes = [features] + [hidden] * num_layers
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])
    self.head = nnx.Linear(hidden, out, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return self.head(x)


def nnx_regression(features: int = 32, hidden: int = 64, num_layers: int = 2, out: int = 8,
                   value_and_grad: Callable = jax.value_and_grad, seed: int = 0):
  """An nnx model + optimizer as a pure ``(state, step)``: ``step(state, batch)``.

  The step merges the nnx graph, computes the loss and gradient with respect to the
  ``nnx.Param`` state, updates the optimizer and returns the new state: ordinary
  functional nnx code, parallelizable like any pytree step.
  """
  model = NnxMLP(features, hidden, num_layers, out, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    model_graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p):
      m = nnx.merge(model_graph, p, rest)
      return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    loss, grads = value_and_grad(loss_fn)(params)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}

  return state, train_step
