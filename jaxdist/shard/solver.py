"""Choose one strategy per group: an ILP in cvxpy, solved by HiGHS.

Variables: a one-hot ``s_g`` per group with more than one choice; for every pair of
such groups joined by data flow, ``e_gh ≥ 0`` of shape ``|s_g| × |s_h|`` with row sums
``s_g`` and column sums ``s_h`` (with one-hot marginals the only feasible ``e`` is their
outer product, so ``e`` needs no integrality). Objective:

    Σ_g c_g · s_g + Σ_(g,h) Σ R_gh ∘ e_gh

with ``c_g`` the groups' compute + communication + in-group resharding and ``R_gh``
the resharding between groups, plus the α of collectives XLA combines, once per combined
group: ``Σ_k α_k · a_k`` with ``a_k ≥`` each member's ``s`` or ``e`` entry, ``a_k ≥``
its members' bytes over the combine threshold and their number over the operand limit
(``jaxdist.shard.combine``). A memory budget adds ``Σ_g m_g(t) · s_g ≤ budget`` for each
checked liveness point ``t``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import warnings

import numpy as np

from jaxdist import errors
from jaxdist.shard.graph import StrategyGraph

HUB_CHOICES = 8  # the most choices of a hub solved once per choice (see _hub)

log = logging.getLogger("jaxdist.plan")


@dataclasses.dataclass(frozen=True)
class MemoryConstraint:
  """Per-device bytes at some liveness points, as a linear function of the choices.

  Attributes:
    per_group: per checked point, group → bytes per choice.
    constant: per checked point, bytes independent of the choices.
    per_edge: per checked point, (group, group) → bytes per pair of their choices (a
      value's resharded copy: it exists where the two ends' layouts differ); empty or
      one dict per point.
  """

  per_group: tuple[dict[int, np.ndarray], ...]
  constant: tuple[float, ...]
  per_edge: tuple[dict[tuple[int, int], np.ndarray], ...] = ()

  def edges(self) -> tuple[dict[tuple[int, int], np.ndarray], ...]:
    return self.per_edge or tuple({} for _ in self.constant)

  def usage(self, choice) -> float:
    return max((c + sum(v[choice[g]] for g, v in groups.items())
                + sum(m[choice[g], choice[h]] for (g, h), m in edges.items())
                for groups, c, edges in zip(self.per_group, self.constant, self.edges())),
               default=0.0)

  def least_possible(self) -> float:
    """A lower bound on the peak any plan reaches: each point at its own minimum."""
    return max((c + sum(v.min() for v in groups.values()) + sum(m.min() for m in edges.values())
                for groups, c, edges in zip(self.per_group, self.constant, self.edges())),
               default=0.0)


@dataclasses.dataclass(frozen=True)
class Solution:
  """One choice per group and what it costs.

  Attributes:
    choice: per group, the index of its strategy.
    objective: predicted seconds (the ILP objective).
    status: "optimal", "time_limit" (best found in the time allowed), "over_budget"
      (the time allowed ended before any plan within the memory budget was found: the
      choice is the solver's last one, over the budget) or "trivial".
  """

  choice: tuple[int, ...]
  objective: float
  status: str


def objective_of(graph: StrategyGraph, choice) -> float:
  graph = graph.priced()
  total = sum(float(c[choice[g]]) for g, c in enumerate(graph.group_costs))
  for (g, h), m in graph.edge_costs.items():
    total += float(m[choice[g], choice[h]])
  if graph.combine is not None:
    total += graph.combine.charge(choice)
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


def tie(graph: StrategyGraph, memory: MemoryConstraint | None,
        rep: list[int]) -> tuple[StrategyGraph, MemoryConstraint | None, list[int]]:
  """The problem over one group per class of tied groups (``rep[g]``: g's representative).

  Costs and memory of tied groups add up; an edge between two groups of one class
  takes the same choice on both ends, so only its diagonal remains, as a group cost.
  Returns the reduced graph and memory, and per original group its reduced index.
  """
  reps = sorted(set(rep))
  index = {g: k for k, g in enumerate(reps)}
  of = [index[rep[g]] for g in range(len(rep))]
  sizes = [graph.group_sizes[g] for g in reps]
  costs = [np.zeros(n) for n in sizes]
  for g, c in enumerate(graph.group_costs):
    costs[of[g]] += c
  edges: dict[tuple[int, int], np.ndarray] = {}
  for (g, h), m in graph.edge_costs.items():
    a, b = of[g], of[h]
    if a == b:
      costs[a] += np.diag(m)
    else:
      edges[a, b] = edges[a, b] + m if (a, b) in edges else m
  combine = graph.combine.reduced(of) if graph.combine is not None else None
  reduced = StrategyGraph([], sizes, costs, edges, {}, (), combine=combine,
                          hub=None if graph.hub is None else of[graph.hub])
  if memory is not None:
    per_group, per_edge = [], []
    for groups, pairs in zip(memory.per_group, memory.edges()):
      merged: dict[int, np.ndarray] = {}
      for g, v in groups.items():
        merged[of[g]] = merged.get(of[g], 0) + v
      joined: dict[tuple[int, int], np.ndarray] = {}
      for (g, h), m in pairs.items():
        a, b = of[g], of[h]
        if a == b:
          merged[a] = merged.get(a, 0) + np.diag(m)
        else:
          joined[a, b] = joined.get((a, b), 0) + m
      per_group.append(merged)
      per_edge.append(joined)
    memory = MemoryConstraint(tuple(per_group), memory.constant, tuple(per_edge))
  return reduced, memory, of


def _hub(graph: StrategyGraph) -> int | None:
  """The graph's hub (:attr:`StrategyGraph.hub`, the micro-batch loop's largest batch
  leaf, whose split decides what every gradient costs after the loop) if it has 2 to
  :data:`HUB_CHOICES` choices. Its edges to the gradients keep the solver from folding
  them and weaken the relaxation: solving once per choice of it is faster (an 8-layer
  MLP's plan on 2x4 with 4 micro-batches and recomputation, 3 choices: 7.8 s in one
  solve; 2x faster by choice, measured side by side)."""
  hub = graph.hub
  return hub if hub is not None and 1 < graph.group_sizes[hub] <= HUB_CHOICES else None


def _fixed(graph: StrategyGraph, memory: MemoryConstraint | None, hub: int, a: int
           ) -> tuple[StrategyGraph, MemoryConstraint | None]:
  """``graph`` and ``memory`` with group ``hub`` held at choice ``a`` (one choice left):
  its edges become costs (and bytes) of the groups at their other ends."""
  sizes = list(graph.group_sizes)
  sizes[hub] = 1
  costs = [np.array(c, dtype=float) for c in graph.group_costs]
  costs[hub] = costs[hub][a:a + 1]
  edges = {}
  for (g, h), m in graph.edge_costs.items():
    if g == hub and h == hub:
      costs[hub] += m[a, a]
    elif g == hub:
      costs[h] = costs[h] + m[a, :]
    elif h == hub:
      costs[g] = costs[g] + m[:, a]
    else:
      edges[g, h] = m
  combine = graph.combine
  if combine is not None:
    terms = []
    for term in combine.terms:
      members = []
      for where, b in term.members:
        if where[0] == "x":
          if where[1] != hub:
            members.append((where, b))
          elif where[2] == a:
            members.append((("x", hub, 0), b))
        elif where[1] == hub:
          if where[3] == a:
            members.append((("x", where[2], where[4]), b))
        elif where[2] == hub:
          if where[4] == a:
            members.append((("x", where[1], where[3]), b))
        else:
          members.append((where, b))
      terms.append(dataclasses.replace(term, members=tuple(members)))
    combine = dataclasses.replace(combine, terms=tuple(terms))
  if memory is not None:
    per_group, per_edge = [], []
    for groups, pairs in zip(memory.per_group, memory.edges()):
      merged = {g: v[a:a + 1] if g == hub else v for g, v in groups.items()}
      joined = {}
      for (g, h), m in pairs.items():
        if g == hub and h == hub:
          merged[hub] = merged.get(hub, 0) + m[a, a:a + 1]
        elif g == hub:
          merged[h] = merged.get(h, 0) + m[a, :]
        elif h == hub:
          merged[g] = merged.get(g, 0) + m[:, a]
        else:
          joined[g, h] = m
      per_group.append(merged)
      per_edge.append(joined)
    memory = MemoryConstraint(tuple(per_group), memory.constant, tuple(per_edge))
  return StrategyGraph([], sizes, costs, edges, {}, (), combine=combine), memory


def _bounded(graph: StrategyGraph) -> StrategyGraph:
  """``graph`` with its infinite (disallowed) costs made finite: each costs more than every
  finite cost of the graph together, so any plan with one costs more than any plan
  without, and the costs stay within a range HiGHS solves."""
  finite = lambda m: float(np.max(m[np.isfinite(m)], initial=0.0))
  if all(np.all(np.isfinite(c)) for c in graph.group_costs) and all(
      np.all(np.isfinite(m)) for m in graph.edge_costs.values()):
    return graph
  bound = sum(finite(np.asarray(c, dtype=float)) for c in graph.group_costs)
  bound += sum(finite(m) for m in graph.edge_costs.values())
  if graph.combine is not None:
    combine = graph.combine
    bound += sum(t.alpha * max(1.0, sum(b for _, b in t.members) / combine.threshold_bytes,
                               len(t.members) / combine.threshold_count)
                 for t in combine.terms)
  big = 2.0 * bound + 1e-3
  costs = [np.where(np.isfinite(c), c, big) for c in map(np.asarray, graph.group_costs)]
  edges = {gh: np.where(np.isfinite(m), m, big) for gh, m in graph.edge_costs.items()}
  return StrategyGraph([], list(graph.group_sizes), costs, edges, {}, (), combine=graph.combine)


def fold_free_leaves(graph: StrategyGraph, memory: MemoryConstraint | None):
  """The problem without the groups whose choice follows from one neighbour's at no cost.

  A group ``g`` folds into ``h`` when its only edge joins it to ``h`` and, for each
  choice ``t`` of ``h``, some choice ``s`` of ``g`` costs nothing (no own cost, no
  resharding on the edge, no collective) and needs no more bytes than any other choice
  at every checked liveness point: then ``s`` is as good as any, and ``g`` takes it
  whatever ``h`` takes. (A value filled from a scalar and read by one elementwise
  operation, say the zero updates of an ``optax.apply_if_finite`` branch: any layout is
  a local fill. Such free groups make the branch and bound much slower.) Folding repeats
  while groups fold (a chain folds into its end).

  Returns None when nothing folds, else the reduced problem (folded groups left with
  one choice) and ``expand(choice)``, the full choice from a reduced one.
  """
  sizes = list(graph.group_sizes)
  active_members: dict = collections.defaultdict(set)  # group → choices / edge cells with a collective
  for term in (graph.combine.terms if graph.combine is not None else ()):
    for where, _ in term.members:
      if where[0] == "x":
        active_members[where[1]].add(("x", where[2]))
      else:
        active_members[where[1]].add(("e", where[1], where[2], where[3], where[4]))
        active_members[where[2]].add(("e", where[1], where[2], where[3], where[4]))
  rows_of = collections.defaultdict(list)
  paired = set()  # groups with bytes that depend on another group's choice: not folded
  if memory is not None:
    for r, groups in enumerate(memory.per_group):
      for g in groups:
        rows_of[g].append(r)
    paired = {g for pairs in memory.edges() for key in pairs for g in key}
  edges = dict(graph.edge_costs)
  edges_of = collections.defaultdict(set)
  for key in edges:
    edges_of[key[0]].add(key)
    edges_of[key[1]].add(key)
  costs = [c for c in graph.group_costs]
  picks: dict[int, tuple[int, np.ndarray]] = {}  # folded g → (h, g's choice per h choice)
  queue = [g for g in range(len(sizes)) if sizes[g] > 1 and len(edges_of[g]) == 1]
  while queue:
    g = queue.pop()
    if g in picks or g in paired or len(edges_of[g]) != 1 or sizes[g] <= 1:
      continue
    (key,) = edges_of[g]
    h = key[1] if key[0] == g else key[0]
    if h == g or h in paired:
      continue
    cost = edges[key] if key[0] == g else edges[key].T  # g's choices × h's
    pick = []
    for t in range(sizes[h]):
      free = [s for s in range(sizes[g]) if costs[g][s] == 0 and cost[s, t] == 0
              and ("x", s) not in active_members[g]
              and (("e", *key, s, t) if key[0] == g else ("e", *key, t, s))
              not in active_members[g]]
      # (A group folded into g earlier holds its least bytes whatever g takes, so only
      # g's own bytes can differ between g's choices.)
      free = [s for s in free if all(memory.per_group[r][g][s] <= memory.per_group[r][g].min()
                                     for r in rows_of[g])]
      if not free:
        break
      pick.append(free[0])
    if len(pick) != sizes[h]:
      continue
    picks[g] = (h, np.array(pick))
    del edges[key]
    edges_of[g].discard(key)
    edges_of[h].discard(key)
    if len(edges_of[h]) == 1:
      queue.append(h)
  if not picks:
    return None
  log.info("folded %d free group(s) into their neighbours", len(picks))
  # Each folded group's choice as a function of the choice of the group it ends in.
  def root(g):
    if g not in picks:
      return g, np.arange(sizes[g])
    h, pick = picks[g]
    r, of_h = root(h)
    return r, pick[of_h]

  roots = {g: root(g) for g in picks}
  reduced_sizes = [1 if g in picks else n for g, n in enumerate(sizes)]
  reduced_costs = [np.zeros(1) if g in picks else c for g, c in enumerate(costs)]
  # Folded groups have no collective at the choices they take: their members drop out.
  # Their bytes move to the group they end in.
  combine = graph.combine
  if combine is not None:
    combine = dataclasses.replace(combine, terms=tuple(
        dataclasses.replace(term, members=tuple(
            (w, b) for w, b in term.members
            if not (w[1] in picks or (w[0] == "e" and w[2] in picks))))
        for term in combine.terms))
  reduced = StrategyGraph([], reduced_sizes, reduced_costs, edges, {}, (), combine=combine)
  if memory is not None:
    per_group = []
    for groups in memory.per_group:
      merged: dict[int, np.ndarray] = {}
      for g, v in groups.items():
        if g in picks:
          r, of_r = roots[g]
          merged[r] = merged.get(r, 0) + v[of_r]
        else:
          merged[g] = merged.get(g, 0) + v
      per_group.append(merged)
    memory = MemoryConstraint(tuple(per_group), memory.constant, memory.per_edge)

  def expand(choice):
    return tuple(int(roots[g][1][choice[roots[g][0]]]) if g in picks else c
                 for g, c in enumerate(choice))

  return reduced, memory, expand


def solve_ilp(graph: StrategyGraph, memory: MemoryConstraint | None = None,
              budget: float | None = None, time_limit_s: float | None = None,
              ties: list[int] | None = None) -> Solution:
  """Solves the ILP; on a time limit returns the best plan found, with a warning.

  ``ties``: per group, the group whose choice it must take (``repeats.tie_groups``);
  the ILP is then solved over one group per class.

  The model is stated with one boolean vector ``x`` (every free group's one-hot, side
  by side), one vector ``e`` (every edge matrix, flattened) and sparse constraint
  matrices, so that cvxpy's canonicalization does not grow with the number of groups.

  Raises:
    InfeasiblePlanError: no plan meets ``budget`` (the message gives the least peak).
  """
  if ties is not None and len(set(ties)) < len(ties):
    reduced, reduced_memory, of = tie(graph, memory, ties)
    solution = solve_ilp(reduced, reduced_memory, budget, time_limit_s)
    choice = tuple(solution.choice[of[g]] for g in range(len(graph.group_sizes)))
    return Solution(choice, objective_of(graph, choice), solution.status)
  hub = _hub(graph)
  if hub is not None:
    # One solve per choice of the hub, whose edges are then costs of their other ends.
    n = graph.group_sizes[hub]
    best, limited = None, False
    for a in range(n):
      try:
        solution = solve_ilp(*_fixed(graph, memory, hub, a), budget,
                             None if time_limit_s is None else time_limit_s / n)
      except errors.InfeasiblePlanError:
        continue
      limited |= solution.status in ("time_limit", "over_budget")
      choice = solution.choice[:hub] + (a,) + solution.choice[hub + 1:]
      found = Solution(choice, objective_of(graph, choice), solution.status)
      if best is None or ((found.status == "over_budget", found.objective)
                          < (best.status == "over_budget", best.objective)):
        best = found
    if best is None:
      _infeasible(memory, budget)  # (the least any plan needs, over every choice of the hub)
    if limited and best.status == "optimal":  # (another choice's solve was cut short)
      best = dataclasses.replace(best, status="time_limit")
    return best
  folded = fold_free_leaves(graph, memory)
  if folded is not None:
    reduced, reduced_memory, expand = folded
    solution = solve_ilp(reduced, reduced_memory, budget, time_limit_s)
    choice = expand(solution.choice)
    return Solution(choice, objective_of(graph, choice), solution.status)
  graph, unbounded = _bounded(graph), graph
  # Imported here: cvxpy takes ~1.4 s to import, which methods without an ILP never need.
  import cvxpy as cp
  import scipy.sparse as sp

  free = [g for g, n in enumerate(graph.group_sizes) if n > 1]
  if not free:
    choice = tuple(0 for _ in graph.group_sizes)
    if budget is not None and memory is not None and memory.usage(choice) > budget:
      _infeasible(memory, budget)
    return Solution(choice, objective_of(graph, choice), "trivial")
  offset, n_x = {}, 0
  for g in free:
    offset[g] = n_x
    n_x += graph.group_sizes[g]
  c = np.zeros(n_x)
  for g in free:
    c[offset[g]:offset[g] + graph.group_sizes[g]] += graph.group_costs[g]
  # One-hot rows: each free group's block sums to 1.
  onehot = sp.csr_matrix((np.ones(n_x), (np.repeat(np.arange(len(free)),
                                                   [graph.group_sizes[g] for g in free]),
                                         np.arange(n_x))), shape=(len(free), n_x))
  terms = graph.combine.terms if graph.combine is not None else ()
  needed = {where[1:3] for term in terms for where, _ in term.members if where[0] == "e"}
  edge_costs = dict(graph.edge_costs)
  if budget is not None and memory is not None:
    for pairs in memory.edges():
      for (g, h), m in pairs.items():
        needed.add((g, h))
        edge_costs.setdefault((g, h), np.zeros(m.shape))
  classes = _edge_classes(edge_costs, memory.edges() if budget is not None and memory is not None
                         else (), terms)
  d_parts, e_rows, e_cols, x_rows, x_cols = [], [], [], [], []
  e_offset = {}
  n_e = n_rows = 0
  for (g, h), m in edge_costs.items():
    if not np.any(m) and (g, h) not in needed:
      continue
    if g in offset and h in offset:
      e_offset[g, h] = n_e
      rows_of, cols_of, _, _ = classes[g, h]
      nr, nc = len(rows_of), len(cols_of)
      idx = n_e + np.arange(nr * nc).reshape(nr, nc)
      # Row sums of e equal the x_g of each row class, column sums the x_h of each
      # column class.
      for r, members in enumerate(rows_of):
        e_rows += [n_rows + r] * nc
        e_cols += idx[r].tolist()
        x_rows += [n_rows + r] * len(members)
        x_cols += [offset[g] + a for a in members]
      for col, members in enumerate(cols_of):
        e_rows += [n_rows + nr + col] * nr
        e_cols += idx[:, col].tolist()
        x_rows += [n_rows + nr + col] * len(members)
        x_cols += [offset[h] + b for b in members]
      d_parts.append(_by_class(m, classes[g, h]).reshape(-1))
      n_e += nr * nc
      n_rows += nr + nc
    elif g in offset:
      c[offset[g]:offset[g] + m.shape[0]] += m[:, 0]
    elif h in offset:
      c[offset[h]:offset[h] + m.shape[1]] += m[0, :]

  x = cp.Variable(n_x, boolean=True)
  constraints = [onehot @ x == 1]
  objective = c @ x
  if n_e:
    e = cp.Variable(n_e, nonneg=True)
    edge_e = sp.csr_matrix((np.ones(len(e_rows)), (e_rows, e_cols)), shape=(n_rows, n_e))
    edge_x = sp.csr_matrix((np.ones(len(x_rows)), (x_rows, x_cols)), shape=(n_rows, n_x))
    constraints.append(edge_e @ e == edge_x @ x)
    objective = objective + np.concatenate(d_parts) @ e
  if terms:
    objective = objective + _combined_alpha(graph, terms, x, e if n_e else None, offset,
                                            e_offset, classes, constraints)
  if budget is not None and memory is not None:
    rows, e_memory, limits = [], [], []
    for groups, const, pairs in zip(memory.per_group, memory.constant, memory.edges()):
      row, e_row = np.zeros(n_x), np.zeros(n_e)
      fixed = const
      for g, v in groups.items():
        if g in offset:
          row[offset[g]:offset[g] + len(v)] += v
        else:
          fixed += float(v[0])
      for (g, h), m in pairs.items():
        if (g, h) in e_offset:
          reduced = _by_class(m, classes[g, h]).reshape(-1)
          e_row[e_offset[g, h]:e_offset[g, h] + reduced.size] += reduced
        elif g in offset:
          row[offset[g]:offset[g] + m.shape[0]] += m[:, 0]
        elif h in offset:
          row[offset[h]:offset[h] + m.shape[1]] += m[0, :]
        else:
          fixed += float(m[0, 0])
      if not row.any() and not e_row.any() and fixed > budget:
        _infeasible(memory, budget)
      rows.append(row)
      e_memory.append(e_row)
      limits.append(budget - fixed)
    used = np.array(rows) @ x
    if n_e and np.any(e_memory):
      used = used + np.array(e_memory) @ e
    constraints.append(used <= np.array(limits))

  # Seconds are tiny numbers; HiGHS is better conditioned on microseconds.
  problem = cp.Problem(cp.Minimize(1e6 * objective), constraints)
  options = {} if time_limit_s is None else {"time_limit": float(time_limit_s)}
  problem.solve(solver=cp.HIGHS, **options)
  if problem.status in ("infeasible", "infeasible_inaccurate", "infeasible_or_unbounded"):
    _infeasible(memory, budget)
  if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE, cp.USER_LIMIT) or x.value is None:
    raise RuntimeError(f"HiGHS returned status {problem.status!r} without a solution")
  choice = tuple(int(np.argmax(x.value[offset[g]:offset[g] + graph.group_sizes[g]]))
                 if g in offset else 0 for g in range(len(graph.group_sizes)))
  status = "optimal"
  if problem.status == cp.USER_LIMIT:
    # Without an incumbent HiGHS still hands back its last (fractional, rounded) point,
    # which need not meet the budget: a time limit of 0.05 s on a tight budget gave
    # choices at 1.7-1.9x of it.
    used = memory.usage(choice) if budget is not None and memory is not None else None
    if used is not None and used > budget * (1 + 1e-9) + 1e-9:
      status = "over_budget"
      warnings.warn(f"the sharding ILP hit its time limit ({time_limit_s} s) before it found a "
                    f"plan within memory_budget_per_device={budget:.0f} bytes; using its last "
                    f"one, which needs {used:.0f} bytes by the planner's model (raise "
                    f"AutoShardingOption.solver_time_limit_s).", errors.JaxdistWarning,
                    stacklevel=3)
    else:
      status = "time_limit"
      warnings.warn(f"the sharding ILP hit its time limit ({time_limit_s} s); using the best "
                    f"plan found so far (raise AutoShardingOption.solver_time_limit_s for a "
                    f"better one).", errors.JaxdistWarning, stacklevel=3)
  return Solution(choice, objective_of(unbounded, choice), status)


def _edge_classes(edge_costs: dict, memory_edges, terms) -> dict:
  """Per edge (g, h): its strategy pairs merged where nothing tells them apart.

  Two strategies of ``g`` whose rows agree in the edge's cost matrix, in every memory
  matrix on the edge and in every combined group's members on it (which pairs are
  members, with what bytes) are one row class; columns alike. The edge's variables are
  then one per (row class, column class): with one strategy chosen per group, a class's
  indicator is the sum of its members' ``x``, and the objective and constraints read
  the same value from any pair of a class pair, so the ILP's optimum is unchanged. On a
  2-layer GPT's (2, 4) mesh (2 micro-batches) it took the ILP from 64993 variables to
  40407 and each solve from 3.1–3.4 s to 1.9–2.1 s, the same objectives and plan.

  Returns (g, h) → (row classes, column classes, a row's class, a column's class), a
  class being the list of its strategies.
  """
  marks: dict = {}  # (g, h) → the memory matrices on the edge
  members: dict = {}  # (g, h) → combined group → its members' bytes + 1 (0: not one)
  for pairs in memory_edges:
    for key, m in pairs.items():
      marks.setdefault(key, []).append(m)
  for k, term in enumerate(terms):
    for where, nbytes in term.members:
      if where[0] == "e":
        _, g, h, a, b = where
        member = members.setdefault((g, h), {}).setdefault(k, np.zeros(edge_costs[g, h].shape))
        member[a, b] = 1.0 + nbytes
  classes = {}
  for key, m in edge_costs.items():
    stack = [m, *marks.get(key, ()), *members.get(key, {}).values()]
    _, row_of = np.unique(np.hstack(stack), axis=0, return_inverse=True)
    _, col_of = np.unique(np.vstack(stack), axis=1, return_inverse=True)
    row_of, col_of = row_of.reshape(-1), col_of.reshape(-1)
    rows = [[] for _ in range(row_of.max() + 1)]
    cols = [[] for _ in range(col_of.max() + 1)]
    for a, r in enumerate(row_of):
      rows[r].append(a)
    for b, c in enumerate(col_of):
      cols[c].append(b)
    classes[key] = (rows, cols, row_of, col_of)
  return classes


def _by_class(m: np.ndarray, classes) -> np.ndarray:
  """``m`` (an edge's matrix) with one entry per (row class, column class)."""
  rows, cols, _, _ = classes
  return m[np.ix_([r[0] for r in rows], [c[0] for c in cols])]


def _combined_alpha(graph, terms, x, e, offset, e_offset, classes, constraints):
  """``Σ_k α_k a_k`` over the combined groups; appends the constraints defining ``a_k``."""
  import cvxpy as cp
  import scipy.sparse as sp

  on_x, on_e = [], []  # (term, variable index, bytes) per member
  fixed = np.zeros(len(terms))  # 1 where a member is active whatever the choice
  seen = set()
  for k, term in enumerate(terms):
    for where, nbytes in term.members:
      if where[0] == "x":
        _, g, t = where
        if g in offset:
          on_x.append((k, offset[g] + t, nbytes, g))
        elif t == 0:
          fixed[k] = 1
        continue
      _, g, h, a, b = where
      if g in offset and h in offset:
        _, cols, row_of, col_of = classes[g, h]
        i = e_offset[g, h] + row_of[a] * len(cols) + col_of[b]
        if (k, i) not in seen:  # (pairs of one class pair: one variable)
          seen.add((k, i))
          on_e.append((k, i, nbytes, (g, h)))
      elif g in offset and b == 0:
        on_x.append((k, offset[g] + a, nbytes, g))
      elif h in offset and a == 0:
        on_x.append((k, offset[h] + b, nbytes, h))
      elif a == 0 and b == 0:
        fixed[k] = 1
  a = cp.Variable(len(terms), nonneg=True)
  constraints.append(a >= fixed)
  # a_k >= the sum of its members' variables within one group (or one edge): at most one
  # of them is 1, and the sum makes the LP relaxation much tighter than one row each.
  rows, cols, n_rows, term_of_row = [], [], 0, []
  for members, base in ((on_x, 0), (on_e, x.shape[0])):
    bucket = {}
    for k, i, _, block in members:
      bucket.setdefault((k, block), set()).add(i)
    for (k, _), indices in bucket.items():
      rows += [n_rows] * len(indices); cols += [base + i for i in indices]
      term_of_row.append(k); n_rows += 1
  if n_rows:
    stacked = x if e is None else cp.hstack([x, e])
    width = x.shape[0] + (0 if e is None else e.shape[0])
    lhs = sp.csr_matrix((np.ones(n_rows), (np.arange(n_rows), term_of_row)),
                        shape=(n_rows, len(terms)))
    rhs = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(n_rows, width))
    constraints.append(lhs @ a >= rhs @ stacked)
    # a_k >= its members' number over the operand limit (and bytes over the byte limit).
    members = [(k, i, b) for k, i, b, _ in on_x] + [(k, x.shape[0] + i, b) for k, i, b, _ in on_e]
    index = ([k for k, _, _ in members], [i for _, i, _ in members])
    weights = [np.full(len(members), 1.0 / graph.combine.threshold_count)]
    if np.isfinite(graph.combine.threshold_bytes):
      weights.append(np.array([b for _, _, b in members]) / graph.combine.threshold_bytes)
    for w in weights:
      constraints.append(a >= sp.csr_matrix((w, index), shape=(len(terms), width)) @ stacked)
  return np.array([term.alpha for term in terms]) @ a


def _infeasible(memory: MemoryConstraint | None, budget: float | None):
  least = memory.least_possible() if memory is not None else float("nan")
  raise errors.InfeasiblePlanError(
      f"no sharding plan fits memory_budget_per_device={budget:.0f} bytes; the least any plan "
      f"needs at its peak is at least {least:.0f} bytes. Raise the budget or use more devices.")
