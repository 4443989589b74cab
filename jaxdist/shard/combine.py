"""What XLA's collective combiners do after partitioning, for the cost model and predictions.

XLA merges independent collectives of one kind over the same devices (no data path from
one to the other) into one op: on CPU all-reduces only, on GPU and TPU also all-gathers
and reduce-scatters, up to a byte and an operand threshold (``cost.Combining``). Data
parallelism's per-leaf gradient all-reduces become one op; Megatron's activation
all-reduces, each feeding the next layer, stay one per layer.

In the ILP (linear): every collective gets a *phase*, the largest number of equations
that can emit a collective on any path from it to the step's outputs (its height). All
gradient reductions sit at phase 0 (only the optimizer update follows them); each layer's
activation reduction sits higher than the next one's. Collectives of one kind, over the
same mesh axes, in the same phase are one combined group, charged

    α · max(active, bytes / threshold_bytes, operands / threshold_count)

with ``active`` ≥ each member's indicator (a one-hot choice or an edge variable). Two
collectives in one phase never depend on each other through an emitting equation.

For predictions: the collectives of a solved plan are combined as XLA does it, along the
data flow: XLA's combiner walks a kind × axes's collectives in post order (depth first
from the outputs) and starts a new op at each one that depends on the op it is filling.
That is at least the longest chain of collectives that depend on each other (each op of a
chain must wait for the one before), and at least as many as the thresholds require. Inside a loop (a scan the planner unrolled and the
step compiles rolled) collectives combine only within one iteration.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

import numpy as np

from jaxdist.shard.cost import CostModel

# The phase of a donated output's resharding back into its input's layout: after everything.
TAIL = -1
# Reductions whose all-reduces XLA does not combine with sums.
OTHER_REDUCTIONS = frozenset({"reduce_and", "reduce_or", "reduce_max", "reduce_min", "argmax",
                              "argmin", "reduce_prod", "reduce_xor"})


def emits(node) -> bool:
  """Whether some strategy of ``node`` has a collective of its own."""
  return any(s.collectives for s in node.strategies)


def phases(nodes, flows) -> tuple[int, ...]:
  """Per node, the most emitting nodes on a path from it to an output (itself excluded).

  Nodes are in program order, so every data flow goes from a lower to a higher index.
  """
  height = [0] * len(nodes)
  consumers = defaultdict(list)
  for flow in flows:
    consumers[flow.src].append(flow.dst)
  emitting = [emits(node) for node in nodes]
  for k in range(len(nodes) - 1, -1, -1):
    height[k] = max((height[d] + emitting[d] for d in consumers[k]), default=0)
  return tuple(height)


def before(phase, nodes, k: int) -> int:
  """The phase of resharding into node ``k``: just before ``k``'s own collectives."""
  return phase[k] + emits(nodes[k])


@dataclasses.dataclass(frozen=True)
class Term:
  """One combined group: collectives of one kind over the same axes in one phase.

  Attributes:
    kind, axes, phase: what the collectives share.
    alpha: seconds of one combined op.
    members: where a member is active, as ("x", group, choice) or ("e", group, group,
      choice, choice), with its per-device bytes.
  """

  kind: str
  axes: tuple
  phase: int
  alpha: float
  members: tuple


@dataclasses.dataclass(frozen=True)
class Terms:
  """Every combined group of a strategy graph, with the backend's thresholds."""

  terms: tuple[Term, ...]
  threshold_bytes: float
  threshold_count: int

  def charge(self, choice) -> float:
    """α seconds of a full choice (per group), as the ILP states it."""
    total = 0.0
    for term in self.terms:
      active = [b for where, b in term.members if _active(where, choice)]
      if active:
        total += term.alpha * max(1.0, sum(active) / self.threshold_bytes,
                                  len(active) / self.threshold_count)
    return total

  def reduced(self, of) -> "Terms":
    """The terms over tied groups (``of[g]``: g's reduced index); an edge between two
    groups of one class is a member only on its diagonal."""
    out = []
    for term in self.terms:
      members = []
      for where, b in term.members:
        if where[0] == "x":
          members.append((("x", of[where[1]], where[2]), b))
        elif of[where[1]] != of[where[2]]:
          members.append((("e", of[where[1]], of[where[2]], where[3], where[4]), b))
        elif where[3] == where[4]:
          members.append((("x", of[where[1]], where[3]), b))
      out.append(dataclasses.replace(term, members=tuple(members)))
    return Terms(tuple(out), self.threshold_bytes, self.threshold_count)


def _active(where, choice) -> bool:
  if where[0] == "x":
    return choice[where[1]] == where[2]
  return choice[where[1]] == where[3] and choice[where[2]] == where[4]


