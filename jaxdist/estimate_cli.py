"""`jaxdist estimate`: memory and step time of a step under a method, before compiling.

The step comes from a reference workload (``--model``) or from a user's script:
``jaxdist estimate path/to/script.py:make_step`` calls ``make_step()``, which returns
``(step, args)``: the step function (or a ``jaxdist.parallelize``'d one) and the tuple of
its arguments (arrays, or ``jax.ShapeDtypeStruct``s from ``jax.eval_shape`` to plan a
model too large to create here). ``--devices N`` runs on N simulated CPU devices when no
accelerator is present, so a 64-device configuration can be sized on a laptop;
``--compile`` adds XLA's own figures (nothing is allocated).
"""

from __future__ import annotations

import importlib.util
import dataclasses
import json
from pathlib import Path

from jaxdist import methods as m
from jaxdist.errors import InvalidArgumentError

METHODS = {"dp": m.DataParallel, "zero2": m.Zero2Parallel, "zero3": m.Zero3Parallel,
           "shard": m.ShardParallel}


def load_step(target: str):
  """``"script.py:make_step"`` → (step, args) from calling ``make_step()``."""
  path, sep, name = target.rpartition(":")
  if not sep or not path.endswith(".py"):
    raise InvalidArgumentError(
        f"{target!r}: give the step as path/to/script.py:function (a function returning "
        f"(step, args)), or use --model.")
  if not Path(path).is_file():
    raise InvalidArgumentError(f"{target!r}: {path} is not a file.")
  spec = importlib.util.spec_from_file_location(Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  make = getattr(module, name, None)
  if not callable(make):
    raise InvalidArgumentError(f"{target!r}: {path} defines no function {name!r}.")
  made = make()
  if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], tuple)):
    raise InvalidArgumentError(
        f"{target!r}: {name}() must return (step, args) with args a tuple; it returned "
        f"{type(made).__name__}.")
  return made


def main(target: str | None, model: str, method: str, micro_batches: int | None,
         recompute: str | None, compile: bool, calibrate: bool, as_json: bool,
         stages: int = 2) -> int:
  import jax

  from jaxdist import calibration
  from jaxdist.estimate import estimate
  from jaxdist.explain import workload

  if calibrate:
    profile = calibration.calibrate(re_profile=True)
    print(f"calibrated {len(jax.devices())} {jax.devices()[0].platform} devices: "
          f"{profile.path}")
  if target:
    step, args = load_step(target)
  else:
    from jaxdist.grad import value_and_grad

    step, *args = workload(model, 16, value_and_grad)
  if method == "pipeshard":
    from jaxdist.pipeline.layers import AutoLayerOption

    chosen = m.PipeshardParallel(
        num_micro_batches=micro_batches or 1, recompute_modules=recompute,
        layer_option=AutoLayerOption(layer_num=stages),
        stage_option=m.UniformStageOption(num_stages=stages))
  else:
    chosen = METHODS[method](num_micro_batches=micro_batches, recompute_modules=recompute)
  est = estimate(step, *args, method=chosen, compile=compile)
  if as_json:
    print(json.dumps({
        "method": est.method, "mesh_shape": list(est.plan.mesh_shape),
        "memory_per_device": est.memory_per_device, "breakdown": est.breakdown,
        "step_time_s": est.step_time_s, "compute_s": est.compute_s,
        "communication_s": est.communication_s, "flops": est.flops,
        "collectives": est.collectives, "compiled": est.compiled, "notes": list(est.notes),
        "stages": [dataclasses.asdict(st) for st in est.stages],
    }, indent=1))
  else:
    print(est.summary())
  return 0
