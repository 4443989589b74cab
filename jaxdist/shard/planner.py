"""ShardParallel planning: jaxpr → StrategyGraph → Solution → Layout, per mesh shape.

The memory model of the budget: the buffers ``jaxdist.liveness.Timeline`` finds XLA
keeping (fused results never written, bitcasts and in-place updates sharing a buffer,
a dying operand's buffer reused), each ``bytes / shards`` on a device under the layout
chosen for its value; inputs are live throughout (donated ones share their buffer with
the output). The peak is checked at the positions where the unsharded live total is
largest (``MEMORY_CHECK_POINTS`` of them), which keeps the ILP small; the estimate is
the planner's, the compiled figure is XLA's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import re
import time
import warnings
from typing import Callable

import jax
import jax.extend.core as jex
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxdist import agree
from jaxdist.accumulate import per_example_outputs, reduced_outputs
from jaxdist import errors
from jaxdist import jaxpr_util
from jaxdist import methods as m
from jaxdist import progress
from jaxdist.coupling import batch_coupling, token_weighted
from jaxdist.layouts import Layout, check_batch_divisible, uses_marker
from jaxdist.liveness import Timeline
from jaxdist.mesh import LogicalMesh
from jaxdist.recompute import tie_recomputations
from jaxdist.shard import cache, combine
from jaxdist.shard.cost import CostModel, combining_for
from jaxdist.shard.graph import REARRANGING, StrategyGraph, build_graph
from jaxdist.shard.micro import (MicroBatchLoop, batch_varying, entry_spec, gather_after_loop,
                                 micro_batch_loop, permute_on_entry, reduce_dim)
from jaxdist.shard.repeats import tie_groups
from jaxdist.shard.rolled import roll
from jaxdist.shard.solver import MemoryConstraint, Solution, solve_ilp
from jaxdist.shard.specs import (DimAxes, divides, enumerate_specs, from_partition_spec,
                                 num_shards, to_partition_spec, used_axes)
from jaxdist.shard.strategies import ELEMENTWISE, nbytes
from jaxdist.trace import BATCH, OPTIMIZER, PARAM, TracedStep

MEMORY_CHECK_POINTS = 8
LOOP_BUFFERS_TIME_LIMIT_S = 20.0
TIME_LIMITED = ("time_limit", "over_budget")  # solutions another run may improve on
log = logging.getLogger("jaxdist.plan")


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """The plan for one logical mesh shape."""

  lmesh: LogicalMesh
  graph: StrategyGraph
  solution: Solution
  input_specs: tuple[DimAxes, ...]
  cost_model: CostModel


def candidate_shapes(n: int) -> list[tuple[int, ...]]:
  """(n,) and every (a, b) with a · b = n, a, b > 1."""
  return [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0 and n // a > 1]


def mesh_for(shape: tuple[int, ...], base: LogicalMesh,
             axis_names: tuple[str, ...] | None = None) -> LogicalMesh:
  """A logical mesh of ``shape`` over ``base``'s devices, with its α/β where they fit."""
  if shape == base.shape and axis_names in (None, base.axis_names):
    return base
  alpha = base.alpha if len(base.shape) == len(shape) else max(base.alpha)
  beta = base.beta if len(base.shape) == len(shape) else max(base.beta)
  return LogicalMesh(shape, axis_names=axis_names, alpha=alpha, beta=beta, devices=base.devices,
                     peak_flops=base.peak_flops)


def pinned_by_plan(plan, step: TracedStep) -> dict[int, DimAxes]:
  """Input position → spec from a saved plan, which must describe exactly this step.

  Raises:
    PlanMismatchError: naming the first leaf path or shape that differs.
  """
  if plan.method != "ShardParallel":
    raise errors.PlanMismatchError(
        f"ShardParallel(plan=...) got a plan made by {plan.method}; pass a ShardParallel plan.")
  by_path = {e.path: e for e in plan.inputs}
  for leaf in step.inputs:
    entry = by_path.get(leaf.path)
    if entry is None:
      raise errors.PlanMismatchError(
          f"the plan has no entry for {leaf.path} {leaf.shape}: it was made for another model "
          f"(its first leaves: {', '.join(e.path for e in plan.inputs[:3])}).")
    if tuple(entry.shape) != leaf.shape:
      raise errors.PlanMismatchError(
          f"the plan has {leaf.path} with shape {tuple(entry.shape)}, the step has {leaf.shape}: "
          f"it was made for another model or batch size.")
  extra = set(by_path) - {leaf.path for leaf in step.inputs}
  if extra:
    raise errors.PlanMismatchError(
        f"the plan has {sorted(extra)[0]}, which this step does not: it was made for another "
        f"model.")
  return {k: from_partition_spec(by_path[leaf.path].spec, len(leaf.shape))
          for k, leaf in enumerate(step.inputs)}


@dataclasses.dataclass(frozen=True)
class ShardPlanResult:
  """What the shard planner hands to the compiler and the plan record.

  Attributes:
    step: the step on its call-inlined jaxpr (the one the layout's equation indices
      refer to).
    layout: the chosen shardings.
    objective: the chosen plan's predicted seconds.
    mesh_objectives: each tried mesh shape's objective, keyed ``"2x4"``.
    predicted_collectives: kind → {"count", "result_bytes"} per step (per device).
    solve: gives the chosen shape's MeshPlan (its strategy graph and solution); after a
      plan-cache hit the graph is rebuilt only when :attr:`mesh_plan` is first read.
  """

  step: TracedStep
  layout: Layout
  objective: float
  mesh_objectives: dict[str, float]
  predicted_collectives: dict[str, dict[str, float]]
  solve: Callable[[], MeshPlan]
  tied_loops: bool = False  # planned with the recomputations in scan bodies tied

  @functools.cached_property
  def mesh_plan(self) -> MeshPlan:
    """The chosen shape's strategy graph and solution (each value's spec)."""
    return self.solve()