class Members:
  """Collects the combinable collectives of a graph while its costs are built."""

  def __init__(self, cost_model: CostModel):
    self._cost_model = cost_model
    self._members = defaultdict(list)
    self._weights = {}
    self._kinds = cost_model.combining.kinds

  def add(self, collective, phase: int, where, region=None, weight: float = 1.0) -> None:
    """``region``: the loop iteration the collective runs in (None: outside loops); XLA
    combines collectives of one loop body only with each other. ``weight``: how many
    times that region runs per step (its combined collectives' α counts that often)."""
    kind, axes, nbytes = collective
    if kind in self._kinds:
      self._members[kind, tuple(axes), phase, region].append((where, nbytes))
      self._weights[kind, tuple(axes), phase, region] = weight

  def terms(self) -> Terms:
    combining = self._cost_model.combining
    return Terms(tuple(Term(kind, axes, phase, self._weights[kind, axes, phase, region]
                            * self._cost_model.latency(axes), tuple(members))
                       for (kind, axes, phase, region), members in self._members.items()
                       if self._cost_model.latency(axes) > 0),
                 combining.threshold_bytes, combining.threshold_count)


def predict(graph, choice, cost_model: CostModel,
            repeat=lambda node, kind, axes: 1,
            axes_of=lambda node, axes: axes,
            at_source=lambda node: False, batch_axes=None,
            extra=(), held=lambda flow: None,
            after_extra=lambda node: True,
            rows=lambda node: False) -> dict[str, dict[str, float]]:
  """kind → {"count", "result_bytes"} per step of a solved plan, combined as XLA does.

  ``count`` is, per kind and mesh axes, the ops XLA's combiner makes of them (where XLA
  combines that kind: :func:`_greedy_groups`, never fewer than the longest chain of
  collectives that depend on each other along the data flow), else one per collective;
  never fewer than the byte and operand thresholds need.
  ``repeat(node, kind, axes)``: how many times a node's collective runs per step (the
  gradient part of a step with micro-batches runs once per micro-batch, on a 1/k slice
  of the batch: k times as many ops, the same bytes). ``axes_of(node, axes)``: the mesh
  axes a node's collective really runs over (inside a ``shard_map``, not its manual ones).
  ``at_source``, ``batch_axes``, ``held``: as :meth:`StrategyGraph.collectives`.
  ``extra``: ``(node, pos, (kind, axes, bytes))`` per collective that runs once on
  ``node``'s output ``pos`` (a gradient's reduction after a micro-batch loop): what reads
  the node's other outputs does not wait for it, and may combine with it.
  ``rows(node)``: whether the node's value holds the batch's rows, which a loop manual
  over ``batch_axes`` keeps split over them.
  """
  combining = cost_model.combining
  sizes = cost_model.axis_sizes
  at_node = defaultdict(list)
  for k, (kind, axes, nbytes) in graph.collectives(choice, cost_model, at_source, batch_axes,
                                                      held):
    inside = axes_of(k, axes)
    if batch_axes and (kind == "all-gather" or kind == "all-reduce" and rows(k)):
      # (in a loop manual over batch axes, the result stays split over them: that much
      # smaller; so is an all-reduce of the loop's rows over a dim the plan split over a
      # batch axis too: a GPT on 2x2 with 2 micro-batches, 10.5 MB predicted, 8.8 MB
      # compiled)
      nbytes /= math.prod(sizes[a] for a in axes if a not in inside and a in batch_axes)
    axes = inside
    if math.prod(sizes[a] for a in axes) > 1:
      at_node[k].append((kind, tuple(axes), nbytes, _reduction(graph.nodes[k], kind)))
  out: dict[str, dict[str, float]] = {}
  keys = {(kind, axes, op) for cs in at_node.values() for kind, axes, _, op in cs}
  keys |= {(kind, tuple(axes), "") for _, _, (kind, axes, _) in extra}
  preds = defaultdict(list)
  for flow in graph.flows:
    if not flow.tied:
      preds[flow.dst].append((flow.src, flow.pos))
  order = functools.cache(lambda: _post_order(preds, graph.outputs, len(graph.nodes)))
  for kind, axes, op in sorted(keys):
    entries = [(k, b) for k, cs in at_node.items() for c_kind, c_axes, b, c_op in cs
               if (c_kind, c_axes, c_op) == (kind, axes, op)]
    late_entries = [(k, pos, b) for k, pos, (c_kind, c_axes, b) in extra
                    if (c_kind, tuple(c_axes), "") == (kind, axes, op)]
    late = defaultdict(set)  # node → its outputs an extra collective of this kind reduces
    for k, pos, _ in late_entries:
      late[k].add(pos)
    total = (sum(b * graph.nodes[k].weight for k, b in entries)
             + sum(b for _, _, b in late_entries))
    if kind in combining.kinds:
      count = 0
      regions = defaultdict(list)  # a loop body's collectives combine only with each other
      for k, b in entries:
        regions[graph.nodes[k].region].append((k, b, False))
      for k, _, b in late_entries:
        regions[graph.nodes[k].region].append((k, b, True))
      for members in regions.values():
        weight, late_weight = defaultdict(int), defaultdict(int)
        for k, _, is_late in members:  # late ones at a node: one combined op
          weight[k] += 1 if is_late else repeat(k, kind, axes)
          late_weight[k] = late_weight[k] or int(is_late)
        for k in {k for k, _, is_late in members if is_late}:
          weight[k] -= sum(is_late for j, _, is_late in members if j == k) - 1
        # (a read of a node's value that is not reduced there yet does not wait for it)
        unwaited = lambda p, pos, k: p in late and (pos not in late[p] or not after_extra(k))
        # What reads a value of a repeated part (a micro-batch loop) runs after the loop:
        # after all its iterations' collectives (a GPT's global-norm sums over split
        # gradients, after a loop whose backward collectives they do not read: 8
        # all-reduces predicted, 9 compiled).
        looped = [repeat(k, kind, axes) > 1 for k in range(len(graph.nodes))]
        loop_chain = 0
        chain = np.zeros(len(graph.nodes), dtype=np.int64)
        for k in range(len(graph.nodes)):
          c = max((chain[p] - unwaited(p, pos, k) for p, pos in preds[k]), default=0)
          if not looped[k] and any(looped[p] for p, _ in preds[k]):
            c = max(c, loop_chain)
          chain[k] = c + weight[k]
          if looped[k]:
            loop_chain = max(loop_chain, int(chain[k]) - late_weight[k])
        count += graph.nodes[members[0][0]].weight * max(
            int(chain.max()),
            _greedy_groups({k for k, _, _ in members}, preds, order(), unwaited),
            math.ceil(sum(b for _, b, _ in members) / combining.threshold_bytes),
            math.ceil(len(members) / combining.threshold_count))
    else:
      count = (sum(repeat(k, kind, axes) * graph.nodes[k].weight for k, _ in entries)
               + len(late_entries))
    entry = out.setdefault(kind, {"count": 0, "result_bytes": 0.0})
    entry["count"] += count
    entry["result_bytes"] += total
  for entry in out.values():  # a whole number unless a loop's length is odd
    if float(entry["count"]).is_integer():
      entry["count"] = int(entry["count"])
  return out


