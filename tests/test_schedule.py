"""Pipeline schedules in pure Python: clocks, dependencies, activations in flight."""

import pytest

from jaxdist import errors
from jaxdist.pipeline.schedule import BACKWARD, FORWARD, UPDATE, make_schedule


def _assert_dependencies(at, n, m):
  """A forward after the stage before's; a backward after the stage after's (the last
  stage: after its own forward)."""
  for s in range(n):
    for b in range(m):
      if s > 0:
        assert at[FORWARD, s, b] > at[FORWARD, s - 1, b]
      dep = (BACKWARD, s + 1, b) if s < n - 1 else (FORWARD, s, b)
      assert at[BACKWARD, s, b] > at[dep]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 2), (8, 3)])
def test_schedule_clocks_dependencies_and_in_flight(name, stages, micro_batches):
  sched = make_schedule(name, stages, micro_batches)
  n, m = stages, micro_batches
  assert sched.num_clocks == 2 * (n + m - 1) + 1  # Alpa's clock count
  at = {(i.kind, i.stage, i.micro_batch): i.clock for i in sched.instructions}
  assert len(at) == 2 * n * m + n  # every pass once, one update per stage
  _assert_dependencies(at, n, m)
  for s in range(n):
    clocks = [i.clock for i in sched.stage_order(s)]
    assert clocks == sorted(set(clocks))  # one instruction per stage per clock
    assert sched.stage_order(s)[-1].kind == UPDATE
  expected = [m] * n if name == "gpipe" else [min(n - s, m) for s in range(n)]
  assert sched.max_in_flight() == expected


def test_one_f_one_b_alternates_in_the_steady_state():
  order = [(i.kind, i.micro_batch) for i in make_schedule("1f1b", 4, 6).stage_order(1)]
  assert order[:6] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1)]


def test_schedule_errors():
  with pytest.raises(errors.InvalidArgumentError, match=r"'zigzag'.*'1f1b', 'gpipe'"):
    make_schedule("zigzag", 2, 2)
  with pytest.raises(errors.InvalidArgumentError, match=r"0 micro-batches"):
    make_schedule("gpipe", 2, 0)


@pytest.mark.parametrize("groups,virtual,micro_batches",
                         [(2, 2, 4), (2, 3, 8), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaved_one_f_one_b_bubble(groups, virtual, micro_batches):
  """Megatron's interleaved 1F1B: v chunks per device group, a group runs one pass per
  clock; idle over busy clocks is (p - 1) / (v m), v times less than plain 1F1B's."""
  p, v, m = groups, virtual, micro_batches
  n = p * v
  sched = make_schedule("1f1b", n, m, virtual_stages=v)
  at = {(i.kind, i.stage, i.micro_batch): i.clock for i in sched.instructions}
  assert len(at) == 2 * n * m + n
  _assert_dependencies(at, n, m)
  for d in range(p):  # a group's chunks share its devices: one pass per clock
    clocks = [i.clock for i in sched.instructions if i.stage % p == d and i.kind != UPDATE]
    assert len(clocks) == len(set(clocks)) == 2 * v * m
  busy = 2 * v * m
  assert (sched.num_clocks - 1 - busy) / busy == pytest.approx((p - 1) / (v * m))
  plain = make_schedule("1f1b", p, m)
  assert (plain.num_clocks - 1 - 2 * m) / (2 * m) == pytest.approx((p - 1) / m)


def test_interleaving_errors():
  with pytest.raises(errors.InvalidArgumentError, match="virtual_stages=2"):
    make_schedule("gpipe", 4, 4, virtual_stages=2)
  with pytest.raises(errors.InvalidArgumentError, match="divisible"):
    make_schedule("1f1b", 4, 3, virtual_stages=2)  # 3 micro-batches over 2 groups
