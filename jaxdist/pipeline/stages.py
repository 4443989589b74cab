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
caps the number of stages: ``s ≤ floor(b / (1 − b) · B + 1)``.
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
                max_bubble_ratio: float | None = None) -> StagePlan:
  """The cheapest stage plan (see the module docstring).

  Args:
    cost: ``cost(i, j, n)``, seconds per micro-batch for layers ``i..j-1`` on ``n`` devices.
    num_layers, num_devices, num_micro_batches: the problem's size.
    submesh_sizes: device counts a stage may have; default the powers of two dividing
      ``num_devices`` (Alpa's ``(1, 2^k)`` sub-meshes of one host).
    fits: ``fits(i, j, n, in_flight)``, whether the stage fits in memory holding
      ``in_flight`` micro-batches; default always.
    max_bubble_ratio: nnScaler's bubble cap on the number of stages, or None.

  Raises:
    InfeasiblePlanError: no split meets the constraints.
  """
  L, D, B = num_layers, num_devices, num_micro_batches
  sizes = submesh_sizes or tuple(n for n in (2 ** k for k in range(D.bit_length())) if D % n == 0)
  max_stages = min(L, D)
  if max_bubble_ratio is not None:
    max_stages = min(max_stages, math.floor(max_bubble_ratio / (1 - max_bubble_ratio) * B + 1))
  table = {(i, j, n): cost(i, j, n) for i in range(L) for j in range(i + 1, L + 1) for n in sizes}
  best: StagePlan | None = None
  for t_max in sorted(set(table.values())):
    if best is not None and (B - 1) * t_max >= best.step_time:
      break
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
              if n > d or c > t_max or F[s - 1][j][d - n][0] == math.inf:
                continue
              if fits is not None and not fits(i, j, n, s):
                continue
              total = c + F[s - 1][j][d - n][0]
              if total < cell[0]:
                cell = (total, (j, n))
          F[s][i][d] = cell
    for s in range(1, max_stages + 1):
      total = F[s][0][D][0]
      if total == math.inf:
        continue
      ranges, counts, costs, i, d = [], [], [], 0, D
      for left in range(s, 0, -1):
        j, n = F[left][i][d][1]
        ranges.append((i, j))
        counts.append(n)
        costs.append(table[i, j, n])
        i, d = j, d - n
      step_time = total + (B - 1) * max(costs)
      if best is None or step_time < best.step_time:
        best = StagePlan(tuple(ranges), tuple(counts), tuple(costs), step_time)
  if best is None:
    raise errors.InfeasiblePlanError(
        f"no split of {L} layers into stages on {D} devices meets the constraints (sub-mesh "
        f"sizes {sizes}, at most {max_stages} stages, and the memory check); raise the memory "
        f"budget or max_pipeline_bubble_ratio, or use more devices.")
  return best
