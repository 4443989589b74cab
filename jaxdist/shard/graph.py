"""The strategy graph: one node per jaxpr input and equation, grouped by following.

Nodes that follow an operand share its producer's decision (a *group*). The ILP then
has one one-hot variable per group with more than one strategy, a cost vector per
group (its nodes' own costs plus resharding between nodes of the group) and a cost
matrix per pair of groups joined by data flow (resharding from the producer's output
spec to the spec the consumer requires).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable

import jax.extend.core as jex
import numpy as np

from jaxdist import errors
from jaxdist.shard import combine
from jaxdist.jaxpr_util import MARKERS
from jaxdist.shard.cost import DISALLOWED_S, CostModel
from jaxdist.shard.micro import MicroBatchLoop, entry_spec, gather_after_loop
from jaxdist.shard.specs import DimAxes, divides, num_shards, replicated
from jaxdist.shard.strategies import (ELEMENTWISE, Follow, Strategy, input_strategies, nbytes,
                                      rule_for)

# Tie-breaking penalty for keeping an input leaf replicated, as a fraction of a 1-byte
# all-reduce over the whole mesh (Alpa's choice of unit), so it scales with α and β.
REPLICATED_INPUT_PENALTY = 0.01
# Equations that only rearrange their one operand's elements (see _rearranged_from_moved).
REARRANGING = frozenset({"rev", "transpose", "convert_element_type", "copy", "copy_p"})
# The region of the collectives inside a micro-batch loop: they combine with each other.
MICRO_LOOP = ("micro-batch loop",)


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
  region: object = None  # the loop iteration it runs in (see build_graph's regions)
  weight: float = 1.0  # how many times it runs per step (see build_graph's weights)


@dataclasses.dataclass(frozen=True)
class Flow:
  """A value flowing from node ``src`` (its output ``pos``) into node ``dst``.

  ``required``: per choice of ``dst``'s group, the spec ``dst`` needs (None: any);
  ``full_bytes``: the value's unsharded size (``dtype``: its type); ``tied``: a donated
  output flowing back to the input it updates (a constraint between steps, not a data
  dependency); ``operand``: which operand of ``dst``'s equation the value is.
  """

  src: int
  pos: int
  dst: int
  required: tuple
  full_bytes: float
  tied: bool = False
  operand: int | None = None
  dtype: object = None


@dataclasses.dataclass
class StrategyGraph:
  """Nodes, groups and costs, ready for the solver.

  Attributes:
    nodes: every node.
    group_sizes: number of choices per group.
    group_costs: per group, a cost vector over its choices (None until
      :meth:`priced`, for a graph built with ``priced=False``; also ``edge_costs`` and
      ``combine``).
    edge_costs: (producer group, consumer group) → cost matrix.
    producer: jaxpr variable → (node index, output position).
    unknown_primitives: primitives that got no rule (replicated).
    flows: every data flow (:class:`Flow`).
    combine: the collectives XLA may combine, for one α per combined group
      (:class:`jaxdist.shard.combine.Terms`).
    loop: the micro-batch loop the costs price, if any (:attr:`loop`).
    hub: the group of the micro-batch loop's largest batch leaf (set when priced), whose
      choice the loop's entry and exit costs depend on (edges to many groups).
    outputs: the node making each of the step's outputs, in order.
    dead: equation nodes outside loops whose results reach no output. XLA drops them, so
      they have no collectives; the ILP still prices them (a pipeline stage's backward
      recomputes its forward, whose outputs it does not return: they stand in for the
      forward program, which the same plan lays out).
  """

  nodes: list[Node]
  group_sizes: list[int]
  group_costs: list[np.ndarray]
  edge_costs: dict[tuple[int, int], np.ndarray]
  producer: dict
  unknown_primitives: tuple[str, ...]
  flows: list = dataclasses.field(default_factory=list)
  combine: object = None
  dead: frozenset = frozenset()
  outputs: tuple = ()
  hub: int | None = None
  _loop: Callable[[], MicroBatchLoop] | None = dataclasses.field(default=None, repr=False)
  _pricing: Callable[[], tuple] | None = dataclasses.field(default=None, repr=False)

  @functools.cached_property
  def loop(self) -> MicroBatchLoop | None:
    """The micro-batch loop the costs price, if any. Built on first use: it needs the
    step traced at the micro-batch size, which a plan from the cache never prices."""
    return None if self._loop is None else self._loop()

  def repeats(self, flow: Flow) -> tuple[int, int]:
    """(α, bytes) multipliers of ``flow``'s resharding: how often it moves per step inside
    a micro-batch loop."""
    eqn = self.nodes[flow.dst].eqn
    if flow.tied or self._loop is None or not self.loop.runs_in_loop(eqn):
      return (1, 1)
    return self.loop.repeats(eqn.invars[flow.operand])

  def priced(self) -> "StrategyGraph":
    """This graph with ``group_costs``, ``edge_costs`` and ``combine`` filled in (a graph
    built with ``priced=False`` computes them on the first call)."""
    if self._pricing is not None:
      self.group_costs, self.edge_costs, self.combine = self._pricing()
      self._pricing = None
    return self

  def collectives(self, choice, cost_model: CostModel, at_source=lambda node: False,
                  batch_axes=None, held=lambda flow: None
                  ) -> list[tuple[int, tuple[str, tuple, float]]]:
    """Every collective the plan ``choice`` has before XLA combines any, as (node, (kind,
    axes, per-device bytes per step)): a node's own, then the resharding into it (``node``
    is the consumer) or, for a tied output or a source where ``at_source(source)``, the
    node of the value moved. A value resharded to the same spec for several consumers
    counts once (XLA computes it once). Inside a micro-batch loop, a value without the
    batch dimension moves once per micro-batch (its bytes count ``k`` times), except a
    partial sum over ``batch_axes`` only (None: every axis), reduced once after the loop.
    ``held(flow)``: the layout the flow's value is in where it is read, where that is not
    the plan's (a parameter gathered over the batch axes on entering the loop), or None."""
    out = []
    for k, node in enumerate(self.nodes):
      if k in self.dead:
        continue
      repeat = self.loop.own_bytes_repeat(node.eqn) if self.loop is not None else 1
      for kind, axes, b in node.strategies[choice[node.group]].collectives:
        if node.eqn is not None:  # 16-bit floats move as f32 on CPU
          b = cost_model.combining.collective_bytes(b, node.eqn.outvars[0].aval.dtype)
        inside = batch_axes is not None and set(axes) - set(batch_axes)
        out.append((k, (kind, axes, b * repeat if inside else b)))
    done = set()  # a value resharded to one spec for several consumers moves once (CSE)
    pieces: dict = {}  # a concatenation's operands moved alike, moved as one (_joined_first)
    moved = {(flow.src, flow.pos, flow.required[choice[self.nodes[flow.dst].group]])
             for flow in self.flows if not flow.tied}
    for flow in self.flows:
      want = flow.required[choice[self.nodes[flow.dst].group]]
      src = self.nodes[flow.src]
      have = held(flow) or src.strategies[choice[src.group]].out_specs[flow.pos]
      key = (flow.src, flow.pos, have, want, flow.tied)
      if want is None or key in done or flow.dst in self.dead:
        continue
      done.add(key)
      if not flow.tied and want != have and self._rearranged_from_moved(flow, want, choice, moved):
        continue
      where = flow.src if flow.tied or at_source(flow.src) else flow.dst
      repeat = self.repeats(flow)[1]
      if not flow.tied and self._joined_first(flow, have, want):
        pieces.setdefault((where, have, want, flow.dtype, repeat), []).append(flow)
        continue
      out += self._moved(where, have, want, flow.full_bytes, flow.dtype, repeat, cost_model)
    for (where, have, want, dtype, repeat), flows in pieces.items():
      out += self._moved(where, have, want, sum(f.full_bytes for f in flows), dtype, repeat,
                         cost_model)
    return out

  @staticmethod
  def _moved(where, have, want, full_bytes, dtype, repeat, cost_model):
    return [(where, (kind, axes, repeat * cost_model.combining.collective_bytes(b, dtype)))
            for kind, axes, b in cost_model.reshard_collectives(have, want, full_bytes)]

  def _joined_first(self, flow: Flow, have, want) -> bool:
    """Whether ``flow`` is one operand of a concatenation that XLA joins before it moves:
    the stack of a scan the planner unrolled and the step compiles as a loop (each
    operand made in one iteration) is written in place by the loop, and if the operands
    are split alike, but not along the joined dim, it is resharded once (a GRU's outputs:
    one all-gather of the stack, not one per iteration). A concatenation in the compiled
    program reshards each operand (an LSTM cell's four gate kernels, gathered for the
    recurrence: one all-gather per kernel)."""
    eqn = self.nodes[flow.dst].eqn
    if (eqn is None or eqn.primitive.name != "concatenate" or have == want
        or not self._made_in_loop(flow.src)):
      return False
    dim = eqn.params["dimension"]
    return len(have) > dim and not have[dim] and not want[dim]

  def _made_in_loop(self, k: int) -> bool:
    """Whether node ``k`` runs in a loop iteration of the compiled program, or reshapes
    such a value (the stack of an unrolled scan reshapes each iteration's output)."""
    node = self.nodes[k]
    while node.region is None and node.eqn is not None and node.eqn.primitive.name == "reshape":
      operand = node.eqn.invars[0]
      if operand not in self.producer:
        return False
      node = self.nodes[self.producer[operand][0]]
    return node.region is not None

  def _rearranged_from_moved(self, flow: Flow, want, choice, moved) -> bool:
    """Whether XLA gets ``flow``'s value in ``want`` without a collective: the value is a
    rearrangement (a reverse, transpose or cast) of one operand that the plan moves, for
    another consumer, into the matching layout (or holds there); XLA rearranges that copy
    (measured: a convolution kernel all-gathered for the forward pass is reversed locally
    for the backward's, not gathered again)."""
    eqn = self.nodes[flow.src].eqn
    if (eqn is None or eqn.primitive.name not in REARRANGING
        or isinstance(eqn.invars[0], jex.Literal) or eqn.invars[0] not in self.producer):
      return False
    needed = want
    if eqn.primitive.name == "transpose":  # output dim i is operand dim perm[i]
      perm = eqn.params["permutation"]
      needed = [()] * len(perm)
      for i, p in enumerate(perm):
        needed[p] = want[i]
      needed = tuple(needed)
    src, pos = self.producer[eqn.invars[0]]
    node = self.nodes[src]
    held = node.strategies[choice[node.group]].out_specs[pos]
    return needed == held or (src, pos, needed) in moved

  def spec_of(self, var, choice: list[int]) -> DimAxes:
    node_id, pos = self.producer[var]
    node = self.nodes[node_id]
    return node.strategies[choice[node.group]].out_specs[pos]


