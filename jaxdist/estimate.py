"""``jaxdist.estimate``: memory and step time per device from a method's plan, before
anything compiles.

Memory is what XLA's ``memory_analysis`` adds up (arguments + outputs − donated +
temporaries), per device:

- arguments and outputs from the layout: each leaf's bytes over its shards, by role;
- temporaries from a liveness walk (``jaxdist.liveness``) of the program one device
  runs: the step at its per-device batch for DataParallel and ZeRO (the layout splits
  the batch over every device), the planner's program with each value at its planned
  shard for ShardParallel. The walk adds what the collectives allocate, as XLA lowers
  them on this backend: combined all-reduces keep every operand until the last one is
  ready and then allocate all results; a reduce-scatter (ZeRO) frees each gradient as
  it is produced; gradient accumulation keeps one accumulator of local gradients; a
  ZeRO-3 parameter is gathered around each equation reading it; a micro-batched shard
  plan's copies of values no batch input reaches (a moment split but updated whole) are
  made before the loop and kept to their reader.

Step time is compute (dot and convolution flops at the device's peak, times a factor
fitted by :func:`calibrate` where a profile exists) plus the plan's collectives under the
mesh's α-β costs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any

import jax.extend.core as jex

from jaxdist import calibration
from jaxdist import jaxpr_util
from jaxdist import methods as m
from jaxdist.accumulate import HEAVY, per_example_outputs, reduced_outputs, split_at_marker
from jaxdist.coupling import token_weighted
from jaxdist.grad import GRAD
from jaxdist.liveness import Timeline
from jaxdist.mesh import LogicalMesh, device_costs
from jaxdist.shard.cost import CostModel, combining_for
from jaxdist.shard.graph import REARRANGING
from jaxdist.shard.specs import from_partition_spec, num_shards
from jaxdist.shard.strategies import ELEMENTWISE, REDUCTIONS, nbytes
from jaxdist.trace import BATCH, INPUT, OPTIMIZER, PARAM, gc_paused, with_micro_batch_trace

ROLE_KEYS = {PARAM: "params", OPTIMIZER: "optimizer", BATCH: "batch"}
# Equations a gradient passes through unchanged but for its layout, or summed with another.
PASSING_GRADIENTS = REARRANGING | {"reshape", "squeeze", "expand_dims", "add_any"}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What a step will need per device, estimated from its plan (no XLA compile).

  Attributes:
    method: the method's name.
    memory_per_device: bytes at the peak, as arguments + outputs − donated +
      temporaries (the figure ``Executable.get_total_allocation_size`` reports).
    breakdown: bytes by part, summing to ``memory_per_device``: ``params``,
      ``optimizer``, ``batch`` and ``other`` (other inputs and outputs not donated) as
      the layout stores them; ``grads`` (gradient buffers live at the peak: local,
      reduced, accumulated), ``activations`` (forward values kept for the backward,
      live at the peak) and ``temporaries`` (the rest live at the peak).
    step_time_s: ``compute_s + communication_s``.
    compute_s: flops of dots and convolutions per device over the peak (calibrated).
    communication_s: the predicted collectives under the mesh's α-β costs (the
      calibration profile's measured ones where the mesh has its device kind's defaults,
      plus the devices' waits at the collectives that the profile measured).
    collectives: kind → {"count", "result_bytes"} per step and device, predicted.
    plan: the method's plan (ShardParallel: the chosen mesh and specs).
    notes: how the figures were made (calibration, approximations).
    compiled: with ``compile=True``: XLA's ``argument``, ``output``, ``alias``,
      ``temp`` and ``total`` bytes per device for the same plan; else None.
    flops: dot and convolution flops per device and step.
    kernels: the values one device's program writes (each roughly a kernel XLA runs; with
      micro-batches, one micro-batch's program, counted once per step): the calibration
      charges each a fitted time, what a step of many small ops is made of.
    bytes_accessed: bytes per device and step that buffers write (each non-fused value
      once) plus the state and batch read.
    approximate: True where the memory model is known to be loose (DataParallel/ZeRO on
      a step whose gradient jaxdist does not see, see ``jaxdist.grad`` and ``notes``);
      tuning does not skip candidates on such estimates.
    stages: PipeshardParallel: one :class:`StageEstimate` per stage (the figures above
      are the stage with the largest memory_per_device; times are the pipelined step's).
    compiled_collectives: with ``compile=True``: the compiled step's collectives, as
      ``collectives`` (kind → count, result bytes); else None.
    timings: seconds by phase: ``trace_s`` and ``plan_s`` (the step traced and planned,
      work a compile of the same step repeats or, for the same ``jaxdist.parallelize``d
      function, reuses), ``estimate_s`` (this estimate's own analysis), and with
      ``compile=True`` ``lower_s`` and ``compile_s`` (XLA's). A pipeline's ``plan_s``
      traces the step, forms its stages and plans their programs; its ``compile_s``
      (with ``compile=True``) is the whole compile of the step.
  """

  method: str
  memory_per_device: float
  breakdown: dict[str, float]
  step_time_s: float
  compute_s: float
  communication_s: float
  collectives: dict[str, dict[str, float]]
  plan: Any
  notes: tuple[str, ...] = ()
  compiled: dict[str, float] | None = None
  flops: float = 0.0
  bytes_accessed: float = 0.0
  approximate: bool = False
  stages: tuple = ()
  compiled_collectives: dict[str, dict[str, float]] | None = None
  timings: dict[str, float] = dataclasses.field(default_factory=dict)
  kernels: float = 0.0

  def summary(self) -> str:
    mib = 2.0**20
    lines = [f"{self.method} on mesh {'x'.join(map(str, self.plan.mesh_shape))}: "
             f"{self.memory_per_device / mib:.2f} MiB per device, "
             f"{self.step_time_s * 1e3:.3f} ms per step "
             f"({self.compute_s * 1e3:.3f} compute + {self.communication_s * 1e3:.3f} "
             f"communication)"]
    for part, b in self.breakdown.items():
      lines.append(f"  {part:<12} {b / mib:10.2f} MiB")
    for st in self.stages:
      lines.append(f"  stage {st.index}: {st.num_devices} devices as {st.mesh_shape}, "
                   f"{st.memory_per_device / mib:.2f} MiB per device ({st.max_in_flight} "
                   f"micro-batches in flight), {st.seconds_per_micro_batch * 1e3:.3f} ms per "
                   f"micro-batch"
                   + ("" if st.compiled_program_bytes is None else
                      f"; its backward program {st.program_bytes / mib:.2f} MiB, compiled "
                      f"{st.compiled_program_bytes / mib:.2f} MiB"))
    compiled = self.compiled_collectives
    none = {"count": 0, "result_bytes": 0.0}
    for kind in sorted(set(self.collectives) | set(compiled or ())):
      c, xla = self.collectives.get(kind, none), (compiled or {}).get(kind, none)
      lines.append(f"  {kind}: {int(c['count'])} x, {c['result_bytes']:.0f} B" + (
          "" if compiled is None else
          f" (compiled {int(xla['count'])} x, {xla['result_bytes']:.0f} B)"))
    if self.compiled is not None:
      total = self.compiled["total"]
      lines.append(f"  compiled     {total / mib:10.2f} MiB "
                   f"(estimate / compiled = {self.memory_per_device / max(total, 1):.3f})")
    lines += [f"  note: {n}" for n in self.notes]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class StageEstimate:
  """One pipeline stage, per device of its sub-mesh.

  Attributes:
    index: the stage number.
    layers: (first, last + 1) layer indices.
    num_devices, mesh_shape: its sub-mesh and the shape its shard plan chose.
    memory_per_device: bytes at the stage's peak: its backward program (arguments +
      outputs − donated + temporaries) plus the inputs of the other micro-batches in
      flight, the optimizer state on its devices and the step's micro-batch slices.
    breakdown: as :attr:`Estimate.breakdown` (``grads`` holds the accumulator,
      ``activations`` the stage's inputs kept for micro-batches in flight).
    max_in_flight: the most micro-batches whose inputs the schedule keeps at once.
    held_bytes: the inputs kept for the other micro-batches in flight.
    program_bytes: the backward program's own figure, what XLA's ``memory_analysis``
      of that program adds up.
    compiled_program_bytes: with ``compile=True``, XLA's figure for that program.
    seconds_per_micro_batch: forward plus backward (which recomputes the forward).
    compute_s, communication_s: its parts.
  """

  index: int
  layers: tuple[int, int]
  num_devices: int
  mesh_shape: tuple[int, ...]
  memory_per_device: float
  breakdown: dict[str, float]
  max_in_flight: int
  held_bytes: float
  program_bytes: float
  compiled_program_bytes: float | None
  seconds_per_micro_batch: float
  compute_s: float
  communication_s: float