def plan_shard_parallel(method: m.ShardParallel, step: TracedStep, base: LogicalMesh,
                        long_scans: bool = True, micro_trace=None,
                        tie_loops: bool = False) -> ShardPlanResult:
  """Searches the mesh shapes (or applies a saved plan) and returns the cheapest plan.

  ``long_scans``: plan scans longer than ``jaxpr_util.MAX_UNROLLED_SCAN`` and while
  loops on their two-iteration stand-ins (with one micro-batch; they compile as loops),
  else leave them to XLA. ``micro_trace(divisor)``: the step's jaxpr traced at
  1/divisor of the batch, inlined with ``jaxpr_util.PLAN_INLINE``; with
  ``num_micro_batches`` > 1 the ILP prices the micro-batch loop from it
  (``jaxdist.shard.micro``), without it the whole-batch step. ``tie_loops``: plan with
  the recomputations in scan bodies tied to their cotangents (as they must be where the
  step compiles its scans unrolled: always with micro-batches, else when the scan's
  iterations got different plans).
  """
  given_step = step
  opt = method.options
  k = method.num_micro_batches or 1
  if k > 1:
    check_batch_divisible(step, k, f"num_micro_batches={k}")
  pinned = None
  given = isinstance(method.devices, (LogicalMesh, Mesh))
  if method.plan is not None:
    pinned = pinned_by_plan(method.plan, step)
    shapes, why = [tuple(method.plan.mesh_shape)], "the saved plan's mesh"
  elif method.logical_mesh_shape == "search" or not (method.logical_mesh_shape or given):
    shapes, why = candidate_shapes(base.num_devices), None
  elif method.logical_mesh_shape:
    shapes, why = [tuple(method.logical_mesh_shape)], "logical_mesh_shape"
    if given and len(base.shape) > 1 and shapes[0] != base.shape:
      raise errors.MeshShapeError(
          f"ShardParallel(logical_mesh_shape={shapes[0]}) differs from the mesh given as "
          f"devices= (shape {base.shape}, axes {base.axis_names}); give one of them, or the "
          f"same shape in both.")
  else:
    shapes, why = [base.shape], "the mesh given as devices="
  for shape in shapes:
    if math.prod(shape) != base.num_devices:
      raise errors.MeshShapeError(
          f"ShardParallel(logical_mesh_shape={shape}) multiplies to {math.prod(shape)}, but "
          f"there are {base.num_devices} devices; use a shape whose product is "
          f"{base.num_devices}.")
  # Calls are inlined; jaxdist.grad's marker stays (the strategy graph sees through it)
  # so that gradient accumulation can split the planned step there.
  long_scans = long_scans and k == 1
  # With micro-batches the step compiles with its scans unrolled (below): a recomputation
  # in a scan body must then wait for its cotangent as one at the top level does.
  tie_loops = tie_loops or k > 1
  batch = recursion_batch(step, k)
  rolled_jaxpr, inlined, origins, weights = jaxpr_util.rolled_and_unrolled(
      tie_recomputations(step.closed_jaxpr, in_loops=True) if tie_loops
      else step.closed_jaxpr, long_scans, batch)
  loops = _control_flow(rolled_jaxpr, long_scans, jaxpr_util.recursions(rolled_jaxpr, batch))
  stand_ins = long_scans and any(kind not in ("short", "cond") for kind in loops)
  weights = weights if stand_ins else None
  pairs = _stand_in_pairs(origins, weights) if stand_ins else ()
  found = jaxpr_util.find_eqns(inlined.jaxpr, jaxpr_util.IDENTITY_MARKER)
  step = dataclasses.replace(step, closed_jaxpr=inlined,
                             marker_index=found[0] if len(found) == 1 else None)
  if k > 1:
    uses_marker(method, step)  # raises unless there is one top-level marker
  # The micro-batch loop's pricing (traced only where an ILP is built: not on a cache hit).
  priced_loop = k > 1 and micro_trace is not None
  loop = (functools.cache(lambda: micro_batch_loop(inlined.jaxpr, step, micro_trace(k), k))
          if priced_loop else None)
  # With one micro-batch the unrolled scans compile as loops (see rolled.py), whose
  # collectives combine only within an iteration; with more, the step compiles unrolled.
  regions = _loop_regions(origins) if k == 1 else None
  names = method.plan.axis_names if method.plan is not None else None
  text = str(step.closed_jaxpr)  # the cache keys' largest part, printed once
  digest = cache.key("result", text, _mesh_key(base), shapes, names, opt, pinned, k, long_scans,
                     priced_loop,
                     [(l.shape, str(l.dtype), l.role) for l in step.inputs])
  # Every process of a job compiles process 0's plan: its cached result if it has one,
  # else what the processes solve (each solve agreed on in _plan_one).
  hit = agree.process_zeros(cache.load_result(digest) if opt.plan_cache else None)
  if hit is not None:
    if hit["long_scans"] != long_scans or hit["tied"] != tie_loops:
      # planned again without stand-ins or with recomputations tied (see below)
      inner = plan_shard_parallel(method, given_step, base, hit["long_scans"], micro_trace,
                                  hit["tied"])
      return dataclasses.replace(inner, layout=dataclasses.replace(
          inner.layout, notes=tuple(hit["layout"].get("notes", inner.layout.notes))))
    lmesh = mesh_for(tuple(hit["shape"]), base, names)
    layout = _decode_layout(hit["layout"], lmesh)
    if layout is None:  # a file not written by this version: plan as if absent
      hit = None
    elif hit["rolled"]:
      layout = dataclasses.replace(layout, rolled=roll(
          rolled_jaxpr, origins, layout.eqn_constraints, layout.operand_constraints))
    if hit is not None and not isinstance(layout.rolled, str):
      return ShardPlanResult(step, layout, hit["objective"], hit["mesh_objectives"],
                             hit["predicted_collectives"], lambda: _plan_one(
                                 step, lmesh, opt, pinned, k, regions, weights, pairs, text,
                                 loop), tie_loops)
  mirrored = _mirrored_shapes(shapes, base, opt, pinned) if why is None else {}
  plans, objectives, infeasible = [], {}, []
  with progress.bar(len(shapes) - len(mirrored), "ShardParallel: planning") as shown:
    for shape in shapes:
      if shape in mirrored:
        continue
      name = "x".join(map(str, shape))
      shown.describe(f"ShardParallel: solving mesh {name}")
      lmesh = mesh_for(shape, base, names)
      try:
        plan = _plan_one(step, lmesh, opt, pinned, k, regions, weights, pairs, text, loop)
      except errors.InfeasiblePlanError as e:
        infeasible.append((shape, e))
        continue
      finally:
        shown.advance()
      plans.append(plan)
      objectives[name] = plan.solution.objective
  if not plans:
    raise infeasible[0][1]
  # A plan over the budget (a time limit hit before any within it was found) ranks last.
  best = min(plans, key=lambda p: (p.solution.status == "over_budget", p.solution.objective))
  predictions = [combine.predict(p.graph, p.solution.choice, p.cost_model) for p in plans]
  predicted = predictions[plans.index(best)]
  notes = [f"mesh {_describe(p, pred)}" for p, pred in zip(plans, predictions)]
  notes += [f"mesh {'x'.join(map(str, shape))} infeasible: {e}" for shape, e in infeasible]
  for shape, twin in mirrored.items():
    name, twin_name = "x".join(map(str, shape)), "x".join(map(str, twin))
    if twin_name in objectives:
      objectives[name] = objectives[twin_name]
    notes.append(f"mesh {name} not solved: it is mesh {twin_name} with its axes swapped, and "
                 f"both axes cost the same, so its plans cost the same")
  unknown = {}
  for node in best.graph.nodes:
    if node.eqn is not None and "no rule" in node.strategies[0].name:
      unknown[node.eqn.primitive.name] = unknown.get(node.eqn.primitive.name, 0) + 1
  if unknown:
    notes.append("planned replicated for lack of a sharding rule (XLA places them, so the "
                 "collectives around them may differ from the prediction): "
                 + ", ".join(f"{n} x {name}" for name, n in sorted(unknown.items())))
  notes += _loop_notes(loops, stand_ins)
  notes.append(f"chosen: {'x'.join(map(str, best.lmesh.shape))}, "
               + (f"{why} (no shape search)" if why else
                  f"the lowest predicted step time of {len(shapes)} shapes searched"))
  layout = layout_of(step, best, k)
  if k > 1:
    coupled = batch_coupling(step)
    if coupled:
      # Each micro-batch runs as one program over all devices, as accumulating by hand over
      # the batch's k slices does (per device, a device's share would use its own statistics).
      layout = dataclasses.replace(layout, batch_axes=())
      notes.append(f"the step mixes examples beyond the loss's mean ({coupled}); with "
                   f"num_micro_batches={k} each micro-batch (a 1/{k} slice of the batch) runs "
                   f"as one program over all devices, its collectives (the gradients' "
                   f"reduction too) in every micro-batch")
    predicted = _micro_batch_predictions(step, best, layout, k, loop)
    if not coupled:
      notes.append(f"num_micro_batches={k}: the gradient part runs {k} times (on 1/{k} of the "
                   f"batch each), split over the batch axes {layout.batch_axes}; gradients are "
                   f"reduced over them once, after the loop")
  rolled = None if regions is None else roll(
      rolled_jaxpr, origins, layout.eqn_constraints, layout.operand_constraints)
  if isinstance(rolled, str) and stand_ins:
    # A long scan's stand-in is not the scan: it cannot compile unrolled.
    result = plan_shard_parallel(method, given_step, base, long_scans=False)
    result = dataclasses.replace(result, layout=dataclasses.replace(
        result.layout, notes=result.layout.notes + (
            f"{rolled}; so the scans longer than {jaxpr_util.MAX_UNROLLED_SCAN} iterations "
            f"and the while loops were planned again as XLA places them",)))
    _store_result(opt, digest, plans, result, False)
    return result
  if (isinstance(rolled, str) and not tie_loops and tie_recomputations(
      given_step.closed_jaxpr, in_loops=True) is not given_step.closed_jaxpr):
    result = plan_shard_parallel(method, given_step, base, long_scans, micro_trace, True)
    result = dataclasses.replace(result, layout=dataclasses.replace(
        result.layout, notes=result.layout.notes + (
            "the step was planned again with the recomputations in scan bodies tied to "
            "their cotangents: compiled unrolled, XLA would run them right after the "
            "forward pass",)))
    _store_result(opt, digest, plans, result, long_scans)
    return result
  if isinstance(rolled, str):  # compiled unrolled: collectives combine across iterations
    notes.append(rolled)
    for node in best.graph.nodes:
      node.region = None
    predicted = combine.predict(best.graph, best.solution.choice, best.cost_model)
  if rolled is None or isinstance(rolled, str):
    if any(o is not None and o[0] == "cond" for o in origins):
      notes.append("the conditionals compile as selections: every branch runs")
  else:
    layout = dataclasses.replace(layout, rolled=rolled)
    notes.append("the step compiles with its loops and conditionals kept (the iterations of "
                 "each unrolled scan got the same plan)")
  layout = dataclasses.replace(layout, notes=layout.notes + tuple(notes))
  result = ShardPlanResult(step, layout, best.solution.objective, objectives, predicted,
                           lambda: best, tie_loops)
  _store_result(opt, digest, plans, result, long_scans)
  return result