def build_graph(jaxpr, cost_model: CostModel, input_choices: dict[int, list[DimAxes]] | None = None,
                tied_outputs: dict[int, int] | None = None,
                batch_inputs: frozenset[int] = frozenset(),
                regions: list | None = None, weights: list | None = None,
                loop: Callable[[], MicroBatchLoop] | None = None,
                priced: bool = True, state_inputs: frozenset[int] = frozenset()
                ) -> StrategyGraph:
  """Builds the strategy graph of an (inlined) jaxpr.

  Args:
    jaxpr: the open jaxpr of the step.
    cost_model: the mesh and its costs.
    input_choices: input position → allowed specs (partition constraints, batch-dim
      forcing); default every divisible spec.
    tied_outputs: output position → input position it must match (donated state).
    batch_inputs: input positions holding the batch.
    regions: per equation, the loop iteration it runs in once compiled (an unrolled
      scan compiled as a loop) or None; collectives combine only within one.
    weights: per equation, how many times it runs per step (a long scan's stand-in
      iterations, see ``jaxpr_util.unroll_scans``): its costs, the resharding of its
      operands and its collectives count that many times.
    loop: returns the micro-batch loop of a step with ``num_micro_batches`` > 1, priced
      as ``jaxdist.shard.micro`` describes (called when the costs are computed).
    priced: compute the costs now; else on :meth:`StrategyGraph.priced` (a plan whose
      solution is cached needs only the strategies: pricing is most of the build).
    state_inputs: input positions holding optimizer state. An elementwise op follows
      such an input (or a value following it) held split with no other choice, as
      ZeRO's sharded Adam moments are, before a freer operand: the update then runs on
      the moments' shards, instead of their being gathered to follow the gradient.
  """
  sizes = cost_model.axis_sizes
  nodes: list[Node] = []
  group_sizes: list[int] = []
  state_groups: set[int] = set()  # the groups of the optimizer-state inputs
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
    penalty = REPLICATED_INPUT_PENALTY * cost_model.all_reduce(tuple(sizes), 1.0)
    if input_choices and k in input_choices:
      # Among the allowed specs, one not split over every mesh axis costs a batch leaf
      # the same small penalty: a batch held redundantly invites XLA to partition the
      # equations reading it differently from the plan.
      allowed, batch = input_choices[k], k in (batch_inputs or ())
      full = math.prod(sizes.values())
      strategies = [Strategy("input", (s,), (), penalty if batch and len(allowed) > 1
                             and num_shards(s, sizes) < full else 0.0) for s in allowed]
    else:
      strategies = input_strategies(shape, sizes, nbytes(v), penalty)
    producer[v] = (new_node(f"input {k}", strategies, input_index=k), 0)
    if k in state_inputs:
      state_groups.add(len(group_sizes) - 1)

  expanded: set = set()  # values broadcast up from fewer elements (see _track_expanded)
  top_level: set = set()  # equations outside any loop or conditional once compiled
  for index, eqn in enumerate(jaxpr.eqns):
    if not eqn.outvars:  # nothing to shard (jaxdist.mark_pipeline_boundary, say)
      continue
    if eqn.primitive.name in MARKERS:
      # jaxdist's markers are identities: their outputs are their operands.
      for v_in, v_out in zip(eqn.invars, eqn.outvars):
        if _has_producer(v_in, producer):
          producer[v_out] = producer[v_in]
      continue
    rule = rule_for(eqn, cost_model, lambda v: _has_producer(v, producer),
                    lambda v: group_sizes[nodes[producer[v][0]].group],
                    lambda v: v in expanded,
                    lambda v: _pinned_state(nodes, producer, v, sizes, state_groups))
    _track_expanded(eqn, expanded)
    if rule is None or (isinstance(rule, list) and not rule):
      if eqn.primitive.name not in unknown:
        unknown.append(eqn.primitive.name)
      rule = [Strategy(f"{eqn.primitive.name} (no rule: replicated)",
                       tuple(replicated(len(getattr(v.aval, "shape", ()))) for v in eqn.outvars),
                       tuple(replicated(len(getattr(v.aval, "shape", ()))) for v in eqn.invars))]
    if isinstance(rule, Follow):
      src_node, src_pos = producer[eqn.invars[rule.operand]]
      src = nodes[src_node]
      mapped = {}  # a group's strategies repeat specs (a 2-D mesh: many dot roles, few specs)
      strategies = [mapped.get(spec) or mapped.setdefault(spec, rule.mapper(spec))
                    for spec in (s.out_specs[src_pos] for s in src.strategies)]
      nodes.append(Node(eqn.primitive.name, src.group, strategies, eqn))
      node_id = len(nodes) - 1
    else:
      node_id = new_node(eqn.primitive.name, rule, eqn)
    if regions is not None:
      nodes[node_id].region = regions[index]
    if regions is None or regions[index] is None:
      top_level.add(node_id)
    if weights is not None:
      nodes[node_id].weight = weights[index]
    for pos, v in enumerate(eqn.outvars):
      if not isinstance(v, jex.DropVar):
        producer[v] = (node_id, pos)

  if unknown:
    warnings.warn(f"no sharding rule for primitive(s) {', '.join(unknown)}: their equations are "
                  f"planned replicated (the plan stays correct; XLA places them).",
                  errors.JaxdistWarning, stacklevel=3)

  flows = []
  node_ids = {id(node): k for k, node in enumerate(nodes)}
  for node in nodes:
    if node.eqn is None:
      continue
    for pos, v in enumerate(node.eqn.invars):
      if isinstance(v, jex.Literal) or v not in producer:
        continue
      required = [s.in_specs[pos] if pos < len(s.in_specs) else None for s in node.strategies]
      flows.append(Flow(producer[v][0], producer[v][1], node_ids[id(node)], tuple(required),
                        nbytes(v), operand=pos, dtype=v.aval.dtype))
  for out_pos, in_pos in (tied_outputs or {}).items():
    v_out = jaxpr.outvars[out_pos]
    if isinstance(v_out, jex.Literal) or v_out not in producer:
      continue
    dst_id = producer[jaxpr.invars[in_pos]][0]
    required = tuple(s.out_specs[0] for s in nodes[dst_id].strategies)
    flows.append(Flow(producer[v_out][0], producer[v_out][1], dst_id, required, nbytes(v_out),
                      tied=True, dtype=v_out.aval.dtype))
  # Inside a micro-batch loop, the collectives of an equation whose outputs keep the
  # batch dimension run once per micro-batch (k α, the same bytes); one that lost it
  # (a weight gradient's partial sums) is reduced once, after the loop, over the batch
  # axes, but k times whole over an axis that cannot split the batch.
  batch_axes = frozenset(a for i in (batch_inputs if loop is not None else ())
                         for s in (input_choices or {}).get(i, ()) if s for a in s[0])
  live, todo = set(), [producer[v][0] for v in jaxpr.outvars if _has_producer(v, producer)]
  sources = {}
  for flow in flows:
    if not flow.tied:
      sources.setdefault(flow.dst, []).append(flow.src)
  while todo:
    k = todo.pop()
    if k not in live:
      live.add(k)
      todo += sources.get(k, [])
  # Inside a loop an iteration's result feeds the next through the carry (and a while
  # loop's stand-in condition feeds nothing here), so only top-level equations are dead.
  # (Anywhere, an equation whose results are all dropped: unread in its loop's body.)
  dead = frozenset(k for k in top_level if k not in live) | frozenset(
      k for k, node in enumerate(nodes) if node.eqn is not None and node.eqn.outvars
      and all(isinstance(o, jex.DropVar) for o in node.eqn.outvars))
  graph = StrategyGraph(nodes, group_sizes, None, None, producer, tuple(unknown), flows,
                        dead=dead, _loop=loop,
                        outputs=tuple(producer[v][0] for v in jaxpr.outvars
                                      if _has_producer(v, producer)))
  graph._pricing = lambda: _price(graph, cost_model, jaxpr.outvars, batch_axes)
  return graph.priced() if priced else graph


