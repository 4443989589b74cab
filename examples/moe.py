"""A GShard mixture-of-experts language model: data parallelism, expert parallelism (the
``strategies/presets/expert_parallel.json`` preset) and the ShardParallel search, each
against the serial step; prints losses, step time, bytes per device, the collectives and
where the expert weights live.

    python examples/moe.py [--steps 5]
"""

from __future__ import annotations

import argparse

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402
from jaxdist.measure import time_steps  # noqa: E402
from jaxdist.tune.presets import load_presets  # noqa: E402

CONFIG = models.GPTConfig(vocab=512, width=128, heads=4, depth=2, seq_len=32)


def methods():
  mesh = jd.LogicalMesh((2, 4), axis_names=("data", "model"))
  (expert,) = [p for p in load_presets() if p.name == "expert_parallel"]
  return {
      "DataParallel": jd.DataParallel(),
      "expert parallel (2 x 4)": jd.ShardParallel(
          devices=mesh, auto_sharding_option=jd.AutoShardingOption(
              partition_constraints=expert.constraints)),
      "ShardParallel search": jd.ShardParallel(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  steps = parser.parse_args().steps
  model = models.MoELM(CONFIG, num_experts=8)
  batch = models.token_batch(16, CONFIG)
  make_state = lambda: models.create_state(model, batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  serial = jax.jit(models.lm_step())
  state, reference = make_state(), []
  for _ in range(steps):
    state, metrics = serial(state, batch)
    reference.append(float(metrics["loss"]))
  print(f"{'serial':<26} loss {reference[0]:.4f} -> {reference[-1]:.4f}")
  for name, method in methods().items():
    step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
    state, losses = make_state(), []
    for _ in range(steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    exe = step.get_executable(state, batch)
    _, _, seconds = time_steps(step, state, batch, num_steps=3, warmup=1)
    w_in = state.params["params"]["block_0"]["MoE_0"]["w_in"]
    collectives = ", ".join(f"{s.count} {kind}" for kind, s in sorted(exe.communication().items()))
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"{name:<26} loss {losses[0]:.4f} -> {losses[-1]:.4f} (|difference| <= {worst:.1e})  "
          f"{seconds * 1e3:6.1f} ms  {exe.get_total_allocation_size() / 2**20:6.2f} MiB/device  "
          f"mesh {exe.plan.mesh_shape}  w_in {w_in.sharding.spec}  [{collectives}]")


if __name__ == "__main__":
  main()
