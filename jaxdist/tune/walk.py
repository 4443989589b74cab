"""``jaxdist.tune``: Alpa's performance-tuning guide as a measured walk.

The guide's order, each stage informed by the last: DataParallel; Zero2Parallel (does
the optimizer state's share drop the memory?); Zero3Parallel; ShardParallel on every
logical mesh shape; the best so far with gradient accumulation (2, 4, 8 micro-batches at
the same global batch); PipeshardParallel over layer and stage counts (layer counts the
forward pass has enough matrix multiplications for), and the fastest pipeline with more
micro-batches. Between the mesh
shapes and accumulation, the partition-constraint presets of ``strategies/presets`` that
match the step's parameters (Megatron-style attention, expert parallelism) are tried on
each 2-D mesh. Each candidate is
estimated first (``jaxdist.estimate``; pipelines only under a budget) and skipped without
compiling when the estimate exceeds the budget by more than :data:`SKIP_MARGIN` (the
estimator's error is smaller; an estimate marked ``approximate`` never skips), or, in the
guide's walk, when its estimated step time is over :data:`SLOWER_SKIP` times the estimate
of the fastest trial measured so far (estimates against estimates: what the estimator
gets wrong about the devices, both share; its step times are within 25% of measured);
then compiled, held to the budget by XLA's own figure, run ``steps`` times and timed.
Failures are classified, never raised: over the budget or out of memory at run time →
``oom``; a compile or run failure → ``error``; a candidate that does not apply (a batch
that does not divide, no ``jaxdist.grad`` for accumulation) → ``skipped``.
"""

from __future__ import annotations

import dataclasses
import gc
import numbers
import statistics
import sys
import time
import warnings

import jax

from jaxdist import agree
from jaxdist import errors
from jaxdist import jaxpr_util
from jaxdist import methods as m
from jaxdist import progress
from jaxdist.mesh import LogicalMesh
from jaxdist.pipeline.layers import AutoLayerOption
from jaxdist.shard.planner import candidate_shapes
from jaxdist.trace import PARAM, trace_step
from jaxdist.tune.presets import load_presets
from jaxdist.tune.report import Trial, TuneReport

SKIP_MARGIN = 0.25
SLOWER_SKIP = 2.0
# Seconds the sharding ILP may take per mesh shape in a walk (a budget makes it a hard
# MIP: a GPT's 2x4 solve took 74 s to prove optimal); the best plan found is used.
SOLVER_TIME_LIMIT_S = 10.0
MICRO_BATCHES = (2, 4, 8)
# (layers, stages) of the pipeline candidates, each with PIPELINE_MICRO_BATCHES; then the
# fastest of them with MORE_PIPELINE_MICRO_BATCHES (a smaller bubble, smaller micro-batches).
PIPELINES = ((2, 2), (4, 2), (4, 4), (4, "auto"))
PIPELINE_MICRO_BATCHES = 4
MORE_PIPELINE_MICRO_BATCHES = 8
# A trial's figures that can differ between the processes of a job (measured, or decided
# by something one process has and another lacks); process 0's are taken.
AGREED = ("status", "step_time_s", "memory_bytes", "compile_s", "reason", "exact",
          "estimated_memory_bytes", "estimated_step_time_s")