def _price(graph: StrategyGraph, cost_model: CostModel, outvars, batch_axes):
  """(group costs, edge costs, combined groups) of a graph's nodes and flows."""
  nodes, flows, loop = graph.nodes, graph.flows, graph.loop
  sizes = cost_model.axis_sizes
  phase = combine.phases(nodes, [f for f in flows if not f.tied])
  fused = _fused_into_consumers(nodes, flows, outvars)
  group_costs = [np.zeros(n) for n in graph.group_sizes]
  edge_costs: dict[tuple[int, int], np.ndarray] = {}
  members = combine.Members(cost_model)
  for k, node in enumerate(nodes):
    looped = loop is not None and loop.runs_in_loop(node.eqn)
    scaled = looped and any(loop.scaled(v) for v in node.eqn.outvars)
    for t, s in enumerate(node.strategies):
      group_costs[node.group][t] += s.cost * node.weight
      for c in s.collectives:
        alpha_repeat, bytes_repeat = ((loop.k, loop.own_bytes_repeat(node.eqn)) if scaled else
                                      (loop.k, loop.k) if looped and set(c[1]) - batch_axes
                                      else (1, 1))
        region = MICRO_LOOP if alpha_repeat > 1 else node.region
        members.add(c, phase[k], ("x", node.group, t), region, node.weight * alpha_repeat)
        if alpha_repeat > 1:  # s.cost has the collective once (its α if not combined)
          alpha = cost_model.latency(c[1]) if c[0] not in cost_model.combining.kinds else 0.0
          group_costs[node.group][t] += node.weight * ((bytes_repeat - 1) * cost_model.collective(*c)
                                                       + (alpha_repeat - bytes_repeat) * alpha)
    if loop is not None and loop.runs_in_loop(node.eqn):
      _rule_out_undivided(group_costs[node.group], node, loop, sizes)
    if node.eqn is None:
      continue
    if fused[k]:
      continue
    out_bytes = [nbytes(v) for v in node.eqn.outvars]
    for t, s in enumerate(node.strategies):
      group_costs[node.group][t] += node.weight * sum(
          cost_model.write(b / num_shards(spec, sizes)) for b, spec in zip(out_bytes, s.out_specs))
  cache = {}
  for flow in flows:
    _add_edge(group_costs, edge_costs, cost_model, members, nodes, flow, graph.repeats(flow),
              combine.TAIL if flow.tied else combine.before(phase, nodes, flow.dst), cache)
  if loop is not None and loop.batch_inputs and loop.batch_inputs[0] in graph.producer:
    _add_loop_entry_and_exit(group_costs, edge_costs, graph, cost_model)
  return group_costs, edge_costs, members.terms()


