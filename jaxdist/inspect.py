"""Collectives in a compiled HLO module, counted per step and loop-aware.

XLA prints collectives in several forms; all of them are read here:

- ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (explicit groups),
- ``replica_groups=[2,4]<=[8]`` or ``[2,4]<=[4,2]T(1,0)`` (iota form: 2 groups of 4),
- ``replica_groups=mesh['a'=2,'b'=4] {'b'}`` (mesh form: groups over the named axes),
- ``source_target_pairs={{0,1},{1,2}}`` (collective-permute).

A collective inside a ``while`` body runs once per iteration: every computation gets a
multiplicity (how often it runs per step), the product of the ``known_trip_count`` of
each enclosing loop. A loop without a known trip count counts once and is reported.

For each kind, three figures per step: ``count``, ``result_bytes`` (bytes of the
collective's per-device result) and ``wire_bytes``, what each device sends under a ring
algorithm, with n the group size and b the per-device result bytes:

- all-reduce: 2(n−1)/n · b
- all-gather: (n−1)/n · b          (b is the gathered result)
- reduce-scatter: (n−1) · b         (b is the scattered shard; the input is n · b)
- all-to-all: (n−1)/n · b
- collective-permute: b
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(?:to_apply|body|condition|calls|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
  """Per-step totals of one collective kind."""

  count: int = 0
  result_bytes: int = 0
  wire_bytes: float = 0.0

  def __add__(self, other: "CollectiveStats") -> "CollectiveStats":
    return CollectiveStats(self.count + other.count, self.result_bytes + other.result_bytes,
                           self.wire_bytes + other.wire_bytes)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction as it appears in the module."""

  kind: str
  name: str
  computation: str
  result_bytes: int
  group_size: int
  multiplicity: int

  @property
  def wire_bytes(self) -> float:
    n, b = self.group_size, self.result_bytes
    if n <= 1:
      return 0.0
    if self.kind == "all-reduce":
      return 2 * (n - 1) / n * b
    if self.kind in ("all-gather", "all-to-all"):
      return (n - 1) / n * b
    if self.kind == "reduce-scatter":
      return (n - 1) * b
    return float(b)


def shape_bytes(type_text: str) -> int:
  """Bytes of an HLO result type such as ``f32[4,8]{1,0}`` or a tuple of them."""
  total = 0
  for dtype, dims in _SHAPE.findall(type_text):
    if dtype not in _DTYPE_BYTES:
      continue
    total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def group_size(attrs: str) -> int:
  """Number of devices in one group of a collective, from its attribute text."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    size = 1
    for name, sub in re.findall(r"'([^']+)'(?::\((?:\d+)\)(\d+))?", m.group(2)):
      size *= int(sub) if sub else int(sizes[name])
    return size
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{(\{[^}]*\})", attrs)
  if m:
    return len([x for x in m.group(1).strip("{}").split(",") if x.strip()])
  if "source_target_pairs" in attrs:
    return 2
  return 1


def parse_collectives(hlo_text: str) -> tuple[list[Collective], list[str]]:
  """All collectives of a module with their per-step multiplicity.

  Returns:
    (collectives, warnings): warnings name loops whose trip count is unknown.
  """
  computations: dict[str, list[tuple[str, str, str, str]]] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    inst = _INSTRUCTION.match(line)
    if inst and current is not None:
      computations[current].append(inst.groups())

  # Multiplicity: how often each computation runs per execution of the entry.
  calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
  warnings = []
  for comp, insts in computations.items():
    for name, _, op, rest in insts:
      trip = 1
      if op == "while":
        t = _TRIP.search(rest)
        if t:
          trip = int(t.group(1))
        else:
          warnings.append(f"while loop {name} in {comp} has no known trip count; counted once")
      body = _BODY.search(rest).group(1) if op == "while" and _BODY.search(rest) else None
      callees = set(_CALLEE.findall(rest))
      for b in _BRANCHES.findall(rest):
        callees.update(c.strip().lstrip("%") for c in b.split(",") if c.strip())
      for callee in callees:
        calls[comp].append((callee, trip if callee == body else 1))

  multiplicity: dict[str, int] = defaultdict(int)
  if entry is not None:
    order = _topological(entry, calls)
    multiplicity[entry] = 1
    for comp in order:
      for callee, factor in calls.get(comp, ()):
        multiplicity[callee] += multiplicity[comp] * factor

  found = []
  for comp, insts in computations.items():
    for name, type_text, op, rest in insts:
      kind = op[:-len("-start")] if op.endswith("-start") else op
      if kind not in KINDS:
        continue
      if op in ("all-gather-start", "collective-permute-start"):
        # These return (operand, result, ...): count the result only.
        type_text = _SHAPE.findall(type_text) and "{}[{}]".format(*_SHAPE.findall(type_text)[1])
      found.append(Collective(kind, name, comp, shape_bytes(type_text), group_size(rest),
                              multiplicity.get(comp, 0)))
  return found, warnings


def _topological(entry: str, calls) -> list[str]:
  seen, order = set(), []

  def visit(c):
    if c in seen:
      return
    seen.add(c)
    for callee, _ in calls.get(c, ()):
      visit(callee)
    order.append(c)

  visit(entry)
  return order[::-1]


def collective_summary(hlo_text: str) -> dict[str, CollectiveStats]:
  """Per-step totals per collective kind (kinds that do not occur are left out).

  A collective whose groups hold one device each moves nothing (XLA keeps a ``psum``
  over a one-device mesh as such an op) and is left out too.
  """
  totals: dict[str, CollectiveStats] = {}
  for c in parse_collectives(hlo_text)[0]:
    if c.multiplicity == 0 or c.group_size <= 1:
      continue
    stats = CollectiveStats(c.multiplicity, c.multiplicity * c.result_bytes,
                            c.multiplicity * c.wire_bytes)
    totals[c.kind] = totals.get(c.kind, CollectiveStats()) + stats
  return totals


def total_wire_bytes(summary: dict[str, CollectiveStats]) -> float:
  return sum(s.wire_bytes for s in summary.values())


def unpredicted(summary: dict[str, CollectiveStats], runtime: str) -> list[str]:
  """``check_communication``'s lines for a runtime whose plan has no collective model:
  the compiled collectives per kind, each marked as not predicted."""
  return [f"{kind}: compiled {c.count} x, {c.result_bytes} B (not predicted: {runtime})"
          for kind, c in sorted(summary.items())]
