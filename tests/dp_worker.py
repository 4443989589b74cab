"""Run under `python -m jaxdist.launch`: a DataParallel MLP step; process 0 prints results."""

import json

import jaxdist as jd

jd.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxdist import models  # noqa: E402

model = models.MLP(hidden=64, num_layers=2)
batch = models.regression_batch(32, 16)
state = models.create_state(model, batch["x"], tx=optax.sgd(0.1, momentum=0.9))
step = jd.parallelize(models.regression_step(), method=jd.DataParallel())
losses = []
for _ in range(2):
  state, metrics = step(state, batch)
  losses.append(float(metrics["loss"]))
kernel = state.params["params"]["Dense_0"]["kernel"]
total = float(jax.jit(lambda k: k.sum(), out_shardings=kernel.sharding)(kernel))
if jax.process_index() == 0:
  print("RESULT " + json.dumps({"losses": losses, "kernel_sum": total,
                                "devices": jax.device_count(), "processes": jax.process_count(),
                                "spec": str(kernel.sharding.spec)}))
print("mean", np.float32(losses[-1]))
