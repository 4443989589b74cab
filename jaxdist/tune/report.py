"""What a tuning walk returns: one :class:`Trial` per candidate, in a :class:`TuneReport`
that prints, saves (CSV as NeMo's Auto Configurator writes them, JSON) and plots."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from typing import Any

from jaxdist import methods as m
from jaxdist.pipeline.layers import AutoLayerOption
from jaxdist.plan import Plan

STATUSES = ("ok", "oom", "error", "skipped")
COLUMNS = ("name", "method", "status", "step_time_s", "memory_bytes", "compile_s",
           "estimated_memory_bytes", "estimated_step_time_s", "num_micro_batches",
           "mesh_shape", "exact", "reason")


@dataclasses.dataclass(frozen=True)
class Trial:
  """One candidate of a tuning walk.

  Attributes:
    name: e.g. ``"DataParallel"``, ``"ShardParallel(2x4)"``, ``"ShardParallel(8) k=4"``,
      ``"PipeshardParallel(layers=4, stages=2, k=4)"``.
    method: the method object; ``jaxdist.parallelize(step, method=trial.method)``
      reproduces the trial (for ShardParallel it carries the saved plan: no new search).
    status: ``"ok"``, ``"oom"`` (over the budget once compiled, or the runtime ran out of
      memory), ``"error"`` (compiling or running failed) or ``"skipped"`` (not tried: the
      estimate exceeds the budget, the candidate does not apply, or the time budget ran
      out).
    step_time_s: median of the timed steps (``ok`` only).
    memory_bytes: compiled bytes per device (arguments + outputs − donated + temporaries,
      the largest stage for pipelines), where it compiled.
    compile_s: seconds to trace, plan and compile.
    reason: one line: why it was skipped or failed.
    estimated_memory_bytes, estimated_step_time_s: ``jaxdist.estimate``'s figures, where
      the method has an estimate.
    mesh_shape: the logical mesh the plan used, where known.
    exact: False where the method computes something else than the single-device step
      (micro-batches of a step with batch statistics: ``reason`` says which); the best
      trial is an exact one whenever one ran.
  """

  name: str
  method: Any
  status: str
  step_time_s: float | None = None
  memory_bytes: float | None = None
  compile_s: float | None = None
  reason: str = ""
  estimated_memory_bytes: float | None = None
  estimated_step_time_s: float | None = None
  mesh_shape: tuple[int, ...] | None = None
  exact: bool = True

  def row(self) -> dict:
    return {"name": self.name, "method": type(self.method).__name__, "status": self.status,
            "step_time_s": self.step_time_s, "memory_bytes": self.memory_bytes,
            "compile_s": self.compile_s,
            "estimated_memory_bytes": self.estimated_memory_bytes,
            "estimated_step_time_s": self.estimated_step_time_s,
            "num_micro_batches": self.method.num_micro_batches or 1,
            "mesh_shape": "x".join(map(str, self.mesh_shape)) if self.mesh_shape else "",
            "exact": self.exact, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class TuneReport:
  """The trials of a walk, in the order tried.

  Attributes:
    trials: one :class:`Trial` per candidate.
    memory_budget_per_device: the budget the walk held trials to (bytes), or None.
    elapsed_s: the walk's wall time.
  """

  trials: tuple[Trial, ...]
  memory_budget_per_device: float | None = None
  elapsed_s: float = 0.0

  @property
  def best_trial(self) -> Trial | None:
    """The fastest ``ok`` trial that computes what the single-device step does; the
    fastest ``ok`` one if none does (None if none ran)."""
    ok = [t for t in self.trials if t.status == "ok"]
    return min(ok, key=lambda t: (not t.exact, t.step_time_s)) if ok else None

  @property
  def best_method(self):
    best = self.best_trial
    return None if best is None else best.method

  def top(self, k: int = 5) -> list[Trial]:
    """The ``k`` fastest ``ok`` trials, fastest first."""
    return sorted((t for t in self.trials if t.status == "ok"), key=lambda t: t.step_time_s)[:k]

  def pareto(self) -> list[Trial]:
    """``ok`` trials no other is both faster and smaller than, by memory."""
    ok = sorted((t for t in self.trials if t.status == "ok"),
                key=lambda t: (t.memory_bytes, t.step_time_s))
    front, best_time = [], math.inf
    for t in ok:
      if t.step_time_s < best_time:
        front.append(t)
        best_time = t.step_time_s
    return front

  def summary(self) -> str:
    mb = 1e6
    best = self.best_trial
    lines = [f"{'trial':<46} {'status':<8} {'ms/step':>9} {'MB/device':>10} {'compile s':>9}"]
    for t in self.trials:
      lines.append(
          f"{t.name:<46} {t.status:<8} "
          f"{'' if t.step_time_s is None else f'{t.step_time_s * 1e3:.2f}':>9} "
          f"{'' if t.memory_bytes is None else f'{t.memory_bytes / mb:.2f}':>10} "
          f"{'' if t.compile_s is None else f'{t.compile_s:.1f}':>9}"
          + ("" if t.exact else "  [results differ]")
          + (f"  {t.reason}" if t.reason else "") + ("  <- best" if t is best else ""))
    budget = ("no memory budget" if self.memory_budget_per_device is None else
              f"budget {self.memory_budget_per_device / mb:.1f} MB per device")
    lines.append(f"{len(self.trials)} trials in {self.elapsed_s:.0f} s, {budget}; best: "
                 + (best.name if best else "none ran")
                 + ("" if best is None or best.exact else
                    " (no exact trial ran: its results differ from the single-device step's)"))
    return "\n".join(lines)

  def to_csv(self, path) -> None:
    """Every trial, one row each (typed columns: numbers empty where absent)."""
    _write_csv(path, self.trials)

  def failures_csv(self, path) -> None:
    """The trials that did not run (``oom``, ``error``, ``skipped``), as NeMo's failure file."""
    _write_csv(path, [t for t in self.trials if t.status != "ok"])

  def to_json(self, path=None) -> str:
    """The report as JSON (written to ``path`` if given); :meth:`load` reads it back."""
    data = {"memory_budget_per_device": self.memory_budget_per_device,
            "elapsed_s": self.elapsed_s,
            "trials": [dict(t.row(), method=method_to_dict(t.method),
                            mesh_shape=list(t.mesh_shape) if t.mesh_shape else None)
                       for t in self.trials]}
    text = json.dumps(data, indent=1)
    if path is not None:
      with open(path, "w") as f:
        f.write(text)
    return text

  @classmethod
  def load(cls, path) -> "TuneReport":
    with open(path) as f:
      data = json.load(f)
    trials = []
    for row in data["trials"]:
      trials.append(Trial(
          name=row["name"], method=method_from_dict(row["method"]), status=row["status"],
          step_time_s=row["step_time_s"], memory_bytes=row["memory_bytes"],
          compile_s=row["compile_s"], reason=row["reason"],
          estimated_memory_bytes=row["estimated_memory_bytes"],
          estimated_step_time_s=row["estimated_step_time_s"],
          mesh_shape=tuple(row["mesh_shape"]) if row["mesh_shape"] else None,
          exact=row.get("exact", True)))
    return cls(tuple(trials), data["memory_budget_per_device"], data["elapsed_s"])

  def plot(self, path) -> None:
    """Step time against memory per device (PNG): every trial that compiled (those that
    did not run, at 0 ms), the budget line, the Pareto front joined and the best marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"ok": "tab:blue", "oom": "tab:red", "error": "tab:gray", "skipped": "tab:gray"}
    for t in self.trials:
      if t.memory_bytes is None:
        continue
      y = t.step_time_s * 1e3 if t.step_time_s is not None else 0.0
      ax.scatter(t.memory_bytes / 1e6, y, color=colors[t.status],
                 marker="o" if t.status == "ok" else "x")
      ax.annotate(t.name, (t.memory_bytes / 1e6, y), fontsize=6, xytext=(3, 3),
                  textcoords="offset points")
    front = self.pareto()
    if front:
      ax.plot([t.memory_bytes / 1e6 for t in front], [t.step_time_s * 1e3 for t in front],
              color="tab:green", label="Pareto front")
    best = self.best_trial
    if best is not None:
      ax.scatter(best.memory_bytes / 1e6, best.step_time_s * 1e3, s=160, facecolors="none",
                 edgecolors="tab:green", label=f"best: {best.name}")
    if self.memory_budget_per_device is not None:
      ax.axvline(self.memory_budget_per_device / 1e6, color="tab:red", linestyle="--",
                 label="memory budget")
    ax.set_xlabel("memory per device (MB, compiled)")
    ax.set_ylabel("step time (ms; x at 0: compiled, not run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_csv(path, trials) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    for t in trials:
      writer.writerow({k: ("" if v is None else v) for k, v in t.row().items()})


_METHODS = {c.__name__: c for c in (m.DataParallel, m.Zero2Parallel, m.Zero3Parallel,
                                    m.ShardParallel, m.PipeshardParallel)}


def method_to_dict(method) -> dict:
  """A method object as JSON data (its devices are not kept: all devices on load)."""
  out = {"type": type(method).__name__}
  for field in dataclasses.fields(method):
    value = getattr(method, field.name)
    if field.name == "devices" or value is None:
      continue
    if isinstance(value, Plan):
      value = {"plan": json.loads(value.to_json())}
    elif isinstance(value, m.AutoShardingOption):
      value = {"auto_sharding_option": {k: v for k, v in dataclasses.asdict(value).items()
                                        if k != "partition_constraints" and k[0] != "_"}}
    elif isinstance(value, AutoLayerOption):
      value = {"auto_layer_option": dataclasses.asdict(value)}
    elif isinstance(value, m.UniformStageOption):
      value = {"uniform_stage_option": dataclasses.asdict(value)}
    elif isinstance(value, tuple):
      value = list(value)
    out[field.name] = value
  return out


def method_from_dict(data: dict):
  kwargs = {}
  for key, value in data.items():
    if key == "type":
      continue
    if isinstance(value, dict) and "plan" in value:
      value = Plan.from_json(json.dumps(value["plan"]))
    elif isinstance(value, dict) and "auto_sharding_option" in value:
      value = m.AutoShardingOption(**value["auto_sharding_option"])
    elif isinstance(value, dict) and "auto_layer_option" in value:
      value = AutoLayerOption(**value["auto_layer_option"])
    elif isinstance(value, dict) and "uniform_stage_option" in value:
      option = value["uniform_stage_option"]
      value = m.UniformStageOption(**{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in option.items()})
    elif isinstance(value, list):
      value = tuple(value)
    kwargs[key] = value
  return _METHODS[data["type"]](**kwargs)
