"""The front door: ``jaxdist.parallelize``."""

from __future__ import annotations

import dataclasses
import functools
import inspect as pyinspect
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax import tree_util

from jaxdist import errors
from jaxdist import follow
from jaxdist import jaxpr_util
from jaxdist import methods as m
from jaxdist.coupling import batch_coupling, warn_split
from jaxdist.executable import Executable, allocation_bytes, compile_layout, make_plan
from jaxdist.grad import SEEN
from jaxdist.layouts import check_batch_divisible, data_parallel_layout
from jaxdist.mesh import LogicalMesh
from jaxdist.pipeline import capture
from jaxdist.pipeline import spmd
from jaxdist.pipeline.runtime import PipelineExecutable, loss_equation
from jaxdist.recompute import RecomputeRequest, recomputing
from jaxdist.shard.planner import plan_shard_parallel, recursion_batch
from jaxdist.trace import (PARAM, TracedStep, gc_paused, is_array, leaf_signature, trace_step,
                           with_micro_batch_trace)


# How often ShardParallel plans again when the compiled step exceeds
# memory_budget_per_device (see AutoShardingOption.memory_budget_per_device).
BUDGET_RETRIES = 2


def parallelize(fun: Callable | None = None, *, method: m.Method | None = None,
                static_argnums: str | int | tuple[int, ...] = "auto",
                donate_argnums: str | int | tuple[int, ...] = "auto",
                batch_argnums: int | tuple[int, ...] = (1,)):
  """Parallelizes a single-device training step.

  The first call traces the step, plans its layout with ``method`` and compiles it;
  later calls with the same argument shapes and dtypes (and equal static arguments)
  reuse the compiled step without tracing again. A new shape compiles a new one.

  Args:
    fun: the step, e.g. ``train_step(state, batch) -> (state, metrics)``.
    method: a method object such as ``jaxdist.DataParallel()``; default
      ``ShardParallel()`` (the ILP chooses every sharding and the mesh shape).
    static_argnums: ``"auto"`` (an argument with no jax or numpy array leaves is a
      Python value and static: ints, bools, strings, None, callables; Python numbers
      *inside* an array pytree are traced, and so is an argument of Python floats only,
      such as a learning rate from a schedule, as ``jax.jit`` traces it; new values of a
      static argument compile anew, and a warning says when that keeps happening) or
      explicit argument numbers.
    donate_argnums: ``"auto"`` (every non-batch argument the step returns updated,
      such as the train state) or explicit argument numbers; ``()`` donates nothing.
    batch_argnums: arguments whose every leaf is split on dim 0.

  Returns:
    A :class:`ParallelizedFunc` (or a decorator making one, if ``fun`` is None).

  Raises:
    InvalidArgumentError: ``method`` is not a method object, or an argnums is malformed.
  """
  if fun is None:
    return functools.partial(parallelize, method=method, static_argnums=static_argnums,
                             donate_argnums=donate_argnums, batch_argnums=batch_argnums)
  return ParallelizedFunc(fun, method, static_argnums, donate_argnums, batch_argnums)


def _as_tuple(value) -> tuple:
  return value if isinstance(value, tuple) else (value,)


RECOMPILES_WARNED = 3