@gc_paused()
def estimate(step, *args, method: m.Method | None = None, compile: bool = False,
             calibrated: bool = True, batch_argnums: int | tuple[int, ...] | None = None
             ) -> Estimate:
  """Estimates the memory per device and the step time of ``step`` under ``method``.

  Args:
    step: a function decorated with :func:`jaxdist.parallelize` (its method is used
      unless ``method`` is given) or a plain step function.
    *args: the step's arguments (arrays or ``jax.ShapeDtypeStruct``s).
    method: the method to estimate; default the step's, or ``ShardParallel()``.
    compile: also compile the step (nothing is allocated or run) and put XLA's own
      figures beside the estimate in ``Estimate.compiled``.
    calibrated: use the devices' calibration profile (``jaxdist.calibrate``) if one
      exists.
    batch_argnums: the step's batch arguments (as :func:`jaxdist.parallelize` takes
      them); default a parallelized step's own, else ``(1,)``.

  Raises:
    InvalidArgumentError: ``method`` is not a jaxdist method.
  """
  from jaxdist.api import ParallelizedFunc, parallelize
  if isinstance(step, ParallelizedFunc):
    func = step if method is None and batch_argnums is None else ParallelizedFunc(
        step.fun, method or step.method, step.static_argnums, step.donate_argnums,
        step.batch_argnums if batch_argnums is None else batch_argnums)
  else:
    func = parallelize(step, method=method,
                       batch_argnums=(1,) if batch_argnums is None else batch_argnums)
  method = func.method
  if isinstance(method, m.PipeshardParallel):
    from jaxdist.pipeline.estimate import estimate_pipeline
    return estimate_pipeline(func, args, compile, calibrated)
  planned = func.planned(*args)
  start = time.perf_counter()
  est = estimate_planned(method, planned, lambda: _micro_step(func, planned, args), calibrated)
  timings = dict(planned.timings, estimate_s=time.perf_counter() - start)
  again = _replanned_with_loop_buffers(func, planned, est, args, calibrated)
  if again is not None:  # (the second plan's trace, plan and estimate seconds are added)
    planned, est, more = again
    for key, seconds in more.items():
      timings[key] += seconds
  if compile:
    figures, collectives = _compiled_figures(planned, timings)
    est = dataclasses.replace(est, compiled=figures, compiled_collectives=collectives)
  return dataclasses.replace(est, timings=timings)


def _replanned_with_loop_buffers(func, planned, est: Estimate, args, calibrated: bool):
  """A micro-batched ShardParallel step whose first plan compiles over its memory budget
  is planned again with the micro-batch loop's buffers in the planner's memory model
  (``ParallelizedFunc``, ``AutoShardingOption._loop_buffers``); the estimate does the
  same when its own figure for the first plan is over the budget, and keeps the second
  plan if it estimates smaller (and hands it to the step's compile). Returns the second
  plan, its estimate and its seconds (``trace_s``, ``plan_s``, ``estimate_s``), or None."""
  method = func.method
  if not isinstance(method, m.ShardParallel) or planned.layout.num_micro_batches <= 1:
    return None
  opt = method.options
  budget = opt.memory_budget_per_device
  if budget is None or opt._loop_buffers or est.memory_per_device <= budget:
    return None
  again = dataclasses.replace(method, auto_sharding_option=dataclasses.replace(
      opt, _loop_buffers=True))
  second = func._replanned(planned, again, *args)  # (the same trace)
  start = time.perf_counter()
  est2 = estimate_planned(again, second, lambda: _micro_step(func, second, args), calibrated)
  if est2.memory_per_device >= est.memory_per_device:
    return None
  note = (f"the first plan was estimated at {est.memory_per_device / 1e6:.1f} MB, over the "
          f"budget of {budget / 1e6:.1f} MB: planned again with the micro-batch loop's "
          "buffers in the planner's memory model, as the compile does after an overshoot")
  est2 = dataclasses.replace(est2, notes=(note, *est2.notes))
  # The compile that follows starts from the second plan, as it would after compiling
  # the first; its timings count both plans.
  func._hand_over(dataclasses.replace(second, timings=dict(
      planned.timings, plan_s=planned.timings["plan_s"] + second.timings["plan_s"])), args)
  return second, est2, dict(second.timings, estimate_s=time.perf_counter() - start)


def estimate_planned(method: m.Method, planned, micro_step, calibrated: bool = True,
                     profile_devices=None) -> Estimate:
  """The estimate of a planned SPMD step (``ParallelizedFunc.planned``); ``micro_step()``
  returns the program one device runs per micro-batch where the layout reduces
  gradients itself. ``profile_devices``: whose calibration profile to use (default the
  plan's devices; a pipeline stage uses the whole job's)."""
  layout, lmesh = planned.layout, planned.layout.logical_mesh
  breakdown = dict(params=0.0, optimizer=0.0, batch=0.0, other=0.0)
  for leaf, spec in zip(planned.traced.inputs, layout.in_specs):
    b = _bytes(leaf.shape, leaf.dtype) / _shards(spec, lmesh)
    breakdown[ROLE_KEYS.get(leaf.role, "other")] += b
  donated = {k for k, leaf in enumerate(planned.traced.inputs)
             if leaf.argnum in planned.traced.donated_argnums}
  outputs = 0.0
  for k, (aval, spec) in enumerate(zip(planned.traced.out_avals, layout.out_specs)):
    b = _bytes(aval.shape, aval.dtype) / _shards(spec, lmesh)
    outputs += b
    if planned.traced.output_source[k] not in donated:
      breakdown["other"] += b
  notes = []
  if planned.shard_plan is not None and layout.grad_reduce_specs is None:
    work = _shard_parallel(planned)
  else:
    closed = micro_step()
    size, gathered, hoisted = _update_sizes(closed, layout), None, None
    if planned.shard_plan is not None:
      # The micro-batch program's equations → the planned ones (aligning takes 0.1-0.4 s
      # on a GPT: once).
      aligned = jaxpr_util.align(planned.step.micro_jaxpr.jaxpr.eqns,
                                 planned.shard_plan.step.closed_jaxpr.jaxpr.eqns)
      size = _micro_sizes(planned, aligned)
      gathered = {i: size(v) for i, v in enumerate(closed.jaxpr.invars)
                  if planned.traced.inputs[i].role in (PARAM, INPUT)
                  and _splits_over(layout.in_specs[i], layout.batch_axes)}
      hoisted = _hoisted_copies(planned, gathered, aligned)
    work = _split_step(planned, closed, size, gathered, hoisted,
                       _reduced_in_loop(planned) if planned.shard_plan is not None else ())
    if planned.shard_plan is not None:
      work = dataclasses.replace(work, flops=_planned_flops(planned.shard_plan.mesh_plan))
  notes += work.notes
  approximate = work.approximate and planned.shard_plan is None
  if _selected_conditional(planned.traced.closed_jaxpr.jaxpr):
    approximate = True
    notes.append("approximate: the step has a conditional XLA computes both ways and "
                 "selects from (optax.MultiSteps); their values fuse into the selections, "
                 "which the estimate counts as buffers (measured 1.3x to 2x of XLA's bytes)")
  if _update_loops_over_products(planned.traced):
    approximate = True
    notes.append("approximate: the update loops over matrix products (Muon's Newton-Schulz "
                 "iterations, say); XLA keeps more of them alive than the estimate counts "
                 "(measured 0.56x of XLA's bytes under DataParallel)")
  if planned.shard_plan is not None:
    collectives = dict(planned.shard_plan.predicted_collectives)
  else:
    collectives = fixed_layout_collectives(method, planned.step, layout, lmesh)
  breakdown.update(work.temps)
  written = work.written + outputs + sum(breakdown[p] for p in ("params", "optimizer", "batch"))
  if isinstance(method, m.Zero2Parallel) and lmesh.devices[0].platform == "cpu":
    # XLA:CPU all-gathers ZeRO-2's updated parameters and then copies them into their
    # output buffers: 8.4 of 9.4 MB gathered on an 8-layer MLP, 13.6 of 14.7 MB on a
    # 4-block GPT (ZeRO-3, whose parameters stay split, copies 1 MB). Not counted, the
    # calibration took them for ZeRO-2's waits, and estimated a ZeRO-3 MLP at 1.3x.
    written += sum(_bytes(l.shape, l.dtype) for l in _updated_on_shards(planned.step, layout))
  profile = calibration.load(profile_devices or lmesh.devices) if calibrated else None
  links = measured_links(profile, lmesh)
  if links is not lmesh:
    notes.append(f"communication time at the link costs {profile.path} measured: α "
                 f"{profile.alpha_s * 1e6:.3g} µs, {1e-9 / max(profile.beta_s_per_byte, 1e-30):.3g} "
                 f"GB/s (the mesh has its device kind's default costs)")
  communication = communication_seconds(collectives, links)
  compute = compute_seconds(profile, work.flops, written, lmesh, work.kernels)
  if profile is not None:
    notes.append(f"compute time calibrated by {profile.path} ({profile.created})")
    if links is not lmesh and profile.sync_fraction:
      communication += profile.sync_seconds(compute, sum(c["count"] for c in collectives.values()))
      notes.append(f"communication time includes the devices' waits at each collective that "
                   f"{profile.path} measured ({profile.sync_fraction:.2f} of the compute "
                   f"before it, at most {profile.sync_cap_s * 1e3:.3g} ms)")
  else:
    notes.append("compute time at the device kind's peak flops and memory bandwidth (no "
                 "calibration profile for these devices: jaxdist.calibrate())")
  from jaxdist.executable import make_plan
  plan = make_plan(method.name, planned.step, layout, planned.shard_plan,
                   None if planned.shard_plan is not None else collectives)
  return Estimate(method.name, sum(breakdown.values()), breakdown, compute + communication,
                  compute, communication, collectives, plan, tuple(notes), None,
                  work.flops, written, approximate, kernels=work.kernels)