def _mirrored_shapes(shapes: list, base: LogicalMesh, opt: m.AutoShardingOption,
                     pinned) -> dict[tuple, tuple]:
  """Searched shapes (a, b) with a > b whose mirror (b, a) is searched too, each mapped
  to that mirror, when the cost model cannot tell them apart: every axis has the same α
  and β, and no option or pinned input names an axis. (Both meshes' plans then map onto
  each other by swapping the axes, at equal predicted cost; which devices neighbour
  which is not in the model.)"""
  if pinned is not None or opt.partition_constraints or opt.force_batch_dim_to_mesh_dim is not None:
    return {}
  out = {}
  for shape in shapes:
    twin = shape[::-1]
    if len(shape) == 2 and shape[0] > shape[1] and twin in shapes:
      lmesh = mesh_for(shape, base)
      if len(set(lmesh.alpha)) == 1 and len(set(lmesh.beta)) == 1:
        out[shape] = twin
  return out


def _mesh_key(lmesh: LogicalMesh) -> tuple:
  device = lmesh.devices[0]
  return (lmesh.shape, lmesh.axis_names, lmesh.alpha, lmesh.beta, lmesh.peak_flops,
          device.platform, getattr(device, "device_kind", ""))


def _store_result(opt, digest: str, plans: list[MeshPlan], result: ShardPlanResult,
                  long_scans: bool) -> None:
  """Caches a search's result (not when a solve stopped at its time limit: another run
  may do better)."""
  if not opt.plan_cache or any(p.solution.status in TIME_LIMITED for p in plans):
    return
  layout = result.layout
  cache.store_result(digest, {
      "shape": list(layout.logical_mesh.shape), "long_scans": long_scans,
      "tied": result.tied_loops,
      "rolled": layout.rolled is not None, "objective": result.objective,
      "mesh_objectives": result.mesh_objectives,
      "predicted_collectives": result.predicted_collectives,
      "layout": _encode_layout(layout)})


def _encode_layout(layout: Layout) -> dict:
  def specs(values):
    return None if values is None else [cache.encode(s) for s in values]

  return {"in_specs": specs(layout.in_specs), "out_specs": specs(layout.out_specs),
          "notes": list(layout.notes), "num_micro_batches": layout.num_micro_batches,
          "batch_axes": list(layout.batch_axes),
          "grad_reduce_specs": specs(layout.grad_reduce_specs),
          "eqn_constraints": [[i, specs(v)] for i, v in (layout.eqn_constraints or {}).items()],
          "operand_constraints": [[i, specs(v)]
                                  for i, v in (layout.operand_constraints or {}).items()]}


def _decode_layout(data: dict, lmesh: LogicalMesh) -> Layout | None:
  """The layout :func:`_encode_layout` wrote, or None if ``data`` is not one."""
  def specs(values):
    return None if values is None else tuple(cache.decode(s) for s in values)

  try:
    out_specs = specs(data["out_specs"])
    return Layout(lmesh, specs(data["in_specs"]), out_specs, (None,) * len(out_specs),
                  notes=tuple(data["notes"]), num_micro_batches=data["num_micro_batches"],
                  batch_axes=tuple(data["batch_axes"]),
                  grad_reduce_specs=specs(data["grad_reduce_specs"]),
                  eqn_constraints={i: specs(v) for i, v in data["eqn_constraints"]},
                  operand_constraints={i: specs(v) for i, v in data["operand_constraints"]})
  except (KeyError, TypeError, ValueError):
    return None


def _stand_in_pairs(origins: list, weights: list) -> list[tuple[int, int]]:
  """Pairs of equations (indices) that are one equation of a loop body in the two
  iterations of its stand-in (see ``jaxpr_util.unroll_scans``)."""
  copies = collections.defaultdict(list)
  for i, (origin, weight) in enumerate(zip(origins, weights)):
    if origin is not None and origin[0] == "eqn" and weight != 1:
      copies[origin[1][::2]].append(i)
  return [tuple(c) for c in copies.values() if len(c) == 2]


def recursion_batch(step: TracedStep, num_micro_batches: int) -> frozenset[int] | None:
  """The batch inputs by which ``jaxpr_util.recursions`` tells the loops over time that
  are left rolled, where the step compiles unrolled (with micro-batches); else None."""
  if num_micro_batches <= 1:
    return None
  return frozenset(i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)


def _control_flow(rolled: jex.ClosedJaxpr, stand_ins: bool,
                  kept: frozenset[int] = frozenset()) -> collections.Counter:
  """The loops and conditionals of ``rolled`` (the step with calls inlined) the planner
  sees, by kind: ``"short"`` scans (unrolled), ``"cond"``, ``"scan of N iterations"``
  and ``"while"`` (on stand-ins if ``stand_ins``, else left to XLA with their bodies),
  and ``"recursion of N steps"`` (the top-level scans ``kept`` rolled)."""
  counts = collections.Counter()

  def walk(jaxpr, top=False):
    for i, e in enumerate(jaxpr.eqns):
      name = e.primitive.name
      if name == "scan" and top and i in kept:
        counts[f"recursion of {e.params['length']} steps"] += 1
      elif name == "scan":
        n = e.params["length"]
        counts["short" if n <= jaxpr_util.MAX_UNROLLED_SCAN else f"scan of {n} iterations"] += 1
        if n <= jaxpr_util.MAX_UNROLLED_SCAN or stand_ins:
          walk(e.params["jaxpr"].jaxpr)
      elif name == "cond":
        counts["cond"] += 1
        for branch in e.params["branches"]:
          walk(branch.jaxpr)
      elif name == "while":
        counts["while"] += 1
        if stand_ins:
          walk(e.params["body_jaxpr"].jaxpr)

  walk(rolled.jaxpr, top=True)
  return counts


def _loop_notes(counts: collections.Counter, stand_ins: bool) -> list[str]:
  """What became of the step's loops and conditionals (see :func:`_control_flow`)."""
  notes = []
  counts = collections.Counter(counts)
  if counts.pop("short", 0):
    notes.append(f"scans of at most {jaxpr_util.MAX_UNROLLED_SCAN} iterations are unrolled "
                 f"for planning: each iteration is planned (identical iterations share one "
                 f"solution)")
  if n := counts.pop("cond", 0):
    notes.append(f"{n} conditional(s) planned branch by branch (each branch's work is priced; "
                 f"one runs), their outputs in one layout whichever branch runs")
  recursions = {k: counts.pop(k) for k in list(counts) if k.startswith("recursion")}
  if recursions:
    notes.append("with micro-batches the step compiles unrolled, but these loops over time "
                 f"(more than {jaxpr_util.MAX_UNROLLED_RECURSION} steps, scanning no "
                 "stacked weights) stay loops that XLA places, planned replicated: unrolled, XLA's "
                 "compile time grows faster than their steps: "
                 + ", ".join(f"{n} x {k}" for k, n in recursions.items()))
  loops = ", ".join(f"{n} x {k}" for k, n in counts.items())
  if loops and stand_ins:
    notes.append("planned on two of their iterations, each weighted by half the length (a "
                 "while loop's is unknown: priced as one iteration); the plan repeats in "
                 "every iteration: " + loops)
  elif loops:
    notes.append(f"planned replicated (these loops are not planned inside; XLA places them): "
                 f"{loops}")
  return notes


