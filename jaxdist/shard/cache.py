"""An on-disk cache of solved sharding ILPs, so that a second process skips the search.

A solution is one choice per strategy group of the graph built from the step's jaxpr;
the graph is rebuilt on every call (it is cheap next to the solve), and the cached choice
applies to it when the key matches. The key hashes everything the solve depends on: the
jaxpr's text, the input shapes, dtypes and roles, the mesh (shape, axis names, α, β, peak
flops, device kind), the planner options, pinned inputs, the number of micro-batches, and
:data:`VERSION` (bumped whenever the cost model changes what a solve returns).

Location: ``$JAXDIST_CACHE_DIR/plans`` (default ``~/.cache/jaxdist/plans``); one small
JSON file per solution. ``AutoShardingOption(plan_cache=False)`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from jaxdist import cache_dir
from jaxdist.shard.solver import Solution

VERSION = 4
log = logging.getLogger("jaxdist.plan")


def directory() -> Path:
  return cache_dir.root() / "plans"


def key(*parts) -> str:
  """A hex digest of ``parts`` (their ``repr``s; jaxprs print deterministically)."""
  digest = hashlib.sha256(f"jaxdist-plan-cache-v{VERSION}".encode())
  for part in parts:
    digest.update(b"\0" + repr(part).encode())
  return digest.hexdigest()


def load(digest: str, num_groups: int) -> Solution | None:
  """The cached solution, or None (absent, unreadable or for another graph size)."""
  path = directory() / f"{digest}.json"
  try:
    data = json.loads(path.read_text())
    choice = tuple(int(c) for c in data["choice"])
  except (OSError, ValueError, KeyError, TypeError):
    return None
  if len(choice) != num_groups:
    return None
  log.info("plan cache hit: %s", path)
  return Solution(choice, float(data["objective"]), data["status"])


def store(digest: str, solution: Solution) -> None:
  """Writes the solution (atomically; a cache that cannot be written is skipped)."""
  folder = directory()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{digest}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"choice": list(solution.choice), "objective": solution.objective,
                               "status": solution.status}))
    tmp.replace(folder / f"{digest}.json")
  except OSError as e:
    log.warning("plan cache not written (%s): %s", folder, e)