# What XLA's conditional simplifier writes out: a two-branch conditional whose branches hold
# only elementwise ops and these is computed both ways, a select per output.
_SELECTABLE = ELEMENTWISE | REDUCTIONS | frozenset(
    "broadcast_in_dim concatenate dynamic_slice reshape squeeze expand_dims pad slice".split())


def _selected_conditional(jaxpr) -> bool:
  """Whether ``jaxpr`` (calls followed) has a conditional that XLA turns into selects
  (``optax.MultiSteps``' update, an ``apply_if_finite``): its branches' values then fuse
  across both branches into the selections, which the liveness walk does not model; it
  counts them as buffers (a GPT with MultiSteps: 1.37x of XLA's bytes under DataParallel
  and ShardParallel, 1.6x and 2.0x under ZeRO-2 and ZeRO-3)."""
  def cheap(jx) -> bool:
    return all(e.primitive.name in _SELECTABLE or (
        e.primitive.name in jaxpr_util.PLAN_CALLS
        and all(cheap(sub) for sub in jex.jaxprs_in_params(e.params)))
               for e in jx.eqns)

  for eqn in jaxpr.eqns:
    subs = list(jex.jaxprs_in_params(eqn.params))
    if (eqn.primitive.name == "cond" and len(subs) == 2
        and all(sub.eqns and cheap(sub) for sub in subs)):  # (XLA keeps one that returns
      return True                                          # its operands as it is)
    if eqn.primitive.name != "cond" and any(_selected_conditional(sub) for sub in subs):
      return True
  return False


def _update_loops_over_products(traced) -> bool:
  """Whether the update (after the gradient marker) has a loop of matrix products."""
  if traced.marker_index is None:
    return False
  jaxpr = traced.closed_jaxpr.jaxpr
  return any(jaxpr.eqns[i].primitive.name in ("scan", "while")
             and jaxpr_util.count_primitive(jaxpr, "dot_general", [i])
             for i in range(traced.marker_index + 1, len(jaxpr.eqns)))


@dataclasses.dataclass(frozen=True)
class _Work:
  """One device's step: temporaries at the peak by part, flops, bytes its buffers write,
  how many buffers it writes."""

  temps: dict[str, float]
  flops: float
  written: float
  notes: tuple[str, ...] = ()
  approximate: bool = False
  kernels: float = 0.0


def _bytes(shape, dtype) -> float:
  return float(math.prod(shape) * getattr(dtype, "itemsize", 4))


def _shards(spec, lmesh) -> int:
  """How many pieces a ``PartitionSpec`` cuts a value into on ``lmesh``."""
  return num_shards(from_partition_spec(spec, len(spec)), dict(zip(lmesh.axis_names, lmesh.shape)))


def _parts(timeline: Timeline, labels: dict, forward_end: int) -> dict[str, float]:
  """Splits the peak's live buffers into grads, activations and temporaries."""
  peak = timeline.peak()
  parts = dict(grads=0.0, activations=0.0, temporaries=0.0)
  for label, b in peak.live:
    if label in labels:
      parts[labels[label]] += b
    elif isinstance(label, tuple) and label[0] == "relaid":
      parts["temporaries"] += b  # an input's transposed copy
    elif timeline.buffers[label][0] <= forward_end:
      parts["activations"] += b
    else:
      parts["temporaries"] += b
  parts["temporaries"] += peak.bytes - sum(b for _, b in peak.live)  # a loop body's own
  return parts


def _forward_end(timeline: Timeline, marker) -> int:
  """The position of the last equation computing the loss (the marker's value operands);
  without a marker, the middle of the program (values made before it count as
  activations)."""
  if marker is not None:
    produced = {}
    for i, (eqn, _, outs) in enumerate(timeline.eqns):
      for o in outs:
        produced[o] = i
    values = [v for v, kind in zip(marker.invars, marker.params["kinds"]) if kind != GRAD]
    ends = [produced.get(timeline.buffer_of(v), -1) for v in values]
    if ends and max(ends) >= 0:
      return max(ends)
  return len(timeline.eqns) // 2


def _micro_step(func, planned, args):
  """The step one device runs per micro-batch: the layout's micro-batch trace, or the
  step traced at its per-device batch."""
  layout = planned.layout
  if planned.step.micro_jaxpr is not None:
    return planned.step.micro_jaxpr
  n = math.prod(layout.logical_mesh.axis_size(a) for a in layout.batch_axes)
  return with_micro_batch_trace(func.fun, args, planned.static_argnums, planned.traced,
                                n * layout.num_micro_batches).micro_jaxpr


