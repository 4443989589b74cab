"""What a compile returns: a callable, introspectable compiled step."""

from __future__ import annotations

import time

import jax
import numpy as np
from jax import tree_util
from jax.sharding import NamedSharding

from jaxdist import errors
from jaxdist import jaxpr_util
from jaxdist.accumulate import split_step_fn
from jaxdist import inspect as hlo_inspect
from jaxdist.layouts import Layout
from jaxdist.plan import Plan, PlanEntry
from jaxdist.shard.rolled import rolled_fn
from jaxdist.trace import TracedStep


def place(x, sharding: NamedSharding, donated: bool = False):
  """Puts one leaf in ``sharding``; a no-op for an array that already is.

  A jax.Array that is about to be donated is copied when it moves: ``device_put``
  reuses the caller's buffer for device 0's shard of a replicated result (even with
  ``may_alias=False`` on jax 0.10.2), and the donation would delete the caller's array.

  In a multi-process job a host value (numpy, a Python number, a process-local array)
  is taken to be the *global* value, identical on every process, and each process
  contributes its addressable shards.
  """
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    if jax.process_count() == 1 or not x.is_fully_addressable:
      return jax.device_put(x.copy() if donated else x, sharding)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    # (a typed key, which numpy cannot hold: placed as its key data)
    data = place(jax.random.key_data(x), sharding, donated)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                      dtype=jax.dtypes.canonicalize_dtype(host.dtype))


def place_inputs(step: TracedStep, leaves, shardings) -> list:
  """Each dynamic input leaf in its sharding (copied where it moves and is donated).

  Raises:
    InvalidArgumentError: a leaf whose buffer an earlier call consumed (executing on a
      deleted buffer crashes the CPU runtime on jax 0.10.2 instead of raising).
  """
  placed = [place(x, s, leaf.argnum in step.donated_argnums)
            for x, s, leaf in zip(leaves, shardings, step.inputs)]
  for x, leaf in zip(placed, step.inputs):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise errors.InvalidArgumentError(
          f"{leaf.path} was deleted: its buffer was donated to an earlier call. Pass the "
          f"state that call returned, or parallelize with donate_argnums=().")
  return placed


class Executable:
  """A step compiled for one abstract signature of its arguments.

  Attributes:
    plan: the :class:`~jaxdist.plan.Plan` it was compiled from.
    layout: the shardings it was compiled with (``jaxdist.layouts.Layout``).
    traced_step: the traced step (inputs, roles, jaxpr) it was compiled from.
    input_shardings: pytree (of the dynamic arguments) of ``NamedSharding``.
    output_shardings: pytree (of the step's outputs) of ``NamedSharding``.
    auto_sharding_objective: the shard planner's objective in seconds, or None for
      methods with fixed layouts.
    timings: seconds of the first call by phase: ``trace_s`` (the user's step),
      ``plan_s`` (the method's planning, every re-plan included), ``lower_s`` (the
      planned step to StableHLO) and ``compile_s`` (XLA).
  """

  def __init__(self, step: TracedStep, layout: Layout, compiled, plan: Plan,
               dyn_argnums: tuple[int, ...], timings: dict | None = None):
    self.timings = dict(timings or {})
    self._step = step
    self.traced_step = step
    self.layout = layout
    self._compiled = compiled
    self._dyn_argnums = dyn_argnums
    mesh = layout.logical_mesh.mesh
    self._in_shardings = tuple(NamedSharding(mesh, s) for s in layout.in_specs)
    self._out_shardings = tuple(NamedSharding(mesh, s) for s in layout.out_specs)
    self.plan = plan
    self.auto_sharding_objective = plan.objective
    self.input_shardings = tree_util.tree_unflatten(step.in_tree, self._in_shardings)
    self.output_shardings = tree_util.tree_unflatten(step.out_tree, self._out_shardings)
    self._communication = None

  # The step's keyword arguments to positions (``ParallelizedFunc`` sets it; None: none).
  bind_keywords = None

  def __call__(self, *args, **kwargs):
    args = positional(self, args, kwargs)
    leaves = tree_util.tree_leaves(tuple(args[i] for i in self._dyn_argnums))
    return self.call_flat(leaves)

  def call_flat(self, leaves):
    """Runs the step on the flat dynamic leaves; returns the output pytree."""
    placed = place_inputs(self._step, leaves, self._in_shardings)
    out = self._compiled(*placed)
    return tree_util.tree_unflatten(self._step.out_tree, out)

  def get_hlo_text(self) -> str:
    """The optimized, partitioned HLO module XLA compiled."""
    return self._compiled.as_text()

  def memory_analysis(self):
    """As ``jax.stages.Compiled.memory_analysis()`` (per device)."""
    return self._compiled.memory_analysis()

  def cost_analysis(self):
    """As ``jax.stages.Compiled.cost_analysis()`` (per device)."""
    return self._compiled.cost_analysis()

  def get_total_allocation_size(self) -> int:
    """Bytes per device: arguments + outputs − aliased (donated) + temporaries.

    The CPU compiler's ``peak_memory_in_bytes`` leaves temporaries out, so the sum is
    formed here from the compiler's own components.
    """
    return allocation_bytes(self._compiled)

  def check_communication(self, tolerance: float = 0.10) -> list[str]:
    """Compares the plan's predicted collectives with what XLA compiled.

    Returns one line per collective kind: predicted and compiled count and result bytes
    per step, marked ``DIFFERS`` where either is more than ``tolerance`` apart
    (relative to the larger) or one side has none. The prediction already combines
    collectives as XLA does (``jaxdist.shard.combine``). DataParallel and ZeRO predict
    their layouts' reductions and gathers, and the reductions an optimizer makes across
    ZeRO's split state (global-norm clipping's sums of squares, LAMB's and adafactor's
    norms; their bytes, while XLA keeps LAMB's and adafactor's apart, one all-reduce per
    leaf, where one combined is predicted). A step
    that mixes examples (BatchNorm) runs under them as one program that the shard planner
    places with their input layouts pinned, and is predicted as a ShardParallel plan is.
    """
    return compare_collectives(self.plan.predicted_collectives, self.communication(), tolerance)

  def communication(self) -> dict[str, hlo_inspect.CollectiveStats]:
    """Collectives per step, loop-aware: kind → count, result bytes and wire bytes."""
    if self._communication is None:
      self._communication = hlo_inspect.collective_summary(self.get_hlo_text())
    return self._communication


