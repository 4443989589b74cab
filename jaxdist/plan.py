"""jd.Plan: a versioned, JSON-serializable record of how a step is laid out.

Plans are keyed by stable parameter paths (``state.params['Dense_0']['kernel']``) and
shapes, never by trace ids, so a plan saved from one run applies to a re-traced step.
"""

from __future__ import annotations

import dataclasses
import json
import os


from jax.sharding import PartitionSpec

from jaxdist.errors import PlanMismatchError

FORMAT_VERSION = 1


def spec_to_json(spec: PartitionSpec) -> list:
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def spec_from_json(entries: list) -> PartitionSpec:
  return PartitionSpec(*[tuple(a) if isinstance(a, list) else a for a in entries])


@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """The layout of one input leaf between steps."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  role: str
  spec: PartitionSpec


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a step is parallelized.

  Attributes:
    method: the method's class name, e.g. ``"Zero2Parallel"``.
    mesh_shape: the logical mesh shape used.
    axis_names: its axis names.
    inputs: one :class:`PlanEntry` per array leaf of the step's dynamic arguments.
    num_micro_batches: gradient-accumulation micro-batches (1 = none).
    notes: human-readable remarks, e.g. leaves that could not be sharded.
    objective: the planner's predicted cost in seconds, where it has one.
    mesh_objectives: for planners that search mesh shapes, each shape's objective.
    predicted_collectives: kind → {"count", "result_bytes"} per step and device, from the
      shard planner or a fixed layout's (DataParallel, ZeRO) reductions and gathers
      (``Executable.check_communication`` compares them with XLA's).
    format_version: the JSON format version.
  """

  method: str
  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  inputs: tuple[PlanEntry, ...]
  num_micro_batches: int = 1
  notes: tuple[str, ...] = ()
  objective: float | None = None
  mesh_objectives: dict[str, float] = dataclasses.field(default_factory=dict)
  predicted_collectives: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  format_version: int = FORMAT_VERSION

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    d["inputs"] = [dict(dataclasses.asdict(e), spec=spec_to_json(e.spec)) for e in self.inputs]
    return json.dumps(d, indent=1)

  @classmethod
  def from_json(cls, text: str) -> "Plan":
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise PlanMismatchError(f"the plan is not valid JSON ({e}); write plans with Plan.save().") from None
    if not isinstance(d, dict):
      raise PlanMismatchError(f"the plan is a JSON {type(d).__name__}, not an object; write plans "
                              f"with Plan.save().")
    version = d.get("format_version")
    if version != FORMAT_VERSION:
      raise PlanMismatchError(
          f"plan format_version={version!r} is not supported; this jaxdist reads version "
          f"{FORMAT_VERSION}. Re-create the plan with this version.")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in d]
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    entry_fields = [f.name for f in dataclasses.fields(PlanEntry)]
    bad = next((k for k, e in enumerate(d.get("inputs") or [])
                if not isinstance(e, dict) or set(entry_fields) - set(e)), None)
    if missing or unknown or bad is not None:
      what = (f"lacks field(s) {', '.join(missing)}" if missing else
              f"has unknown field(s) {', '.join(unknown)}" if unknown else
              f"has an inputs[{bad}] entry without all of {', '.join(entry_fields)}")
      raise PlanMismatchError(
          f"the plan (format_version {version}) {what}; a plan needs {', '.join(required)} "
          f"(as Plan.to_json() writes them). Re-create it with Plan.save().")
    d["inputs"] = tuple(PlanEntry(e["path"], tuple(e["shape"]), e["dtype"], e["role"],
                                  spec_from_json(e["spec"])) for e in d["inputs"])
    d["mesh_shape"] = tuple(d["mesh_shape"])
    d["axis_names"] = tuple(d["axis_names"])
    d["notes"] = tuple(d.get("notes", ()))
    return cls(**d)

  def save(self, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Plan":
    with open(path) as f:
      return cls.from_json(f.read())

  def summary(self) -> str:
    """A readable table: method, mesh, and every leaf's path, shape, role and spec."""
    lines = [f"method: {self.method}   mesh: {self.mesh_shape} {self.axis_names}   "
             f"micro-batches: {self.num_micro_batches}"]
    if self.objective is not None:
      lines.append(f"objective: {self.objective:.6g} s   mesh shapes tried: {self.mesh_objectives}")
    for kind, c in sorted(self.predicted_collectives.items()):
      lines.append(f"predicted {kind}: {c['count']} per step, {c['result_bytes']:.0f} bytes")
    width = max([len(e.path) for e in self.inputs] + [4])
    lines.append(f"{'path':<{width}}  {'shape':<16} {'role':<9} spec")
    for e in self.inputs:
      lines.append(f"{e.path:<{width}}  {str(e.shape):<16} {e.role:<9} {tuple(e.spec)}")
    lines += [f"note: {n}" for n in self.notes]
    return "\n".join(lines)

  def spec_of(self, path: str) -> PartitionSpec:
    for e in self.inputs:
      if e.path == path:
        return e.spec
    raise KeyError(path)
