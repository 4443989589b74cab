"""Quickstart: an ordinary flax GPT train step, parallelized with one decorator.

    python examples/quickstart.py          # 8 simulated CPU devices when no GPU is present
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything touches a device

import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist.models import GPT, GPTConfig, token_batch  # noqa: E402

config = GPTConfig(vocab=512, width=128, heads=4, depth=2, seq_len=64)
model = GPT(config)
batch = token_batch(32, config)


def train_step(state, batch):  # plain single-device code
  tokens = batch["tokens"]

  def loss_fn(params):
    logits = state.apply_fn(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


for method in (jd.DataParallel(), jd.Zero2Parallel()):
  params = model.init(jax.random.key(0), batch["tokens"][:, :-1])
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))
  step = jd.parallelize(train_step, method=method)
  for i in range(5):
    state, metrics = step(state, batch)
  exe = step.get_executable(state, batch)
  print(f"{method.name:<14} loss after 5 steps {float(metrics['loss']):.4f}   "
        f"{exe.get_total_allocation_size() / 1e6:.1f} MB/device   "
        f"collectives/step: {({k: v.count for k, v in exe.communication().items()})}")
print(exe.plan.summary().splitlines()[0])