def _micro_batch_predictions(step: TracedStep, plan: MeshPlan, layout: Layout, k: int,
                             loop=None):
  """Predicted collectives per step with ``k`` micro-batches (``jaxdist.accumulate``).

  The gradient part runs per micro-batch inside a ``shard_map`` that is manual over the
  batch axes: its collectives over the other axes run once per micro-batch (k times as
  many ops, the same bytes), and none runs over the batch axes there. Instead each marked
  value (gradients, loss, aux) is reduced over the batch axes once, after the loop:
  an all-reduce of the device's part, or a reduce-scatter where the layout keeps the
  gradient split over the batch axes. The apply part runs once. ``loop``: the cached
  :class:`MicroBatchLoop` maker, which tells the values that hold the batch's rows (None:
  none is taken to).
  """
  jaxpr = step.closed_jaxpr.jaxpr
  graph, choice, cost_model = plan.graph, plan.solution.choice, plan.cost_model
  marker = jaxpr.eqns[step.marker_index]
  looped = {id(jaxpr.eqns[i]) for i in jaxpr_util.needed_eqns(jaxpr, marker.invars)}
  batch = set(layout.batch_axes)
  sizes = cost_model.axis_sizes
  shards = math.prod(sizes[a] for a in batch)
  inside = lambda node: graph.nodes[node].eqn is not None and id(graph.nodes[node].eqn) in looped

  def kept(node):
    """Mesh axes the node's strategy (or its operands' producers, for a resharding into
    it) still splits a dim over on one device's micro-batch: inside the region a
    constraint keeps an axis only where it divides the dim, and a dim split over a batch
    axis shrinks k x batch shards."""
    node = graph.nodes[node]
    strategy = node.strategies[choice[node.group]]
    have = [graph.spec_of(v, choice) if _produced(v, graph) else None for v in node.eqn.invars]
    out = set()
    for specs, atoms in ((strategy.in_specs, node.eqn.invars), (have, node.eqn.invars),
                         (strategy.out_specs, node.eqn.outvars)):
      for spec, v in zip(specs, atoms):
        shape = getattr(v.aval, "shape", ())
        micro = None
        if loop is not None and not isinstance(v, jex.Literal):
          micro = loop().micro_shapes[v] if loop().varies(v) else shape  # (None: unknown)
        for d, (size, axes) in enumerate(zip(shape, spec or ())):
          if micro is not None and len(micro) == len(shape):
            # (the batch dim, which the micro-batch trace shrinks, is split over the batch
            # axes; another dim the plan split over one too, a projection's heads over
            # both axes, keeps its size and its other axes: 8 heads split 8 ways were
            # taken for 1 per device, and the projection's all-reduce for none)
            if micro[d] != size:
              size = micro[d] // shards
          elif any(a in batch for a in axes):
            size //= k * shards
          rest = [a for a in axes if a not in batch]
          if rest and size % math.prod(sizes[a] for a in rest) == 0:
            out.update(rest)
    return out

  def axes_of(node, axes):
    if not inside(node):
      return axes
    here = kept(node)
    return tuple(a for a in axes if a in here)

  # A value that no batch input reaches (a parameter) is the same in every iteration:
  # XLA hoists it, its collectives and its resharding out of the loop: they run once.
  varies = {graph.producer[v][0] for v in batch_varying(jaxpr, step, list(graph.producer))}
  axes = tuple(a for a in cost_model.axis_sizes if a in batch)
  reduced = {}  # marked value → (kind, axes, bytes) of its collectives after the loop
  producer = {id(o): i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
  for j, (v, spec, each, stays) in enumerate(zip(
      marker.invars, layout.grad_reduce_specs, per_example_outputs(step),
      reduced_outputs(step))):
    if isinstance(v, jex.Literal) or not _produced(v, graph) or shards == 1 or each or not stays:
      continue  # (a per-example aux is concatenated where it is: no reduction)
    local = tuple(tuple(a for a in axes if a not in batch) for axes in graph.spec_of(v, choice))
    nbytes_ = nbytes(v) / num_shards(local, sizes)
    # A gradient constrained to a split over other axes is all-reduced on its shards and
    # sliced, not reduce-scattered (as jaxdist.accumulate does).
    split_inside = producer.get(id(v)) in layout.eqn_constraints and any(local)
    nbytes_ = cost_model.combining.collective_bytes(nbytes_, v.aval.dtype)
    if spec is None or split_inside:
      reduced[j] = [("all-reduce", axes, nbytes_)]
    else:
      reduced[j] = [("reduce-scatter", axes, nbytes_ / shards)]
    gather = gather_after_loop(graph.spec_of(v, choice), layout.batch_axes, nbytes(v), sizes)
    if split_inside and gather is not None:
      kind, over, b = gather
      reduced[j].append((kind, over, cost_model.combining.collective_bytes(b, v.aval.dtype)))
  # A parameter split over a batch axis enters the region gathered over it, once; the
  # loop reads it in that layout.
  gathers, permutes, entered = [], [], {}
  read = {v for e in jaxpr.eqns if id(e) in looped for v in e.invars
          if not isinstance(v, jex.Literal)}
  for v, spec in zip(jaxpr.invars, plan.input_specs):
    if v in read and step.inputs[jaxpr.invars.index(v)].role == PARAM and shards > 1 and any(
        a in batch for axes in spec for a in axes):
      local = tuple(tuple(a for a in axes if a not in batch) for axes in spec)
      gathered = cost_model.combining.collective_bytes(nbytes(v), v.aval.dtype)
      gathers.append(gathered / num_shards(local, sizes))
      entered[graph.producer[v][0]] = local
      permute = permute_on_entry(spec, layout.batch_axes, gathered, sizes)
      permutes += [permute[2]] if permute is not None else []
  # Every batch leaf enters the region split on dim 0 over the batch axes, and over the
  # other axes as the loop's first reader of it wants (the region's auto axes are XLA's
  # to place: a regression target the loss reads split over mesh_1 on its outputs was
  # moved as that block, half the one predicted): a leaf planned otherwise is resharded
  # there, once.
  entry_moves = []
  first_read = {}
  for flow in graph.flows:
    if not flow.tied and inside(flow.dst):
      first_read.setdefault(flow.src, flow.required[choice[graph.nodes[flow.dst].group]])
  for v, spec, leaf in zip(jaxpr.invars, plan.input_specs, step.inputs):
    if leaf.role == BATCH and leaf.shape and v in graph.producer and shards > 1:
      read = first_read.get(graph.producer[v][0])
      if read is not None:  # (an axis that does not divide its dim stays off)
        read = tuple(axes if size % math.prod(sizes[a] for a in axes if a not in batch) == 0
                     else () for size, axes in zip(leaf.shape, read))
      entry = entry_spec(len(leaf.shape), layout.batch_axes, read)
      entry_moves += [(kind, cost_model.combining.collective_bytes(b, v.aval.dtype))
                      for kind, _, b in cost_model.reshard_collectives(spec, entry, nbytes(v))]
      entered[graph.producer[v][0]] = ((),) * len(leaf.shape)
  # Read outside the loop in the layout it entered it with (a parameter gathered for the
  # update too), it is that same gather: XLA computes it once.
  held = lambda flow: entered.get(flow.src) if inside(flow.dst) or (
      flow.src in entered
      and flow.required[choice[graph.nodes[flow.dst].group]] == entered[flow.src]) else None
  # Each marked value is reduced after the loop, where its producer put it: what reads
  # none of them (a metric of the per-example aux) does not wait, and combines with them.
  late = [(*graph.producer[marker.invars[j]], op) for j, ops in reduced.items() for op in ops]
  predicted = combine.predict(
      graph, choice, cost_model,
      repeat=lambda node, kind, axes: k if inside(node) and node in varies else 1,
      axes_of=axes_of, at_source=lambda node: node not in varies, batch_axes=layout.batch_axes,
      extra=late, held=held, after_extra=lambda node: not inside(node),
      rows=lambda node: loop is not None and inside(node) and any(
          loop().scaled(v) for v in graph.nodes[node].eqn.outvars))

  def add(kind, count, result_bytes):
    entry = predicted.setdefault(kind, {"count": 0, "result_bytes": 0.0})
    entry["count"] += count
    entry["result_bytes"] += result_bytes

  if gathers:
    add("all-gather", cost_model.combining.count("all-gather", gathers), sum(gathers))
  if permutes:
    add("collective-permute", len(permutes), sum(permutes))
  for kind, b in entry_moves:
    add(kind, 1, b)
  if not layout.batch_axes:
    # Run as one program over all devices, each batch leaf is moved once, before the loop,
    # so that every 1/k slice is split as its rows were (jaxdist.accumulate): XLA moves the
    # leaf's split dimension by an all-to-all and puts its parts in order by a permute.
    for v, spec, leaf in zip(jaxpr.invars, plan.input_specs, step.inputs):
      if leaf.role == BATCH and leaf.shape and num_shards(spec[:1], sizes) > 1:
        moved = cost_model.combining.collective_bytes(nbytes(v) / num_shards(spec, sizes),
                                                      v.aval.dtype)
        add("all-to-all", 1, moved)
        add("collective-permute", 1, moved)
  if shards > 1 and token_weighted(step):
    # The micro-batches' token counts, summed beside the gradients after the loop (these
    # are divided by it after their reduction): in their all-reduce where there is one.
    add("all-reduce", 0 if any(c[0] == "all-reduce" for _, _, c in late) else 1, 4.0)
  return predicted


def communication_seconds(plan: MeshPlan) -> float:
  """The communication part of a solved plan's objective (collectives and resharding,
  with one α per combined group)."""
  graph, choice, cost_model = plan.graph.priced(), plan.solution.choice, plan.cost_model
  seconds = sum(cost_model.collective(*c) for _, c in graph.collectives(choice, cost_model))
  return seconds + (graph.combine.charge(choice) if graph.combine is not None else 0.0)


def _describe(plan: MeshPlan, predicted: dict) -> str:
  """``2x4 ('a', 'b'): 0.41 ms predicted, 0.12 ms of it communication (2 all-reduce)``."""
  ops = ", ".join(f"{int(c['count'])} {kind}" for kind, c in sorted(predicted.items())) or "none"
  return (f"{'x'.join(map(str, plan.lmesh.shape))} {plan.lmesh.axis_names}: "
          f"{plan.solution.objective * 1e3:.4g} ms predicted, "
          f"{communication_seconds(plan) * 1e3:.4g} ms of it communication ({ops})"
          + ("; over the memory budget: the solver's time limit ended before it found a plan "
             "within it" if plan.solution.status == "over_budget" else ""))


def _input_choices(step: TracedStep, lmesh: LogicalMesh, opt: m.AutoShardingOption,
                   pinned: dict[int, DimAxes] | None = None, num_micro_batches: int = 1):
  sizes = dict(zip(lmesh.axis_names, lmesh.shape))
  if pinned is not None:
    return {k: [spec] for k, spec in pinned.items()}
  names = lmesh.axis_names
  choices = {}
  constraints = opt.partition_constraints or {}
  unused = set(constraints)
  for k, leaf in enumerate(step.inputs):
    specs = enumerate_specs(leaf.shape, sizes)
    pinned = [pattern for pattern in constraints if path_matches(pattern, leaf.path)]
    unused -= set(pinned)
    if pinned:
      pspec = constraints[pinned[0]]
      spec = _validated_constraint(pinned[0], pspec, leaf, lmesh)
      choices[k] = [spec]
      continue
    if leaf.role == BATCH:
      if opt.force_data_parallel:
        # (a batch-role leaf without a splittable dim 0, a scalar say, keeps its choices)
        specs = [s for s in specs
                 if s and set(s[0]) == {a for a in names if sizes[a] > 1}] or specs
      elif opt.force_batch_dim_to_mesh_dim is not None:
        axis = names[opt.force_batch_dim_to_mesh_dim]
        specs = [s for s in specs if s and axis in s[0]] or specs
      if num_micro_batches > 1:
        # Each device's share of the batch must split into the micro-batches.
        fitting = [s for s in specs
                   if leaf.shape[0] % (num_shards(s[:1], sizes) * num_micro_batches) == 0]
        if not fitting:
          raise errors.BatchDivisibilityError(
              f"batch argument leaf {leaf.path} has shape {leaf.shape}: on mesh {lmesh.shape} no "
              f"allowed split of dim 0 leaves each device a multiple of num_micro_batches="
              f"{num_micro_batches} examples; use a batch size that is a multiple of "
              f"{num_micro_batches * lmesh.num_devices}.")
        # Micro-batches run in a shard_map over the mesh axes splitting dim 0, with
        # gradients reduced once after the loop; an unsplit batch would leave the
        # reductions to XLA inside the loop, once per micro-batch. The leaf enters it
        # split on dim 0 alone (``micro.entry_spec``): a split of another dim would be
        # gathered there, so none is offered (fewer choices keep the ILP small).
        specs = ([s for s in fitting if s[0] and not any(s[1:])]
                 or [s for s in fitting if s[0]] or fitting)
    elif leaf.role in (PARAM, OPTIMIZER):
      if opt.force_data_parallel:
        specs = [s for s in specs if not any(s)]
      else:
        must_shard = ((not opt.allow_replicated_parameters and leaf.role == PARAM)
                      or (opt.force_zero_stage_3)
                      or (opt.prefer_reduce_scatter and leaf.role == OPTIMIZER))
        if must_shard and len(specs) > 1:
          specs = [s for s in specs if any(s)]
    choices[k] = specs
  if unused:
    pattern = sorted(unused)[0]
    raise errors.InvalidArgumentError(
        f"partition_constraints pattern {pattern!r} matches no leaf; "
        f"{pattern_help(pattern, [leaf.path for leaf in step.inputs])}")
  return choices


def pattern_help(pattern: str, paths) -> str:
  """How patterns match, a few example paths, and the pattern with ``*`` at both ends
  if that would match (``*kernel`` misses ``...['kernel']`` by its closing ``']``)."""
  paths = list(paths)
  text = (f"patterns match whole leaf paths with * and ? as wildcards, e.g. "
          f"{', '.join(paths[:3])}.")
  wider = "*" + pattern.strip("*") + "*"
  if wider != pattern and any(path_matches(wider, p) for p in paths):
    text += f" Did you mean {wider!r}?"
  return text


def path_matches(pattern: str, path: str) -> bool:
  """Glob match of a leaf path: ``*`` and ``?`` are wildcards, brackets are literal
  (leaf paths are full of them: ``state.params['Dense_0']['kernel']``)."""
  return _glob(pattern).fullmatch(path) is not None


@functools.lru_cache(maxsize=4096)
def _glob(pattern: str) -> re.Pattern:
  """The compiled regex of a leaf-path pattern (a pipeline's update programs pin every
  state leaf by its path: leaves × pins matches per plan)."""
  return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c)
                            for c in pattern))


