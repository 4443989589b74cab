"""The strategy graph: one node per jaxpr input and equation, grouped by following.

Nodes that follow an operand share its producer's decision (a *group*). The ILP then
has one one-hot variable per group with more than one strategy, a cost vector per
group (its nodes' own costs plus resharding between nodes of the group) and a cost
matrix per pair of groups joined by data flow (resharding from the producer's output
spec to the spec the consumer requires).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.extend.core as jex
import numpy as np

from jaxdist import errors
from jaxdist.jaxpr_util import MARKERS
from jaxdist.shard.cost import CostModel
from jaxdist.shard.specs import DimAxes, num_shards, replicated
from jaxdist.shard.strategies import Follow, Strategy, input_strategies, nbytes, rule_for

# Tie-breaking penalty for keeping an input leaf replicated, as a fraction of a 1-byte
# all-reduce over the whole mesh (Alpa's choice of unit), so it scales with α and β.
REPLICATED_INPUT_PENALTY = 0.01


@dataclasses.dataclass
class Node:
  """An input leaf (``eqn is None``) or an equation, with its strategies.

  ``strategies[t]`` is the node's strategy when its group takes choice ``t``.
  """

  label: str
  group: int
  strategies: list[Strategy]
  eqn: object = None
  input_index: int | None = None


@dataclasses.dataclass
class StrategyGraph:
  """Nodes, groups and costs, ready for the solver.

  Attributes:
    nodes: every node.
    group_sizes: number of choices per group.
    group_costs: per group, a cost vector over its choices.
    edge_costs: (producer group, consumer group) → cost matrix.
    producer: jaxpr variable → (node index, output position).
    unknown_primitives: primitives that got no rule (replicated).
    flows: every data flow as (source node, its output position, consumer node, the
      spec the consumer requires per consumer choice, unsharded bytes).
  """

  nodes: list[Node]
  group_sizes: list[int]
  group_costs: list[np.ndarray]
  edge_costs: dict[tuple[int, int], np.ndarray]
  producer: dict
  unknown_primitives: tuple[str, ...]
  flows: list = dataclasses.field(default_factory=list)

  def collectives(self, choice, cost_model: CostModel) -> list[tuple[str, tuple, float]]:
    """Every collective the plan ``choice`` predicts: (kind, axes, per-device bytes)."""
    out = []
    for node in self.nodes:
      out += node.strategies[choice[node.group]].collectives
    for src, pos, dst, required, full_bytes in self.flows:
      want = required[choice[self.nodes[dst].group]]
      have = self.nodes[src].strategies[choice[self.nodes[src].group]].out_specs[pos]
      if want is not None:
        out += cost_model.reshard_collectives(have, want, full_bytes)
    return out

  def spec_of(self, var, choice: list[int]) -> DimAxes:
    node_id, pos = self.producer[var]
    node = self.nodes[node_id]
    return node.strategies[choice[node.group]].out_specs[pos]


def build_graph(jaxpr, cost_model: CostModel, input_choices: dict[int, list[DimAxes]] | None = None,
                tied_outputs: dict[int, int] | None = None) -> StrategyGraph:
  """Builds the strategy graph of an (inlined) jaxpr.

  Args:
    jaxpr: the open jaxpr of the step.
    cost_model: the mesh and its costs.
    input_choices: input position → allowed specs (partition constraints, batch-dim
      forcing); default every divisible spec.
    tied_outputs: output position → input position it must match (donated state).
  """
  sizes = cost_model.axis_sizes
  nodes: list[Node] = []
  group_sizes: list[int] = []
  producer = {}
  unknown = []

  def new_node(label, strategies, eqn=None, input_index=None):
    group_sizes.append(len(strategies))
    nodes.append(Node(label, len(group_sizes) - 1, strategies, eqn, input_index))
    return len(nodes) - 1

  for v in jaxpr.constvars:
    producer[v] = (new_node("const", [Strategy("const", (replicated(len(v.aval.shape)),), ())]), 0)
  for k, v in enumerate(jaxpr.invars):
    shape = tuple(getattr(v.aval, "shape", ()))
    if input_choices and k in input_choices:
      strategies = [Strategy("input", (s,), ()) for s in input_choices[k]]
    else:
      penalty = REPLICATED_INPUT_PENALTY * cost_model.all_reduce(tuple(sizes), 1.0)
      strategies = input_strategies(shape, sizes, nbytes(v), penalty)
    producer[v] = (new_node(f"input {k}", strategies, input_index=k), 0)

  for eqn in jaxpr.eqns:
    if not eqn.outvars:  # nothing to shard (jaxdist.mark_pipeline_boundary, say)
      continue
    if eqn.primitive.name in MARKERS:
      # jaxdist's markers are identities: their outputs are their operands.
      for v_in, v_out in zip(eqn.invars, eqn.outvars):
        if _has_producer(v_in, producer):
          producer[v_out] = producer[v_in]
      continue
    rule = rule_for(eqn, cost_model, lambda v: _has_producer(v, producer),
                    lambda v: group_sizes[nodes[producer[v][0]].group])
    if rule is None or (isinstance(rule, list) and not rule):
      if eqn.primitive.name not in unknown:
        unknown.append(eqn.primitive.name)
      rule = [Strategy(f"{eqn.primitive.name} (no rule: replicated)",
                       tuple(replicated(len(getattr(v.aval, "shape", ()))) for v in eqn.outvars),
                       tuple(replicated(len(getattr(v.aval, "shape", ()))) for v in eqn.invars))]
    if isinstance(rule, Follow):
      src_node, src_pos = producer[eqn.invars[rule.operand]]
      src = nodes[src_node]
      strategies = [rule.mapper(s.out_specs[src_pos]) for s in src.strategies]
      nodes.append(Node(eqn.primitive.name, src.group, strategies, eqn))
      node_id = len(nodes) - 1
    else:
      node_id = new_node(eqn.primitive.name, rule, eqn)
    for pos, v in enumerate(eqn.outvars):
      if not isinstance(v, jex.DropVar):
        producer[v] = (node_id, pos)

  if unknown:
    warnings.warn(f"no sharding rule for primitive(s) {', '.join(unknown)}: their equations are "
                  f"planned replicated (the plan stays correct; XLA places them).",
                  errors.JaxdistWarning, stacklevel=3)

  group_costs = [np.zeros(n) for n in group_sizes]
  edge_costs: dict[tuple[int, int], np.ndarray] = {}
  flows = []
  node_ids = {id(node): k for k, node in enumerate(nodes)}
  for node in nodes:
    for t, s in enumerate(node.strategies):
      group_costs[node.group][t] += s.cost
    if node.eqn is None:
      continue
    out_bytes = [nbytes(v) for v in node.eqn.outvars]
    for t, s in enumerate(node.strategies):
      group_costs[node.group][t] += sum(cost_model.write(b / num_shards(spec, sizes))
                                        for b, spec in zip(out_bytes, s.out_specs))
    for pos, v in enumerate(node.eqn.invars):
      if isinstance(v, jex.Literal) or v not in producer:
        continue
      required = [s.in_specs[pos] if pos < len(s.in_specs) else None for s in node.strategies]
      flows.append((producer[v][0], producer[v][1], node_ids[id(node)],
                    required, nbytes(v)))
      _add_edge(group_costs, edge_costs, cost_model, nodes[producer[v][0]], producer[v][1],
                required, node.group, nbytes(v))

  for out_pos, in_pos in (tied_outputs or {}).items():
    v_out = jaxpr.outvars[out_pos]
    if isinstance(v_out, jex.Literal) or v_out not in producer:
      continue
    dst_id = producer[jaxpr.invars[in_pos]][0]
    required = [s.out_specs[0] for s in nodes[dst_id].strategies]
    flows.append((producer[v_out][0], producer[v_out][1], dst_id, required, nbytes(v_out)))
    _add_edge(group_costs, edge_costs, cost_model, nodes[producer[v_out][0]], producer[v_out][1],
              required, nodes[dst_id].group, nbytes(v_out))
  return StrategyGraph(nodes, group_sizes, group_costs, edge_costs, producer, tuple(unknown),
                       flows)


def _has_producer(v, producer) -> bool:
  return not isinstance(v, jex.Literal) and v in producer


def _add_edge(group_costs, edge_costs, cost_model, src: Node, src_pos: int,
              required: list[DimAxes | None], dst_group: int, full_bytes: float):
  if all(r is None for r in required):
    return
  src_specs = [s.out_specs[src_pos] for s in src.strategies]
  if src.group == dst_group:
    for t, (a, b) in enumerate(zip(src_specs, required)):
      if b is not None:
        group_costs[dst_group][t] += cost_model.reshard(a, b, full_bytes)
    return
  matrix = np.array([[0.0 if b is None else cost_model.reshard(a, b, full_bytes)
                      for b in required] for a in src_specs])
  key = (src.group, dst_group)
  edge_costs[key] = edge_costs[key] + matrix if key in edge_costs else matrix
