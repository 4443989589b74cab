"""Automatic stage construction: the DP against brute force on random stage costs."""

import itertools
import math

import numpy as np
import pytest

from jaxdist import errors
from jaxdist.pipeline.stages import auto_stages


def _brute_force(cost, L, D, B, sizes, fits=None, max_stages=None, ratio=None):
  best = math.inf
  for s in range(1, min(L, D, max_stages or L) + 1):
    for cuts in itertools.combinations(range(1, L), s - 1):
      bounds = (0,) + cuts + (L,)
      for counts in itertools.product(sizes, repeat=s):
        if sum(counts) != D:
          continue
        stages = list(zip(bounds, bounds[1:], counts))
        if fits and not all(fits(i, j, n, s - k) for k, (i, j, n) in enumerate(stages)):
          continue
        c = [cost(i, j, n) for i, j, n in stages]
        mean = sum(c) / s
        if ratio is not None and not all(ratio * mean <= x <= mean / ratio for x in c):
          continue
        best = min(best, sum(c) + (B - 1) * max(c))
  return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("B", [1, 4])
def test_stage_dp_equals_brute_force(seed, B):
  rng = np.random.default_rng(seed)
  L, D = 5, 8
  work = rng.uniform(1, 10, L)
  overhead = rng.uniform(0, 2, (L + 1, 9))
  cost = lambda i, j, n: work[i:j].sum() / n + overhead[j, n]
  plan = auto_stages(cost, L, D, B)
  assert plan.step_time == pytest.approx(_brute_force(cost, L, D, B, (1, 2, 4, 8)))
  assert sum(plan.submesh_sizes) == D
  assert [r[0] for r in plan.layer_ranges][0] == 0 and plan.layer_ranges[-1][1] == L
  c = plan.stage_costs
  assert plan.step_time == pytest.approx(sum(c) + (B - 1) * max(c))


def test_memory_and_bubble_limits():
  work = [4.0, 4.0, 4.0, 4.0]
  cost = lambda i, j, n: sum(work[i:j]) / n
  fits = lambda i, j, n, in_flight: (j - i) * in_flight <= 3  # layers x micro-batches held
  assert auto_stages(cost, 4, 8, 8).layer_ranges == ((0, 4),)  # unconstrained: one stage
  plan = auto_stages(cost, 4, 8, 8, fits=fits)
  assert len(plan.layer_ranges) >= 2
  assert plan.step_time == pytest.approx(_brute_force(cost, 4, 8, 8, (1, 2, 4, 8), fits))
  for k, ((i, j), n) in enumerate(zip(plan.layer_ranges, plan.submesh_sizes)):
    assert (j - i) * (len(plan.layer_ranges) - k) <= 3
  # b = 0.2 with 8 micro-batches: at most floor(0.25 * 8 + 1) = 3 stages.
  assert len(auto_stages(cost, 4, 8, 8, max_bubble_ratio=0.2).layer_ranges) <= 3
  with pytest.raises(errors.InfeasiblePlanError, match="no split of 4 layers"):
    auto_stages(cost, 4, 8, 8, fits=lambda i, j, n, f: False)


@pytest.mark.parametrize("seed", range(6))
def test_unbalance_ratio_keeps_stages_within_bounds_of_their_mean(seed):
  rng = np.random.default_rng(seed)
  L, D, B, r = 5, 8, 4, 0.8
  work = rng.uniform(1, 10, L)
  overhead = rng.uniform(0, 2, (L + 1, 9))
  cost = lambda i, j, n: work[i:j].sum() / n + overhead[j, n]
  fits = lambda i, j, n, in_flight: j - i <= 2  # at least 3 stages
  exact = _brute_force(cost, L, D, B, (1, 2, 4, 8), fits, ratio=r)
  if exact == math.inf:  # seeds 0 and 5: no split meets the ratio
    with pytest.raises(errors.InfeasiblePlanError, match="max_pipeline_unbalance_ratio"):
      auto_stages(cost, L, D, B, fits=fits, max_unbalance_ratio=r)
    return
  plan = auto_stages(cost, L, D, B, fits=fits, max_unbalance_ratio=r)
  c = plan.stage_costs
  mean = sum(c) / len(c)
  assert all(r * mean <= x <= mean / r for x in c), c
  assert plan.step_time == pytest.approx(exact)
