"""Run under `python -m jaxdist.launch`: MLP steps with DataParallel and with Zero2Parallel
over 2 micro-batches (the shard_map gradient path); process 0 prints the results."""

import json

import jaxdist as jd

jd.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxdist import models  # noqa: E402
from helpers import dropout_key_step  # noqa: E402



def run(method, value_and_grad):
  model = models.MLP(hidden=64, num_layers=2)
  batch = models.regression_batch(32, 16)
  state = models.create_state(model, batch["x"], tx=optax.sgd(0.1, momentum=0.9))
  step = jd.parallelize(models.regression_step(value_and_grad), method=method)
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  kernel = state.params["params"]["Dense_0"]["kernel"]
  total = float(jax.jit(lambda k: k.sum(), out_shardings=kernel.sharding)(kernel))
  return {"losses": losses, "kernel_sum": total}


def dropout_loss():
  """One Zero2Parallel step over 2 micro-batches of a dropout MLP whose key is in the batch
  dict (a typed key: each process placed it through numpy, which cannot hold one)."""
  step, make_state, batch = dropout_key_step()
  _, loss = jd.parallelize(step, method=jd.Zero2Parallel(num_micro_batches=2))(make_state(),
                                                                              batch)
  return float(loss)


result = {"dp": run(jd.DataParallel(), jax.value_and_grad),
          "dropout_key": dropout_loss(),
          "zero2_k2": run(jd.Zero2Parallel(num_micro_batches=2), jd.value_and_grad),
          "devices": jax.device_count(), "processes": jax.process_count()}
if jax.process_index() == 0:
  print("RESULT " + json.dumps(result))
print("mean", np.float32(result["dp"]["losses"][-1]))
