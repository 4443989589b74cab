"""Partition-constraint presets (``strategies/presets/*.json``, data not code) that the
tuning walk tries as ShardParallel candidates on each 2-D mesh shape.

A preset names mesh axes and maps leaf-path patterns (``AutoShardingOption``'s
``partition_constraints`` globs) to ``PartitionSpec``s; the planner optimizes every other
leaf. A preset applies to a step when at least one of its patterns matches a parameter;
patterns that match nothing (a model without attention biases, say) are dropped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jax.sharding import PartitionSpec

from jaxdist.plan import spec_from_json
from jaxdist.shard.planner import path_matches

DIRECTORY = Path(__file__).resolve().parents[2] / "strategies" / "presets"


@dataclasses.dataclass(frozen=True)
class Preset:
  name: str
  description: str
  axis_names: tuple[str, ...]
  constraints: dict[str, PartitionSpec]

  def matching(self, param_paths) -> dict[str, PartitionSpec]:
    """The constraints whose pattern matches at least one of ``param_paths``."""
    return {p: s for p, s in self.constraints.items()
            if any(path_matches(p, path) for path in param_paths)}


def load_presets(directory: Path = DIRECTORY) -> list[Preset]:
  """Every preset in ``directory`` (none if it does not exist: an installed package
  without the repository's ``strategies/``)."""
  presets = []
  for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
    data = json.loads(path.read_text())
    presets.append(Preset(path.stem, data["description"], tuple(data["axis_names"]),
                          {k: spec_from_json(v) for k, v in data["constraints"].items()}))
  return presets