def _validated_constraint(pattern, pspec, leaf, lmesh) -> DimAxes:
  if not isinstance(pspec, PartitionSpec) or len(pspec) > len(leaf.shape):
    raise errors.InvalidArgumentError(
        f"partition_constraints[{pattern!r}] = {pspec!r} for {leaf.path} {leaf.shape}: give a "
        f"PartitionSpec with at most {len(leaf.shape)} entries.")
  spec = from_partition_spec(pspec, len(leaf.shape))
  sizes = dict(zip(lmesh.axis_names, lmesh.shape))
  named = [a for axes in spec for a in axes]
  unknown = [a for a in named if a not in sizes]
  if unknown:
    raise errors.InvalidArgumentError(
        f"partition_constraints[{pattern!r}] = {pspec!r} names mesh axis {unknown[0]!r}; the "
        f"logical mesh {lmesh.shape} has axes {lmesh.axis_names}.")
  twice = sorted({a for a in named if named.count(a) > 1})
  if twice:
    raise errors.InvalidArgumentError(
        f"partition_constraints[{pattern!r}] = {pspec!r} splits more than one dimension over "
        f"mesh axis {twice[0]!r}; each axis may split at most one dimension of a leaf.")
  if not divides(leaf.shape, spec, sizes):
    raise errors.InvalidArgumentError(
        f"partition_constraints[{pattern!r}] = {pspec!r} does not divide {leaf.path} of shape "
        f"{leaf.shape} on mesh {dict(sizes)}.")
  return spec


