"""`jaxdist tune path/to/script.py:make_step`: the tuning walk from the command line.

``make_step()`` returns ``(step, args)`` (see ``jaxdist estimate``). Prints the trials as
they finish and the final table; writes the CSV files, the JSON report and the plot when
asked. Sizes take units: ``--budget 45MB`` (or 45e6, 4GiB).
"""

from __future__ import annotations

import re

from jaxdist import methods as m
from jaxdist.errors import InvalidArgumentError

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
         "gib": 2**30}
METHODS = {"dp": m.DataParallel, "zero2": m.Zero2Parallel, "zero3": m.Zero3Parallel,
           "shard": m.ShardParallel}


def parse_bytes(text: str) -> float:
  match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
  if not match or match.group(2).lower() not in UNITS:
    raise InvalidArgumentError(f"--budget {text!r}: give bytes such as 45MB, 4GiB or 45e6.")
  return float(match.group(1)) * UNITS[match.group(2).lower()]


def parse_methods(text: str | None):
  """``"dp,zero3,shard:2x4"`` → method objects (None: the guide's walk)."""
  if not text:
    return None
  out = []
  for item in text.split(","):
    name, _, shape = item.strip().partition(":")
    if name not in METHODS:
      raise InvalidArgumentError(
          f"--methods {text!r}: {name!r} is not one of {', '.join(METHODS)} (shard:2x4 for a "
          f"mesh shape).")
    if shape:
      out.append(m.ShardParallel(logical_mesh_shape=tuple(int(v) for v in shape.split("x"))))
    else:
      out.append(METHODS[name]())
  return out


def main(target: str, budget: str | None, steps: int, methods: str | None,
         time_budget_s: float | None, csv_path, failures_path, json_path, plot_path,
         quiet: bool) -> int:
  from jaxdist.estimate_cli import load_step
  from jaxdist.tune.walk import tune

  step, args = load_step(target)
  candidates = parse_methods(methods)
  if candidates is not None and budget is not None:
    candidates = [c if not isinstance(c, m.ShardParallel) else
                  m.ShardParallel(logical_mesh_shape=c.logical_mesh_shape,
                                  auto_sharding_option=m.AutoShardingOption(
                                      memory_budget_per_device=parse_bytes(budget)))
                  for c in candidates]
  report = tune(step, *args, memory_budget_per_device=parse_bytes(budget) if budget else None,
                steps=steps, time_budget_s=time_budget_s, candidates=candidates,
                progress=not quiet)
  print(report.summary())
  if csv_path:
    report.to_csv(csv_path)
  if failures_path:
    report.failures_csv(failures_path)
  if json_path:
    report.to_json(json_path)
  if plot_path:
    report.plot(plot_path)
  return 0 if report.best_trial is not None else 1
