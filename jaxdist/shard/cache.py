"""An on-disk cache of sharding plans, so that a second process skips the search.

Two kinds of entries, one small JSON file each:

- a *solution* (per mesh shape): one choice per strategy group of the graph built from
  the step's jaxpr; the cached choice applies to a rebuilt graph when the key matches;
- a *result* (per search): the layout the search chose (every constraint as a
  ``PartitionSpec``), its predictions and notes; a hit skips building the strategy
  graphs too, which takes longer than the solve on a GPT. The chosen shape's graph is
  rebuilt only if asked for (``jaxdist.estimate`` reads it), from the cached solution.

The key hashes everything a plan depends on: the jaxpr's text, the input shapes, dtypes
and roles, the mesh (shape, axis names, α, β, peak flops, device kind), the planner
options, pinned inputs, the number of micro-batches, :data:`VERSION` (bumped when an
entry's format changes) and a digest of jaxdist's own source, so that a plan made by
other code (an upgrade, or a change while developing) is never reused.

Location: ``$JAXDIST_CACHE_DIR/plans`` (default ``~/.cache/jaxdist/plans``).
``AutoShardingOption(plan_cache=False)`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

from jax.sharding import PartitionSpec

from jaxdist import cache_dir
from jaxdist.shard.solver import Solution

VERSION = 28  # 28: the liveness model under budgets (convolutions read and write transposed copies)
log = logging.getLogger("jaxdist.plan")


def directory() -> Path:
  return cache_dir.root() / "plans"


@functools.cache
def source_digest() -> str:
  """A digest of every module of the jaxdist package (read once per process)."""
  package = Path(__file__).resolve().parent.parent
  digest = hashlib.sha256()
  for path in sorted(package.rglob("*.py")):
    digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
  return digest.hexdigest()


def key(*parts) -> str:
  """A hex digest of ``parts`` (their ``repr``s; jaxprs print deterministically)."""
  digest = hashlib.sha256(f"jaxdist-plan-cache-v{VERSION}-{source_digest()}".encode())
  for part in parts:
    digest.update(b"\0" + repr(part).encode())
  return digest.hexdigest()


def load(digest: str, num_groups: int) -> Solution | None:
  """The cached solution, or None (absent, unreadable or for another graph size)."""
  data = _read(digest)
  try:
    choice = tuple(int(c) for c in data["choice"])
    solution = Solution(choice, float(data["objective"]), data["status"])
  except (KeyError, TypeError, ValueError):
    return None
  return solution if len(choice) == num_groups else None


def store(digest: str, solution: Solution) -> None:
  """Writes the solution (atomically; a cache that cannot be written is skipped)."""
  _write(digest, {"choice": list(solution.choice), "objective": solution.objective,
                  "status": solution.status})


RESULT_FIELDS = frozenset({"shape", "long_scans", "tied", "rolled", "objective",
                           "mesh_objectives", "predicted_collectives", "layout"})


def load_result(digest: str) -> dict | None:
  """A cached search result as :func:`store_result` wrote it, or None (absent, unreadable
  or lacking a field)."""
  data = _read(digest)
  if (not isinstance(data, dict) or not RESULT_FIELDS <= data.keys()
      or not isinstance(data["layout"], dict)
      or not all(isinstance(data[f], bool) for f in ("long_scans", "tied"))):
    return None
  return data


def store_result(digest: str, result: dict) -> None:
  """Writes a search result: JSON values, ``PartitionSpec`` s encoded by :func:`encode`."""
  _write(digest, result)


def encode(spec: PartitionSpec | None):
  """A PartitionSpec (or None) as JSON: entries None, an axis name or a list of them."""
  if spec is None:
    return None
  return [list(e) if isinstance(e, tuple) else e for e in spec]


def decode(data) -> PartitionSpec | None:
  if data is None:
    return None
  return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in data))


def _read(digest: str):
  path = directory() / f"{digest}.json"
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  log.info("plan cache hit: %s", path)
  return data


def _write(digest: str, data: dict) -> None:
  folder = directory()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{digest}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(folder / f"{digest}.json")
  except OSError as e:
    log.warning("plan cache not written (%s): %s", folder, e)
