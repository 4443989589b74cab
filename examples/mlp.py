"""An MLP regression trained with each method; prints the loss curve and layouts.

    python examples/mlp.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402

batch = models.regression_batch(256, 64)
model = models.MLP(hidden=256, num_layers=4)

for method in (jd.DataParallel(), jd.Zero2Parallel(), jd.Zero3Parallel()):
  state = models.create_state(model, batch["x"], tx=optax.adam(1e-3))
  step = jd.parallelize(models.regression_step(), method=method)
  losses = []
  for _ in range(20):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  kernel = state.params["params"]["Dense_1"]["kernel"]
  mu = state.opt_state[0].mu["params"]["Dense_1"]["kernel"]
  print(f"{method.name:<14} loss {losses[0]:.4f} -> {losses[-1]:.4f}   kernel {kernel.sharding.spec}"
        f"   adam mu {mu.sharding.spec}")
