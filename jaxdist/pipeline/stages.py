"""Automatic stage construction: Alpa's dynamic program over layer ranges and sub-meshes.

Given the cost ``c(i, j, n)`` of running layers ``i..j-1`` as one stage on ``n`` devices,
a plan is a split of the layers into consecutive stages with a device count each,
adding up to all devices. With ``B`` micro-batches its pipelined step time is

    T = Σ_stages c  +  (B − 1) · max_stages c

(every micro-batch passes every stage once; the slowest stage paces the other B − 1).
For each candidate ``t_max`` (the distinct stage costs, ascending) a dynamic program
finds the least ``Σ c`` using stages that cost at most ``t_max``::

    F[s][i][d] = min over j > i and n  of  c(i, j, n) + F[s − 1][j][d − n]

with ``F[0][L][0] = 0``; the plan minimizing ``F[s][0][D] + (B − 1) · t_max`` over ``s``
and ``t_max`` wins, and the search stops once ``(B − 1) · t_max`` alone exceeds the best.
A stage that is ``s``-th from the end holds ``s`` micro-batches in flight under 1F1B, which
is what the optional memory check is given. nnScaler's ``max_pipeline_bubble_ratio`` ``b``
caps the number of stages: ``s ≤ floor(b / (1 − b) · B + 1)``; its
``max_pipeline_unbalance_ratio`` ``r`` keeps a plan only if every stage's cost lies in
``[r · G, G / r]`` around their mean ``G``. For each ``t_max`` the DP is then run with
the stage costs bounded below as well, ``t_min ≤ c ≤ t_max``: first ``t_min = r · t_max``
(every plan found meets the ratio, as ``G`` lies between the smallest and the largest
cost), then each distinct cost down to ``r² · t_max`` (no lower stage cost can meet
it), each plan found checked against the ratio. As the DP keeps only the least-sum plan
per window, a plan meeting the ratio may still be missed: it is a search, not a proof.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxdist import errors


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """The chosen stages.

  Attributes:
    layer_ranges: per stage, (first layer, last layer + 1).
    submesh_sizes: per stage, its number of devices.
    stage_costs: per stage, its predicted seconds per micro-batch.
    step_time: predicted seconds per step, ``Σ c + (B − 1) · max c``.
  """

  layer_ranges: tuple[tuple[int, int], ...]
  submesh_sizes: tuple[int, ...]
  stage_costs: tuple[float, ...]
  step_time: float


def auto_stages(cost: Callable[[int, int, int], float], num_layers: int, num_devices: int,
                num_micro_batches: int, submesh_sizes: tuple[int, ...] | None = None,
                fits: Callable[[int, int, int, int], bool] | None = None,
                max_bubble_ratio: float | None = None,
                max_unbalance_ratio: float | None = None) -> StagePlan:
  """The cheapest stage plan (see the module docstring).

  Args:
    cost: ``cost(i, j, n)``, seconds per micro-batch for layers ``i..j-1`` on ``n`` devices.
    num_layers, num_devices, num_micro_batches: the problem's size.
    submesh_sizes: device counts a stage may have; default the powers of two dividing
      ``num_devices`` (Alpa's ``(1, 2^k)`` sub-meshes of one host).
    fits: ``fits(i, j, n, in_flight)``, whether the stage fits in memory holding
      ``in_flight`` micro-batches; default always.
    max_bubble_ratio: nnScaler's bubble cap on the number of stages, or None.
    max_unbalance_ratio: nnScaler's balance bound ``r`` in (0, 1], or None.

  Raises:
    InfeasiblePlanError: no split meets the constraints.
  """
  L, D, B = num_layers, num_devices, num_micro_batches
  sizes = submesh_sizes or tuple(n for n in (2 ** k for k in range(D.bit_length())) if D % n == 0)
  max_stages = min(L, D)
  if max_bubble_ratio is not None:
    max_stages = min(max_stages, math.floor(max_bubble_ratio / (1 - max_bubble_ratio) * B + 1))
  table = {(i, j, n): cost(i, j, n) for i in range(L) for j in range(i + 1, L + 1) for n in sizes}
  r = max_unbalance_ratio

  def plans(t_min, t_max):
    """Per number of stages, the least-Σ-cost plan whose stages cost within [t_min, t_max]."""
    # F[s][i][d]: (least Σ cost, the first stage (j, n)) for layers i.. on d devices, s stages.
    inf = (math.inf, None)
    F = [[[inf] * (D + 1) for _ in range(L + 1)] for _ in range(max_stages + 1)]
    F[0][L][0] = (0.0, None)
    for s in range(1, max_stages + 1):
      for i in range(L - 1, -1, -1):
        for d in range(1, D + 1):
          cell = inf
          for j in range(i + 1, L + 1):
            for n in sizes:
              c = table[i, j, n]
              if n > d or not t_min <= c <= t_max or F[s - 1][j][d - n][0] == math.inf:
                continue
              if fits is not None and not fits(i, j, n, s):
                continue
              total = c + F[s - 1][j][d - n][0]
              if total < cell[0]:
                cell = (total, (j, n))
          F[s][i][d] = cell
    for s in range(1, max_stages + 1):
      if F[s][0][D][0] == math.inf:
        continue
      ranges, counts, costs, i, d = [], [], [], 0, D
      for left in range(s, 0, -1):
        j, n = F[left][i][d][1]
        ranges.append((i, j))
        counts.append(n)
        costs.append(table[i, j, n])
        i, d = j, d - n
      yield StagePlan(tuple(ranges), tuple(counts), tuple(costs),
                      F[s][0][D][0] + (B - 1) * max(costs))

  def balanced(plan):
    mean = sum(plan.stage_costs) / len(plan.stage_costs)
    return r is None or all(r * mean <= c <= mean / r for c in plan.stage_costs)

  values = sorted(set(table.values()))
  best: StagePlan | None = None
  for t_max in values:
    if best is not None and (B - 1) * t_max >= best.step_time:
      break
    # The windows' lower ends: none without a ratio; else r·t_max (sufficient), then each
    # cost down to r²·t_max (below it no stage can be within r of the mean).
    lows = [0.0] if r is None else [r * t_max] + [v for v in reversed(values)
                                                  if r * r * t_max <= v < r * t_max]
    for t_min in lows:
      for plan in plans(t_min, t_max):
        if balanced(plan) and (best is None or plan.step_time < best.step_time):
          best = plan
  if best is None:
    raise errors.InfeasiblePlanError(
        f"no split of {L} layers into stages on {D} devices meets the constraints (sub-mesh "
        f"sizes {sizes}, at most {max_stages} stages, the balance bound and the memory check); "
        f"raise the memory budget or max_pipeline_bubble_ratio, lower "
        f"max_pipeline_unbalance_ratio, or use more devices.")
  return best