def _split_step(planned, closed, size=nbytes, gathered_inputs=None, hoisted=None,
                in_loop=()):
  """Temporaries of a step whose gradients the layout reduces itself (``jaxdist.grad``'s
  marker) or XLA reduces (no marker), walked on one device's micro-batch program.
  ``gathered_inputs``: bytes per input position the gradient part reads gathered;
  ``hoisted``: the copies made before the loop (:func:`_hoisted_copies`); ``in_loop``:
  the gradients (positions among the marker's operands) reduced in the loop
  (:func:`_reduced_in_loop`)."""
  layout = planned.layout
  lmesh, k = layout.logical_mesh, layout.num_micro_batches
  jaxpr = closed.jaxpr
  # (A shard plan's micro-batch loop runs the gradient part unrolled: its scans too.)
  timeline = Timeline(jaxpr, size, lmesh.devices[0].platform,
                      frozenset(jaxpr.invars[i] for i in layout.stream_inputs or ()),
                      unrolled=planned.shard_plan is not None, in_loop=k > 1,
                      draws_in_readers=True)
  markers = [e for e, _, _ in timeline.eqns if e.primitive.name == jaxpr_util.IDENTITY_MARKER]
  marker = markers[0] if layout.grad_reduce_specs is not None and len(markers) == 1 else None
  combined = "all-reduce" in combining_for(lmesh.devices[0].platform).kinds
  batch_shards = math.prod(lmesh.axis_size(a) for a in layout.batch_axes)
  labels, notes = {}, []
  if marker is not None:
    pm = timeline.position[id(marker)]
    if k > 1:  # parameters the loop reads as they are (not gathered in it)
      streamed = set(layout.stream_inputs or ()) | set(gathered_inputs or ())
      timeline.hoist_invariant_values(
          [v for i, (v, leaf) in enumerate(zip(jaxpr.invars, planned.traced.inputs))
           if leaf.role == PARAM and i not in streamed], pm - 1)
    grads = [(i, v) for i, (v, kind) in enumerate(zip(marker.invars, marker.params["kinds"]))
             if kind == GRAD]
    starts, ends, local = [], [], 0.0
    per_leaf = _updates_per_leaf(timeline, pm)
    made = {o: e for e, _, outs in timeline.eqns[:pm] for o in outs}
    producer = {o: e.primitive.name for o, e in made.items()}
    written = {}  # buffer → the last position writing it before the marker
    for pos, (_, _, outs) in enumerate(timeline.eqns[:pm]):
      for o in outs:
        written[timeline.buffer_of(o)] = pos
    for i, v in grads:
      b = timeline.buffer_of(v)
      if b not in timeline.buffers:
        continue
      first, end, nb = timeline.buffers[b]
      start = written.get(b, first)  # complete (a scatter's zeros are made earlier)
      spec = layout.grad_reduce_specs[i]
      reduced = nb if spec is None else nb / batch_shards
      starts.append(start)
      ends.append(end)
      local += nb
      if k > 1 and i in in_loop:
        # all-reduced per micro-batch: the reduced copy is made beside the local one
        # (combined: every gradient's, at the backward's end), then added into the
        # accumulator (a tied GPT on 4x2 whose micro-batches the plan splits over both
        # axes, the loop over one: 0.79x of XLA's bytes without it)
        last = max(start, pm - 1) if combined else start
        timeline.buffers[b] = [first, last, nb]
        timeline.add(("reduced in loop", i), last, last, nb)
        labels[("reduced in loop", i)] = "grads"
        if batch_shards > 1:
          timeline.add(("reduced", i), pm, end, reduced)
      elif batch_shards == 1:  # nothing to reduce (``accumulate`` emits no collective):
        # added into the accumulator, or, where each leaf's update reads its own
        # gradient only, updated as produced
        timeline.buffers[b] = [first, start if k > 1 or per_leaf else end, nb]
      elif k == 1 and combined and spec is None:
        timeline.buffers[b] = [first, pm, nb]  # waits for the combined all-reduce
        timeline.add(("reduced", i), pm, end, reduced)
      elif k == 1:
        timeline.buffers[b] = [first, start, nb]  # reduce-scattered as produced
        if spec is not None and _scattered_over_batch_dim(made.get(v), made, spec):
          # (a stacked weight's gradient, ``[experts, in, out]`` scattered over the
          # experts: XLA copies it into another layout for the reduce-scatter, beside
          # the next parameter's gather: a MoE LM under ZeRO-3 was 0.70x of XLA's bytes
          # without the copy)
          timeline.add(("gradient copy", i), start, start, nb)
          labels[("gradient copy", i)] = "grads"
        # and, where each leaf's update reads its own gradient only, updated with it
        timeline.add(("reduced", i), start, start if per_leaf else end, reduced)
      elif producer.get(v) == "concatenate" or (
          producer.get(v) in ("scatter-add", "scatter_add") and _zeros(timeline, b)):
        # an unrolled scan's stacked gradient: XLA fuses the concatenation into the add,
        # writing into the accumulator in place (a 6-layer nn.scan MLP with 2
        # micro-batches: counted, the estimate was 1.11x of XLA's bytes); an embedding's
        # gradient, scattered into zeros: XLA scatters into the accumulator, and the
        # zeros, made at the start, are never written (a BERT layer under ZeRO-3 with 4
        # micro-batches and recomputation: 1.15x of XLA's bytes counting them)
        del timeline.buffers[b]
        timeline.add(("reduced", i), pm, end, reduced)
      else:
        timeline.buffers[b] = [first, start, nb]  # added into the accumulator
        if producer.get(v) == "convert_element_type":
          # (a bf16 dot's gradient cast to its f32 parameter's type: XLA fuses the cast
          # into the accumulator's add: counted, a bf16-compute MLP's DataParallel
          # estimate with 2 micro-batches was 1.04x of XLA's bytes, 1.00x without it)
          del timeline.buffers[b]
        timeline.add(("reduced", i), pm, end, reduced)
      labels[b] = labels[("reduced", i)] = "grads"
    if k > 1 and starts:
      # The micro-batch loop's carry: alive through every micro-batch's forward and
      # backward. (On one device the accumulator is the gradient the update reads.)
      timeline.add("accumulator", 0, pm if batch_shards > 1 else max(ends), local)
      labels["accumulator"] = "grads"
    if gathered_inputs:
      # Inputs the plan splits over the batch axes enter the gradient part gathered over
      # them (its shard_map replicates them there), and die with the loop, before the
      # gradients' reductions after it (measured on a 4-layer MLP on 2x4 with 4
      # micro-batches: counted at those too, the estimate was 1.35x of XLA's bytes).
      first = min(starts, default=0)
      for pos, nb in gathered_inputs.items():
        timeline.add(("gathered input", pos), first, max(first, pm - 1), nb)
        labels[("gathered input", pos)] = "temporaries"
    for n, (reader, nb) in enumerate(hoisted or ()):
      end = pm if reader is None else timeline.position.get(id(jaxpr.eqns[reader]), pm)
      timeline.add(("hoisted", n), 0, end, nb)
      labels[("hoisted", n)] = "temporaries"
    if layout.stream_inputs:
      # ZeRO-3: each parameter is gathered (whole) around every equation reading it.
      streamed = {jaxpr.invars[i] for i in layout.stream_inputs}
      for label in [l for l in timeline.buffers
                    if isinstance(l, tuple) and l[0] == "relaid" and l[1] in streamed]:
        del timeline.buffers[label]  # made from the gathered copy, where it is used
      # With micro-batches (the gathers are the loop's own all_gathers): a stacked
      # parameter a scan reads, split on another dim than the layers', is gathered with
      # that dim leading and copied back for the scan while the gather is alive (a
      # 6-layer nn.scan MLP with 2 micro-batches: one 1.6 MB copy at the peak beside
      # both gathered kernels; without it the estimate was 0.87x of XLA's). With one,
      # XLA's partitioner makes no such copy (a scanned GPT: 1.01x without, 1.11x with).
      relaid = {jaxpr.invars[i]: nbytes(jaxpr.invars[i])
                for i, spec in layout.stream_inputs.items()
                if next((d for d, e in enumerate(spec) if e is not None), 0) > 0}
      for pos, (eqn, ins, _) in enumerate(timeline.eqns[:pm]):
        gathered = sum(nbytes(v) for v in set(ins) if v in streamed)
        if gathered and k > 1 and eqn.primitive.name == "scan":
          gathered += max((relaid.get(v, 0.0) for v in ins), default=0.0)
        if gathered:
          timeline.add(("gathered", pos), pos, pos, gathered)
          labels[("gathered", pos)] = "temporaries"
  else:
    peak = timeline.peak()
    grad_bytes = sum(_bytes(l.shape, l.dtype) / _shards(spec, lmesh)
                     for l, spec in zip(planned.traced.inputs, layout.in_specs)
                     if l.role == PARAM)
    timeline.add("reduced", peak.index, peak.index, grad_bytes)
    labels["reduced"] = "grads"
    why = ("the step mixes examples beyond the loss's mean, so gradients are computed over "
           "the whole batch" if markers else
           "jaxdist does not see the step's gradient (a jax.grad bound elsewhere before the step "
           "runs, or taken in a loop or more than once), so it is not known by name")
    notes.append(f"approximate: {why} and XLA lays out their reduction itself; the reduced "
                 "gradients are counted at the backward's peak (measured from 0.8x to 3x of "
                 "XLA's figure for ZeRO" + ("" if markers else "; use jaxdist.value_and_grad")
                 + ")")
  temps = _parts(timeline, labels, _forward_end(timeline, marker))
  flops = k * sum(jaxpr_util.eqn_flops(e) for e, _, _ in timeline.eqns)
  written = k * sum(b for _, _, b in timeline.buffers.values())
  return _Work(temps, flops, written, tuple(notes), approximate=marker is None and k == 1
               and any(l.role == PARAM for l in planned.traced.inputs),
               kernels=len(timeline.buffers))  # (not x k: see calibration's docstring)


def _scattered_over_batch_dim(transpose, made: dict, spec) -> bool:
  """Whether a gradient made by ``transpose`` of a dot's result is reduce-scattered
  (``spec``) over a dim that is one of the dot's batch dims."""
  if transpose is None or transpose.primitive.name != "transpose":
    return False
  dot = made.get(transpose.invars[0])
  if dot is None or dot.primitive.name != "dot_general":
    return False
  batch = len(dot.params["dimension_numbers"][1][0])
  perm = transpose.params["permutation"]
  return any(e is not None and perm[d] < batch for d, e in enumerate(spec))


def _updates_per_leaf(timeline: Timeline, marker_position: int) -> bool:
  """Whether every equation after the gradient marker reads at most one gradient leaf
  (an optimizer without a global norm): XLA then updates each leaf as soon as its
  gradient is reduced, so the reduced gradients do not pile up."""
  marker, _, outs = timeline.eqns[marker_position]
  deps = {o: {i} for i, (o, kind) in enumerate(zip(outs, marker.params["kinds"]))
          if kind == GRAD}
  for _, ins, outs in timeline.eqns[marker_position + 1:]:
    read = set().union(*(deps.get(v, ()) for v in ins))
    if len(read) > 1:
      return False
    if read:
      deps.update((o, read) for o in outs)
  return True