def _add_loop_entry_and_exit(group_costs, edge_costs, graph: StrategyGraph,
                             cost_model: CostModel) -> None:
  """Charges what XLA moves where the micro-batch loop's region starts and ends, which
  depends on the batch axes (the largest batch leaf's dim 0 split, a choice of the ILP):
  every batch leaf enters it split on dim 0 over them and on nothing else (a leaf planned
  otherwise is resharded: its own cost for the largest leaf, an edge from it for the
  others), and a gradient split after it over them and then another axis on one dim is
  all-gathered first (``micro.gather_after_loop``: an edge from the largest leaf)."""
  loop, nodes, sizes = graph.loop, graph.nodes, cost_model.axis_sizes
  first = nodes[graph.producer[loop.batch_inputs[0]][0]]
  graph.hub = first.group
  batch_axes = [s.out_specs[0][0] if s.out_specs[0] else () for s in first.strategies]
  seconds = lambda moves: sum(cost_model.collective(*c) + (
      cost_model.latency(c[1]) if c[0] in cost_model.combining.kinds else 0.0) for c in moves)

  def add(node, cost):  # cost(batch axes, strategy) → seconds
    matrix = np.array([[cost(axes, s) for s in node.strategies] for axes in batch_axes])
    if not matrix.any():
      return
    if node.group == first.group:
      group_costs[node.group] += np.diag(matrix)
      return
    key = (first.group, node.group)
    edge_costs[key] = edge_costs[key] + matrix if key in edge_costs else matrix

  for v in loop.batch_inputs:
    if v in graph.producer:
      add(nodes[graph.producer[v][0]], lambda axes, s, v=v: seconds(cost_model.reshard_collectives(
          s.out_specs[0], entry_spec(len(v.aval.shape), axes), nbytes(v))))
  for v in loop.reduced:
    if v not in graph.producer:
      continue
    node, pos = graph.producer[v]
    if graph.group_sizes[nodes[node].group] == 1:
      continue  # (an unconstrained producer is not held split inside the loop)

    def gather(axes, s, v=v, pos=pos):
      found = gather_after_loop(s.out_specs[pos], axes, nbytes(v), sizes)
      return 0.0 if found is None else cost_model.all_gather(
          found[1], cost_model.combining.collective_bytes(found[2], v.aval.dtype))
    add(nodes[node], gather)


