"""Choose one strategy per group: an ILP in cvxpy, solved by HiGHS.

Variables: a one-hot ``s_g`` per group with more than one choice; for every pair of
such groups joined by data flow, ``e_gh ≥ 0`` of shape ``|s_g| × |s_h|`` with row sums
``s_g`` and column sums ``s_h`` (with one-hot marginals the only feasible ``e`` is their
outer product, so ``e`` needs no integrality). Objective:

    Σ_g c_g · s_g + Σ_(g,h) Σ R_gh ∘ e_gh

with ``c_g`` the groups' compute + communication + in-group resharding and ``R_gh``
the resharding between groups. A memory budget adds ``Σ_g m_g(t) · s_g ≤ budget`` for
each checked liveness point ``t``.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import cvxpy as cp
import numpy as np

from jaxdist import errors
from jaxdist.shard.graph import StrategyGraph


@dataclasses.dataclass(frozen=True)
class MemoryConstraint:
  """Per-device bytes at some liveness points, as a linear function of the choices.

  Attributes:
    per_group: per checked point, group → bytes per choice.
    constant: per checked point, bytes independent of the choices.
  """

  per_group: tuple[dict[int, np.ndarray], ...]
  constant: tuple[float, ...]

  def usage(self, choice) -> float:
    return max((c + sum(v[choice[g]] for g, v in groups.items())
                for groups, c in zip(self.per_group, self.constant)), default=0.0)

  def least_possible(self) -> float:
    """A lower bound on the peak any plan reaches: each point at its own minimum."""
    return max((c + sum(v.min() for v in groups.values())
                for groups, c in zip(self.per_group, self.constant)), default=0.0)


@dataclasses.dataclass(frozen=True)
class Solution:
  """One choice per group and what it costs.

  Attributes:
    choice: per group, the index of its strategy.
    objective: predicted seconds (the ILP objective).
    status: "optimal", "time_limit" (best found in the time allowed) or "trivial".
  """

  choice: tuple[int, ...]
  objective: float
  status: str


def objective_of(graph: StrategyGraph, choice) -> float:
  total = sum(float(c[choice[g]]) for g, c in enumerate(graph.group_costs))
  for (g, h), m in graph.edge_costs.items():
    total += float(m[choice[g], choice[h]])
  return total


def solve_brute_force(graph: StrategyGraph, memory: MemoryConstraint | None = None,
                      budget: float | None = None) -> Solution:
  """Exhaustive search (small graphs only): the reference the ILP is tested against."""
  ranges = [range(n) for n in graph.group_sizes]
  best = None
  for choice in itertools.product(*ranges):
    if budget is not None and memory is not None and memory.usage(choice) > budget:
      continue
    value = objective_of(graph, choice)
    if best is None or value < best[1] - 1e-15:
      best = (choice, value)
  if best is None:
    raise errors.InfeasiblePlanError("no combination of strategies meets the memory budget")
  return Solution(tuple(best[0]), best[1], "optimal")


def solve_ilp(graph: StrategyGraph, memory: MemoryConstraint | None = None,
              budget: float | None = None, time_limit_s: float | None = None) -> Solution:
  """Solves the ILP; on a time limit returns the best plan found, with a warning.

  Raises:
    InfeasiblePlanError: no plan meets ``budget`` (the message gives the least peak).
  """
  free = [g for g, n in enumerate(graph.group_sizes) if n > 1]
  if not free:
    choice = tuple(0 for _ in graph.group_sizes)
    if budget is not None and memory is not None and memory.usage(choice) > budget:
      _infeasible(memory, budget)
    return Solution(choice, objective_of(graph, choice), "trivial")
  s = {g: cp.Variable(graph.group_sizes[g], boolean=True) for g in free}

  def pick(g):  # the one-hot of group g, as an expression or a constant vector
    if g in s:
      return s[g]
    one = np.zeros(graph.group_sizes[g])
    one[0] = 1.0
    return one

  constraints = [cp.sum(s[g]) == 1 for g in free]
  terms = [graph.group_costs[g] @ s[g] for g in free if np.any(graph.group_costs[g])]
  constant = sum(float(graph.group_costs[g][0]) for g in range(len(graph.group_sizes))
                 if g not in s)
  for (g, h), m in graph.edge_costs.items():
    if not np.any(m):
      continue
    if g in s and h in s:
      e = cp.Variable(m.shape, nonneg=True)
      constraints += [cp.sum(e, axis=1) == s[g], cp.sum(e, axis=0) == s[h]]
      terms.append(cp.sum(cp.multiply(m, e)))
    elif g in s:
      terms.append(m[:, 0] @ s[g])
    elif h in s:
      terms.append(m[0, :] @ s[h])
    else:
      constant += float(m[0, 0])
  if budget is not None and memory is not None:
    for groups, c in zip(memory.per_group, memory.constant):
      fixed = c + sum(float(v[0]) for g, v in groups.items() if g not in s)
      variable = [v @ s[g] for g, v in groups.items() if g in s]
      if variable:
        constraints.append(cp.sum(cp.hstack(variable)) + fixed <= budget)
      elif fixed > budget:
        _infeasible(memory, budget)

  problem = cp.Problem(cp.Minimize(cp.sum(cp.hstack(terms)) if terms else 0), constraints)
  options = {} if time_limit_s is None else {"time_limit": float(time_limit_s)}
  problem.solve(solver=cp.HIGHS, **options)
  if problem.status in ("infeasible", "infeasible_inaccurate", "infeasible_or_unbounded"):
    _infeasible(memory, budget)
  if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE, cp.USER_LIMIT) or any(
      s[g].value is None for g in free):
    raise RuntimeError(f"HiGHS returned status {problem.status!r} without a solution")
  status = "optimal"
  if problem.status == cp.USER_LIMIT:
    status = "time_limit"
    warnings.warn(f"the sharding ILP hit its time limit ({time_limit_s} s); using the best plan "
                  f"found so far (raise AutoShardingOption.solver_time_limit_s for a better one).",
                  errors.JaxdistWarning, stacklevel=3)
  choice = tuple(int(np.argmax(s[g].value)) if g in s else 0
                 for g in range(len(graph.group_sizes)))
  return Solution(choice, objective_of(graph, choice), status)


def _infeasible(memory: MemoryConstraint | None, budget: float | None):
  least = memory.least_possible() if memory is not None else float("nan")
  raise errors.InfeasiblePlanError(
      f"no sharding plan fits memory_budget_per_device={budget:.0f} bytes; the least any plan "
      f"needs at its peak is at least {least:.0f} bytes. Raise the budget or use more devices.")