def tune(step, *args, memory_budget_per_device: float | None = None, steps: int = 3,
         time_budget_s: float | None = None, candidates=None, progress: bool = True,
         devices=None, batch_argnums: int | tuple[int, ...] | None = None) -> TuneReport:
  """Tries parallelization methods on ``step(*args)`` and reports them, fastest first.

  Args:
    step: the step function, or a :func:`jaxdist.parallelize`'d one (its argnums are
      used; its method is not: the walk chooses).
    *args: the step's arguments; they are copied for each trial (never donated).
    memory_budget_per_device: bytes each device may use; trials over it are ``oom``.
    steps: timed steps per trial after one warm-up step (the median is reported).
    time_budget_s: stop starting new trials after this many seconds; the rest are
      ``skipped`` with the reason.
    candidates: method objects to try instead of the guide's walk.
    progress: print one line per trial as it finishes (and a progress bar in a
      terminal); False prints nothing.
    devices: the devices (a list, a ``jax.sharding.Mesh`` or a ``jaxdist.LogicalMesh``
      whose α/β the ShardParallel candidates use); default all.
    batch_argnums: the step's batch arguments (as :func:`jaxdist.parallelize` takes
      them); default a parallelized step's own, else ``(1,)``.

  Returns:
    A :class:`jaxdist.TuneReport`.
  """
  from jaxdist.api import ParallelizedFunc

  if isinstance(step, ParallelizedFunc):
    fun, argnums = step.fun, (step.static_argnums, step.donate_argnums, step.batch_argnums)
  else:
    fun, argnums = step, ("auto", "auto", (1,))
  if batch_argnums is not None:
    argnums = argnums[:2] + (batch_argnums,)
  if steps < 1:
    raise errors.InvalidArgumentError(f"tune(steps={steps!r}): give at least 1 timed step.")
  number = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)
  budget = memory_budget_per_device
  if budget is not None and not (number(budget) and budget > 0):
    raise errors.InvalidArgumentError(
        f"tune(memory_budget_per_device={budget!r}): give a positive number of bytes per "
        f"device, or None for no limit.")
  if time_budget_s is not None and not (number(time_budget_s) and time_budget_s >= 0):
    raise errors.InvalidArgumentError(
        f"tune(time_budget_s={time_budget_s!r}): give seconds >= 0, or None for no limit.")
  for method in candidates or ():
    if not isinstance(method, m.Method):
      raise errors.InvalidArgumentError(
          f"tune(candidates=[..., {method!r}, ...]): every candidate must be a jaxdist method "
          f"object such as jaxdist.DataParallel().")
  walk = _Walk(fun, args, argnums, memory_budget_per_device, steps, progress,
               skip_slower=candidates is None)
  start = time.perf_counter()
  given = None if candidates is None else [_with_devices(c, devices) for c in candidates]
  total = len(given) if given is not None else _guide_size(devices)
  with progress_bar(total, progress) as bar:
    named = [(_name(c), c) for c in given] if given is not None else _guide(walk, devices)
    for name, method in named:
      if time_budget_s is not None and agree.process_zeros(
          time.perf_counter() - start > time_budget_s):
        walk.add(Trial(name, method, "skipped",
                       reason=f"not reached: time_budget_s={time_budget_s:g} was used up"))
        continue
      bar.describe(f"tune: {name}")
      walk.run(name, method)
      bar.advance()
  return TuneReport(tuple(walk.trials), memory_budget_per_device, time.perf_counter() - start)


def progress_bar(total, show):
  return progress.bar(total, "tune", show=show)


def _with_devices(method, devices):
  if devices is None or method.devices is not None:
    return method
  return dataclasses.replace(method, devices=devices)


def _num_devices(devices) -> int:
  return LogicalMesh.from_devices(devices).num_devices


def _guide_size(devices) -> int:
  shapes = candidate_shapes(_num_devices(devices))
  return (3 + len(shapes) + len(load_presets()) * sum(len(s) == 2 for s in shapes)
          + len(MICRO_BATCHES) + len(PIPELINES) + 2)


