"""The example GPT for `jaxdist tune`: which method runs it fastest within 45 MB per device?

    jaxdist tune examples/tune_gpt.py:make_step --budget 45MB --plot tune.png
    python examples/tune_gpt.py            # the same through the Python API

``make_step()`` returns ``(step, args)``: the step function and its arguments. The step
uses ``jd.value_and_grad`` so that the walk can also try gradient accumulation.
"""

import optax

import jaxdist as jd
from jaxdist import models


def make_step():
  config = models.GPTConfig(vocab=1024, width=256, heads=8, depth=4, seq_len=64)
  batch = models.token_batch(16, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  return models.lm_step(jd.value_and_grad), (state, batch)


if __name__ == "__main__":
  import jax

  jax.config.update("jax_num_cpu_devices", 8)  # simulated devices when no GPU is present
  step, args = make_step()
  report = jd.tune(step, *args, memory_budget_per_device=45e6)
  print(report.summary())
  state, metrics = jd.parallelize(step, method=report.best_method)(*args)
  print("best method reproduced, loss", float(metrics["loss"]))
