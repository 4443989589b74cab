"""`jaxdist plan`: plan a reference workload with ShardParallel and show what it predicts
next to what XLA compiled (collectives per kind: count and bytes per step and device)."""

from __future__ import annotations

import json

import jax
import optax

from jaxdist import methods as m
from jaxdist import models
from jaxdist.api import parallelize
from jaxdist.errors import InvalidArgumentError
from jaxdist.mesh import LogicalMesh

WORKLOADS = ("mlp", "gpt", "bert", "moe")


def workload(name: str, batch_size: int, value_and_grad=jax.value_and_grad):
  """(step, state, batch) of a reference workload (``jaxdist.models``); gradients by
  ``value_and_grad`` (``jaxdist.value_and_grad`` allows gradient accumulation)."""
  if name == "mlp":
    batch = models.regression_batch(batch_size, 256, out=256)
    state = models.create_state(models.MLP(hidden=256, num_layers=5, out=256), batch["x"],
                                tx=optax.adam(1e-3))
    return models.regression_step(value_and_grad), state, batch
  config = models.GPTConfig(vocab=1024, width=256, heads=8, depth=4, seq_len=64)
  model = {"gpt": models.GPT, "bert": models.BERT, "moe": models.MoELM}[name](config)
  batch = models.token_batch(batch_size, config)
  state = models.create_state(model, batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  return models.lm_step(value_and_grad), state, batch


def parse_costs(text: str | None, axes: int):
  """``"1e-5"`` (every axis) or ``"2e-5,1e-5"`` (per axis) → float or tuple; None stays."""
  if text is None:
    return None
  values = tuple(float(v) for v in text.split(","))
  if len(values) not in (1, axes):
    raise InvalidArgumentError(f"{text!r}: give one value, or one per mesh axis ({axes}).")
  return values[0] if len(values) == 1 else values


def report(model: str, mesh_shape: tuple[int, ...] | None, alpha=None, beta=None,
           batch_size: int = 16, budget: float | None = None) -> dict:
  """Plans ``model`` on ``mesh_shape`` (None: search every shape over all devices) and
  returns the plan, its notes and predicted vs compiled collectives as a dict."""
  if model not in WORKLOADS:
    raise InvalidArgumentError(f"model={model!r}: choose one of {', '.join(WORKLOADS)}.")
  step, state, batch = workload(model, batch_size)
  n = jax.device_count()
  shape = mesh_shape or (n,)
  lmesh = LogicalMesh(shape, alpha=parse_costs(alpha, len(shape)),
                      beta=parse_costs(beta, len(shape)))
  method = m.ShardParallel(devices=lmesh, logical_mesh_shape=None if mesh_shape else "search",
                           auto_sharding_option=m.AutoShardingOption(
                               memory_budget_per_device=budget))
  exe = parallelize(step, method=method).get_executable(state, batch)
  compiled = exe.communication()
  return {
      "model": model, "mesh_shape": list(exe.plan.mesh_shape),
      "axis_names": list(exe.plan.axis_names), "alpha": list(lmesh.alpha),
      "beta": list(lmesh.beta), "objective_s": exe.plan.objective,
      "bytes_per_device": exe.get_total_allocation_size(),
      "predicted": exe.plan.predicted_collectives,
      "compiled": {k: {"count": c.count, "result_bytes": c.result_bytes}
                   for k, c in compiled.items()},
      "check": exe.check_communication(), "notes": list(exe.plan.notes),
      "summary": exe.plan.summary(),
  }


def main(model: str, mesh: str | None, alpha: str | None, beta: str | None, batch_size: int,
         budget: float | None, as_json: bool) -> int:
  shape = tuple(int(v) for v in mesh.lower().split("x")) if mesh else None
  result = report(model, shape, alpha, beta, batch_size, budget)
  if as_json:
    print(json.dumps({k: v for k, v in result.items() if k != "summary"}, indent=1))
  else:
    print(result["summary"])
    print("\npredicted vs compiled collectives (per step and device):")
    print("\n".join("  " + line for line in result["check"]))
  return 0 if not [line for line in result["check"] if "DIFFERS" in line] else 1
