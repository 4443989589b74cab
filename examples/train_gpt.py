"""A complete training run: sharded creation, ShardParallel, periodic evaluation, checkpoint
and resume, metrics printed on process 0.

    python examples/train_gpt.py                       # 8 simulated CPU devices
    python examples/train_gpt.py --steps 40 --resume   # continues from the last checkpoint
    python -m jaxdist.launch --num-processes 2 --devices-per-process 4 -- \\
        python examples/train_gpt.py                   # the same over 2 processes
"""

import argparse
import itertools
import os

import jax

import jaxdist as jd

if "JAXDIST_COORDINATOR" in os.environ:  # started by python -m jaxdist.launch
  jd.init_distributed()
else:
  jax.config.update("jax_num_cpu_devices", 8)  # simulated devices when no GPU is present

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

from jaxdist import models  # noqa: E402

CONFIG = models.GPTConfig(vocab=512, width=128, heads=4, depth=2, seq_len=64)
MODEL = models.GPT(CONFIG)
BATCH_SIZE = 16


def batches(seed: int):
  """An endless stream of token batches (a stand-in for a data loader); every process
  reads the same global batch and jaxdist keeps its own shards."""
  rng = np.random.default_rng(seed)
  while True:
    yield {"tokens": rng.integers(0, CONFIG.vocab, (BATCH_SIZE, CONFIG.seq_len + 1),
                                  dtype=np.int32)}


def make_state(key):
  params = MODEL.init(key, np.zeros((1, CONFIG.seq_len), np.int32))
  return train_state.TrainState.create(apply_fn=MODEL.apply, params=params,
                                       tx=optax.adamw(3e-3))


@jd.parallelize(method=jd.ShardParallel())
def train_step(state, batch):
  tokens = batch["tokens"]

  def loss_fn(params):
    logits = state.apply_fn(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss, grads = jd.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def eval_fn(state, batch):
  tokens = batch["tokens"]
  logits = state.apply_fn(state.params, tokens[:, :-1])
  return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--every", type=int, default=10, help="evaluate and checkpoint period")
  parser.add_argument("--checkpoints", default="/tmp/jaxdist_train_gpt")
  parser.add_argument("--resume", action="store_true")
  args = parser.parse_args()

  data, held_out = batches(0), next(batches(1))
  example = next(batches(0))
  state = train_step.create_state(make_state, jax.random.key(0), batch=example)
  first = 0
  if args.resume and jd.checkpoint.latest_step(args.checkpoints) is not None:
    first = jd.checkpoint.latest_step(args.checkpoints)
    state = jd.checkpoint.restore(args.checkpoints, like=state, step=first,
                                  executable=train_step.get_executable(state, example))
    data = itertools.islice(data, first, None)  # the stream where it stopped
  evaluate = jd.parallelize(eval_fn, method=jd.FollowParallel(train_step))
  for step in range(first + 1, args.steps + 1):
    state, metrics = train_step(state, next(data))
    if step % args.every == 0:
      held = evaluate(state, held_out)
      jd.checkpoint.save(args.checkpoints, state, step=step)
      if jax.process_index() == 0:
        print(f"step {step}: train loss {float(metrics['loss']):.4f}, "
              f"held-out loss {float(held['loss']):.4f}, checkpoint saved", flush=True)
  if jax.process_index() == 0:
    plan = train_step.get_executable(state, example).plan
    print(f"mesh {plan.mesh_shape}, {len(plan.inputs)} leaves planned")


if __name__ == "__main__":
  main()
