"""Repeated layers: identical runs of equations that share one sharding solution.

A transformer's blocks trace to the same equations on the same shapes, once per block,
in the forward pass, in the backward pass and in the optimizer update. Such a run is a
*tandem repeat* of the equation sequence: copies ``c`` of a segment of ``L`` equations
side by side. Tying every group of copy ``r`` to the corresponding group of copy 0
leaves the ILP one set of variables per segment instead of one per copy, so its size
stops growing with depth.

Tying restricts the plans: copies can no longer differ (an MLP whose identical layers
want alternating column / row splits needs *pairs* of layers to repeat). Segments
shorter than ``MIN_SEGMENT_EQNS`` are therefore left alone
(``AutoShardingOption.share_repeated_layers=False`` turns sharing off).
"""

from __future__ import annotations

import dataclasses

import jax.extend.core as jex
import numpy as np

from jaxdist.shard.graph import StrategyGraph

MIN_SEGMENT_EQNS = 48


@dataclasses.dataclass(frozen=True)
class Repeat:
  """``copies`` runs of ``period`` equations, the first starting at ``start``."""

  start: int
  period: int
  copies: int


# Where a slice starts does not change how it may be split: an unrolled scan's
# iterations differ only there (each reads its own layer of the stacked weights).
_POSITION_PARAMS = frozenset({"start_indices", "limit_indices"})


def _signature(eqn) -> tuple:
  params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items()
                        if not isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr))
                        and k not in _POSITION_PARAMS))
  avals = tuple((tuple(getattr(v.aval, "shape", ())), str(getattr(v.aval, "dtype", "")))
                for v in list(eqn.invars) + list(eqn.outvars))
  return (eqn.primitive.name, avals, params)


def find_repeats(eqns, min_period: int = MIN_SEGMENT_EQNS) -> list[Repeat]:
  """Non-overlapping tandem repeats of the equation signatures, most coverage first.

  For each period ``L`` a run of ``r`` positions where ``sig[i] == sig[i + L]`` spans
  ``r + L`` equations: ``(r + L) // L`` copies. Candidates are taken greedily by the
  number of equations they cover (ties: the shorter period) and must not overlap.
  """
  ids: dict = {}
  sig = np.array([ids.setdefault(_signature(e), len(ids)) for e in eqns], dtype=np.int64)
  n = len(sig)
  candidates = []
  for period in range(min_period, n // 2 + 1):
    same = np.concatenate(([False], sig[:-period] == sig[period:], [False]))
    edges = np.flatnonzero(np.diff(same.astype(np.int8)))
    for begin, end in zip(edges[::2], edges[1::2]):
      copies = (end - begin + period) // period
      if copies >= 2:
        candidates.append((copies * period, -period, int(begin), period, int(copies)))
  candidates.sort(reverse=True)
  taken = np.zeros(n, dtype=bool)
  out = []
  for _, _, start, period, copies in candidates:
    span = slice(start, start + copies * period)
    if not taken[span].any():
      taken[span] = True
      out.append(Repeat(start, period, copies))
  return sorted(out, key=lambda r: r.start)


def tie_groups(jaxpr, graph: StrategyGraph, min_period: int = MIN_SEGMENT_EQNS,
               pairs=()) -> list[int]:
  """Per group, the group whose choice it takes (itself when untied).

  Two groups are tied when corresponding equations of two copies belong to them and
  their strategies give the same output specs choice for choice; ties are transitive
  (union-find, the earliest group representing its class). ``pairs``: more pairs of
  corresponding equations (indices into ``jaxpr.eqns``), tied the same way; with
  ``min_period=None`` only those.
  """
  rep = list(range(len(graph.group_sizes)))

  def find(g):
    while rep[g] != g:
      rep[g] = rep[rep[g]]
      g = rep[g]
    return g

  node_of = {id(node.eqn): node for node in graph.nodes if node.eqn is not None}

  def tie(i, k):
    first, other = node_of.get(id(jaxpr.eqns[i])), node_of.get(id(jaxpr.eqns[k]))
    if (first is None or other is None or graph.group_sizes[first.group] < 2
        or [s.out_specs for s in other.strategies] != [s.out_specs for s in first.strategies]):
      return
    a, b = find(first.group), find(other.group)
    if a != b and graph.group_sizes[a] == graph.group_sizes[b]:
      rep[max(a, b)] = min(a, b)

  for r in find_repeats(jaxpr.eqns, min_period) if min_period is not None else ():
    for j in range(r.period):
      for copy in range(1, r.copies):
        tie(r.start + j, r.start + copy * r.period + j)
  for i, k in pairs:
    tie(i, k)
  return [find(g) for g in range(len(rep))]
