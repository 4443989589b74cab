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


def _orders(name: str, n: int, m: int) -> list[list[tuple[str, int]]]:
  orders = []
  for s in range(n):
    if name == "gpipe":
      order = [(FORWARD, b) for b in range(m)] + [(BACKWARD, b) for b in range(m)]
    else:
      warm = min(n - s - 1, m)
      order = [(FORWARD, b) for b in range(warm)]
      for b in range(m - warm):
        order += [(FORWARD, warm + b), (BACKWARD, b)]
      order += [(BACKWARD, b) for b in range(m - warm, m)]
    orders.append(order)
  return orders


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> Schedule:
  """The ``name`` schedule ("1f1b" or "gpipe") of ``num_stages`` × ``num_micro_batches``.

  Raises:
    InvalidArgumentError: an unknown name, or fewer than one stage or micro-batch.
  """
  if name not in SCHEDULES:
    raise errors.InvalidArgumentError(
        f"pipeline_schedule={name!r} is not a known schedule; valid: "
        f"{', '.join(map(repr, SCHEDULES))}.")
  if num_stages < 1 or num_micro_batches < 1:
    raise errors.InvalidArgumentError(
        f"a schedule needs at least one stage and one micro-batch, got {num_stages} stages and "
        f"{num_micro_batches} micro-batches.")
  n, m = num_stages, num_micro_batches
  orders = _orders(name, n, m)
  done: dict[tuple[str, int, int], int] = {}
  position = [0] * n
  last = [-1] * n
  while any(position[s] < len(orders[s]) for s in range(n)):
    progressed = False
    for s in range(n):
      if position[s] == len(orders[s]):
        continue
      kind, b = orders[s][position[s]]
      if kind == FORWARD:
        need = done.get((FORWARD, s - 1, b), -1) if s > 0 else -1
        ready = s == 0 or (FORWARD, s - 1, b) in done
      else:
        dep = (BACKWARD, s + 1, b) if s < n - 1 else (FORWARD, s, b)
        need, ready = done.get(dep, -1), dep in done
      if not ready:
        continue
      done[kind, s, b] = max(need, last[s]) + 1
      last[s] = done[kind, s, b]
      position[s] += 1
      progressed = True
    assert progressed, "schedule deadlock"  # the orders above never deadlock
  update_clock = max(done.values()) + 1
  instructions = [Instruction(k, s, b, c) for (k, s, b), c in done.items()]
  instructions += [Instruction(UPDATE, s, None, update_clock) for s in range(n)]
  instructions.sort(key=lambda i: (i.clock, i.stage))
  return Schedule(name, n, m, tuple(instructions))
