"""recommend(): the grid of configurations NeMo's Auto Configurator would try, pruned by its
validity rules, evaluated, ranked, with the Pareto front and why the others lost."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any, Iterable

from jaxdist import errors
from jaxdist.advise.cluster import Cluster
from jaxdist.advise.config import RECOMPUTE, ParallelConfig, validate
from jaxdist.advise.evaluate import Evaluation, _check_batch, evaluate
from jaxdist.advise.specs import ModelSpec

OBJECTIVES = ("throughput", "cost")
# Keyword constraints: a value or a list of allowed values per configuration field, and
# the search's own switches.
FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "micro_batch_size", "recompute",
          "virtual_stages", "sequence_parallel")
SWITCHES = ("allow_cross_node_tp", "min_model_parallel", "max_model_parallel", "device_counts",
            "precision", "optimizer")


@dataclasses.dataclass
class Advice:
  """What :func:`recommend` found.

  Attributes:
    candidates: configurations that fit, best first (``top_k`` of them).
    rejected: valid configurations that do not fit, least memory first (their
      ``problems`` say by how much).
    evaluated: how many valid configurations were evaluated; ``objective``.
  """

  candidates: list[Evaluation]
  rejected: list[Evaluation]
  evaluated: int
  objective: str
  _all_fitting: list[Evaluation] = dataclasses.field(default_factory=list, repr=False)

  @property
  def best(self) -> Evaluation | None:
    return self.candidates[0] if self.candidates else None

  def pareto(self, against: str = "cost") -> list[Evaluation]:
    """The non-dominated fitting configurations: more tokens/s and less cost per million
    tokens (``against="cost"``) or fewer devices (``against="devices"``); by throughput."""
    if against not in ("cost", "devices"):
      raise errors.InvalidArgumentError(
          f"Advice.pareto(against={against!r}) must be 'cost' or 'devices'.")
    key = ((lambda e: e.cost_per_million_tokens) if against == "cost"
           else (lambda e: e.config.num_devices))
    front, best_key = [], float("inf")
    for e in sorted(self._all_fitting, key=lambda e: (-e.tokens_per_s, key(e))):
      if key(e) < best_key:
        front.append(e)
        best_key = key(e)
    return front

  def training_days(self, tokens: float) -> float:
    """Days to train on ``tokens`` with the best configuration's predicted throughput."""
    if self.best is None:
      raise errors.InfeasiblePlanError("no configuration fits; nothing to time")
    return self.best.training_days(tokens)

  def explain(self, evaluation: Evaluation) -> str:
    """Why ``evaluation`` ranks below the best (or does not fit)."""
    if evaluation.problems:
      return "; ".join(evaluation.problems)
    best = self.best
    if best is None or evaluation is best:
      return "best"
    ratio = evaluation.step_time_s / best.step_time_s
    what = (f"{evaluation.cost_per_million_tokens / best.cost_per_million_tokens:.2f}x the cost "
            f"per token" if self.objective == "cost" else f"{ratio:.2f}x the best's step time")
    n, n_best = evaluation.config.num_devices, best.config.num_devices
    if n != n_best:
      return f"{what}; {ratio:.2f}x the step time on {n} devices (best: {n_best})"
    diffs = {k: v - best.time.parts()[k] for k, v in evaluation.time.parts().items()}
    part, delta = max(diffs.items(), key=lambda kv: kv[1])
    if delta <= 0:
      return what
    return f"{what}; most of the difference: {part.replace('_', ' ')} (+{delta:.3g} s)"

  def rows(self) -> list[dict[str, Any]]:
    out = []
    for rank, e in enumerate(self.candidates + self.rejected, 1):
      row = e.to_dict()
      row["rank"] = rank if e.fits else None
      row["why"] = self.explain(e)
      row["problems"] = " | ".join(row["problems"])
      out.append(row)
    return out

  def to_csv(self, path: str | Path) -> None:
    rows = self.rows()
    if not rows:
      Path(path).write_text("")
      return
    with open(path, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)

  def to_json(self) -> str:
    return json.dumps({"objective": self.objective, "evaluated": self.evaluated,
                       "candidates": [e.to_dict() for e in self.candidates],
                       "rejected": [e.to_dict() for e in self.rejected[:20]]}, indent=1)


def _allowed(constraints: dict, field: str, default: Iterable) -> list:
  if field not in constraints:
    return list(default)
  value = constraints[field]
  values = list(value) if isinstance(value, (list, tuple, set)) else [value]
  return [v for v in values if v in set(default)]


def _powers_of_two(limit: int) -> list[int]:
  return [2 ** i for i in range(limit.bit_length()) if 2 ** i <= limit]