def _guide(walk, devices):
  """The guide's candidates, generated as the walk goes (later stages read the trials)."""
  for cls in (m.DataParallel, m.Zero2Parallel, m.Zero3Parallel):
    yield cls.__name__, cls(devices=devices)
  budget = walk.budget
  option = m.AutoShardingOption(memory_budget_per_device=budget,
                                solver_time_limit_s=SOLVER_TIME_LIMIT_S)
  for shape in candidate_shapes(_num_devices(devices)):
    yield (f"ShardParallel({'x'.join(map(str, shape))})",
           m.ShardParallel(devices=devices, logical_mesh_shape=shape, auto_sharding_option=option))
  # Named presets (strategies/presets): the planner with some leaves pinned, per 2-D shape.
  base_mesh = LogicalMesh.from_devices(devices)
  for preset in load_presets():
    constraints = preset.matching(walk.param_paths())
    if not constraints:
      continue
    for shape in candidate_shapes(base_mesh.num_devices):
      if len(shape) != 2:
        continue
      lmesh = LogicalMesh(shape, axis_names=preset.axis_names, alpha=max(base_mesh.alpha),
                          beta=max(base_mesh.beta), devices=base_mesh.devices,
                          peak_flops=base_mesh.peak_flops)
      yield (f"ShardParallel({'x'.join(map(str, shape))}, {preset.name})",
             m.ShardParallel(devices=lmesh, auto_sharding_option=dataclasses.replace(
                 option, partition_constraints=constraints)))
  # Accumulation on the best so far (or, if nothing fit, the smallest that compiled:
  # accumulation is what shrinks activations).
  ok = [t for t in walk.trials if t.status == "ok"]
  compiled = [t for t in walk.trials if t.memory_bytes is not None]
  base = (min(ok, key=lambda t: t.step_time_s) if ok else
          min(compiled, key=lambda t: t.memory_bytes) if compiled else None)
  for k in MICRO_BATCHES:
    if base is None:
      yield f"DataParallel k={k}", m.DataParallel(devices=devices, num_micro_batches=k)
      continue
    origin = walk.origin[base.name]
    yield f"{base.name} k={k}", dataclasses.replace(origin, num_micro_batches=k)
  for layers, stages in PIPELINES:
    stage_option = "auto" if stages == "auto" else m.UniformStageOption(num_stages=stages)
    name = f"PipeshardParallel(layers={layers}, stages={stages}, k={PIPELINE_MICRO_BATCHES})"
    method = m.PipeshardParallel(devices=devices, num_micro_batches=PIPELINE_MICRO_BATCHES,
                                 layer_option=AutoLayerOption(layer_num=layers),
                                 stage_option=stage_option, default_auto_sharding_option=option)
    matmuls = walk.forward_matmuls()
    if matmuls is not None and matmuls < layers:
      walk.add(Trial(name, method, "skipped", reason=(
          f"the forward pass has about {matmuls} matrix multiplications; {layers} layers "
          f"need at least {layers}")))
      continue
    yield name, method
  # The SPMD runtime on the step's stack of identical layers, if it has one (one program,
  # GPipe order; skipped with the reason otherwise).
  yield f"PipeshardParallel(spmd, k={PIPELINE_MICRO_BATCHES})", m.PipeshardParallel(
      devices=devices, num_micro_batches=PIPELINE_MICRO_BATCHES, pipeline_schedule="gpipe",
      runtime="spmd", layer_option=AutoLayerOption(layer_num=2))
  pipelines = [t for t in walk.trials
               if isinstance(t.method, m.PipeshardParallel) and t.status == "ok"]
  if pipelines:
    best = min(pipelines, key=lambda t: t.step_time_s)
    k = MORE_PIPELINE_MICRO_BATCHES
    yield (best.name.replace(f"k={PIPELINE_MICRO_BATCHES}", f"k={k}"),
           dataclasses.replace(walk.origin[best.name], num_micro_batches=k))


def _name(method) -> str:
  name = type(method).__name__
  if isinstance(method, m.ShardParallel) and method.logical_mesh_shape:
    name += f"({'x'.join(map(str, method.logical_mesh_shape))})"
  if isinstance(method, m.PipeshardParallel) and method.runtime == "spmd":
    name += "(spmd)"
  elif isinstance(method, m.PipeshardParallel) and isinstance(method.layer_option, AutoLayerOption):
    stages = method.stage_option
    stages = stages.num_stages if isinstance(stages, m.UniformStageOption) else stages
    name += f"(layers={method.layer_option.layer_num}, stages={stages})"
  k = method.num_micro_batches or 1
  return name + (f" k={k}" if k > 1 else "")