def _rule_out_undivided(costs, node: Node, loop: MicroBatchLoop, sizes) -> None:
  """Makes the strategies of a looped node that split a dimension the micro-batch's
  shapes do not divide cost ``DISALLOWED_S``: inside the loop the split cannot be kept."""
  eqn = node.eqn
  for t, s in enumerate(node.strategies):
    for specs, values in ((s.out_specs, eqn.outvars), (s.in_specs, eqn.invars)):
      if any(spec is not None and loop.varies(v) and loop.micro_shapes[v] is not None
             and not divides(loop.micro_shapes[v], spec, sizes)
             for spec, v in zip(specs, values)):
        costs[t] += DISALLOWED_S
        break


def _fused_into_consumers(nodes, flows, outvars) -> list[bool]:
  """Per node, whether XLA's loop fusion keeps its outputs out of memory: an elementwise
  equation whose every consumer is elementwise too, in the same loop iteration, and that
  is no output of the step (an optimizer update's chain of a dozen elementwise ops writes
  only its results). Nothing fuses into a loop: a backward loop's zero-filled gradient
  accumulators are its state, written (free here, they were planned replicated where the
  loop carries them split: 5 x 2 MB per device estimated, the compiled loop had none)."""
  elementwise = [n.eqn is not None and (n.eqn.primitive.name in ELEMENTWISE
                                        or n.eqn.primitive.name == "broadcast_in_dim")
                 for n in nodes]
  fused = list(elementwise)
  for flow in flows:
    if not elementwise[flow.dst] or nodes[flow.src].region != nodes[flow.dst].region:
      fused[flow.src] = False
  outputs = {id(v) for v in outvars}
  for k, node in enumerate(nodes):
    if fused[k] and any(id(v) in outputs for v in node.eqn.outvars):
      fused[k] = False
  return fused