def _loop_regions(origins: list) -> list | None:
  """Per equation of the unrolled jaxpr, the loop iteration or conditional branch it runs
  in once the step is compiled with its scans rolled (None: outside them); None if
  nothing was unrolled."""
  regions, any_loop = [], False
  for origin in origins:
    if origin is None or (origin[0] == "eqn" and len(origin[1]) == 1):
      regions.append(None)
      continue
    any_loop = True
    kind, path = origin[0], origin[1]
    region = path[:-1] if kind == "eqn" else path + (origin[2],) if kind == "xs" else path[:-1]
    regions.append(region or None)
  if not any_loop:
    return None
  # A scan of one iteration is no loop once compiled (XLA inlines its body): its
  # collectives combine with those around it (a one-block scanned GPT: predicted 2
  # all-reduces where XLA compiled 1). (A conditional's branch is ``((i, b), 0)``.)
  iterations: dict = {}
  looped = lambda region: region is not None and len(region) >= 2 and isinstance(region[-2], int)
  for region in regions:
    while looped(region):
      iterations.setdefault(region[:-1], set()).add(region[-1])
      region = region[:-2]

  def outer(region):
    while looped(region) and len(iterations[region[:-1]]) == 1:
      region = region[:-2]
    return region or None

  return [outer(region) if region else None for region in regions]


def _plan_one(step: TracedStep, lmesh: LogicalMesh, opt: m.AutoShardingOption,
              pinned: dict[int, DimAxes] | None = None, num_micro_batches: int = 1,
              regions: list | None = None, weights: list | None = None,
              pairs=(), jaxpr_text: str | None = None,
              loop: Callable[[], MicroBatchLoop] | None = None) -> MeshPlan:
  """Solves (or loads from the plan cache) the plan on one mesh. ``loop`` returns the
  micro-batch loop to price (traced at the micro-batch size: only when solving)."""
  jaxpr = step.closed_jaxpr.jaxpr
  cost_model = CostModel(lmesh, allow_all_gather=opt.allow_all_gather,
                         allow_all_to_all=opt.allow_all_to_all,
                         combining=combining_for(lmesh.devices[0].platform),
                         peak_flops=lmesh.peak_flops)
  tied = {o: i for o, i in enumerate(step.output_source) if i is not None}
  batch = frozenset(k for k, leaf in enumerate(step.inputs) if leaf.role == BATCH)
  graph = build_graph(jaxpr, cost_model,
                      _input_choices(step, lmesh, opt, pinned, num_micro_batches), tied, batch,
                      regions, weights, loop, priced=False,
                      state_inputs=frozenset(k for k, leaf in enumerate(step.inputs)
                                             if leaf.role == OPTIMIZER))
  digest = cache.key(jaxpr_text or str(step.closed_jaxpr),
                     [(l.shape, str(l.dtype), l.role) for l in step.inputs], _mesh_key(lmesh),
                     opt, pinned, num_micro_batches, tied, regions is not None, loop is not None)
  solution = loaded = cache.load(digest, len(graph.group_sizes)) if opt.plan_cache else None
  memory = None
  if solution is None:
    if opt.memory_budget_per_device is not None:
      memory = memory_constraint(jaxpr, graph, step, lmesh, graph.loop)
    # A stand-in's two iterations always share one plan: the loop compiles with one body.
    ties = (tie_groups(jaxpr, graph, pairs=pairs) if opt.share_repeated_layers else
            tie_groups(jaxpr, graph, None, pairs) if pairs else None)
    free = sum(1 for n in graph.group_sizes if n > 1)
    log.info("solving mesh %s %s: %d equations, %d choice groups (%d after tying repeats)",
             lmesh.shape, lmesh.axis_names, len(jaxpr.eqns), free,
             free if ties is None else len({ties[g] for g, n in enumerate(graph.group_sizes)
                                            if n > 1}))
    start = time.perf_counter()
    solution = solve_ilp(graph.priced(), memory, opt.memory_budget_per_device,
                         opt.solver_time_limit_s, ties)
    if memory is not None and opt._loop_buffers and graph.loop is not None:
      solution, memory = _with_loop_buffers(jaxpr, graph, step, lmesh, opt, ties, solution,
                                            memory)
    log.info("mesh %s solved in %.2f s: %.4g ms predicted (%s)", lmesh.shape,
             time.perf_counter() - start, solution.objective * 1e3, solution.status)
  if jax.process_count() > 1:  # a time limit or a cached solution may differ per process
    choice, objective, status = agree.process_zeros(
        [list(solution.choice), solution.objective, solution.status])
    solution = Solution(tuple(choice), objective, status)
  if opt.plan_cache and solution != loaded and solution.status not in TIME_LIMITED:
    cache.store(digest, solution)
  if memory is not None:
    log.info("mesh %s: the plan's peak by the planner's memory model: %.0f bytes per device "
             "(budget %.0f)", lmesh.shape, memory.usage(solution.choice),
             opt.memory_budget_per_device)
  input_specs = tuple(graph.spec_of(v, solution.choice) for v in jaxpr.invars)
  return MeshPlan(lmesh, graph, solution, input_specs, cost_model)


def _with_loop_buffers(jaxpr, graph: StrategyGraph, step: TracedStep, lmesh: LogicalMesh,
                       opt: m.AutoShardingOption, ties, solution: Solution,
                       memory: MemoryConstraint) -> tuple[Solution, MemoryConstraint]:
  """The solution re-solved with the micro-batch loop's buffers in the memory model.

  Their sizes depend on which mesh axes split the batch, itself a choice of the ILP (a
  product of choices, not linear), so they are sized for the batch axes of the solution
  at hand and solved again until those axes hold (twice at most). Their rows (the copies
  on edge variables) make the branch and bound much slower near the budget (on a (2, 4)
  GPT at 0.42x DataParallel's bytes: 4 s without them, 60-165 s with), so each solve
  takes the best plan found in ``LOOP_BUFFERS_TIME_LIMIT_S`` (or the option's limit). If
  no plan fits with the batch split that way, or none is found in time, the solution
  without them is kept: the compiled bytes decide (``ParallelizedFunc`` re-plans with a
  tighter budget, and warns if none fits)."""
  budget = opt.memory_budget_per_device
  axes = _batch_axes(step, tuple(graph.spec_of(v, solution.choice) for v in jaxpr.invars))
  tried = set()
  while axes not in tried and len(tried) < 2:
    tried.add(axes)
    held = memory_constraint(jaxpr, graph, step, lmesh, graph.loop, axes)
    if held.usage(solution.choice) <= budget:
      return solution, held
    try:
      if held.least_possible() > budget:
        raise errors.InfeasiblePlanError("")
      with warnings.catch_warnings():  # (a time limit of our own: the best plan found)
        warnings.simplefilter("ignore")
        found = solve_ilp(graph.priced(), held, budget,
                          opt.solver_time_limit_s or LOOP_BUFFERS_TIME_LIMIT_S, ties)
      if held.usage(found.choice) > budget:  # none found in time
        raise errors.InfeasiblePlanError("")
    except (errors.InfeasiblePlanError, RuntimeError):  # (RuntimeError: none found in time)
      log.warning("mesh %s: no plan found keeps the micro-batch loop's accumulators and "
                  "gathered inputs within the budget with the batch split over %s; the plan "
                  "without them is kept", lmesh.shape, axes)
      return solution, memory
    solution, memory = found, held
    axes = _batch_axes(step, tuple(graph.spec_of(v, solution.choice) for v in jaxpr.invars))
  return solution, memory