def fixed_layout_collectives(method, traced, layout, lmesh):
  """The per-step collectives of the fixed layouts: gradients all-reduced or, where the
  layout reduce-scatters them (ZeRO through ``jaxdist.grad``), reduce-scattered; ZeRO's
  parameters all-gathered. One op per leaf, or one in all where the backend combines
  that kind."""
  if lmesh.num_devices == 1:
    return {}
  combining = combining_for(lmesh.devices[0].platform)
  out = {}

  def add(kind, sizes, result_bytes):
    if sizes:
      entry = out.setdefault(kind, {"count": 0, "result_bytes": 0.0})
      entry["count"] += combining.count(kind, sizes)
      entry["result_bytes"] += float(result_bytes)

  params = [l for l in traced.inputs if l.role == PARAM]
  moved = lambda b, dtype: combining.collective_bytes(b, dtype)  # 16-bit as f32 on CPU
  if layout.grad_reduce_specs is not None and traced.marker_index is not None:
    marker = traced.closed_jaxpr.jaxpr.eqns[traced.marker_index]
    # (an aux output with a batch dimension is concatenated where it is, not reduced)
    # (a gradient XLA computes once for several leaves, or a constant one, moves once or
    # not at all)
    distinct = _distinct_values(traced.closed_jaxpr.jaxpr, traced.marker_index, marker.invars)
    reduced = [moved(nbytes(v), v.aval.dtype) for v, s, rows, kept, once in
               zip(marker.invars, layout.grad_reduce_specs, per_example_outputs(traced),
                   reduced_outputs(traced), distinct)
               if s is None and not rows and kept and once]
    # XLA combines all-reduces of one reduction only (a finiteness check's `and`s apart
    # from the sums: apply_if_finite over split gradients compiled 2 ops, 1 predicted).
    if token_weighted(traced):  # the token counts, summed beside the gradients (which are
      reduced += [4.0]          # divided by them after their reduction)
    by_op = {"reduce_sum": reduced}
    examples, gathers, _ = batch_values_moved(traced, layout, lmesh)
    for b, dtype, name in _split_reductions(traced, layout, lmesh) + examples:
      by_op.setdefault(name, []).append(moved(b, dtype))
    for sizes in by_op.values():
      add("all-reduce", sizes, sum(sizes))
    scattered = [moved(nbytes(v), v.aval.dtype) for v, s, once in
                 zip(marker.invars, layout.grad_reduce_specs, distinct) if s is not None and once]
    add("reduce-scatter", scattered, sum(scattered) / lmesh.num_devices)
  else:
    sizes = [moved(_bytes(l.shape, l.dtype), l.dtype) for l in params]
    add("all-reduce", sizes, sum(sizes))
    gathers = []
  gathered = [moved(b, dtype) for b, dtype in gathers]
  if isinstance(method, m.Zero2Parallel):
    gathered += [moved(_bytes(l.shape, l.dtype), l.dtype)
                 for l in _updated_on_shards(traced, layout)]
  if isinstance(method, m.Zero3Parallel):
    gathered += [moved(_bytes(l.shape, l.dtype), l.dtype)
                 for l, n in _gathers(traced, layout, lmesh) for _ in range(n)]
  add("all-gather", gathered, sum(gathered))
  return out


def _zeros(timeline, b) -> bool:
  """Whether buffer ``b`` is made as a broadcast of the literal zero."""
  made = next((e for e, _, outs in timeline.eqns if b in outs), None)
  return (made is not None and made.primitive.name == "broadcast_in_dim"
          and isinstance(made.invars[0], jex.Literal) and made.invars[0].val == 0)


def _updated_on_shards(traced, layout) -> list:
  """ZeRO-2's parameter leaves updated on shards and all-gathered after (not a (1,) bias)."""
  split = {src for src, c in zip(traced.output_source, layout.out_constraints) if c is not None}
  return [l for k, l in enumerate(traced.inputs) if l.role == PARAM and k in split]


def _distinct_values(jaxpr, end: int, values) -> list[bool]:
  """Per value (made by the equations before ``end``), whether XLA computes it as a
  value of its own: not a constant (the zero
  gradient of a parameter the loss does not read) and not the same computation of the
  same inputs as an earlier one (XLA's CSE: the biases of a WaveNet's skip connections,
  all summed into one output, get the same gradient; their reduce-scatters were 6
  predicted where XLA made 1)."""
  key: dict = {}  # value → the number of its computation (hash-consed)
  numbers: dict = {}
  constant = set()
  for v in jaxpr.constvars:
    key[v] = ("const", id(v))
    constant.add(v)
  for v in jaxpr.invars:
    key[v] = ("input", id(v))
  atom = lambda v: ("literal", repr(v.val)) if isinstance(v, jex.Literal) else key[v]
  for eqn in jaxpr.eqns[:end]:
    operands = tuple(atom(v) for v in eqn.invars)
    made = (eqn.primitive.name, repr(sorted(
        (name, id(p) if isinstance(p, (jex.ClosedJaxpr, jex.Jaxpr)) else p)
        for name, p in eqn.params.items())), operands)
    fixed = all(isinstance(v, jex.Literal) or v in constant for v in eqn.invars)
    for pos, o in enumerate(eqn.outvars):
      key[o] = (numbers.setdefault(made + (pos,), len(numbers)) if not eqn.effects
                else ("effect", id(o)))
      if fixed and not eqn.effects:
        constant.add(o)
  seen, out = set(), []
  for v in values:
    k = atom(v)
    out.append(not isinstance(v, jex.Literal) and v not in constant and k not in seen)
    seen.add(k)
  return out


def _split_reductions(traced, layout, lmesh, unmodelled: list | None = None,
                      reducing: list | None = None) -> list[tuple[float, Any, str]]:
  """(result bytes, dtype, primitive) of each reduction the update makes across a split
  dimension of the state or the reduce-scattered gradients (global-norm clipping's sums of squares,
  LAMB's norms): the partial results are all-reduced. Splits are followed through
  elementwise equations and into the branches of a ``cond`` (``optax.MultiSteps``
  updates under one: XLA compiles both branches' collectives); values that other
  equations make count as whole."""
  jaxpr = traced.closed_jaxpr.jaxpr
  marker = jaxpr.eqns[traced.marker_index]
  dims = lambda spec: frozenset(d for d, a in enumerate(spec) if a is not None)
  # (the batch's own splits are batch_values_moved's)
  split = {v: dims(spec) for v, spec, leaf in zip(jaxpr.invars, layout.in_specs, traced.inputs)
           if _shards(spec, lmesh) > 1 and leaf.role != BATCH}
  split.update((v, dims(spec)) for v, spec in zip(marker.outvars, layout.grad_reduce_specs)
               if spec is not None and _shards(spec, lmesh) > 1)
  # An aux output with a batch dimension stays split over the batch axes: with the state
  # whole (DataParallel), XLA all-reduces the partial sums the update makes of it (a
  # codebook's usage counts), beside the gradients. (ZeRO's plans say that XLA places
  # those: into split state, it gathered the examples instead.)
  if not split and all(s is None for s in layout.grad_reduce_specs) and math.prod(
      lmesh.axis_size(a) for a in layout.batch_axes) > 1:
    split.update(_per_example_aux(traced))
  out = []
  _follow_splits(jaxpr.eqns[traced.marker_index + 1:], split, out, unmodelled, reducing)
  return out


def unmodelled_update(traced, layout, lmesh) -> tuple[list[str], bool]:
  """What of the update over split state or split gradients the predicted collectives
  leave out: the primitives by which it multiplies or loops over them (Muon's
  Newton-Schulz iterations, Shampoo's preconditioners: XLA gathers or reduces for them
  as it chooses), and whether a reduction across a split reads the result of another
  (``optax.safe_norm``'s second pass, LAMB's trust ratios: their all-reduces cannot all
  combine into one, and XLA groups them as its schedule allows)."""
  found, reducing = [], []
  _split_reductions(traced, layout, lmesh, found, reducing)
  derived = {o for e in reducing for o in e.outvars}
  reductions, chained = {id(e) for e in reducing}, False
  for eqn in traced.closed_jaxpr.jaxpr.eqns[traced.marker_index + 1:]:
    if any(not isinstance(v, jex.Literal) and v in derived for v in eqn.invars):
      if id(eqn) in reductions:
        chained = True
        break
      derived.update(eqn.outvars)
  return sorted(set(found)), chained


def _per_example_aux(traced) -> dict:
  """The gradient marker's aux outputs with a batch dimension, as split on dim 0."""
  marker = traced.closed_jaxpr.jaxpr.eqns[traced.marker_index]
  return {v: frozenset({0}) for v, rows in zip(marker.outvars, per_example_outputs(traced))
          if rows}


def examples_reduced_in_update(traced) -> bool:
  """Whether the update (after the gradient marker) sums over a per-example aux output
  of the gradient (a codebook's usage counts)."""
  out = []
  _follow_splits(traced.closed_jaxpr.jaxpr.eqns[traced.marker_index + 1:],
                 _per_example_aux(traced), out)
  return bool(out)