def _has_producer(v, producer) -> bool:
  return not isinstance(v, jex.Literal) and v in producer


def _add_edge(group_costs, edge_costs, cost_model, members, nodes, flow: Flow,
              repeats: tuple[int, int], phase: int, cache: dict):
  """Adds a flow's resharding: to its group's costs when both ends share a group, else
  to the edge matrix of the two groups; records the collectives for combining.
  ``repeats``: (α, bytes) multipliers (:meth:`StrategyGraph.repeats`). ``cache``:
  (source spec, target spec, bytes) → (seconds, collectives)."""
  src, required = nodes[flow.src], flow.required
  if all(r is None for r in required):
    return
  dst_group = nodes[flow.dst].group
  src_specs = [s.out_specs[flow.pos] for s in src.strategies]
  same = src.group == dst_group
  weight = 1.0 if flow.tied else nodes[flow.dst].weight  # the operand is read that often
  alpha_repeat, bytes_repeat = repeats
  matrix = np.zeros((len(src_specs), len(required)))
  for a, have in enumerate(src_specs):
    for b, want in enumerate(required):
      if want is None or (same and a != b) or have == want:
        continue
      key = (have, want, flow.full_bytes)
      if key not in cache:
        collectives = cost_model.reshard_collectives(have, want, flow.full_bytes)
        alphas = sum(cost_model.latency(axes) for kind, axes, _ in collectives
                     if kind not in cost_model.combining.kinds)
        cache[key] = (sum(cost_model.collective(*c) for c in collectives), alphas, collectives)
      seconds, alphas, collectives = cache[key]
      matrix[a, b] = bytes_repeat * seconds + (alpha_repeat - bytes_repeat) * alphas
      region = None if flow.tied else MICRO_LOOP if alpha_repeat > 1 else nodes[flow.dst].region
      for c in collectives:
        members.add(c, phase, ("x", dst_group, b) if same else ("e", src.group, dst_group, a, b),
                    region, weight * alpha_repeat)
  matrix *= weight
  if same:
    group_costs[dst_group] += np.diag(matrix)
    return
  key = (src.group, dst_group)
  edge_costs[key] = edge_costs[key] + matrix if key in edge_costs else matrix


def _track_expanded(eqn, expanded: set) -> None:
  """Marks values that are a smaller value broadcast up (a batch statistic spread over the
  batch, a softmax's max over its row), and elementwise results of only such values: an
  elementwise op should follow its other operand, whose layout carries real splits."""
  name = eqn.primitive.name
  out = eqn.outvars[0] if eqn.outvars else None
  if out is None or isinstance(out, jex.DropVar):
    return
  size = math.prod(getattr(out.aval, "shape", ()))
  if name == "broadcast_in_dim":
    operand = eqn.invars[0]
    if math.prod(getattr(operand.aval, "shape", ())) < size:
      expanded.add(out)
  elif name in ELEMENTWISE:
    full = [v for v in eqn.invars if not isinstance(v, jex.Literal)
            and math.prod(getattr(v.aval, "shape", ())) == size]
    if full and all(v in expanded for v in full):
      expanded.add(out)


def _pinned_state(nodes, producer, v, sizes, state_groups) -> bool:
  """Whether ``v`` follows an optimizer-state input whose only choice splits it."""
  node_id, pos = producer[v]
  node = nodes[node_id]
  return (node.group in state_groups and len(node.strategies) == 1
          and num_shards(node.strategies[0].out_specs[pos], sizes) > 1)
