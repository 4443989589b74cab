"""``jaxdist.estimate`` for PipeshardParallel: each stage estimated from its plan.

The stages are formed, each stage's backward program (which recomputes the forward, so
it holds all of the stage's work) and the update programs are planned on their
sub-meshes exactly as the compile would do it (``PipelineExecutable(compile=False)``);
nothing compiles. A
stage's peak per device is that program's estimate (arguments + outputs − donated +
temporaries, as for a ShardParallel step) plus what lives beside it while it runs:

- the stage's inputs kept for the other micro-batches in flight (the schedule's
  ``max_in_flight`` − 1 of them: a stage keeps only its inputs per micro-batch, never
  its residuals);
- the optimizer state that lives on the stage's devices, as the stage's update program
  (planned too, not compiled) lays it out;
- the micro-batch slices of the batch, cut at the start of the step and replicated on
  every device.

A stage's time per micro-batch is its backward program's estimate plus its forward's
compute (the backward's compute scaled by the forward's share of the flops). A stage
run per device (``per_device.py``) is timed from that program, the one that runs: its
flops and bytes per device, its loss outputs' all-reduces per micro-batch, and one
all-reduce of its gradient accumulator per step (its shard plan, priced instead, put a
2-stage MLP's step at 0.57x of its measured time; the per-device program's figures
0.8x–1.3x over later runs, the spread of that step's own measurements). The step is
``Σ c + (micro-batches − 1) · max c`` (the formula the executable's objective uses; on
simulated CPU devices the bubble ``Σ c − max c`` is cheaper, ``_bubble_share``) plus the
optimizer's update after the last micro-batch (each stage's gradient reduction and
update programs, planned on its devices, estimated alike; the slowest stage's count).
Not counted: moving activations between sub-meshes, and the collectives of a planned
stage's forward program (planned apart from its backward only when it compiles).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.extend.core as jex
import numpy as np

from jaxdist import calibration, jaxpr_util
from jaxdist.estimate import (Estimate, StageEstimate, communication_seconds, compute_seconds,
                              estimate_planned, measured_links)
from jaxdist.liveness import Timeline
from jaxdist.pipeline.partition import stage_functions
from jaxdist.pipeline.per_device import LOSS_OUTPUT, REPLICATED
from jaxdist.pipeline.runtime import device_bytes
from jaxdist.plan import Plan, PlanEntry
from jaxdist.shard.strategies import nbytes
from jaxdist.trace import OPTIMIZER


def estimate_pipeline(func, args, compile: bool = False, calibrated: bool = True) -> Estimate:
  """The estimate of ``func`` (a PipeshardParallel step) on ``args``; see the module
  docstring. ``compile=True`` also compiles the step and puts XLA's figure for each
  stage's backward program beside the estimate (and the step's in ``compiled``)."""
  from jaxdist.api import ParallelizedFunc, Planned
  method = func.method
  start = time.perf_counter()
  exe = func.planned_stages(*args)
  timings = {"plan_s": time.perf_counter() - start}
  k = method.num_micro_batches or 1
  in_flight = exe.schedule.max_in_flight()
  loss_jaxpr = exe._loss.closed.jaxpr
  compiled_exe = None
  if compile:  # the program the estimate models: the driver's, also where SPMD would run
    target = func if not exe.spmd_runtime else ParallelizedFunc(
        func.fun, dataclasses.replace(method, runtime="mpmd"), func.static_argnums,
        func.donate_argnums, func.batch_argnums)
    start = time.perf_counter()
    compiled_exe = target.get_executable(*args)
    timings["compile_s"] = time.perf_counter() - start
  start = time.perf_counter()
  slices = exe.batch_slice_bytes()
  profile = calibration.load(exe._lmesh.devices) if calibrated else None
  stages, estimates, reductions = [], [], {}
  for s, st in enumerate(exe.stages):
    result = _accumulating_early(st.backward_plan)
    planned = Planned(result.step, result.step, result.layout, result, (), {})
    est = estimate_planned(method, planned, None, calibrated, exe._lmesh.devices)
    per_device = exe._per_device(st)
    lmesh = result.layout.logical_mesh
    # (a stage's kernels count once per step, not per micro-batch: see jaxdist.calibration)
    if isinstance(per_device, str) or per_device.axes:
      # (per shard of the batch, the other axes as planned: the plan's figures hold)
      part = dict(est.breakdown)
      part["grads"] += part.pop("optimizer")  # the backward's donated gradient accumulator
      est = dataclasses.replace(est, kernels=est.kernels / k, compute_s=compute_seconds(
          profile, est.flops, est.bytes_accessed, lmesh, est.kernels / k))
    else:
      # The programs that run are the per-device ones: per micro-batch they all-reduce
      # only the loss outputs and the cotangents of inputs every device holds alike; the
      # accumulator is all-reduced once per step (the stage's ``reduce``).
      links = measured_links(profile, lmesh)
      part, flops, written, collectives, kernels = _per_device_work(
          per_device, st.mesh.devices[0].platform, exe._frozen)
      reduced = {"count": 1.0, "result_bytes": part["grads"]}
      reductions[_devices(lmesh)] = (reduced, communication_seconds({"all-reduce": reduced},
                                                                    links))
      compute = compute_seconds(profile, flops, written, lmesh, kernels / k)
      communication = communication_seconds(collectives, links)
      if profile is not None and links is not lmesh:
        communication += profile.sync_seconds(compute, sum(c["count"]
                                                           for c in collectives.values()))
      est = dataclasses.replace(est, compute_s=compute, communication_s=communication,
                                collectives=collectives, flops=flops, bytes_accessed=written,
                                kernels=kernels / k)
    held = sum(device_bytes(a) for a in st.in_avals) * max(in_flight[s] - 1, 0)
    program = sum(part.values())
    breakdown = dict(params=part["params"], optimizer=exe.optimizer_bytes(st),
                     batch=part["batch"] + slices, other=part["other"], grads=part["grads"],
                     activations=part["activations"] + held, temporaries=part["temporaries"])
    forward_flops = sum(jaxpr_util.eqn_flops(loss_jaxpr.eqns[i]) for i in st.eqns)
    n = st.mesh.num_devices
    share = forward_flops / n / est.flops if est.flops else 0.0
    compute = est.compute_s * (1 + share)
    compiled_bytes = None
    if compiled_exe is not None:
      ma = compiled_exe.stages[s].backward.memory_analysis()
      compiled_bytes = float(ma.argument_size_in_bytes + ma.output_size_in_bytes
                             - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    stages.append(StageEstimate(
        s, st.layers, n, tuple(st.mesh.shape), sum(breakdown.values()), breakdown,
        in_flight[s], held, program, compiled_bytes, compute + est.communication_s,
        compute, est.communication_s))
    estimates.append(est)
  peak = max(stages, key=lambda st: st.memory_per_device)
  slowest = max(stages, key=lambda st: st.seconds_per_micro_batch)
  update_compute, update_communication, once = _update_seconds(exe, method, calibrated,
                                                               reductions)
  shared = _bubble_share(stages, exe._lmesh.devices[0].platform)
  compute = (slowest.compute_s + shared * (sum(st.compute_s for st in stages) - slowest.compute_s)
             + (k - 1) * slowest.compute_s + update_compute)
  communication = (sum(st.communication_s for st in stages)
                   + (k - 1) * slowest.communication_s + update_communication)
  memory, breakdown = peak.memory_per_device, dict(peak.breakdown)
  v = method.virtual_stages
  if v > 1:  # interleaved: stages c, c + p, ... share group c mod p's devices
    p = len(stages) // v
    groups = [stages[d::p] for d in range(p)]
    # A group holds all its stages' state and in-flight inputs, and runs one program at a time.
    held = lambda st: sum(st.breakdown[key] for key in STATE) + st.held_bytes
    memory = max(sum(held(st) for st in g) + max(st.memory_per_device - held(st) for st in g)
                 for g in groups)
    busy = max(groups, key=lambda g: sum(st.seconds_per_micro_batch for st in g))
    compute = (k * sum(st.compute_s for st in busy) + shared * (p - 1) * slowest.compute_s
               + update_compute)
    communication = (k * sum(st.communication_s for st in busy)
                     + (p - 1) * slowest.communication_s + update_communication)
    breakdown = {key: sum(st.breakdown[key] for st in busy) for key in breakdown}
  collectives: dict = {}  # the stages' backward programs per micro-batch, the rest once
  for times, program in [(k, e.collectives) for e in estimates] + [(1, c) for c in once]:
    for kind, c in program.items():
      total = collectives.setdefault(kind, {"count": 0.0, "result_bytes": 0.0})
      total["count"] += times * c["count"]
      total["result_bytes"] += times * c["result_bytes"]
  notes = [f"stage {st.index}: layers {st.layers[0]}..{st.layers[1] - 1} on {st.num_devices} "
           f"devices as {st.mesh_shape}, {st.max_in_flight} micro-batches in flight"
           for st in stages]
  notes += [(f"memory_per_device and breakdown are stage {peak.index}'s (the largest)"
             if v == 1 else f"interleaved ({v} stages per device group): memory_per_device is "
             f"the fullest group's (its stages' state and in-flight inputs together, plus its "
             f"largest program); time is its busiest group's k passes plus the bubble") + "; "
            f"transfers between stages and the update programs' temporaries are not counted",
            *estimates[0].notes[-1:]]
  if shared < 1:
    notes.append(f"the {len(exe._lmesh.devices)} CPU devices share this host's {_host_cores()} "
                 f"cores: the bubble's compute (where some stages idle) is counted at "
                 f"{shared:.2f} of its time with every device busy")
  if exe.spmd_runtime:
    notes.insert(0, "approximate: compiled, this step takes the SPMD pipeline runtime (one "
                 "program over a (stage, data) mesh; see the executable's plan notes); these "
                 "figures model the same method on the MPMD driver (runtime='mpmd')")
  plan = Plan(method=method.name, mesh_shape=exe._lmesh.shape, axis_names=exe._lmesh.axis_names,
              inputs=tuple(PlanEntry(leaf.path, leaf.shape, str(leaf.dtype), leaf.role, home.spec)
                           for leaf, home in zip(exe._step.inputs, exe._input_homes)),
              num_micro_batches=k, notes=tuple(notes),
              objective=compute + communication)
  compiled = None
  if compiled_exe is not None:
    peaks = compiled_exe.device_peaks()
    compiled = dict(total=max(peaks.values()), **peaks)
    if exe.spmd_runtime:  # and the program that does run, beside the modelled one
      start = time.perf_counter()
      compiled["spmd_program"] = float(func.get_executable(*args).get_total_allocation_size())
      timings["compile_s"] += time.perf_counter() - start
      notes.insert(1, f"compiled, the SPMD program this step runs needs "
                   f"{compiled['spmd_program'] / 2**20:.2f} MiB per device, "
                   f"{compiled['spmd_program'] / max(memory, 1):.2f}x these figures "
                   f"(`compiled['spmd_program']`)")
  timings["estimate_s"] = time.perf_counter() - start
  return Estimate(method.name, memory, breakdown,
                  compute + communication, compute, communication, collectives, plan,
                  tuple(notes), compiled, sum(e.flops for e in estimates) * k,
                  sum(e.bytes_accessed for e in estimates) * k,
                  exe.spmd_runtime or any(e.approximate for e in estimates), tuple(stages),
                  timings=timings, kernels=sum(e.kernels for e in estimates) * k)


def _bubble_share(stages, platform: str) -> float:
  """What the pipeline's bubble costs, as a share of its compute time with every device
  busy (the rate the calibrated stage times hold).

  1 on accelerators and across processes (each process's devices have their own
  cores there). Simulated CPU devices in one process are threads sharing its cores, so
  where stages idle the busy ones run faster: with ``b`` devices busy of ``n`` on ``c``
  cores, a stage's compute takes ``max(b, c) / n`` of its time with all ``n`` busy. The
  bubble's ``j``-th slot (of ``stages − 1``) runs the first ``j`` stages while filling
  and the last ``j`` while draining. Measured on 8 CPU devices sharing 2 cores, 2 stages
  of 4 devices and 4 micro-batches: an MLP's and a GPT's steps were estimated 1.25x and
  1.22x of their measured times, about what a bubble that costs nothing gives (5 slots
  against 4). At this share (0.5 there) the next run of ``bench/estimate.py`` gave 0.94x
  and 1.09x; at 2 and 8 micro-batches the ratios spread from 0.83x to 1.5x between runs.
  Tried and not kept: the steady state too at each stage's rate running alone, the step
  being all stages' work over the cores (``k · Σ c_s · n_s / n``: the cores never idle
  while a stage that fills them runs). That is a lower bound here: with the stages timed
  by their per-device programs it gave 176 and 571 ms for an MLP and a GPT (2 stages
  of 4, 4 micro-batches) measured at about 210 and 620 ms (171–259 and 542–810 ms over
  the runs of one session), where this share gives 225 and 656 ms.
  """
  sizes = [st.num_devices for st in stages]
  n, cores = sum(sizes), _host_cores()
  if len(sizes) < 2 or platform != "cpu" or n <= cores or jax.process_count() > 1:
    return 1.0
  slots = [max(sum(sizes[:j]), cores) + max(sum(sizes[-j:]), cores)
           for j in range(1, len(sizes))]
  return sum(slots) / (2 * n * len(slots))


def _host_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _update_seconds(exe, method, calibrated: bool,
                    reductions: dict[frozenset, tuple]) -> tuple[float, float, list[dict]]:
  """(compute, communication) seconds of what runs once after the last micro-batch, and
  its collectives (a list of kind → count and bytes). The update programs planned on a
  stage's devices are estimated as a stage program is; they follow the stage's gradient
  ``reductions`` (per stage's devices: the all-reduce and its seconds). The stages'
  updates run side by side, so the stage whose updates take longest counts. Replicated
  programs over all devices (scalars crossing stages, a global norm) are not counted."""
  from jaxdist.api import Planned
  per_stage = {devices: (0.0, seconds) for devices, (_, seconds) in reductions.items()}
  collectives = [{"all-reduce": reduced} for reduced, _ in reductions.values()]
  for program in exe._applies:
    result = program.plan
    if result is None:
      continue
    planned = Planned(result.step, result.step, result.layout, result, (), {})
    est = estimate_planned(method, planned, None, calibrated, exe._lmesh.devices)
    devices = _devices(result.layout.logical_mesh)
    compute, communication = per_stage.get(devices, (0.0, 0.0))
    per_stage[devices] = (compute + est.compute_s, communication + est.communication_s)
    collectives.append(est.collectives)
  return (*max(per_stage.values(), key=sum, default=(0.0, 0.0)), collectives)


def _devices(lmesh) -> frozenset:
  return frozenset(d.id for d in lmesh.mesh.devices.flat)


# What a stage keeps on its devices between its programs.
STATE = ("params", "optimizer", "grads")


def _per_device_work(pd, platform: str, frozen: frozenset):
  """The backward program of a stage run per device (``per_device.py``), per device:
  its parts (operands, micro-batch slices and cotangents, one full-size row of the
  gradient accumulator (donated), and the temporaries of a liveness walk of the
  per-device trace), its flops, the bytes it reads and writes (as ``estimate_planned``
  counts them: its buffers, inputs and outputs), and the collectives of its forward and
  backward per micro-batch (kind → count and result bytes: all-reduces of the loss
  outputs and of the cotangents of inputs every device holds alike, one per element
  type, as ``predict.py`` counts them), and the buffers it writes."""
  forward, backward, diff, float_in, float_out = stage_functions(pd.loss, pd.stage,
                                                                 frozen=frozen)
  del forward
  reduced = [v.aval for v, kind in zip(pd.stage.acts_out, pd.acts_out) if kind[0] == LOSS_OUTPUT]
  reduced += [pd.stage.acts_in[p].aval for p in float_in if pd.acts_in[p][0] == REPLICATED]
  collectives = {"all-reduce": {
      "count": float(len({str(a.dtype) for a in reduced})),
      "result_bytes": sum(float(math.prod(a.shape) * a.dtype.itemsize) for a in reduced)}
  } if reduced else {}
  loss_jaxpr = pd.loss.closed.jaxpr
  aval = lambda v: jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype)
  ops = [aval(loss_jaxpr.invars[p]) for p in pd.stage.operands]
  acts_in = [aval(v) for v in pd.stage.acts_in]
  cots = [aval(pd.stage.acts_out[p]) for p in float_out]
  grads = [ops[p] for p in diff]
  closed = jax.make_jaxpr(backward)(ops, acts_in, cots, grads)
  size = lambda a: float(math.prod(a.shape) * a.dtype.itemsize)
  accumulator = sum(size(g) for g in grads)
  outputs = sum(nbytes(v) for v in closed.jaxpr.outvars) - accumulator  # aliased
  params = sum(size(ops[p]) for p in diff)
  timeline = Timeline(_accumulate_early(closed.jaxpr, len(grads)), platform=platform)
  parts = dict(params=params, optimizer=0.0,
               batch=sum(map(size, ops)) - params + sum(map(size, acts_in + cots)),
               other=outputs, grads=accumulator, activations=0.0,
               temporaries=timeline.peak().bytes)
  flops = sum(jaxpr_util.eqn_flops(e) for e, _, _ in timeline.eqns)
  written = (sum(b for _, _, b in timeline.buffers.values()) + sum(parts.values())
             - parts["temporaries"])
  return parts, flops, written, collectives, len(timeline.buffers)


def _accumulating_early(result):
  """A stage backward's shard plan with its jaxpr in the order XLA runs it: each gradient
  added into its accumulator (the program's last inputs, the ``optimizer`` role) as soon
  as it is computed. In the traced order the adds come last, and a 4-stage MLP's last
  stage was estimated with all three of its weight gradients alive at once (0.9 MB over
  XLA's 5.5 MB program)."""
  step = result.step
  num = sum(leaf.role == OPTIMIZER for leaf in step.inputs)
  jaxpr = _accumulate_early(step.closed_jaxpr.jaxpr, num)
  closed = jex.ClosedJaxpr(jaxpr, step.closed_jaxpr.consts)
  return dataclasses.replace(result, step=dataclasses.replace(step, closed_jaxpr=closed))


def _accumulate_early(jaxpr, num_accumulators: int):
  """``jaxpr`` with each addition into an accumulator (its last ``num_accumulators``
  inputs) moved to just after the gradient it adds is computed, as XLA's scheduler
  places it (the traced order adds them all at the end, keeping every gradient alive)."""
  accumulators = set(jaxpr.invars[len(jaxpr.invars) - num_accumulators:])
  producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  after: dict[int, list] = {}
  for i, e in enumerate(jaxpr.eqns):
    others = [v for v in e.invars if isinstance(v, jex.Literal) or v not in accumulators]
    if (e.primitive.name in ("add", "add_any") and len(e.invars) == 2 and len(others) == 1
        and not isinstance(others[0], jex.Literal)):
      after.setdefault(producer.get(others[0], -1), []).append(i)
  moved = {i for group in after.values() for i in group}
  order = after.get(-1, [])
  for i in range(len(jaxpr.eqns)):
    if i not in moved:
      order += [i] + after.get(i, [])
  return jaxpr.replace(eqns=[jaxpr.eqns[i] for i in order])