def _follow_splits(eqns, split: dict, out: list, unmodelled: list | None = None,
                   reducing: list | None = None) -> None:
  """:func:`_split_reductions`' walk over ``eqns``: ``split`` maps a value to its split
  dimensions (updated); each reduction across one is appended to ``out`` (and its
  equation to ``reducing``), and to ``unmodelled`` the name of each matrix product or
  loop reading one otherwise."""
  for eqn in eqns:
    ins = [(v, split[v]) for v in eqn.invars if not isinstance(v, jex.Literal) and v in split]
    if not ins:
      continue
    name = eqn.primitive.name
    if unmodelled is not None and name in ("dot_general", "conv_general_dilated", "scan",
                                           "while") and not (
        name == "dot_general" and len(ins) == 2 and _contracts_split(eqn, ins)):
      unmodelled.append(name)
    if name == "cond":
      for branch in eqn.params["branches"]:
        inner = {b: split[v] for b, v in zip(branch.jaxpr.invars, eqn.invars[1:])
                 if not isinstance(v, jex.Literal) and v in split}
        _follow_splits(branch.jaxpr.eqns, inner, out, unmodelled, reducing)
    elif name in ELEMENTWISE:  # (an operand's size-1 dims broadcast: one-hot's ``eq``)
      shape = eqn.outvars[0].aval.shape
      found = next((kept for v, d in ins if len(v.aval.shape) == len(shape)
                    for kept in [frozenset(k for k in d if v.aval.shape[k] == shape[k])]
                    if kept), None)
      if found is not None:
        split.update((o, found) for o in eqn.outvars)
    elif name == "broadcast_in_dim":
      split[eqn.outvars[0]] = frozenset(eqn.params["broadcast_dimensions"][d] for d in ins[0][1])
    elif name == "transpose":
      split[eqn.outvars[0]] = frozenset(eqn.params["permutation"].index(d) for d in ins[0][1])
    elif name == "reshape":  # a split dim kept whole, with as many elements before it
      shape, out_shape = ins[0][0].aval.shape, eqn.outvars[0].aval.shape
      kept = frozenset(q for d in ins[0][1] for q in range(len(out_shape))
                       if out_shape[q] == shape[d]
                       and math.prod(out_shape[:q]) == math.prod(shape[:d]))
      if kept:
        split[eqn.outvars[0]] = kept
    elif name == "dot_general" and len(ins) == 2 and _contracts_split(eqn, ins):
      # both split on a contracted dim: partial products, summed across the devices
      out.append((nbytes(eqn.outvars[0]), eqn.outvars[0].aval.dtype, "reduce_sum"))
      if reducing is not None:
        reducing.append(eqn)
    elif name in REDUCTIONS and len(ins) == 1:
      axes, held = set(eqn.params["axes"]), ins[0][1]
      kept = [d for d in range(len(ins[0][0].aval.shape)) if d not in axes]
      if held & axes:
        out.append((nbytes(eqn.outvars[0]), eqn.outvars[0].aval.dtype, name))
        if reducing is not None:
          reducing.append(eqn)
      rest = frozenset(kept.index(d) for d in held - axes)
      if rest:
        split[eqn.outvars[0]] = rest


FOLLOWED = frozenset({"broadcast_in_dim", "transpose", "reshape", *ELEMENTWISE, *REDUCTIONS})


def batch_values_moved(traced, layout, lmesh) -> tuple[list, list, list[str]]:
  """What XLA moves of the batch values a fixed layout's step uses outside its gradient
  part, split over the batch axes as the batch is: ``(reductions, gathers, unmodelled)``.
  A metric's sum over the examples is all-reduced (``reductions``: (bytes, dtype,
  primitive), as :func:`_split_reductions`); examples written into state that every
  device holds (a MoCo queue's keys) are all-gathered (``gathers``: (bytes, dtype)); the
  names of the other equations reading split examples are ``unmodelled`` (XLA moves
  those examples as it chooses)."""
  if traced.marker_index is None or layout.grad_reduce_specs is None or math.prod(
      lmesh.axis_size(a) for a in layout.batch_axes) == 1:
    return [], [], []
  split, reductions, gathers, unmodelled = _batch_split(traced, layout, lmesh)
  jaxpr = traced.closed_jaxpr.jaxpr
  for v, spec in zip(jaxpr.outvars, layout.out_specs):
    if not isinstance(v, jex.Literal) and v in split and _shards(spec, lmesh) == 1:
      gathers.append((nbytes(v), v.aval.dtype))
  return reductions, gathers, sorted(set(unmodelled))


def _batch_split(traced, layout, lmesh) -> tuple[dict, list, list, list[str]]:
  """:func:`batch_values_moved`'s walk over the equations outside the gradient part:
  the values split like the batch's rows (value -> split dims) and what it found."""
  jaxpr = traced.closed_jaxpr.jaxpr
  split = {v: frozenset(d for d, a in enumerate(spec) if a is not None)
           for v, spec, leaf in zip(jaxpr.invars, layout.in_specs, traced.inputs)
           if leaf.role == BATCH and _shards(spec, lmesh) > 1}
  apply = jaxpr_util.needed_eqns(jaxpr, jaxpr.outvars, stop=[traced.marker_index])
  reductions, gathers, unmodelled = [], [], []

  def walk(eqns, split):
    for eqn in eqns:
      ins = {k: split[v] for k, v in enumerate(eqn.invars)
             if not isinstance(v, jex.Literal) and v in split}
      name, body = eqn.primitive.name, jaxpr_util.call_body(eqn)
      if not ins:
        continue
      if body is not None and name not in ("cond", "scan", "while"):  # jit, custom_jvp, ...
        inner = {b: ins[k] for k, b in enumerate(body.jaxpr.invars) if k in ins}
        walk(body.jaxpr.eqns, inner)
        split.update((o, inner[b]) for o, b in zip(eqn.outvars, body.jaxpr.outvars)
                     if not isinstance(b, jex.Literal) and b in inner)
      elif name == "dot_general" and _free_dims_split(eqn, ins) is not None:
        split[eqn.outvars[0]] = _free_dims_split(eqn, ins)
      elif _kept_rows(eqn, ins) is not None:
        split[eqn.outvars[0]] = _kept_rows(eqn, ins)
      elif name == "dynamic_update_slice" and set(ins) == {1}:
        gathers.append((nbytes(eqn.invars[1]), eqn.invars[1].aval.dtype))
      elif name in FOLLOWED or (name == "dot_general" and len(ins) == 2
                                 and _contracts_split(eqn, list(ins.items()))):
        _follow_splits([eqn], split, reductions)
      else:
        unmodelled.append(name)

  walk([jaxpr.eqns[i] for i in sorted(apply - {traced.marker_index})], split)
  return split, reductions, gathers, unmodelled


def _kept_rows(eqn, ins: dict) -> frozenset | None:
  """The split dims of the result of a slice, pad, squeeze or convolution whose first
  operand alone is split, where the split dims are not cut (XLA keeps the split)."""
  name, dims = eqn.primitive.name, ins.get(0)
  if set(ins) != {0}:
    return None
  shape = eqn.invars[0].aval.shape
  if name in ("slice", "pad", "dynamic_slice"):
    out = eqn.outvars[0].aval.shape
    return dims if all(out[d] == shape[d] for d in dims) else None
  if name == "squeeze":
    gone = set(eqn.params["dimensions"])
    return frozenset(d - sum(g < d for g in gone) for d in dims)
  if name == "conv_general_dilated":
    numbers = eqn.params["dimension_numbers"]
    batch = numbers.lhs_spec[0]
    return frozenset({numbers.out_spec[0]}) if dims == {batch} else None
  return None


def _free_dims_split(eqn, ins: dict) -> frozenset | None:
  """The output dims of a dot whose operands are split on batch or free dims only (none
  contracted): its result is split on those dims' places, with no communication."""
  (contract, batch) = eqn.params["dimension_numbers"]
  shapes = [len(v.aval.shape) for v in eqn.invars]
  if any(set(ins.get(k, ())) & set(contract[k]) for k in (0, 1)):
    return None
  free = [[d for d in range(shapes[k]) if d not in contract[k] and d not in batch[k]]
          for k in (0, 1)]
  place = [dict(zip(batch[k], range(len(batch[0])))) for k in (0, 1)]
  for k in (0, 1):
    offset = len(batch[0]) + (len(free[0]) if k else 0)
    place[k].update((d, offset + j) for j, d in enumerate(free[k]))
  return frozenset(place[k][d] for k, dims in ins.items() for d in dims)


def _contracts_split(eqn, ins) -> bool:
  """Whether a dot's two operands are split on a pair of its contracted dims."""
  (lc, rc), _ = eqn.params["dimension_numbers"]
  return any(a in ins[0][1] and b in ins[1][1] for a, b in zip(lc, rc))


def _gathers(traced, layout, lmesh) -> list[tuple[Any, int]]:
  """ZeRO-3's sharded parameters with how often each is all-gathered per step: once
  before every equation of the gradient part reading it, per micro-batch, where the
  parameters are streamed (``jaxdist.accumulate``), and once more for every matmul or
  convolution after the gradients reading it (a loss evaluated again after the update:
  XLA gathers the parameter for it); else twice (forward and backward)."""
  sharded = [(k, l) for k, (l, spec) in enumerate(zip(traced.inputs, layout.in_specs))
             if l.role in (PARAM, INPUT) and _shards(spec, lmesh) > 1]
  if not layout.stream_inputs or traced.marker_index is None:
    return [(l, 2) for _, l in sharded]
  split = split_at_marker(traced)
  grad_jaxpr = split.grad_jaxpr.jaxpr
  reads = collections.Counter()
  for i in split.grad_eqns:
    for v in {v for v in grad_jaxpr.eqns[i].invars if not isinstance(v, jex.Literal)}:
      reads[v] += 1
  # Outside the gradients: a parameter, or its update (elementwise, broadcast, reshaped: held
  # split alike), read by a matmul or convolution, or beside values split like the batch's
  # rows (a momentum encoder's bias added to its activations, a queue the keys are
  # written into).
  jaxpr = traced.closed_jaxpr.jaxpr
  held = {jaxpr.invars[k]: k for k, _ in sharded}
  rows = _batch_split(traced, layout, lmesh)[0]
  after, gathered = collections.Counter(), set()
  for i in sorted(split.apply_eqns):
    eqn = jaxpr.eqns[i]
    ins = {held[v] for v in eqn.invars if not isinstance(v, jex.Literal) and v in held}
    if not ins:
      continue
    if (any(jaxpr_util.count_primitive(jaxpr, name, [i]) for name in HEAVY)
        or any(not isinstance(v, jex.Literal) and v in rows for v in eqn.invars)):
      # XLA's partitioner gathers a value once for all its readers
      new = {v for v in eqn.invars if not isinstance(v, jex.Literal) and v in held} - gathered
      after.update(held[v] for v in new)
      gathered |= new
    elif eqn.primitive.name in (*ELEMENTWISE, "broadcast_in_dim", "reshape") and len(ins) == 1:
      (k,) = ins
      held.update((o, k) for o in eqn.outvars)
  return [(l, reads[grad_jaxpr.invars[k]] * layout.num_micro_batches + after[k])
          for k, l in sharded]