def grid(model: ModelSpec, cluster: Cluster, *, global_batch_size: int, seq_len: int | None = None,
         **constraints) -> Iterable[ParallelConfig]:
  """Every configuration of the search space that keeps the rules (see
  :func:`jaxdist.advise.validate`) and the constraints."""
  s = seq_len or model.seq_len
  cross = bool(constraints.get("allow_cross_node_tp", False))
  lo = constraints.get("min_model_parallel", 1)
  hi = constraints.get("max_model_parallel", None)
  counts = constraints.get("device_counts") or [cluster.num_devices]
  for n in counts:
    sized = cluster.with_devices(n)
    tp_limit = n if cross else min(n, cluster.devices_per_node)
    for tp in _allowed(constraints, "tp", _powers_of_two(tp_limit)):
      cps = [1, 2, 4, 8] if s >= 8192 else [1]
      for cp in _allowed(constraints, "cp", cps):
        if n % (tp * cp):
          continue
        pps = [p for p in range(1, model.num_layers + 1)
               if model.num_layers % p == 0 and (n // (tp * cp)) % p == 0]
        for pp in _allowed(constraints, "pp", pps):
          if n % (tp * cp * pp):
            continue
          dp = n // (tp * cp * pp)
          if "dp" in constraints and dp not in _allowed(constraints, "dp", [dp]):
            continue
          eps = [e for e in range(1, dp + 1) if dp % e == 0 and model.num_experts % e == 0]
          for ep in _allowed(constraints, "ep", eps if model.is_moe else [1]):
            mp = tp * pp * cp * ep
            if mp < lo or (hi is not None and mp > hi):
              continue
            vs = [1, 2, 4] if pp > 1 else [1]
            zeros = [0] if dp == 1 else [0, 1] if pp > 1 else [0, 1, 2, 3]
            for mbs, v, zero, rec in itertools.product(
                _allowed(constraints, "micro_batch_size", [1, 2, 4, 8]),
                _allowed(constraints, "virtual_stages", vs),
                _allowed(constraints, "zero_stage", zeros),
                _allowed(constraints, "recompute", RECOMPUTE)):
              # Sequence parallelism (on by default with tp) costs no time and saves memory.
              sp = tp > 1 and (_allowed(constraints, "sequence_parallel", [True, False]) or [True])[0]
              config = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
                                      micro_batch_size=mbs, recompute=rec, virtual_stages=v,
                                      sequence_parallel=sp)
              if not validate(model, sized, config, global_batch_size=global_batch_size,
                              seq_len=s, allow_cross_node_tp=cross):
                yield sized, config


def recommend(model: ModelSpec, cluster: Cluster, *, global_batch_size: int,
              seq_len: int | None = None, top_k: int = 10, objective: str = "throughput",
              **constraints) -> Advice:
  """Search the configurations of ``model`` on ``cluster`` and rank those that fit.

  ``objective="throughput"`` ranks by tokens/s on the whole cluster; ``"cost"`` by US$ per
  million tokens and also tries smaller device counts (whole nodes, and powers of two
  below one node) unless ``device_counts=`` is given.

  Constraints (keywords): a value or list of values for any of ``dp, tp, pp, cp, ep,
  zero_stage, micro_batch_size, recompute, virtual_stages, sequence_parallel``; and
  ``allow_cross_node_tp`` (default False: tensor parallelism stays inside a node),
  ``min_model_parallel`` / ``max_model_parallel`` (bounds on tp·pp·cp·ep),
  ``device_counts``, ``precision`` (bf16, fp16, fp8, fp32), ``optimizer`` (adam, adamw,
  sgd, adafactor).
  """
  if objective not in OBJECTIVES:
    raise errors.InvalidArgumentError(
        f"recommend(objective={objective!r}) must be one of {OBJECTIVES}.")
  unknown = set(constraints) - set(FIELDS) - set(SWITCHES)
  if unknown:
    raise errors.UnknownArgumentError(
        f"recommend() got unknown constraint(s) {sorted(unknown)}; valid: {FIELDS + SWITCHES}.")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
    raise errors.InvalidArgumentError(f"recommend(top_k={top_k!r}) must be a positive integer.")
  _check_batch(global_batch_size)
  precision = constraints.pop("precision", "bf16")
  optimizer = constraints.pop("optimizer", "adam")
  if objective == "cost" and not constraints.get("device_counts"):
    n, per = cluster.num_devices, cluster.devices_per_node
    constraints["device_counts"] = sorted(
        {d for d in _powers_of_two(min(n, per))}
        | {per * k for k in range(1, n // per + 1)})
  fitting, rejected, count = [], [], 0
  for sized, config in grid(model, cluster, global_batch_size=global_batch_size, seq_len=seq_len,
                            **constraints):
    e = evaluate(model, sized, config, global_batch_size=global_batch_size, seq_len=seq_len,
                 precision=precision, optimizer=optimizer,
                 allow_cross_node_tp=bool(constraints.get("allow_cross_node_tp", False)))
    count += 1
    (fitting if e.fits else rejected).append(e)
  key = ((lambda e: -e.tokens_per_s) if objective == "throughput"
         else (lambda e: e.cost_per_million_tokens))
  fitting.sort(key=key)
  rejected.sort(key=lambda e: e.memory["total"])
  return Advice(candidates=fitting[:top_k], rejected=rejected, evaluated=count,
                objective=objective, _all_fitting=fitting)