def _argnums(name: str, value, allow_auto: bool):
  if allow_auto and value == "auto":
    return "auto"
  if isinstance(value, int) and not isinstance(value, bool):
    value = (value,)
  if (not isinstance(value, (tuple, list))
      or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
    valid = '"auto", ' if allow_auto else ""
    raise errors.InvalidArgumentError(
        f"{name}={value!r} is not valid: use {valid}a non-negative int or a tuple of them.")
  return tuple(sorted(set(value)))


def _batch_hint(args) -> str:
  """Names the arguments that could be the batch: those whose array leaves share a leading dim."""
  leading = lambda a: {jax.numpy.shape(x)[:1] for x in tree_util.tree_leaves(a) if is_array(x)}
  fits = [i for i, a in enumerate(args) if len(leading(a) - {()}) == 1]
  if not fits:
    return ""
  return f" (pass batch_argnums=({fits[-1]},) if argument {fits[-1]} is the batch)"


@dataclasses.dataclass(frozen=True)
class Planned:
  """A step traced and planned, not compiled.

  Attributes:
    traced: the step as traced (full batch).
    step: the step the layout refers to (call-inlined for ShardParallel, with its
      micro-batch trace where the layout splits gradients).
    layout: the method's shardings.
    shard_plan: the shard planner's result (ShardParallel), else None.
    static_argnums: the argument numbers treated as static.
    timings: seconds spent tracing (``trace_s``) and planning (``plan_s``).
    method: the method it was planned under where that is not the function's own (the
      estimate's re-plan of a micro-batched step with the loop's buffers in the memory
      model); the compile's re-plans on an overshoot go on from its options.
  """

  traced: Any
  step: Any
  layout: Any
  shard_plan: Any
  static_argnums: tuple[int, ...]
  timings: dict
  method: Any = None


def _evaluation(step: TracedStep) -> bool:
  """Whether the step differentiates nothing with jaxdist and updates no parameter."""
  return (not jaxpr_util.count_primitive(step.closed_jaxpr.jaxpr, capture.pipeline_loss_p.name)
          and not any(src is not None and step.inputs[src].role == PARAM
                      for src in step.output_source))


def _untraced(retrace, layout) -> str | None:
  """Why the step does not trace on a device's share of the batch (``retrace(divisor)``
  fails: it takes the batch size as a constant), or None. Under the per-device layout
  without micro-batches only: with them, the failure is the user's error to see."""
  divisor = math.prod(layout.logical_mesh.axis_size(a) for a in layout.batch_axes)
  if layout.grad_reduce_specs is None or layout.num_micro_batches > 1 or divisor == 1:
    return None
  try:
    retrace(divisor)  # (cached: the layout's trace below)
  except errors.BatchDivisibilityError as e:
    return str(e)
  return None


class ParallelizedFunc:
  """A step wrapped by :func:`parallelize`; call it like the original function."""

  def __init__(self, fun, method, static_argnums, donate_argnums, batch_argnums):
    if method is None:
      method = m.ShardParallel()
    if not isinstance(method, m.Method):
      raise errors.InvalidArgumentError(
          f"method={method!r} is not a jaxdist method; use one of jaxdist.DataParallel(), "
          f"jaxdist.Zero2Parallel(), jaxdist.Zero3Parallel(), jaxdist.ShardParallel(), "
          f"jaxdist.PipeshardParallel().")
    self.fun = fun
    self.method = method
    self.static_argnums = _argnums("static_argnums", static_argnums, allow_auto=True)
    self.donate_argnums = _argnums("donate_argnums", donate_argnums, allow_auto=True)
    self.batch_argnums = _argnums("batch_argnums", batch_argnums, allow_auto=False)
    self._executables: dict[Any, Executable] = {}
    self._planned: dict[Any, Planned] = {}  # plans made by planned(), used by the compile
    self._logical_mesh = None
    self._static_floats: set[int] = set()  # float arguments the step needs as Python values
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    args = self._positional(args, kwargs)
    if isinstance(self.method, m.CreateStateParallel):
      return self.method.train_step.create_state(self.fun, *args,
                                                 other_args=_as_tuple(self.method.other_args))
    exe, dyn_leaves = self._lookup(args)
    return exe.call_flat(dyn_leaves)

  def _positional(self, args: tuple, kwargs: dict) -> tuple:
    """``args`` with each keyword argument at its parameter's position (and the defaults
    of the parameters skipped before it): argument numbers (batch, static, donated) are
    positions."""
    if not kwargs:
      return args
    try:
      signature = pyinspect.signature(self.fun)
      bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
      raise errors.UnknownArgumentError(
          f"{getattr(self.fun, '__name__', 'the step')} called with keyword arguments "
          f"{sorted(kwargs)}: {e}") from None
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    other = [name for name in kwargs if name not in {p.name for p in positional}]
    if other:
      raise errors.InvalidArgumentError(
          f"keyword arguments {other} of {getattr(self.fun, '__name__', 'the step')} are not "
          f"positional parameters: jaxdist numbers arguments by position (batch_argnums, "
          f"static_argnums); pass them by position or bind them with functools.partial.")
    last = max(k for k, p in enumerate(positional) if p.name in bound.arguments)
    return tuple(bound.arguments.get(p.name, p.default) for p in positional[:last + 1])

  def create_state(self, init_fn, *init_args, batch=None, other_args=None):
    """Runs ``init_fn(*init_args)`` so that the state it returns is born in the layout this
    step wants for its first argument (nothing is created on one device and moved).

    The step is planned and compiled from abstract shapes (``jax.eval_shape`` of
    ``init_fn``; nothing is allocated), and ``init_fn`` runs under ``jax.jit`` with the
    plan's shardings as its output shardings. The first call of the step with the state
    reuses that compilation.

    Args:
      init_fn: makes the state, e.g. ``lambda key: TrainState.create(...)``.
      *init_args: its arguments.
      batch: the step's second argument (an example batch; arrays or
        ``jax.ShapeDtypeStruct``s), for a ``step(state, batch)``.
      other_args: all of the step's arguments after the state, instead of ``batch``.
    """
    other = _as_tuple(other_args) if other_args is not None else (
        () if batch is None else (batch,))
    abstract = jax.eval_shape(init_fn, *init_args)
    args = (abstract, *other)
    static = self._static_argnums(args)
    if 0 in static:
      raise errors.InvalidArgumentError(
          "create_state: init_fn returns no arrays, so it is not a state this step shards.")
    exe = self.get_executable(*args)
    shardings, tree = jax.tree.flatten(exe.input_shardings[0])
    # One jit per device set (a pipeline's stages live on different sub-meshes); each
    # computes only its own leaves (XLA drops the rest).
    groups: dict = {}
    for k, s in enumerate(shardings):
      groups.setdefault(tuple(d.id for d in s.mesh.devices.flat), []).append(k)
    leaves = [None] * len(shardings)
    for members in groups.values():
      def part(*a, members=members):
        flat = jax.tree.leaves(init_fn(*a))
        return [flat[k] for k in members]
      made = jax.jit(part, out_shardings=[shardings[k] for k in members])(*init_args)
      for k, x in zip(members, made):
        leaves[k] = x
    return jax.tree.unflatten(tree, leaves)

  def last_executable(self):
    """The executable compiled most recently (None before the first compile)."""
    return next(reversed(self._executables.values()), None)

  def get_executable(self, *args, **kwargs) -> Executable:
    """The compiled step for these arguments (compiling it on first use)."""
    return self._lookup(self._positional(args, kwargs))[0]

  def _lookup(self, args):
    static = self._static_argnums(args)
    dyn_leaves, key = self._key(args, static)
    exe = None if key is None else self._executables.get(key)
    if exe is None:
      try:
        exe = self._compile(args, static, self._planned.pop(key, None) if key else None)
      except jax.errors.ConcretizationTypeError:
        # A float argument the step branches on in Python (``if rate > 0``): static after all.
        floats = {i for i in range(len(args)) if i not in static and i not in self.batch_argnums
                  and not any(is_array(x) for x in tree_util.tree_leaves(args[i]))}
        if self.static_argnums != "auto" or not floats - self._static_floats:
          raise
        self._static_floats |= floats
        return self._lookup(args)
      exe.bind_keywords = self._positional
      if key is not None:
        self._executables[key] = exe
        self._warn_recompiles(key)
    return exe, dyn_leaves

  def _warn_recompiles(self, key):
    """Warns (once) when the same array shapes have been compiled for
    ``RECOMPILES_WARNED`` different values of the static arguments: a value that changes
    every step (a step counter passed as an int) recompiles every step."""
    same = [k for k in self._executables if k[:2] == key[:2] and k[3:] == key[3:]]
    if len(same) == RECOMPILES_WARNED:
      warnings.warn(
          f"{getattr(self.fun, '__name__', 'the step')} was compiled {len(same)} times for "
          f"the same array shapes and new values of its static arguments (now "
          + ", ".join(f"argument {i} = {v!r:.40}" for i, v in zip(key[1], key[2]))
          + "); each new value traces, plans and compiles anew. Pass a value "
          f"that changes between calls as an array (jnp.asarray(x)), or name the static "
          f"arguments with static_argnums.", errors.JaxdistWarning, stacklevel=4)

  def _key(self, args, static):
    """(dynamic leaves, the cache key of their signature), or a None key for arguments
    that cannot be hashed (an unhashable static, a non-array leaf: _compile reports it)."""
    dyn_leaves, dyn_tree = tree_util.tree_flatten(
        tuple(a for i, a in enumerate(args) if i not in static))
    try:
      key = (len(args), static, tuple(args[i] for i in static), dyn_tree,
             tuple(leaf_signature(x) for x in dyn_leaves))
      hash(key)
    except (TypeError, AttributeError):
      key = None
    return dyn_leaves, key

  def _static_argnums(self, args) -> tuple[int, ...]:
    for b in self.batch_argnums:
      if b >= len(args):
        raise errors.BatchArgnumsError(
            f"batch_argnums={self.batch_argnums!r} names argument {b}, but the step was called "
            f"with {len(args)} arguments; valid argument numbers are 0..{len(args) - 1}.")
    if self.static_argnums != "auto":
      bad = [s for s in self.static_argnums if s >= len(args) or s in self.batch_argnums]
      if bad:
        raise errors.InvalidArgumentError(
            f"static_argnums={self.static_argnums!r}: {bad} is out of range for {len(args)} "
            f"arguments or is also a batch argument.")
      return self.static_argnums

    def python_values(i, a):
      leaves = tree_util.tree_leaves(a)
      return not any(is_array(x) for x in leaves) and (
          i in self._static_floats or not (leaves and all(type(x) is float for x in leaves)))

    return tuple(i for i, a in enumerate(args)
                 if i not in self.batch_argnums and python_values(i, a))

  @gc_paused()
  def planned(self, *args) -> "Planned":
    """Traces and plans the step for these arguments without compiling it (SPMD methods;
    what estimates and tuning read)."""
    if isinstance(self.method, m.PipeshardParallel):
      raise errors.InvalidArgumentError(
          "planned() covers the SPMD methods; a PipeshardParallel step is planned per stage "
          "when it compiles.")
    static = self._static_argnums(args)
    self._check_args(args, static)
    request = self._request()
    start = time.perf_counter()
    traced = self._trace_spmd(args, static, request)
    timings = {"trace_s": time.perf_counter() - start}
    start = time.perf_counter()
    with recomputing(request):
      step, layout, shard_plan = self._plan(self.method, traced, args, static, self._mesh())
    timings["plan_s"] = time.perf_counter() - start
    planned = Planned(traced, step, layout, shard_plan, static, timings)
    self._hand_over(planned, args)
    return planned

  def _hand_over(self, planned: "Planned", args) -> None:
    """Keeps ``planned`` for these arguments: the compile that follows starts from it."""
    _, key = self._key(args, planned.static_argnums)
    if key is not None and key not in self._executables:
      self._planned = {key: planned}

  def _replanned(self, planned: "Planned", method: m.Method, *args) -> "Planned":
    """``planned``'s trace planned again under ``method`` (another option of the same
    SPMD method, which the trace does not depend on), for the estimate of a re-plan."""
    start = time.perf_counter()
    with recomputing(self._request()):
      step, layout, shard_plan = self._plan(method, planned.traced, args,
                                            planned.static_argnums, self._mesh())
    return Planned(planned.traced, step, layout, shard_plan, planned.static_argnums,
                   {"trace_s": 0.0, "plan_s": time.perf_counter() - start}, method)

  @gc_paused()
  def planned_stages(self, *args) -> PipelineExecutable:
    """PipeshardParallel: traces the step, forms its stages and plans their programs,
    compiling nothing (what estimates read: ``.stages``, ``.schedule``, where state lives)."""
    if not isinstance(self.method, m.PipeshardParallel):
      raise errors.InvalidArgumentError(
          f"planned_stages() is for PipeshardParallel; this step's method is "
          f"{self.method.name} (use planned()).")
    static = self._static_argnums(args)
    self._check_args(args, static)
    return self._pipeline(args, static, self._mesh(), self._request(), compile=False)

  def _request(self):
    return (None if self.method.recompute_modules is None else
            RecomputeRequest.parse(self.method.recompute_modules, self.method.name))

  def _check_args(self, args, static):
    for i in static:
      try:
        hash(args[i])
      except TypeError:
        raise errors.InvalidArgumentError(
            f"argument {i} ({type(args[i]).__name__}) holds no arrays, so it is static, but it "
            f"is not hashable; pass it as a hashable value (tuple, frozen dataclass) or make it "
            f"hold arrays.") from None
    for b in self.batch_argnums:
      if not any(is_array(x) for x in tree_util.tree_leaves(args[b])):
        raise errors.NonArrayLeafError(
            f"batch argument {b} ({args[b]!r:.60}) holds no arrays; batch arguments must be "
            f"arrays or pytrees of arrays with a leading batch dimension{_batch_hint(args)}.")

  @gc_paused()
  def _compile(self, args, static, planned: Planned | None = None):
    if isinstance(self.method, m.CreateStateParallel):
      raise errors.InvalidArgumentError(
          "a function parallelized with CreateStateParallel is called to create the state; "
          "it has no executable of its own (the train step's is train_step.get_executable).")
    self._check_args(args, static)
    lmesh = self._mesh()
    request = self._request()
    dyn_argnums = tuple(i for i in range(len(args)) if i not in static)
    if isinstance(self.method, m.PipeshardParallel):
      return self._pipeline(args, static, lmesh, request)
    start = time.perf_counter()
    traced = planned.traced if planned else self._trace_spmd(args, static, request)
    timings = dict(planned.timings) if planned else {"trace_s": time.perf_counter() - start}
    timings.setdefault("plan_s", 0.0)
    with recomputing(request):
      method = planned.method if planned is not None and planned.method else self.method
      budget = (method.options.memory_budget_per_device
                if isinstance(method, m.ShardParallel) else None)
      best = None  # (bytes, attempt, step, layout, shard_plan, compiled): the smallest yet
      for attempt in range(BUDGET_RETRIES + 1):
        try:
          if attempt == 0 and planned is not None:
            result = planned.step, planned.layout, planned.shard_plan
          else:
            start = time.perf_counter()
            result = self._plan(method, traced, args, static, lmesh)
            timings["plan_s"] += time.perf_counter() - start
        except errors.InfeasiblePlanError:
          if attempt == 0:
            raise
          break  # no plan meets the tighter budget
        compiled = compile_layout(*result[:2], timings)
        used, replans = allocation_bytes(compiled), attempt
        if best is None or used < best[0]:
          best = (used, attempt, *result, compiled)
        if budget is None or used <= budget:
          break
        # The planner's memory model is an estimate; XLA's figure is the one to meet. Plan
        # again: with micro-batches, first with the loop's buffers in the model, at the
        # budget; then with the budget scaled down by the overshoot.
        options = method.options
        if result[1].num_micro_batches > 1 and not options._loop_buffers:
          options = dataclasses.replace(options, _loop_buffers=True)
        else:
          options = dataclasses.replace(
              options, memory_budget_per_device=options.memory_budget_per_device * budget / used
              * 0.99)
        method = dataclasses.replace(method, auto_sharding_option=options)
      # None met the budget: the plan that came closest.
      used, kept, step, layout, shard_plan, compiled = best
    predicted = None
    if shard_plan is None and isinstance(self.method, (m.DataParallel, m.Zero2Parallel,
                                                       m.Zero3Parallel)):
      from jaxdist.estimate import fixed_layout_collectives
      predicted = fixed_layout_collectives(self.method, step, layout, lmesh)
    plan = make_plan(self.method.name, step, layout, shard_plan, predicted)
    if budget is not None:
      note = (f"memory_budget_per_device={budget:.0f}: compiled {used:.0f} bytes per device"
              + (f" after {replans} re-plan(s)" if replans else ""))
      if used > budget:
        if kept != replans:
          note += f" (the plan of attempt {kept + 1} kept: the smallest compiled)"
        warnings.warn(f"ShardParallel: the compiled step needs {used:.0f} bytes per device, over "
                      f"memory_budget_per_device={budget:.0f} after {replans} re-plans (the "
                      f"smallest of them kept); the planner's memory estimate is below XLA's "
                      f"here.", errors.JaxdistWarning, stacklevel=3)
      plan = dataclasses.replace(plan, notes=plan.notes + (note,))
    return Executable(step, layout, compiled, plan, dyn_argnums, timings)

  def _pipeline(self, args, static, lmesh, request, compile: bool = True):
    """The PipelineExecutable of these arguments (``compile=False``: stages planned only)."""
    dyn_argnums = tuple(i for i in range(len(args)) if i not in static)
    with recomputing(request), capture.capturing():
      step = trace_step(self.fun, args, static, self.batch_argnums, self.donate_argnums)
      step = dataclasses.replace(step, closed_jaxpr=jaxpr_util.inline_calls(step.closed_jaxpr))
      k = self.method.num_micro_batches or 1
      check_batch_divisible(step, 1, "")  # a scalar batch leaf (divisibility: per runtime)
      step = (dataclasses.replace(step, micro_jaxpr=step.closed_jaxpr) if k == 1 else
              with_micro_batch_trace(self.fun, args, static, step, k, jaxpr_util.CALLS))
    if request is not None:
      request.check_all_matched(self.method.name)

    def retrace(divisor):  # the step at 1/divisor of the batch (per-device stages)
      with recomputing(request), capture.capturing():
        return with_micro_batch_trace(self.fun, args, static, step, divisor,
                                      jaxpr_util.CALLS).micro_jaxpr

    if compile and _evaluation(step):
      return self._evaluation_executable(args, static, lmesh)
    index = loss_equation(step.closed_jaxpr.jaxpr, step.unseen_gradients)
    runtime, why_not = self.method.runtime, None
    if runtime == "auto" and self.method.pipeline_schedule == "1f1b":
      runtime, why_not = "mpmd", spmd.WHY_1F1B_ON_THE_DRIVER
    if not compile and runtime != "mpmd":  # which runtime a compile would use
      planned = self._spmd(lambda: spmd.plan(self.method, step, lmesh, index, retrace))
      if not isinstance(planned, str):
        exe = PipelineExecutable(self.method, step, lmesh, dyn_argnums, retrace, compile)
        exe.spmd_runtime = True
        return exe
    if compile and runtime != "mpmd":
      built = self._spmd(lambda: spmd.build(self.method, step, lmesh, index, dyn_argnums,
                                            retrace))
      if not isinstance(built, str):
        return built
      if self.method.runtime == "spmd":
        raise errors.InvalidArgumentError(
            f"PipeshardParallel(runtime='spmd') cannot pipeline this step in one program: "
            f"{built}. Use runtime='mpmd' (or 'auto', which falls back to it).")
      why_not = built
    exe = PipelineExecutable(self.method, step, lmesh, dyn_argnums, retrace, compile)
    if why_not is not None and compile:
      exe.plan = dataclasses.replace(exe.plan, notes=(f"runtime mpmd: {why_not}",
                                                      *exe.plan.notes))
    return exe

  def _evaluation_executable(self, args, static, lmesh: LogicalMesh):
    """An evaluation step under PipeshardParallel: ShardParallel over the same devices."""
    method = m.ShardParallel(devices=lmesh,
                             auto_sharding_option=self.method.default_auto_sharding_option)
    inner = ParallelizedFunc(self.fun, method, self.static_argnums, self.donate_argnums,
                             self.batch_argnums)
    exe = inner._compile(args, static)
    exe.plan = dataclasses.replace(exe.plan, notes=(
        f"PipeshardParallel: the step differentiates nothing and updates no parameter (an "
        f"evaluation step), so it has no stages to pipeline: it runs as ShardParallel over "
        f"the pipeline's {lmesh.num_devices} devices", *exe.plan.notes))
    return exe

  def _spmd(self, attempt):
    """``attempt()`` (the SPMD pipeline runtime's plan or build: a result, or why not);
    an unexpected failure is our shortfall: under runtime="auto" it warns and becomes the
    reason, so the driver runs the step."""
    try:
      return attempt()
    except errors.JaxdistError:
      raise
    except Exception as e:
      if self.method.runtime == "spmd":
        raise
      why = f"the SPMD runtime failed on this step ({type(e).__name__}: {e})"
      warnings.warn(f"PipeshardParallel: {why}; running it on the MPMD driver.",
                    errors.JaxdistWarning, stacklevel=4)
      return why

  def _trace_spmd(self, args, static, request):
    """The traced step of an SPMD method (with its recomputation request applied)."""
    with recomputing(request):
      traced = trace_step(self.fun, args, static, self.batch_argnums, self.donate_argnums)
    if request is not None:
      if traced.marker_index is None:
        raise errors.GradientMarkerError(
            f"{self.method.name}(recompute_modules={self.method.recompute_modules!r}) is "
            f"applied to the function the step differentiates, and jaxdist found none: "
            f"{SEEN}. Use jaxdist.value_and_grad if jax's is bound elsewhere.")
      request.check_all_matched(self.method.name)
    return traced

  def _plan(self, method, step, args, static, lmesh):
    """Plans ``step`` with ``method`` (a fixed layout or the shard planner) and traces it
    again at the micro-batch size where the layout needs it; nothing is compiled."""
    shard_plan = None
    if isinstance(method, m.FollowParallel):
      method, lmesh = follow.shard_method(method, step)
    traced, k = step, method.num_micro_batches or 1

    @functools.cache
    def retrace(divisor, planned=isinstance(method, m.ShardParallel)):
      """The step at 1/divisor of the batch; for the shard planner (``planned``) inlined
      as its equations are and with recomputations in loops tied as it ties them where
      the step compiles unrolled (its micro-batch trace is the layout's too when the batch
      is not split)."""
      tie = planned and k > 1
      return with_micro_batch_trace(
          self.fun, args, static, traced, divisor, jaxpr_util.PLAN_INLINE if planned else (),
          tie, recursion_batch(traced, k) if tie else None)

    if isinstance(method, m.ShardParallel):
      shard_plan = plan_shard_parallel(method, step, lmesh,
                                       micro_trace=lambda d: retrace(d).micro_jaxpr)
      step, layout = shard_plan.step, shard_plan.layout
      coupled = layout.num_micro_batches > 1 and batch_coupling(step)
      if coupled:  # (the plan's notes say so too; a cached plan skips the planner)
        warn_split(coupled, f"with num_micro_batches={layout.num_micro_batches}, the "
                            f"micro-batches")
    else:
      layout = data_parallel_layout(method, step, lmesh)
      untraced = _untraced(retrace, layout)
      if untraced:
        warnings.warn(f"{method.name}: {untraced} It runs as one whole-batch program instead "
                      f"(exact; XLA places its gradients' reduction).", errors.JaxdistWarning,
                      stacklevel=4)
        layout = data_parallel_layout(method, step, lmesh, whole_batch=untraced)
      whole = layout.grad_reduce_specs is None and (
          untraced or batch_coupling(step) or step.num_markers + step.unseen_gradients > 1)
      if whole or (layout.num_micro_batches > 1 and not layout.batch_axes):
        # One program over the whole batch or, with micro-batches, over each micro-batch
        # (its batch statistics reduced across devices, or several gradients: a
        # Hessian-vector product's reduced beside the gradient's): the shard planner places
        # its equations with the layout's inputs pinned, so that XLA compiles the
        # collectives the plan predicts instead of choosing its own.
        pinned = m.ShardParallel(devices=lmesh, num_micro_batches=layout.num_micro_batches,
                                 plan=make_plan("ShardParallel", step, layout))
        retrace = functools.partial(retrace, planned=True)
        shard_plan = plan_shard_parallel(pinned, step, lmesh,
                                         micro_trace=lambda d: retrace(d).micro_jaxpr)
        step, layout = shard_plan.step, dataclasses.replace(shard_plan.layout, notes=(
            *layout.notes, "the shard planner placed the program's equations with these "
            "input layouts pinned (its predicted collectives are checked against XLA's)"))
      elif step.marker_index is None and isinstance(method, m.Zero3Parallel):
        layout = dataclasses.replace(layout, notes=(
            *layout.notes, "jaxdist does not see the step's gradient (see jaxdist.grad): XLA "
            "places the parameters' gathers and the gradients' reduction itself, so the "
            "predicted collectives (each split parameter gathered for the forward and for "
            "the backward) may differ from the compiled ones"))
      elif step.marker_index is not None:
        from jaxdist.estimate import (batch_values_moved, examples_reduced_in_update,
                                      unmodelled_update)
        notes = []
        zero = isinstance(method, (m.Zero2Parallel, m.Zero3Parallel))
        ops, chained = (unmodelled_update(step, layout, lmesh)
                        if zero and layout.grad_reduce_specs is not None else ([], False))
        moved = batch_values_moved(step, layout, lmesh)[2]
        if moved:
          notes.append(f"the step runs {'/'.join(moved)} on examples outside its gradient (a "
                       f"queue concatenated with the batch's keys, say): XLA moves those "
                       f"examples itself, so the predicted collectives leave that out")
        if zero and examples_reduced_in_update(step):
          notes.append("the update sums per-example aux outputs of the gradient (usage "
                       "counts, say): XLA gathers the examples or reduces their partial sums "
                       "itself, so the predicted collectives leave those out")
        if ops:
          notes.append(f"the update runs {'/'.join(ops)} on split state or gradients (Muon's "
                       f"Newton-Schulz iterations, say): XLA gathers or reduces for them "
                       f"itself, so the predicted collectives leave those out")
        if chained:
          notes.append("the update's reductions over split state read each other's results "
                       "(optax.safe_norm's second pass, LAMB's trust ratios): XLA combines "
                       "their small all-reduces as its schedule allows, so their predicted "
                       "count (one) may be below the compiled one (their bytes are exact)")
        layout = dataclasses.replace(layout, notes=(*layout.notes, *notes))
    if layout.grad_reduce_specs is not None:
      divisor = layout.num_micro_batches * math.prod(
          layout.logical_mesh.axis_size(a) for a in layout.batch_axes)
      if divisor > 1:
        micro = retrace(divisor)
        step = dataclasses.replace(step, micro_jaxpr=micro.micro_jaxpr,
                                   micro_marker_index=micro.micro_marker_index)
    return step, layout, shard_plan

  def _mesh(self) -> LogicalMesh:
    if self._logical_mesh is None:
      self._logical_mesh = LogicalMesh.from_devices(self.method.devices)
    return self._logical_mesh