def positional(exe, args: tuple, kwargs: dict) -> tuple:
  """``args`` with an executable's keyword arguments at their parameters' positions."""
  if not kwargs:
    return args
  if exe.bind_keywords is None:
    raise errors.InvalidArgumentError(
        f"this executable was built without its step's signature, so keyword arguments "
        f"{sorted(kwargs)} have no positions; pass them by position.")
  return exe.bind_keywords(args, kwargs)


def allocation_bytes(compiled) -> int:
  """Arguments + outputs − aliased (donated) + temporaries of a compiled program, per device."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)


def compare_collectives(predicted: dict, compiled: dict, tolerance: float) -> list[str]:
  """One line per kind: predicted (kind → {"count", "result_bytes"}) and compiled
  (kind → ``CollectiveStats``) count and bytes, marked ``DIFFERS`` where either is more
  than ``tolerance`` apart (relative to the larger) or one side has none."""
  lines = []
  for kind in sorted(set(predicted) | set(compiled)):
    p = predicted.get(kind, {"count": 0, "result_bytes": 0.0})
    c = compiled.get(kind, hlo_inspect.CollectiveStats())
    differs = (_apart(p["result_bytes"], c.result_bytes, tolerance)
               or _apart(p["count"], c.count, tolerance))
    lines.append(f"{kind}: predicted {p['count']} x, {p['result_bytes']:.0f} B; compiled "
                 f"{c.count} x, {c.result_bytes} B{'  DIFFERS' if differs else ''}")
  return lines


def _apart(a: float, b: float, tolerance: float) -> bool:
  return abs(a - b) > tolerance * max(a, b, 1e-12)


def make_plan(method_name: str, step: TracedStep, layout: Layout, shard_plan=None,
              predicted=None) -> Plan:
  """The plan record of a compiled step (``shard_plan``: the shard planner's result;
  ``predicted``: the collectives of a fixed layout, without one)."""
  lmesh = layout.logical_mesh
  entries = tuple(PlanEntry(leaf.path, leaf.shape, str(leaf.dtype), leaf.role, spec)
                  for leaf, spec in zip(step.inputs, layout.in_specs))
  extra = {} if predicted is None else dict(predicted_collectives=dict(predicted))
  if shard_plan is not None:
    extra = dict(objective=shard_plan.objective, mesh_objectives=dict(shard_plan.mesh_objectives),
                 predicted_collectives=dict(shard_plan.predicted_collectives))
  return Plan(method=method_name, mesh_shape=lmesh.shape, axis_names=lmesh.axis_names,
              inputs=entries, num_micro_batches=layout.num_micro_batches, notes=layout.notes,
              **extra)


def compile_layout(step: TracedStep, layout: Layout, timings: dict | None = None):
  """jax.jit of the traced step with the layout's shardings; returns the Compiled.

  ``timings``: ``lower_s`` and ``compile_s`` are added to it.
  """
  mesh = layout.logical_mesh.mesh
  in_shardings = tuple(NamedSharding(mesh, s) for s in layout.in_specs)
  out_shardings = tuple(NamedSharding(mesh, s) for s in layout.out_specs)
  if layout.grad_reduce_specs is not None:
    flat_fun = split_step_fn(step, mesh, layout.batch_axes, layout.num_micro_batches,
                             layout.grad_reduce_specs, layout.eqn_constraints,
                             layout.operand_constraints, layout.stream_inputs, layout.in_specs)
  elif layout.rolled is not None:
    flat_fun = rolled_fn(layout.rolled, mesh)
  elif layout.eqn_constraints or layout.operand_constraints:
    flat_fun = constrained_fn(step.closed_jaxpr, mesh, layout.eqn_constraints or {},
                              layout.operand_constraints or {})
  else:
    flat_fun = jax.extend.core.jaxpr_as_fun(step.closed_jaxpr)
  constraints = [None if c is None else NamedSharding(mesh, c) for c in layout.out_constraints]

  def run(*leaves):
    outs = flat_fun(*leaves)
    return tuple(o if c is None else jax.lax.with_sharding_constraint(o, c)
                 for o, c in zip(outs, constraints))

  return compile_flat(run, step, in_shardings, out_shardings, timings)


def compile_flat(run, step: TracedStep, in_shardings, out_shardings, timings: dict | None = None):
  """``run`` (the step on its flat dynamic leaves) jitted with these shardings and the
  step's donations, lowered and compiled for its abstract inputs; returns the Compiled.

  ``timings``: ``lower_s`` and ``compile_s`` are added to it.
  """
  donated = tuple(k for k, leaf in enumerate(step.inputs) if leaf.argnum in step.donated_argnums)
  jitted = jax.jit(run, in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=donated)
  args = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)
          for leaf, s in zip(step.inputs, in_shardings)]
  start = time.perf_counter()
  lowered = jitted.lower(*args)
  lowered_at = time.perf_counter()
  compiled = compile_here(lowered, in_shardings[0].device_set if in_shardings else ())
  if timings is not None:
    timings["lower_s"] = timings.get("lower_s", 0.0) + lowered_at - start
    timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - lowered_at
  return compiled


def compile_here(lowered, devices):
  """``lowered.compile()``, or, in a multi-process job for a program on none of this
  process's ``devices`` (a pipeline stage another process runs), a :class:`Remote`: every
  process runs the same pipeline driver, and such a call only makes placeholders here
  (the 2-process pipeline test compiled 55 programs per process, 6 of them the other
  process's stage's)."""
  mine = jax.process_index()
  if jax.process_count() == 1 or not devices or any(d.process_index == mine for d in devices):
    return lowered.compile()
  return Remote(lowered)


class Remote:
  """A lowered program that runs on other processes' devices only: a call returns its
  outputs as placeholders (arrays with no shard here), as the compiled program's call
  would; anything else (memory analysis, HLO text) compiles it and asks that."""

  def __init__(self, lowered):
    self._lowered, self._compiled = lowered, None

  def __call__(self, *args):
    return jax.tree.map(
        lambda o: jax.make_array_from_single_device_arrays(o.shape, o.sharding, [],
                                                           dtype=o.dtype),
        self._lowered.out_info)

  def __getattr__(self, name):
    if self._compiled is None:
      self._compiled = self._lowered.compile()
    return getattr(self._compiled, name)


def constrained_fn(closed, mesh, eqn_constraints, operand_constraints=None):
  """Evaluates ``closed`` with ``with_sharding_constraint`` on the chosen equations' outputs
  (and on the operands the plan reshards)."""
  after = jaxpr_util.constraint_hook(mesh, eqn_constraints)
  before = jaxpr_util.operand_hook(mesh, operand_constraints or {})

  def run(*leaves):
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, leaves))
    jaxpr_util.eval_eqns(closed.jaxpr, env, after=after, before=before)
    return [jaxpr_util.read(env, v) for v in closed.jaxpr.outvars]

  return run