def _shard_parallel(planned):
  """Temporaries, flops and collectives of a ShardParallel plan on one device."""
  result = planned.shard_plan
  plan = result.mesh_plan
  graph, choice, lmesh = plan.graph, plan.solution.choice, plan.lmesh
  sizes = dict(zip(lmesh.axis_names, lmesh.shape))

  sliced = _sliced_by_every_reader(graph, choice, sizes)

  def size(v):
    if v in graph.producer:
      return nbytes(v) / sliced.get(v, num_shards(graph.spec_of(v, choice), sizes))
    return nbytes(v)

  jaxpr = result.step.closed_jaxpr.jaxpr
  regions = None
  if planned.layout.rolled is not None:  # the unrolled scans compile as loops
    region = {id(n.eqn): n.region for n in graph.nodes if n.eqn is not None}
    regions = lambda eqn: region.get(id(eqn))
  timeline = Timeline(jaxpr, size, lmesh.devices[0].platform, regions=regions)
  written = sum(b for _, _, b in timeline.buffers.values())
  kernels = len(timeline.buffers)
  marker = next((e for e, _, _ in timeline.eqns
                 if e.primitive.name == jaxpr_util.IDENTITY_MARKER), None)
  labels, early = {}, collections.Counter()
  for n, (end, b, readers) in enumerate(_early_copies(result, timeline, marker)):
    timeline.add(("early copy", n), 0, end, b)
    labels[("early copy", n)] = "temporaries"
    early.update((k, b) for k in readers)
  # A collective's result is a buffer of its own next to its operand, but for a gather
  # into an elementwise step output (a parameter's update computed split, its sum with
  # the replicated parameter): XLA adds on the shards and gathers into the output buffer
  # (a PCGrad step planned with DataParallel's layouts: 3 x 4 MB counted, none compiled).
  outputs = {id(v) for v in jaxpr.outvars}
  for k, (kind, axes, b) in graph.collectives(choice, plan.cost_model):
    eqn = graph.nodes[k].eqn
    if eqn is None or id(eqn) not in timeline.position:
      continue
    if (kind == "all-gather" and eqn.primitive.name in ELEMENTWISE
        and all(id(o) in outputs for o in eqn.outvars)):
      continue
    if early[(k, b)]:  # the early copy's
      early[(k, b)] -= 1
      continue
    pos = timeline.position[id(eqn)]
    timeline.add(("collective", k, kind, len(timeline.buffers)), pos, pos, b)
  temps = _parts(timeline, labels, _forward_end(timeline, marker))
  return _Work(temps, _planned_flops(plan), written, kernels=kernels)


def _sliced_by_every_reader(graph, choice, sizes) -> dict:
  """Replicated elementwise results that every reader takes split (a slice, no
  communication), or feeds into another such result → the fewest shards a reader takes.
  XLA computes only the slice: it pushes the slice up into the elementwise fusions (a
  ViT's position add and first LayerNorm planned replicated, read split by the attention:
  four replicated [32,17,128] values counted, XLA kept only the embedding's concatenation
  whole; ShardParallel 1.17x of XLA's bytes)."""
  readers = collections.defaultdict(list)
  for flow in graph.flows:
    if not flow.tied:
      readers[(flow.src, flow.pos)].append(flow)
  out = {}
  for v, (k, pos) in sorted(graph.producer.items(), key=lambda item: -item[1][0]):
    eqn = graph.nodes[k].eqn
    if (eqn is None or eqn.primitive.name not in ELEMENTWISE
        or num_shards(graph.spec_of(v, choice), sizes) > 1 or not readers.get((k, pos))):
      continue
    taken = []
    for flow in readers[(k, pos)]:
      dst = graph.nodes[flow.dst].eqn
      if dst is not None and len(dst.outvars) == 1 and dst.outvars[0] in out:
        taken.append(out[dst.outvars[0]])  # (an elementwise reader computed sliced)
      else:
        spec = flow.required[choice[graph.nodes[flow.dst].group]]
        taken.append(1 if spec is None else num_shards(spec, sizes))
    if min(taken) > 1:
      out[v] = min(taken)
  return out


def _early_copies(result, timeline: Timeline, marker) -> list[tuple[int, float, set]]:
  """The resharded copies of values no batch input reaches (``planner.hoisted_flows``:
  parameters, optimizer state) that XLA's schedule makes early, since they wait on
  nothing the step computes, and keeps to their last reader: the gathered and the
  sliced ones, and those only the update after the gradient ``marker`` (if any) reads.
  One per value and layout; per copy, that reader's position in ``timeline``, the copy's
  bytes per device and the graph nodes reading it.

  Measured on BatchNorm CNNs under ZeRO (planned as one program): the Adam moments'
  all-gathers for the update and ZeRO-3's parameter all-gathers for the backward came
  before the forward's end; counted at their readers, a 4-block CNN's estimate was
  0.875x of XLA's bytes under ZeRO-2 and 0.79x under ZeRO-3. A 4-stage MLP's kernels
  moved by all-to-all for the backward's dots were made where they are read (counted
  early, its stage programs' estimates went from 0.90-1.00x to 1.09-1.12x); its
  replicated kernels sliced for the dots were all made at the program's start (counted
  at their readers, 0.79x).
  """
  update = len(timeline.eqns) if marker is None else timeline.position[id(marker)]
  graph = result.mesh_plan.graph
  out = []
  for b, change, flows in _resharded_copies(
      result, lambda e: id(e) in timeline.position).values():
    read = [timeline.position[id(graph.nodes[f.dst].eqn)] for f in flows]
    if change or min(read) > update:
      out.append((max(read), b, {f.dst for f in flows}))
  return out


def _planned_flops(plan) -> float:
  """Dot and convolution flops one device runs under a solved plan."""
  graph, choice = plan.graph, plan.solution.choice
  sizes = dict(zip(plan.lmesh.axis_names, plan.lmesh.shape))
  flops = 0.0
  for node in graph.nodes:
    if node.eqn is None:
      continue
    strategy = node.strategies[choice[node.group]]
    out_shards = max((num_shards(s, sizes) for s in strategy.out_specs), default=1)
    flops += (node.weight * jaxpr_util.eqn_flops(node.eqn)
              / _compute_shards(strategy, sizes, out_shards))
  return flops


def _splits_over(spec, axes) -> bool:
  return any(a in axes for dim in from_partition_spec(spec, len(spec)) for a in dim)


def _update_sizes(closed, layout):
  """Per-device bytes of the values of a data-parallel step: the gradient part's as
  traced (whole parameters), the update's (after the gradient marker) split as the
  state it updates. Under ZeRO the update runs on its shard: a value with the shape of
  a split operand it reads (a gradient reduce-scattered, a sharded moment or
  parameter) has that operand's shards; the others are whole."""
  jaxpr = closed.jaxpr
  lmesh = layout.logical_mesh
  found = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == jaxpr_util.IDENTITY_MARKER]
  if layout.grad_reduce_specs is None or len(found) != 1:
    return nbytes
  marker = jaxpr.eqns[found[0]]
  shards = {v: _shards(spec, lmesh) for v, spec in zip(jaxpr.invars, layout.in_specs)}
  batch_shards = math.prod(lmesh.axis_size(a) for a in layout.batch_axes)
  shards.update((v, batch_shards) for v, spec in zip(marker.outvars, layout.grad_reduce_specs)
                if spec is not None)
  shape = lambda v: tuple(getattr(v.aval, "shape", ()))
  for e in jaxpr.eqns[found[0] + 1:]:
    for o in e.outvars:
      same = [shards.get(v, 1) for v in e.invars
              if not isinstance(v, jex.Literal) and shape(v) == shape(o)]
      shards[o] = max(same, default=1)
  after = {o for e in jaxpr.eqns[found[0] + 1:] for o in e.outvars}
  return lambda v: nbytes(v) / shards[v] if v in after else nbytes(v)


