"""An equinox MLP trained with optax, parallelized without changing the model: the step
takes the model's arrays (``eqx.partition``) and the optimizer state, and closes over the
rest (activation functions, shapes). DataParallel, Zero3Parallel with two micro-batches
and ShardParallel each follow the serial losses.

    python examples/equinox_mlp.py [--steps 5]
"""

from __future__ import annotations

import argparse

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402

WIDTH, DEPTH, BATCH = 256, 4, 64
OPTIMIZER = optax.adam(1e-3)


def make(key=jax.random.key(0)):
  """(params, static, optimizer state, batch): the model split into arrays and the rest."""
  model = eqx.nn.MLP(WIDTH, WIDTH, WIDTH, DEPTH, activation=jax.nn.gelu, key=key)
  params, static = eqx.partition(model, eqx.is_array)
  x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  batch = {"x": x, "y": jnp.sin(x)}
  return params, static, OPTIMIZER.init(params), batch


def make_step(static):
  """An ordinary equinox train step. ``eqx.filter_value_and_grad`` calls
  ``jax.value_and_grad``, which is jaxdist's while jaxdist traces the step, so gradients
  are accumulated over micro-batches when a method asks for them."""

  def loss_fn(params, batch):
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

  def step(params, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


METHODS = {
    "DataParallel": jd.DataParallel(),
    "Zero3Parallel, 2 micro-batches": jd.Zero3Parallel(num_micro_batches=2),
    "ShardParallel": jd.ShardParallel(),
}


def losses(step, params, opt_state, batch, steps):
  out = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, batch)
    out.append(float(loss))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  steps = parser.parse_args().steps
  params, static, opt_state, batch = make()
  reference = losses(jax.jit(make_step(static)), params, opt_state, batch, steps)
  print(f"{'serial':<32} loss {reference[0]:.5f} -> {reference[-1]:.5f}")
  for name, method in METHODS.items():
    # The batch is argument 2; params and optimizer state are updated in place (donated).
    step = jd.parallelize(make_step(static), method=method,
                          batch_argnums=(2,))
    params, _, opt_state, _ = make()
    exe = step.get_executable(params, opt_state, batch)
    got = losses(step, params, opt_state, batch, steps)
    worst = max(abs(a - b) for a, b in zip(got, reference))
    print(f"{name:<32} loss {got[0]:.5f} -> {got[-1]:.5f}  |difference| <= {worst:.1e}  "
          f"{exe.get_total_allocation_size() / 2**20:.2f} MiB/device  "
          f"collectives {sorted(exe.communication())}")


if __name__ == "__main__":
  main()