def memory_constraint(jaxpr, graph: StrategyGraph, step: TracedStep, lmesh: LogicalMesh,
                      loop: MicroBatchLoop | None = None,
                      batch_axes: tuple[str, ...] | None = None) -> MemoryConstraint:
  """Per-device bytes at the heaviest positions of the step's timeline, linear in the
  choices (inside a micro-batch ``loop``, a value holds one micro-batch's share of its
  bytes). Counting every value from its equation to its last reader instead, as this
  did before, put model-parallel GPT plans 10-12% over their compiled bytes (so a budget
  ruled out plans that fit it); the timeline's buffers are within 7% on them.

  ``batch_axes``: the mesh axes the ``loop``'s micro-batches are split over, if known
  (see ``_loop_buffers``: the accumulators and gathered parameters the loop keeps)."""
  sizes = dict(zip(lmesh.axis_names, lmesh.shape))
  inputs = set(jaxpr.invars)
  share = lambda v: loop.fraction(v) if loop is not None and v not in inputs else 1.0
  timeline = Timeline(jaxpr, lambda v: nbytes(v) * share(v), lmesh.devices[0].platform)
  n = len(timeline.eqns)
  # (the value whose layout sizes it, start, end, unsharded bytes, how it is sized: None
  # by its layout, LOCAL by its layout without the batch axes, GATHERED likewise but
  # only where the layout splits it over a batch axis)
  buffers = []
  for label, (start, end, b) in timeline.buffers.items():
    buffers.append((label[1] if isinstance(label, tuple) else label, start, end, b, None))
  buffers += [(v, -1, n, nbytes(v), None) for v in jaxpr.invars]
  held = loop is not None and batch_axes is not None and step.marker_index is not None
  if held:
    buffers = _loop_buffers(jaxpr, step, loop, timeline, buffers)
  local = {a: 1 if a in (batch_axes or ()) else s for a, s in sizes.items()}
  batch = set(batch_axes or ())

  def on_device(b, spec, kind):
    if kind == GATHERED and not batch & used_axes(spec):
      return 0.0
    return b / num_shards(spec, sizes if kind is None else local)
  made = {v: timeline.position[id(e)] for e in jaxpr.eqns for v in e.outvars
          if id(e) in timeline.position}
  for o, v in enumerate(jaxpr.outvars):  # output buffers, but for the donated state's
    if step.output_source[o] is None and v in made:
      buffers.append((v, made[v], n, nbytes(v), None))
  devices = math.prod(lmesh.shape)
  extra = [x / devices for x in timeline.extra]  # loop bodies' own peaks, split evenly
  live = np.zeros(n + 1)
  for _, start, end, b, _ in buffers:
    live[max(start, 0):min(end, n) + 1] += b
  live[:n] += extra
  copies = _hoisted_copies(jaxpr, graph, step, loop, timeline, sizes) if held else []
  per_group, constant, per_edge = [], [], []
  for t in sorted(np.argsort(-live)[:MEMORY_CHECK_POINTS].tolist()):
    groups: dict[int, np.ndarray] = {}
    pairs: dict[tuple[int, int], np.ndarray] = {}
    fixed = extra[t] if t < n else 0.0
    for (g, h), start, end, m in copies:
      if not start <= t <= end:
        continue
      if g == h:
        groups[g] = groups.get(g, 0) + np.diag(m)
      elif graph.group_sizes[g] == 1 or graph.group_sizes[h] == 1:
        vec = m[0, :] if graph.group_sizes[g] == 1 else m[:, 0]
        if len(vec) == 1:
          fixed += float(vec[0])
        else:
          k = h if graph.group_sizes[g] == 1 else g
          groups[k] = groups.get(k, 0) + vec
      else:
        pairs[g, h] = pairs.get((g, h), 0) + m
    for v, start, end, b, kind in buffers:
      if not start <= t <= end:
        continue
      if v not in graph.producer:
        fixed += b if kind is None else 0.0  # (the loop's buffers are of planned values)
        continue
      node_id, pos = graph.producer[v]
      node = graph.nodes[node_id]
      vec = np.array([on_device(b, s.out_specs[pos], kind) for s in node.strategies])
      if graph.group_sizes[node.group] == 1:
        fixed += float(vec[0])
      else:
        groups[node.group] = groups.get(node.group, 0) + vec
    per_group.append(groups)
    constant.append(fixed)
    per_edge.append(pairs)
  return MemoryConstraint(tuple(per_group), tuple(constant), tuple(per_edge))


def _hoisted_copies(jaxpr, graph: StrategyGraph, step: TracedStep, loop: MicroBatchLoop,
                    timeline: Timeline, sizes: dict[str, int]) -> list:
  """The resharded copies of :func:`hoisted_flows`, as ((source group, reader group),
  start, end, bytes per pair of their choices): live from the program's start to the
  reader (to the loop's end for a reader inside it). Measured on a GPT whose Adam
  moments the plan split but updated whole: the 31 all-gathers of ``b1 * mu`` and
  ``b2 * nu`` ran before the loop and held 100 MB through it, which put the plan 50% over
  the memory model that left them out."""
  pm = timeline.position.get(id(jaxpr.eqns[step.marker_index]))
  if pm is None:
    return []
  copies = []
  for flow in hoisted_flows(jaxpr, graph, step, lambda e: id(e) in timeline.position):
    src, dst = graph.nodes[flow.src], graph.nodes[flow.dst]
    m = np.zeros((graph.group_sizes[src.group], graph.group_sizes[dst.group]))
    for a, strategy in enumerate(src.strategies[:m.shape[0]]):
      for b, want in enumerate(flow.required[:m.shape[1]]):
        if want is not None and want != strategy.out_specs[flow.pos]:
          m[a, b] = flow.full_bytes / num_shards(want, sizes)
    if m.any():
      end = pm if loop.runs_in_loop(dst.eqn) else timeline.position[id(dst.eqn)]
      copies.append(((src.group, dst.group), -1, end, m))
  return copies


def hoisted_flows(jaxpr, graph: StrategyGraph, step: TracedStep, in_program) -> list:
  """The flows into readers (equations where ``in_program(eqn)``) of values no batch
  input reaches: parameters, optimizer state and what is computed from them alone, but
  not constants (XLA makes those in any layout where they are read). Where the reader
  wants another layout than the source's, XLA computes the copy before the micro-batch
  loop and keeps it to its reader: on XLA:CPU every all-gather of such a value came at the
  start of the program."""
  sources = {}
  for flow in graph.flows:
    src, dst = graph.nodes[flow.src], graph.nodes[flow.dst]
    if (flow.tied or dst.eqn is None or not in_program(dst.eqn)
        or (src.eqn is None and src.input_index is None)):  # (a constant of the jaxpr)
      continue
    v = jaxpr.invars[src.input_index] if src.eqn is None else src.eqn.outvars[flow.pos]
    sources.setdefault(v, []).append(flow)
  batch = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
  values = [v for v in sources if not isinstance(v, jex.Literal)]
  reads = dict(zip(values, jaxpr_util.dependencies(jaxpr, len(step.inputs), values)))
  return [flow for v, flows in sources.items() if reads.get(v) and not reads[v] & batch
          for flow in flows]


LOCAL, GATHERED = "local", "gathered"


def _loop_buffers(jaxpr, step: TracedStep, loop: MicroBatchLoop, timeline: Timeline,
                  buffers: list) -> list:
  """``buffers`` as the micro-batch loop keeps them (``jaxdist.accumulate`` runs it per
  shard of the batch axes, which its values are local to):

  - each gradient is added into an accumulator of its layout less the batch axes, live
    from the loop's first equation to the gradient marker; after the loop it holds its
    own layout (reduced over the batch axes) until its last reader, and inside the
    loop each micro-batch's gradient dies where it is added;
  - an input the loop reads whose layout splits it over a batch axis enters the loop
    gathered over those axes, for the whole loop (XLA hoists the gather out of it).
  """
  marker = jaxpr.eqns[step.marker_index]
  where = [timeline.position[id(e)] for e in jaxpr.eqns
           if loop.runs_in_loop(e) and id(e) in timeline.position]
  if not where or id(marker) not in timeline.position:
    return buffers
  first, pm = min(where), timeline.position[id(marker)]
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  grads = {timeline.buffer_of(v): v for v in marker.invars
           if not isinstance(v, jex.Literal) and loop.runs_in_loop(producers.get(v))}
  out = []
  for v, start, end, b, kind in buffers:
    g = grads.get(v)
    if g is None or start < 0:
      out.append((v, start, end, b, kind))
      continue
    out += [(g, start, start, b, LOCAL), (g, first, pm, b, LOCAL), (g, pm, end, b, None)]
  read = {v for e in jaxpr.eqns if loop.runs_in_loop(e) for v in e.invars
          if not isinstance(v, jex.Literal)}
  for v, leaf in zip(jaxpr.invars, step.inputs):
    if leaf.role != BATCH and v in read:
      out.append((v, first, pm, nbytes(v), GATHERED))
  return out


