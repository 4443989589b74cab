"""`jaxdist demo`: the example GPT under every available method, one table row each."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from jaxdist import methods as m
from jaxdist.api import parallelize
from jaxdist.grad import value_and_grad
from jaxdist.inspect import total_wire_bytes
from jaxdist.measure import time_steps
from jaxdist.models import GPT, GPTConfig, create_state, lm_step, token_batch
from jaxdist.pipeline.layers import AutoLayerOption

DEMO_CONFIG = GPTConfig(vocab=512, width=128, heads=4, depth=2, seq_len=64)


@dataclasses.dataclass(frozen=True)
class DemoRow:
  method: str
  step_time_s: float
  bytes_per_device: int
  comm_bytes_per_step: float
  loss: float


def available_methods() -> list[m.Method]:
  return [m.DataParallel(), m.Zero2Parallel(), m.Zero3Parallel(), m.ShardParallel(),
          m.PipeshardParallel(num_micro_batches=4, layer_option=AutoLayerOption(layer_num=4))]


def run(config: GPTConfig = DEMO_CONFIG, batch_size: int = 32, num_steps: int = 5):
  """Trains the demo GPT for ``num_steps`` steps under each method.

  Returns:
    (rows, serial_losses): one :class:`DemoRow` per method (loss after the first
    step) and the plain single-device step's loss.
  """
  batch = token_batch(batch_size, config)
  model = GPT(config)
  make_state = lambda: create_state(model, batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  _, serial_metrics = jax.jit(lm_step())(make_state(), batch)
  rows = []
  for method in available_methods():
    # A pipeline differentiates by stages: it needs jaxdist.value_and_grad's marker.
    pipelined = isinstance(method, m.PipeshardParallel)
    step = parallelize(lm_step(value_and_grad) if pipelined else lm_step(), method=method)
    state = make_state()
    exe = step.get_executable(state, batch)
    state, metrics = step(state, batch)
    first_loss = float(metrics["loss"])
    _, _, seconds = time_steps(step, state, batch, num_steps=num_steps, warmup=1)
    name = method.name
    if exe.plan.objective is not None:
      name += f" {'x'.join(map(str, exe.plan.mesh_shape))}"
    if pipelined:
      name = f"Pipeshard {len(exe.stages)} stages"
    rows.append(DemoRow(name, seconds, exe.get_total_allocation_size(),
                        total_wire_bytes(exe.communication()), first_loss))
  return rows, float(serial_metrics["loss"])


def format_table(rows: list[DemoRow], serial_loss: float) -> str:
  lines = [f"{'method':<18} {'step ms':>9} {'MB/device':>10} {'comm MB/step':>13} "
           f"{'loss':>10} {'Δ serial':>9}"]
  for r in rows:
    lines.append(f"{r.method:<18} {r.step_time_s * 1e3:>9.1f} {r.bytes_per_device / 1e6:>10.2f} "
                 f"{r.comm_bytes_per_step / 1e6:>13.2f} {r.loss:>10.5f} "
                 f"{abs(r.loss - serial_loss):>9.1e}")
  spread = max(abs(r.loss - serial_loss) for r in rows)
  verdict = "match" if spread <= 1e-5 * abs(serial_loss) else "DIFFER"
  lines.append(f"serial single-device loss {serial_loss:.5f}; every method's first-step loss "
               f"is within {spread:.1e} of it: losses {verdict}.")
  return "\n".join(lines)


def main(batch_size: int = 32, num_steps: int = 5) -> int:
  c = DEMO_CONFIG
  print(f"jaxdist demo: GPT (vocab {c.vocab}, width {c.width}, {c.depth} blocks, seq {c.seq_len}),"
        f" batch {batch_size}, Adam, on {jax.device_count()} {jax.devices()[0].platform} devices")
  rows, serial_loss = run(batch_size=batch_size, num_steps=num_steps)
  print(format_table(rows, serial_loss))
  return 0 if all(np.isclose(r.loss, serial_loss, rtol=1e-5) for r in rows) else 1
