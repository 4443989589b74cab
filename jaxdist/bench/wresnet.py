"""Wide-ResNet (Zagoruyko & Komodakis 2016) in flax linen: basic blocks with batch norm and
widths scaled by a factor (the small sizes that run here), or, with ``bottleneck=True``,
the ResNet-50/101 bottleneck network with a widened 3x3 convolution that Alpa's benchmark
uses at its published sizes. Convolutions and batch norm exercise sharding rules no
transformer touches."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


@dataclasses.dataclass(frozen=True)
class WResNetConfig:
  image_size: int = 32
  num_classes: int = 10
  base_width: int = 16
  width_factor: int = 2
  blocks_per_stage: tuple[int, ...] = (1, 1, 1)
  bottleneck: bool = False  # ResNet-50/101 bottleneck blocks and the ImageNet stem


class BasicBlock(nn.Module):
  features: int
  strides: int

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
    h = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(x)
    h = nn.relu(norm()(h))
    h = nn.Conv(self.features, (3, 3), use_bias=False)(h)
    h = norm()(h)
    if x.shape[-1] != self.features or self.strides != 1:
      x = nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(x)
      x = norm()(x)
    return nn.relu(x + h)


class BottleneckBlock(nn.Module):
  """ResNet-50's block widened in its 3x3 convolution (Alpa's Wide-ResNet): 1x1 to
  ``features``, 3x3 to ``features · width_factor``, 1x1 to ``4 · features``."""

  features: int
  width_factor: int
  strides: int

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda **kw: nn.BatchNorm(use_running_average=not train, momentum=0.9, **kw)
    h = nn.relu(norm()(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
    h = nn.Conv(self.features * self.width_factor, (3, 3), (self.strides, self.strides),
                use_bias=False)(h)
    h = nn.relu(norm()(h))
    h = norm(scale_init=nn.initializers.zeros)(
        nn.Conv(4 * self.features, (1, 1), use_bias=False)(h))
    if x.shape != h.shape:
      x = norm()(nn.Conv(4 * self.features, (1, 1), (self.strides, self.strides),
                         use_bias=False)(x))
    return nn.relu(x + h)


class WideResNet(nn.Module):
  config: WResNetConfig

  @nn.compact
  def __call__(self, x, train: bool = True):
    c = self.config
    if c.bottleneck:  # ImageNet stem: 7x7 stride 2, then a 3x3 max pool of stride 2
      x = nn.Conv(c.base_width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    else:
      x = nn.Conv(c.base_width, (3, 3), use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for stage, blocks in enumerate(c.blocks_per_stage):
      for b in range(blocks):
        strides = 2 if b == 0 and stage > 0 else 1
        name = f"stage{stage}_block{b}"
        if c.bottleneck:
          x = BottleneckBlock(c.base_width * 2 ** stage, c.width_factor, strides,
                              name=name)(x, train)
        else:
          x = BasicBlock(c.base_width * c.width_factor * 2 ** stage, strides,
                         name=name)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(c.num_classes)(x)


class TrainState(train_state.TrainState):
  batch_stats: dict


def create_state(config: WResNetConfig, tx=None, seed: int = 0) -> TrainState:
  model = WideResNet(config)
  sample = jnp.zeros((1, config.image_size, config.image_size, 3))
  variables = model.init(jax.random.key(seed), sample, train=False)
  return TrainState.create(apply_fn=model.apply, params=variables["params"],
                           batch_stats=variables["batch_stats"],
                           tx=tx if tx is not None else optax.sgd(0.05, momentum=0.9))


def train_step(value_and_grad=jax.value_and_grad):
  """``step(state, batch) -> (state, {"loss"})``: softmax cross entropy, batch statistics
  updated (over the whole batch, as the single-device step computes them)."""

  def step(state, batch):
    def loss_fn(params):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                       batch["x"], train=True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      return loss, updates["batch_stats"]

    (loss, stats), grads = value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), {"loss": loss}

  return step


def batch(size: int, config: WResNetConfig, seed: int = 1) -> dict:
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (size, config.image_size, config.image_size, 3)),
          "y": jax.random.randint(ky, (size,), 0, config.num_classes)}
