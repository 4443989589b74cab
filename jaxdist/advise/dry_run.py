"""Dry run: check the advisor's memory formula against XLA for a configuration.

Builds ``jaxdist.models.GPT`` (pre-LayerNorm, GeLU MLP of 4·h, learned positions, untied
head, no dropout; fp32 weights with Adam) at the model's width, heads, vocabulary and
sequence length but only ``num_layers`` layers, plans it with the configuration's jaxdist
method on as many simulated CPU devices as one pipeline stage has (``dp·tp``), and compiles
it with abstract inputs (``jax.ShapeDtypeStruct``: nothing is allocated). One micro-batch
per data-parallel rank (no accumulation). It reports, per device: the advisor's formula for
exactly that model and configuration, ``jaxdist.estimate``'s analytic figure from the traced
step, and XLA's compiled bytes (arguments + outputs − donated + temporaries).

Runs in a subprocess (``python -m jaxdist.advise.dry_run``) so that the device count is its
own; returns a dict with the three figures and a printable ``text``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from jaxdist import errors

GIB = float(1 << 30)


def dry_run(e, num_layers: int = 2, timeout_s: float = 900.0) -> dict:
  """``e``: a :class:`jaxdist.advise.Evaluation`. Pipelines are checked one stage at a time
  (the stage's ``dp·tp`` devices with ``num_layers`` layers)."""
  from jaxdist.advise.cluster import Cluster
  from jaxdist.advise.config import ParallelConfig
  from jaxdist.advise.evaluate import evaluate
  from jaxdist.advise.specs import ModelSpec

  if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
    raise errors.InvalidArgumentError(f"dry_run(num_layers={num_layers!r}) must be a positive int.")
  c, m = e.config, e.model
  # flax attention needs the width to divide by the heads (GPT-3 1.3B's 24 do not divide 2048).
  heads = max(d for d in range(1, m.num_heads + 1) if m.hidden_size % d == 0)
  spec = ModelSpec(name=f"{m.name} width, {num_layers} GPT layers", family="gpt",
                   num_layers=num_layers, hidden_size=m.hidden_size, num_heads=heads,
                   vocab_size=m.vocab_size, seq_len=e.seq_len, tied_embeddings=False,
                   dropout=False)
  config = ParallelConfig(dp=c.dp, tp=c.tp, zero_stage=c.zero_stage if c.zero_stage != 1 else 2,
                          micro_batch_size=c.micro_batch_size, recompute=c.recompute,
                          sequence_parallel=c.sequence_parallel)
  devices = config.num_devices
  cluster = Cluster(devices, e.cluster.devices_per_node, e.cluster.device)
  batch = c.dp * c.micro_batch_size
  formula = evaluate(spec, cluster, config, global_batch_size=batch, precision="fp32",
                     optimizer="adam", allow_cross_node_tp=True)
  payload = {"width": m.hidden_size, "heads": heads, "vocab": m.vocab_size, "seq": e.seq_len,
             "layers": num_layers, "batch": batch, "devices": devices,
             "config": dataclasses.asdict(config)}
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  proc = subprocess.run([sys.executable, "-m", "jaxdist.advise.dry_run", json.dumps(payload)],
                        capture_output=True, text=True, timeout=timeout_s, env=env)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    raise RuntimeError(f"dry run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  xla = json.loads(lines[-1])
  mem = formula.memory
  states = mem["params"] + mem["grads"] + mem["optimizer"]
  without_allowance = mem["total"] - mem["workspace"]
  text = "\n".join([
      f"dry run: {spec.name}, {config.label()}, batch {batch} x seq {e.seq_len}, fp32 Adam, "
      f"on {devices} simulated devices ({xla['method']})",
      f"  advisor formula   {without_allowance / GIB:8.2f} GiB/device (states {states / GIB:.2f}, "
      f"activations {mem['activations'] / GIB:.2f}; allowance {mem['workspace'] / GIB:.2f} not "
      f"included)",
      f"  jaxdist.estimate  {xla['estimate'] / GIB:8.2f} GiB/device (analytic, from the traced step)",
      f"  XLA compiled      {xla['compiled'] / GIB:8.2f} GiB/device "
      f"(arguments {xla['argument'] / GIB:.2f}"
      f" + outputs - donated + temporaries {xla['temp'] / GIB:.2f}), compiled in {xla['seconds']:.1f} s",
      f"  formula / XLA     {without_allowance / xla['compiled']:8.2f}"])
  return {"formula_bytes": without_allowance, "formula_states_bytes": states,
          "formula_activations_bytes": mem["activations"], "estimate_bytes": xla["estimate"],
          "compiled_bytes": xla["compiled"], "compiled": xla, "text": text,
          "ratio": without_allowance / xla["compiled"]}


def _child(payload: dict) -> dict:
  import time

  import jax

  jax.config.update("jax_num_cpu_devices", payload["devices"])
  import jax.numpy as jnp

  from jaxdist import estimate, models, value_and_grad
  from jaxdist.advise.cluster import Cluster
  from jaxdist.advise.config import ParallelConfig
  from jaxdist.advise.evaluate import evaluate
  from jaxdist.advise.specs import ModelSpec

  gpt = models.GPT(models.GPTConfig(vocab=payload["vocab"], width=payload["width"],
                                    heads=payload["heads"], depth=payload["layers"],
                                    seq_len=payload["seq"]))
  sample = jax.ShapeDtypeStruct((1, payload["seq"]), jnp.int32)
  state = jax.eval_shape(lambda: models.create_state(gpt, jnp.zeros(sample.shape, sample.dtype)))
  batch = {"tokens": jax.ShapeDtypeStruct((payload["batch"], payload["seq"] + 1), jnp.int32)}
  config = ParallelConfig(**payload["config"])
  spec = ModelSpec(num_layers=payload["layers"], hidden_size=payload["width"],
                   num_heads=payload["heads"], vocab_size=payload["vocab"], seq_len=payload["seq"])
  e = evaluate(spec, Cluster(payload["devices"], payload["devices"]), config,
               global_batch_size=payload["batch"], allow_cross_node_tp=True)
  import warnings

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    method = e.method(layer_module="Block")
  step = jax.jit(models.lm_step(value_and_grad), donate_argnums=0)
  start = time.perf_counter()
  est = estimate(step, state, batch, method=method, compile=True)
  seconds = time.perf_counter() - start
  return {"estimate": est.memory_per_device, **est.compiled, "compiled": est.compiled["total"],
          "seconds": seconds, "method": type(method).__name__}


if __name__ == "__main__":
  print(json.dumps(_child(json.loads(sys.argv[1]))))