def _reduction(node, kind: str) -> str:
  """The reduction of an all-reduce made at ``node`` where it is no sum (XLA combines
  all-reduces of one reduction only: a finiteness check's ``and`` apart from the sums),
  else ""."""
  name = node.eqn.primitive.name if node.eqn is not None else ""
  return name if kind == "all-reduce" and name in OTHER_REDUCTIONS else ""


def _post_order(preds, outputs, n: int) -> list[int]:
  """The nodes as XLA's ``MakeInstructionPostOrder`` lists them: depth first from the
  outputs in order, then from nodes nothing reads, each node's operands in order."""
  read = set()
  for k in range(n):
    read.update(p for p, _ in preds[k])
  order, seen = [], [False] * n
  for root in [*outputs, *(k for k in range(n) if k not in read)]:
    stack = [(root, False)]
    while stack:
      k, done = stack.pop()
      if done:
        order.append(k)
        continue
      if seen[k]:
        continue
      seen[k] = True
      stack.append((k, True))
      stack.extend((p, False) for p, _ in reversed(preds[k]) if not seen[p])
  return order


def _greedy_groups(members: set, preds, order: list[int],
                   unwaited=lambda p, pos, k: False) -> int:
  """The combined ops XLA's combiner makes of ``members`` (node indices): it walks them
  in post order and starts a new op at each one that depends on a member of the op it is
  filling (``unwaited(p, pos, k)``: ``k`` reads ``p``'s output ``pos`` without waiting
  for ``p``'s collective)."""
  depends = [-1] * len(order)  # per node, the latest op it depends on a member of
  op_of: dict = {}
  ops = 0
  for k in order:
    d = -1
    for p, pos in preds[k]:
      d = max(d, depends[p], -1 if unwaited(p, pos, k) else op_of.get(p, -1))
    depends[k] = d
    if k in members:
      if ops == 0 or d == ops - 1:  # it waits on the op being filled: a new op
        ops += 1
      op_of[k] = ops - 1
  return ops