def layout_of(step: TracedStep, plan: MeshPlan, num_micro_batches: int = 1) -> Layout:
  """Turns a solved plan into the Layout the compiler applies.

  With ``num_micro_batches > 1`` the batch axes are the mesh axes splitting the
  largest batch leaf's dim 0, and each gradient is reduce-scattered over them where
  the plan splits one of its dims over them first (all-reduced otherwise).
  """
  jaxpr = step.closed_jaxpr.jaxpr
  graph, choice = plan.graph, plan.solution.choice
  in_specs = tuple(to_partition_spec(s) for s in plan.input_specs)
  out_specs = []
  for o, v in enumerate(jaxpr.outvars):
    src = step.output_source[o]
    if src is not None:
      out_specs.append(in_specs[src])
    elif isinstance(v, jex.Literal) or v not in graph.producer:
      out_specs.append(PartitionSpec())
    else:
      out_specs.append(to_partition_spec(graph.spec_of(v, choice)))
  # Pin the output of every equation the plan decided (as Alpa does): left to itself,
  # XLA's propagation may place followers differently (an optimizer update computed
  # replicated and then gathered, say). Equations with no rule are left to XLA, and so
  # are the insides of elementwise chains (each constraint costs compile time).
  eqn_index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
  constraints = {}
  for node in graph.nodes:
    if node.eqn is None or graph.group_sizes[node.group] == 1 or "no rule" in node.strategies[0].name:
      continue
    strategy = node.strategies[choice[node.group]]
    constraints[eqn_index[id(node.eqn)]] = tuple(to_partition_spec(s) for s in strategy.out_specs)
  for i in _inside_chains(jaxpr, constraints):
    del constraints[i]
  # Pin the operands the plan reshards too: left to itself, XLA may partition the
  # consumer another way (gather the other operand of a dot instead, say), which the
  # plan did not price.
  operands: dict[int, list] = {}
  kept, moved = [], set()  # flows reading their value as made; values resharded
  for flow in graph.flows:
    node = graph.nodes[flow.dst]
    if flow.tied or node.eqn is None or "no rule" in node.strategies[0].name:
      continue
    want = flow.required[choice[node.group]]
    src = graph.nodes[flow.src]
    if want is None or want == src.strategies[choice[src.group]].out_specs[flow.pos]:
      kept.append(flow)
      continue
    specs = operands.setdefault(eqn_index[id(node.eqn)], [None] * len(node.eqn.invars))
    specs[flow.operand] = to_partition_spec(want)
    moved.add((flow.src, flow.pos))
    # The value resharded keeps the plan's layout where it is produced, even where the
    # plan had no choice to make there: else XLA may carry the resharded layout back to
    # it, and its other readers would see that one (a gather's split token ids read
    # split by the embedding gradient's scatter too, partitioned with an all-reduce).
    # Not a rearrangement, which XLA makes from the moved copy of its operand instead.
    if (src.eqn is not None and "no rule" not in src.strategies[0].name
        and src.eqn.primitive.name not in REARRANGING):
      constraints.setdefault(eqn_index[id(src.eqn)], tuple(
          to_partition_spec(s) for s in src.strategies[choice[src.group]].out_specs))
  # The other readers of a value so pinned read it as made too: left to themselves, XLA
  # may have them read the moved copy (a GPT's position-embedding gradient summed from
  # the copy of the embeddings' gradient that the token table's scatter reads split
  # another way, then all-gathered, where the plan all-reduces the sum of the value as
  # made). (A parameter's readers are left alone: the plan has XLA reuse its gathered
  # copy, for a convolution's reversed kernel, say.)
  for flow in kept:
    node, src = graph.nodes[flow.dst], graph.nodes[flow.src]
    if ((flow.src, flow.pos) in moved and flow.operand is not None and src.eqn is not None
        and "no rule" not in src.strategies[0].name
        and src.eqn.primitive.name not in REARRANGING):
      specs = operands.setdefault(eqn_index[id(node.eqn)], [None] * len(node.eqn.invars))
      if specs[flow.operand] is None:
        specs[flow.operand] = to_partition_spec(
            src.strategies[choice[src.group]].out_specs[flow.pos])
  # With micro-batches a top-level scan is a loop over time left rolled (see
  # ``jaxpr_util.recursions``), planned replicated: pinned so, operands and results, or
  # XLA partitions its body after its readers (a GRU's, split over the micro-batch's
  # examples, all-reduced its kernels' gradients in every backward step: 51 all-reduces
  # compiled, 3 predicted).
  if num_micro_batches > 1:
    for node in graph.nodes:
      if node.eqn is not None and node.eqn.primitive.name == "scan":
        strategy = node.strategies[choice[node.group]]
        i = eqn_index[id(node.eqn)]
        constraints[i] = tuple(to_partition_spec(s) for s in strategy.out_specs)
        operands[i] = [None if isinstance(v, jex.Literal) else to_partition_spec(s)
                       for v, s in zip(node.eqn.invars, strategy.in_specs)]
  operand_constraints = {i: tuple(specs) for i, specs in operands.items()}
  batch_axes, reduce_specs = plan.lmesh.axis_names, None
  if num_micro_batches > 1:
    batch_axes = _batch_axes(step, plan.input_specs)
    sizes = dict(zip(plan.lmesh.axis_names, plan.lmesh.shape))
    check_batch_divisible(step, num_micro_batches * math.prod(sizes[a] for a in batch_axes),
                          f"num_micro_batches={num_micro_batches} x the batch shards of the plan")
    marker = jaxpr.eqns[step.marker_index]
    reduce_specs = tuple(
        _reduce_spec(graph.spec_of(v, choice), batch_axes) if _produced(v, graph) else None
        for v in marker.invars)
  return Layout(plan.lmesh, in_specs, tuple(out_specs), (None,) * len(out_specs),
                num_micro_batches=num_micro_batches, batch_axes=batch_axes,
                grad_reduce_specs=reduce_specs, eqn_constraints=constraints,
                operand_constraints=operand_constraints)


def _inside_chains(jaxpr, constraints: dict) -> list[int]:
  """Constrained elementwise equations whose every reader is an elementwise equation of
  the same shape constrained to the same spec: XLA's propagation carries the reader's
  sharding back to them (the prediction tests check the compiled collectives). Dropping
  their constraints halves the constraints of a GPT step and its compile's overhead."""
  readers: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jex.Literal):
        readers.setdefault(v, []).append(i)
  outputs = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}

  def elementwise(i):
    eqn = jaxpr.eqns[i]
    return i in constraints and eqn.primitive.name in ELEMENTWISE and len(eqn.outvars) == 1

  inside = []
  for i in constraints:
    if not elementwise(i) or jaxpr.eqns[i].outvars[0] in outputs:
      continue
    out = jaxpr.eqns[i].outvars[0]
    users = readers.get(out, [])
    if users and all(elementwise(j) and constraints[j] == constraints[i]
                     and jaxpr.eqns[j].outvars[0].aval.shape == out.aval.shape for j in users):
      inside.append(i)
  return inside


def _produced(v, graph: StrategyGraph) -> bool:
  return not isinstance(v, jex.Literal) and v in graph.producer


def _batch_axes(step: TracedStep, input_specs: tuple[DimAxes, ...]) -> tuple[str, ...]:
  """The mesh axes splitting dim 0 of the largest batch leaf (micro-batches run over them)."""
  batch = [(math.prod(leaf.shape), k) for k, leaf in enumerate(step.inputs)
           if leaf.role == BATCH and leaf.shape]
  if not batch:
    return ()
  return tuple(input_specs[max(batch)[1]][0])


def _reduce_spec(spec: DimAxes, batch_axes: tuple[str, ...]) -> PartitionSpec | None:
  """The reduce-scatter result spec for a gradient planned as ``spec``, or None (psum)."""
  d = reduce_dim(spec, batch_axes)
  if d is None:
    return None
  return PartitionSpec(*([None] * d), batch_axes if len(batch_axes) > 1 else batch_axes[0])