def _reduced_in_loop(planned) -> set[int]:
  """The gradients (positions among the marker's operands) a shard plan's micro-batch
  loop reduces per micro-batch: summed over a mesh axis that is not one of the loop's
  batch axes (the plan splits each micro-batch over more axes than the batch it is
  given). The sum is found at the gradient's producer or, through rearrangements and
  sums of gradients, before it."""
  layout, result = planned.layout, planned.shard_plan
  if layout.num_micro_batches <= 1 or result.step.marker_index is None:
    return set()
  plan = result.mesh_plan
  graph, choice = plan.graph, plan.solution.choice
  jaxpr = result.step.closed_jaxpr.jaxpr
  batch_axes = set(layout.batch_axes)

  def summed_in_loop(v, seen) -> bool:
    if isinstance(v, jex.Literal) or v not in graph.producer or v in seen:
      return False
    seen.add(v)
    node = graph.nodes[graph.producer[v][0]]
    if any(kind in ("all-reduce", "reduce-scatter") and set(axes) - batch_axes
           for kind, axes, _ in node.strategies[choice[node.group]].collectives):
      return True
    eqn = node.eqn
    return (eqn is not None and eqn.primitive.name in PASSING_GRADIENTS
            and any(summed_in_loop(u, seen) for u in eqn.invars))

  marker = jaxpr.eqns[result.step.marker_index]
  return {i for i, (v, kind) in enumerate(zip(marker.invars, marker.params["kinds"]))
          if kind == GRAD and summed_in_loop(v, set())}


def _micro_sizes(planned, aligned: dict):
  """Per-device bytes of the micro-batch program's values under a shard plan: each
  value's planned shards, less the batch axes (its micro-batch shape already has them).
  ``aligned``: the micro-batch program's equation indices → the planned step's (matched
  by their primitive sequence, ``jaxpr_util.align``)."""
  result = planned.shard_plan
  graph, choice, lmesh = (result.mesh_plan.graph, result.mesh_plan.solution.choice,
                          result.mesh_plan.lmesh)
  sizes = {a: 1 if a in planned.layout.batch_axes else n
           for a, n in zip(lmesh.axis_names, lmesh.shape)}
  full = result.step.closed_jaxpr.jaxpr
  micro = planned.step.micro_jaxpr.jaxpr
  pairs = list(zip(full.invars, micro.invars))
  for j, i in aligned.items():
    pairs += zip(full.eqns[i].outvars, micro.eqns[j].outvars)
  shards = {mv: num_shards(graph.spec_of(fv, choice), sizes)
            for fv, mv in pairs if fv in graph.producer}
  return lambda v: nbytes(v) / shards.get(v, 1)


def _hoisted_copies(planned, gathered: dict, aligned: dict) -> list[tuple[int | None, float]]:
  """The resharded copies XLA makes before the micro-batch loop under a shard plan
  (:func:`_resharded_copies`), per copy: its reader's index in the micro-batch program
  (None for a reader inside the loop, or one without a counterpart there: kept to the
  loop's end) and its bytes per device. The loop's readers of the ``gathered`` inputs
  (by position) read those: they are not copies of their own. ``aligned``: as
  :func:`_micro_sizes`."""
  from jaxdist.shard.micro import looped_eqns
  result = planned.shard_plan
  graph = result.mesh_plan.graph
  full = result.step.closed_jaxpr.jaxpr
  if result.step.marker_index is None or planned.step.micro_jaxpr is None:
    return []
  looped = looped_eqns(full, result.step)  # (graph.loop would trace the micro-batch step)
  index = {id(e): i for i, e in enumerate(full.eqns)}
  copies = []
  for (source, _, _), (b, _, flows) in _resharded_copies(result, lambda e: id(e) in index).items():
    src = graph.nodes[source]
    readers = [graph.nodes[f.dst].eqn for f in flows]
    if src.eqn is None and src.input_index in gathered:
      readers = [e for e in readers if id(e) not in looped]
    if readers:
      copies.append((None if any(id(e) in looped for e in readers)
                     else max(index[id(e)] for e in readers), b))
  in_micro = {i: j for j, i in aligned.items()}
  return [(None if i is None else in_micro.get(i), b) for i, b in copies]


def _resharded_copies(result, in_program) -> dict:
  """The copies of values no batch input reaches (``planner.hoisted_flows`` into the
  equations where ``in_program(eqn)``) that a reader wants in another layout than the
  plan gives them: one per value and layout, however many read it, as (source node, its
  output, layout) → (bytes per device as the backend holds them (XLA:CPU: 16-bit floats
  as f32, as the collectives move them), 1 where it gathers (fewer shards than the
  source's), -1 where it slices (more), 0 where it moves, the flows reading it)."""
  from jaxdist.shard.planner import hoisted_flows
  plan = result.mesh_plan
  graph, choice = plan.graph, plan.solution.choice
  sizes = dict(zip(plan.lmesh.axis_names, plan.lmesh.shape))
  copies: dict = {}
  for flow in hoisted_flows(result.step.closed_jaxpr.jaxpr, graph, result.step, in_program):
    src, dst = graph.nodes[flow.src], graph.nodes[flow.dst]
    want = flow.required[choice[dst.group]]
    have = src.strategies[choice[src.group]].out_specs[flow.pos]
    if want is not None and want != have:
      copies.setdefault((flow.src, flow.pos, want), (
          plan.cost_model.combining.collective_bytes(
              flow.full_bytes / num_shards(want, sizes), flow.dtype),
          (num_shards(have, sizes) > num_shards(want, sizes))
          - (num_shards(have, sizes) < num_shards(want, sizes)), []))[2].append(flow)
  return copies


def _compute_shards(strategy, sizes, out_shards) -> int:
  """How many ways a strategy splits its equation's work (its output's shards, or more
  where it contracts a split dimension: the partial sums are all-reduced)."""
  reduced = math.prod(num_shards((axes,), sizes) for kind, axes, _ in strategy.collectives
                      if kind in ("all-reduce", "reduce-scatter"))
  return max(out_shards * reduced, 1)


def compute_seconds(profile, flops: float, written: float, lmesh, kernels: float = 0.0) -> float:
  """One device's seconds for ``flops``, ``written`` bytes and ``kernels`` run: at the
  calibration ``profile``'s rates, or (None) at ``lmesh``'s peak flops and memory
  bandwidth."""
  if profile is not None:
    return profile.compute_seconds(flops, written, kernels)
  return flops / lmesh.peak_flops + written / CostModel(lmesh).memory_bandwidth


def communication_seconds(collectives, lmesh) -> float:
  """α-β time of the predicted collectives on ``lmesh``, over every mesh axis (a
  conservative placement where the kind's axes are not recorded)."""
  cost_model = CostModel(lmesh, combining=combining_for(lmesh.devices[0].platform),
                         peak_flops=lmesh.peak_flops)
  axes = lmesh.axis_names
  seconds = 0.0
  for kind, c in collectives.items():
    count = max(c["count"], 1.0)
    per_op = c["result_bytes"] / count
    if kind == "all-reduce":
      one = cost_model.all_reduce(axes, per_op)
    elif kind == "reduce-scatter":
      one = cost_model.reduce_scatter(axes, per_op)
    elif kind == "all-to-all":
      one = cost_model.all_to_all(axes, per_op)
    else:
      one = cost_model.all_gather(axes, per_op)
    seconds += count * one
  return seconds


def measured_links(profile, lmesh):
  """``lmesh`` with the link costs ``profile`` measured, where it has its device kind's
  defaults (the user's own costs are kept); else ``lmesh`` itself."""
  if profile is None or profile.alpha_s is None or not _default_costs(lmesh):
    return lmesh
  return LogicalMesh(lmesh.shape, axis_names=lmesh.axis_names, alpha=profile.alpha_s,
                     beta=profile.beta_s_per_byte, devices=lmesh.devices,
                     peak_flops=lmesh.peak_flops)


def _default_costs(lmesh) -> bool:
  """Whether every axis of ``lmesh`` has its device kind's default α and β."""
  alpha, beta, _ = device_costs(lmesh.devices[0])
  return set(lmesh.alpha) == {alpha} and set(lmesh.beta) == {beta}


def _compiled_figures(planned, timings=None) -> tuple[dict, dict[str, dict[str, float]]]:
  """XLA's memory figures and collectives of the planned step (``timings``: its
  ``lower_s`` and ``compile_s`` are added)."""
  from jaxdist import inspect as hlo_inspect
  from jaxdist.executable import compile_layout
  compiled = compile_layout(planned.step, planned.layout, timings)
  ma = compiled.memory_analysis()
  figures = dict(argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                 alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes)
  figures["total"] = (figures["argument"] + figures["output"] - figures["alias"]
                      + figures["temp"])
  collectives = {kind: {"count": float(c.count), "result_bytes": float(c.result_bytes)}
                 for kind, c in hlo_inspect.collective_summary(compiled.as_text()).items()}
  return {k: float(v) for k, v in figures.items()}, collectives
