"""Pipeline schedules as explicit instruction lists: GPipe and 1F1B.

A schedule says, per stage, the order in which it runs forward (``F``) and backward
(``B``) passes of micro-batches, then its optimizer update (``U``). Clocks come from
the data dependencies, every instruction taking one clock: ``F(s, b)`` needs
``F(s − 1, b)``; ``B(s, b)`` needs ``B(s + 1, b)`` (the last stage: its own
``F(s, b)``); an instruction also waits for the one before it on its stage. With
``n`` stages and ``m`` micro-batches both schedules take ``2 (n + m − 1)`` clocks of
passes plus one clock of updates.

- GPipe: every forward, then every backward; a stage keeps all ``m`` micro-batches'
  activations.
- 1F1B: stage ``s`` runs ``n − s − 1`` warm-up forwards, then alternates one forward
  and one backward, then drains its backwards; it keeps at most ``min(n − s, m)``
  micro-batches' activations.
- Interleaved 1F1B (Megatron's virtual stages, ``virtual_stages = v > 1``): the ``n``
  stages are ``v`` model chunks on each of ``p = n / v`` device groups (stage ``c`` on
  group ``c mod p``), and a group, not a stage, runs one instruction per clock. Group
  ``d`` runs its forwards in rounds of ``p`` micro-batches through its chunks in order
  (backwards through them in reverse), ``2 (p − d − 1) + (v − 1) p`` of them as warm-up,
  then one forward and one backward alternately. A chunk's pass is ``1/v`` of a stage's,
  so the bubble, idle over busy clocks, shrinks from ``(p − 1) / m`` to
  ``(p − 1) / (v m)``; ``m`` must be a multiple of ``p``.
"""

from __future__ import annotations

import dataclasses

from jaxdist import errors

FORWARD, BACKWARD, UPDATE = "F", "B", "U"
SCHEDULES = ("1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One unit of work: ``kind`` on ``stage`` for ``micro_batch`` (None for an update)."""

  kind: str
  stage: int
  micro_batch: int | None
  clock: int


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Instructions in clock order (ties: by stage).

  Attributes:
    name: "1f1b" or "gpipe".
    num_stages, num_micro_batches: its size.
    instructions: every instruction, sorted by (clock, stage).
  """

  name: str
  num_stages: int
  num_micro_batches: int
  instructions: tuple[Instruction, ...]
  virtual_stages: int = 1

  @property
  def num_clocks(self) -> int:
    return 1 + max(i.clock for i in self.instructions)

  def stage_order(self, stage: int) -> list[Instruction]:
    return [i for i in self.instructions if i.stage == stage]

  def max_in_flight(self) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and backward did not yet."""
    out = []
    for s in range(self.num_stages):
      live = peak = 0
      for ins in self.stage_order(s):
        live += {FORWARD: 1, BACKWARD: -1}.get(ins.kind, 0)
        peak = max(peak, live)
      out.append(peak)
    return out


def _orders(name: str, p: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
  """Per device group, its (kind, stage, micro-batch) in order."""
  orders = []
  for d in range(p):
    if name == "gpipe":
      order = [(FORWARD, d, b) for b in range(m)] + [(BACKWARD, d, b) for b in range(m)]
    elif v == 1:
      warm = min(p - d - 1, m)
      order = [(FORWARD, d, b) for b in range(warm)]
      for b in range(m - warm):
        order += [(FORWARD, d, warm + b), (BACKWARD, d, b)]
      order += [(BACKWARD, d, b) for b in range(m - warm, m)]
    else:  # the k-th forward (backward) of group d, in rounds of p micro-batches
      def forward(k):
        return (FORWARD, (k // p) % v * p + d, k // (p * v) * p + k % p)

      def backward(k):
        return (BACKWARD, (v - 1 - (k // p) % v) * p + d, k // (p * v) * p + k % p)

      total = v * m
      warm = min(2 * (p - d - 1) + (v - 1) * p, total)
      order = [forward(k) for k in range(warm)]
      for k in range(total - warm):
        order += [forward(warm + k), backward(k)]
      order += [backward(k) for k in range(total - warm, total)]
    orders.append(order)
  return orders


def make_schedule(name: str, num_stages: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> Schedule:
  """The ``name`` schedule ("1f1b" or "gpipe") of ``num_stages`` × ``num_micro_batches``;
  with ``virtual_stages`` > 1, interleaved 1F1B over ``num_stages / virtual_stages``
  device groups.

  Raises:
    InvalidArgumentError: an unknown name, fewer than one stage or micro-batch, or
      virtual stages that do not fit (see the module doc).
  """
  if name not in SCHEDULES:
    raise errors.InvalidArgumentError(
        f"pipeline_schedule={name!r} is not a known schedule; valid: "
        f"{', '.join(map(repr, SCHEDULES))}.")
  if num_stages < 1 or num_micro_batches < 1:
    raise errors.InvalidArgumentError(
        f"a schedule needs at least one stage and one micro-batch, got {num_stages} stages and "
        f"{num_micro_batches} micro-batches.")
  n, m, v = num_stages, num_micro_batches, virtual_stages
  if v > 1 and (name != "1f1b" or n % v or m % (n // v)):
    raise errors.InvalidArgumentError(
        f"virtual_stages={v} interleaves the 1f1b schedule over {n} stages: it needs "
        f"pipeline_schedule='1f1b' (got {name!r}), a number of stages divisible by {v} and a "
        f"number of micro-batches ({m}) divisible by the number of device groups "
        f"(stages / virtual_stages).")
  p = n // v
  orders = _orders(name, p, v, m)
  done: dict[tuple[str, int, int], int] = {}
  position = [0] * p
  last = [-1] * p
  while any(position[d] < len(orders[d]) for d in range(p)):
    progressed = False
    for d in range(p):
      if position[d] == len(orders[d]):
        continue
      kind, s, b = orders[d][position[d]]
      if kind == FORWARD:
        need = done.get((FORWARD, s - 1, b), -1) if s > 0 else -1
        ready = s == 0 or (FORWARD, s - 1, b) in done
      else:
        dep = (BACKWARD, s + 1, b) if s < n - 1 else (FORWARD, s, b)
        need, ready = done.get(dep, -1), dep in done
      if not ready:
        continue
      done[kind, s, b] = max(need, last[d]) + 1
      last[d] = done[kind, s, b]
      position[d] += 1
      progressed = True
    assert progressed, "schedule deadlock"  # the orders above never deadlock
  update_clock = max(done.values()) + 1
  instructions = [Instruction(k, s, b, c) for (k, s, b), c in done.items()]
  instructions += [Instruction(UPDATE, s, None, update_clock) for s in range(n)]
  instructions.sort(key=lambda i: (i.clock, i.stage))
  return Schedule(name, n, m, tuple(instructions), v)