class _Walk:
  """Runs trials one at a time and keeps them."""

  def __init__(self, fun, args, argnums, budget, steps, show, skip_slower=False):
    self.fun, self.args, self.argnums = fun, args, argnums
    self.budget, self.steps, self.show = budget, steps, show
    self.skip_slower = skip_slower
    self.trials: list[Trial] = []
    self.origin: dict[str, object] = {}  # trial name → the method as generated
    self._traced = None

  def traced(self):
    """The step traced once (None if it cannot be traced: the trials will say why)."""
    if self._traced is None:
      from jaxdist.api import ParallelizedFunc

      func = ParallelizedFunc(self.fun, m.DataParallel(), *self.argnums)
      try:
        self._traced = trace_step(self.fun, self.args, func._static_argnums(self.args),
                                  func.batch_argnums, func.donate_argnums)
      except errors.JaxdistError:
        self._traced = False
    return self._traced or None

  def param_paths(self) -> list[str]:
    """The step's parameter leaf paths ([] if it cannot be traced)."""
    traced = self.traced()
    return [] if traced is None else [l.path for l in traced.inputs if l.role == PARAM]

  def forward_matmuls(self) -> int | None:
    """About how many dots and convolutions the forward pass has (a third of the step's:
    the backward has two per forward one); None if the step cannot be traced."""
    traced = self.traced()
    if traced is None:
      return None
    inlined = jaxpr_util.inline_calls(traced.closed_jaxpr, jaxpr_util.PLAN_INLINE)
    return sum(e.primitive.name in ("dot_general", "conv_general_dilated")
               for e in inlined.jaxpr.eqns) // 3

  def add(self, trial: Trial) -> None:
    if jax.process_count() > 1:
      # Later candidates and the pick follow from the trials: every process takes
      # process 0's measurements, so that all run the same walk.
      trial = dataclasses.replace(trial, **dict(zip(AGREED, agree.process_zeros(
          [getattr(trial, f) for f in AGREED]))))
    self.trials.append(trial)
    if self.show:
      figures = []
      if trial.step_time_s is not None:
        figures.append(f"{trial.step_time_s * 1e3:.2f} ms/step")
      if trial.memory_bytes is not None:
        figures.append(f"{trial.memory_bytes / 1e6:.2f} MB/device")
      print(f"[tune] {trial.name}: {trial.status}"
            + (f", {', '.join(figures)}" if figures else "")
            + (f" ({trial.reason})" if trial.reason else ""), file=sys.stderr, flush=True)

  def run(self, name: str, method) -> None:
    self.origin[name] = method
    trial = None
    try:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", errors.JaxdistWarning)
        trial = self._trial(name, method)
      said = sorted({_first_line(w.message) for w in caught
                     if issubclass(w.category, errors.JaxdistWarning)})
      if said and not trial.reason:
        trial = dataclasses.replace(trial, reason="; ".join(said)[:300])
      if any(issubclass(w.category, errors.ResultsDifferWarning) for w in caught):
        trial = dataclasses.replace(trial, exact=False)
      self.add(trial)
    finally:
      if trial is None or trial.compile_s is not None:
        gc.collect()  # the trial's executables and buffers go before the next one

  def _trial(self, name, method) -> Trial:
    from jaxdist.api import ParallelizedFunc
    from jaxdist.estimate import estimate

    budget = self.budget
    est_bytes = est_time = None
    func = ParallelizedFunc(self.fun, method, *self.argnums)
    # A pipeline's estimate plans its stages (a fifth to a third of its compile): made
    # only where it can save the compile, under a budget; the estimator does not model
    # the SPMD pipeline runtime.
    pipeline = isinstance(method, m.PipeshardParallel)
    if not pipeline or (budget is not None and method.runtime != "spmd"):
      try:
        est = estimate(func, *self.args)
        est_bytes, est_time = est.memory_per_device, est.step_time_s
      except errors.InfeasiblePlanError as e:
        return Trial(name, method, "oom", reason=_first_line(e))
      except errors.JaxdistError as e:
        return Trial(name, method, "skipped", reason=_first_line(e))
      if (budget is not None and not est.approximate
          and est_bytes > budget * (1 + SKIP_MARGIN)):
        return Trial(name, method, "skipped", reason=(
            f"estimated {est_bytes / 1e6:.1f} MB per device > budget {budget / 1e6:.1f} MB "
            f"by more than {SKIP_MARGIN:.0%}"), estimated_memory_bytes=est_bytes,
            estimated_step_time_s=est_time)
    common = dict(estimated_memory_bytes=est_bytes, estimated_step_time_s=est_time)
    slower = self._much_slower(est_time)
    if slower:
      return Trial(name, method, "skipped", reason=slower, **common)
    start = time.perf_counter()
    try:
      exe = func.get_executable(*self.args)
    except errors.InfeasiblePlanError as e:
      return Trial(name, method, "oom", reason=_first_line(e), **common)
    except errors.JaxdistError as e:
      return Trial(name, method, "skipped", reason=_first_line(e), **common)
    except Exception as e:  # noqa: BLE001  (a failing candidate is a result, not a crash)
      status = "oom" if _out_of_memory(e) else "error"
      return Trial(name, method, status, reason=_first_line(e), **common)
    compile_s = time.perf_counter() - start
    memory = float(exe.get_total_allocation_size())
    mesh = tuple(exe.plan.mesh_shape) if hasattr(exe, "plan") else None
    if isinstance(method, m.ShardParallel):
      # The saved plan reproduces this trial without a new search.
      method = dataclasses.replace(method, plan=exe.plan, logical_mesh_shape=None)
    common.update(memory_bytes=memory, compile_s=compile_s, mesh_shape=mesh)
    if budget is not None and memory > budget:
      return Trial(name, method, "oom", reason=(
          f"compiled {memory / 1e6:.1f} MB per device > budget {budget / 1e6:.1f} MB"), **common)
    try:
      seconds = _time(func, self.args, self.steps)
    except Exception as e:  # noqa: BLE001
      status = "oom" if _out_of_memory(e) else "error"
      return Trial(name, method, status, reason=_first_line(e), **common)
    return Trial(name, method, "ok", step_time_s=seconds, **common)


  def _much_slower(self, est_time: float | None) -> str | None:
    """Why a candidate estimated at ``est_time`` seconds per step is not worth compiling
    (over :data:`SLOWER_SKIP` times the estimate of the fastest trial so far), or None."""
    if not self.skip_slower or est_time is None:
      return None
    measured = [t for t in self.trials if t.status == "ok" and t.estimated_step_time_s]
    if not measured:
      return None
    fastest = min(measured, key=lambda t: t.step_time_s)
    # (A calibration profile is per host: the decision must be process 0's.)
    ratio = agree.process_zeros(est_time / fastest.estimated_step_time_s)
    if ratio <= SLOWER_SKIP:
      return None
    return (f"estimated {est_time * 1e3:.3g} ms per step, {ratio:.1f}x the estimate for "
            f"{fastest.name} ({fastest.estimated_step_time_s * 1e3:.3g} ms; the fastest so far, "
            f"measured {fastest.step_time_s * 1e3:.3g} ms): over {SLOWER_SKIP:g}x, not compiled")


def _time(func, args, steps: int) -> float:
  """Median seconds of ``steps`` calls after a warm-up, on copies of ``args`` (the state a
  call returns is fed to the next, as a training loop does)."""
  call = list(jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, args))
  times = []
  for i in range(steps + 1):
    start = time.perf_counter()
    out = func(*call)
    jax.block_until_ready(out)
    if i:
      times.append(time.perf_counter() - start)
    if (isinstance(out, tuple) and out and call
        and jax.tree.structure(out[0]) == jax.tree.structure(call[0])):
      call[0] = out[0]
  return statistics.median(times)


def _out_of_memory(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or isinstance(e, MemoryError)


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
