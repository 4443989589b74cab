"""A GPT written with flax nnx, trained under every jaxdist method.

The step is ordinary nnx: the model and its ``nnx.Optimizer`` travel as one state pytree
(``nnx.split``), the step merges them, differentiates the loss of the parameters and
returns the new state, with ``nnx.value_and_grad`` as usual: called in the step, it
differentiates through ``jax.value_and_grad``, which is jaxdist's while jaxdist traces the
step (so micro-batches and pipelines work; ``jd.value_and_grad`` in its place does the
same). Pipeline layer boundaries may sit inside the model (``jd.mark_pipeline_boundary()``).

    python examples/nnx_gpt.py            # every method against the serial step
    python examples/nnx_gpt.py --steps 20
"""

from __future__ import annotations

import argparse

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxdist as jd  # noqa: E402


class Block(nnx.Module):
  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False,
                                            rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(x[..., 0])
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
  def __init__(self, vocab: int, width: int, heads: int, depth: int, seq_len: int,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, width)))
    self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens, boundaries: bool = False):
    x = self.embed(tokens) + self.position[:tokens.shape[1]]
    for i, block in enumerate(self.blocks):
      if boundaries and i == len(self.blocks) // 2:
        jd.mark_pipeline_boundary()
      x = block(x)
    return self.head(self.norm(x))


def create(vocab=256, width=64, heads=4, depth=4, seq_len=32, tx=None, seed=0):
  """(graphdef, state): the model and its optimizer (default Adam, 1e-3) split into one
  state pytree."""
  model = GPT(vocab, width, heads, depth, seq_len, nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, tx or optax.adam(1e-3), wrt=nnx.Param)
  return nnx.split((model, optimizer))


def make_step(graphdef, value_and_grad=None, boundaries: bool = False):
  """The train step: next-token cross-entropy, one Adam update (``value_and_grad``: the
  transform, default ``nnx.value_and_grad``)."""

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    model_def, params, rest = nnx.split(model, nnx.Param, ...)
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]

    def loss_fn(params):
      logits = nnx.merge(model_def, params, rest)(inputs, boundaries)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = (value_and_grad or nnx.value_and_grad)(loss_fn)(params)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}

  return train_step


def token_batch(batch_size=16, seq_len=32, vocab=256, seed=0):
  rng = np.random.default_rng(seed)
  return {"tokens": jnp.asarray(rng.integers(0, vocab, (batch_size, seq_len + 1)), jnp.int32)}


def methods():
  """Every method, with accumulation and a two-stage pipeline split inside the model."""
  return {
      "DataParallel": (jd.DataParallel(), False),
      "Zero2Parallel k=2": (jd.Zero2Parallel(num_micro_batches=2), False),
      "Zero3Parallel": (jd.Zero3Parallel(), False),
      "ShardParallel 2x4": (jd.ShardParallel(logical_mesh_shape=(2, 4)), False),
      "PipeshardParallel 2 stages k=4": (jd.PipeshardParallel(
          num_micro_batches=4, layer_option="manual",
          stage_option=jd.UniformStageOption(num_stages=2)), True),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  steps = parser.parse_args().steps
  graphdef, state = create()
  batch = token_batch()
  serial = jax.jit(make_step(graphdef, jax.value_and_grad))
  reference, s = [], state
  for _ in range(steps):
    s, metrics = serial(s, batch)
    reference.append(float(metrics["loss"]))
  print(f"{'serial':<32} loss {reference[0]:.4f} -> {reference[-1]:.4f}")
  for name, (method, boundaries) in methods().items():
    step = jd.parallelize(make_step(graphdef, boundaries=boundaries), method=method)
    s, losses = jax.tree.map(jnp.copy, state), []
    for _ in range(steps):
      s, metrics = step(s, batch)
      losses.append(float(metrics["loss"]))
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"{name:<32} loss {losses[0]:.4f} -> {losses[-1]:.4f}   |difference| <= {worst:.1e}")


if __name__ == "__main__":
  main()
