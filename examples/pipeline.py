"""Pipeline parallelism: the same GPT step, cut into stages at the model's own boundaries.

    python examples/pipeline.py                  # the MPMD driver, 1F1B, 2 stages
    python examples/pipeline.py --runtime spmd   # one SPMD program, GPipe, 2 stages

The model calls jaxdist.mark_pipeline_boundary() between its embedding, blocks and head
(GPTConfig(mark_boundaries=True)); the step differentiates with jaxdist.value_and_grad,
which is what lets PipeshardParallel run the loss stage by stage. On 8 simulated CPU
devices when no GPU is present.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything touches a device

import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402

config = models.GPTConfig(vocab=512, width=128, heads=4, depth=4, seq_len=64,
                          mark_boundaries=True)
batch = models.token_batch(32, config)
state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=optax.adam(3e-3))

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--runtime", choices=("mpmd", "spmd"), default="mpmd")
runtime = parser.parse_args().runtime
method = jd.PipeshardParallel(num_micro_batches=4, layer_option="manual",
                              stage_option=jd.UniformStageOption(num_stages=2),
                              pipeline_schedule="1f1b" if runtime == "mpmd" else "gpipe",
                              runtime=runtime)
step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
exe = step.get_executable(state, batch)
for i in range(5):
  state, metrics = exe(state, batch)
  print(f"step {i}: loss {float(metrics['loss']):.4f}")
print("\n".join(exe.plan.notes))
print(f"micro-batches held per stage: {exe.stats['max_in_flight']}")
print(f"largest program: {exe.get_total_allocation_size() / 1e6:.2f} MB/device")
for r in (exe.stage_report() if runtime == "mpmd" else []):  # the driver's per-stage programs
  print(f"stage {r.stage}: layers {r.layers[0]}..{r.layers[1] - 1} on devices {r.devices}: "
        f"forward {r.forward_s * 1e3:.1f} ms, backward {r.backward_s * 1e3:.1f} ms per "
        f"micro-batch, {r.bytes_per_device / 1e6:.2f} MB/device")
