"""Plans the example workloads with ShardParallel and saves them under strategies/.

    python examples/save_plans.py

A saved plan is applied with ``jd.ShardParallel(plan=jd.Plan.load(path))``: no mesh search,
and it refuses a step whose parameter paths or shapes differ.
"""

import os

import jax
import optax

import jaxdist as jd
from jaxdist import demo, models

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "strategies")


def workloads():
  """(name, step, state, batch) of each example workload."""
  mlp_batch = models.regression_batch(256, 64)
  yield ("mlp_adam", models.regression_step(),
         models.create_state(models.MLP(hidden=256, num_layers=4), mlp_batch["x"],
                             tx=optax.adam(1e-3)), mlp_batch)
  gpt_batch = models.token_batch(32, demo.DEMO_CONFIG)
  yield ("demo_gpt_adam", models.lm_step(),
         models.create_state(models.GPT(demo.DEMO_CONFIG), gpt_batch["tokens"][:, :-1],
                             tx=optax.adam(1e-3)), gpt_batch)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # before anything touches a device
  for name, step, state, batch in workloads():
    exe = jd.parallelize(step, method=jd.ShardParallel()).get_executable(state, batch)
    path = os.path.join(OUT, f"{name}.shard_parallel.json")
    exe.plan.save(path)
    print(f"{path}: mesh {exe.plan.mesh_shape}, objective {exe.plan.objective:.3g} s, "
          f"shapes tried {exe.plan.mesh_objectives}")
