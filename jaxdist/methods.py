"""Parallelization methods: small declarative option records, no planning logic.

A method says *what* kind of parallelism to use and on which devices; the planners in
``jaxdist.layouts`` (and later ``jaxdist.shard`` / ``jaxdist.pipeline``) decide *how*.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxdist import errors
from jaxdist.recompute import RecomputeRequest


def _options(cls):
  """Makes ``cls`` a frozen dataclass whose constructor rejects unknown keywords by name."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  init = cls.__init__
  valid = [f.name for f in dataclasses.fields(cls)]

  @functools.wraps(init)
  def checked_init(self, *args, **kwargs):
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
      raise errors.UnknownArgumentError(
          f"{cls.__name__}() got unknown argument(s) {', '.join(map(repr, unknown))}; "
          f"valid arguments are: {', '.join(valid)}.")
    init(self, *args, **kwargs)
    if hasattr(self, "_validate"):
      self._validate()

  cls.__init__ = checked_init
  return cls


class Method:
  """Base of every method. ``devices`` and ``num_micro_batches`` are common to all."""

  devices: Any
  num_micro_batches: int | None
  recompute_modules: str | None

  def _validate(self):
    if self.recompute_modules is not None:
      RecomputeRequest.parse(self.recompute_modules, type(self).__name__)
    n = self.num_micro_batches
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise errors.InvalidArgumentError(
          f"{type(self).__name__}(num_micro_batches={n!r}): must be None or an integer >= 1.")

  @property
  def name(self) -> str:
    return type(self).__name__


@_options
class DataParallel(Method):
  """Batch arguments split on dim 0 over all devices; everything else replicated.

  One gradient all-reduce per step (XLA may combine the per-leaf reductions).

  Args:
    devices: None (all devices), a list of devices, a ``jax.sharding.Mesh`` or a
      ``jaxdist.LogicalMesh``. The batch is split over every mesh axis.
    num_micro_batches: split the batch into this many micro-batches and accumulate
      gradients (needs ``jaxdist.grad`` / ``jaxdist.value_and_grad``).
    recompute_modules: comma-separated flax module names (path suffixes or class
      names) whose activations are recomputed in the backward pass instead of kept;
      ``"ROOT"`` for the whole model (needs ``jaxdist.grad`` / ``value_and_grad``).
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None


@_options
class Zero2Parallel(Method):
  """Data parallel with optimizer state sharded over the devices (ZeRO stage 2).

  Parameters stay replicated between steps; optimizer state is split on one dimension
  per leaf (the largest that divides by the device count; a leaf that divides nowhere
  stays replicated and the plan says so); gradients are reduced and the update is
  computed on the local shard, then parameters are gathered.

  Args: as :class:`DataParallel`.
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None


@_options
class Zero3Parallel(Method):
  """ZeRO stage 3: parameters are sharded between steps too and gathered for compute.

  Args: as :class:`DataParallel`.
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None


SOLVERS = ("ilp",)


@_options
class AutoShardingOption:
  """Options of the shard planner (Alpa's names where Alpa had the option).

  Attributes:
    allow_all_gather: allow plans whose resharding needs all-gathers.
    allow_all_to_all: allow plans whose resharding needs all-to-alls.
    allow_replicated_parameters: allow parameters to stay replicated.
    force_data_parallel: plan plain data parallelism (batch over every axis).
    force_batch_dim_to_mesh_dim: split every batch leaf's dim 0 over this mesh axis
      (an index into the logical mesh shape), or None to let the planner choose.
    prefer_reduce_scatter: keep optimizer state sharded (ZeRO-2-like): gradients are
      then reduced into shards instead of all-reduced.
    force_zero_stage_3: keep parameters and optimizer state sharded.
    memory_budget_per_device: bytes each device may use at its peak (arguments,
      outputs and live temporaries, as the planner estimates them); None: no limit. A
      compiled step over it is planned again, at most twice: with micro-batches first
      with the loop's gradient accumulators, gathered inputs and hoisted copies in the
      planner's memory model (slower to solve, so only when needed), then with the budget
      scaled down by the overshoot. If none fits, the smallest runs, with a warning and
      a note in the plan.
    partition_constraints: parameter-path pattern → ``PartitionSpec``. A pattern is
      a glob on the leaf path where only ``*`` and ``?`` are wildcards
      (``state.params*kernel``, ``state.params['params']['Dense_0']['bias']``);
      matching leaves get that spec and the planner optimizes the rest.
    solver: "ilp" (cvxpy + HiGHS).
    solver_time_limit_s: seconds the solver may take per mesh shape; after it the best
      plan found is used, with a warning.
    share_repeated_layers: give identical repeated layers (the same run of equations on
      the same shapes, as transformer blocks are) one shared solution, so that the ILP
      does not grow with depth (on a 2x4 mesh a 6-block GPT's ILP took over 12 minutes
      unshared and 7 s shared). Runs shorter than 48 equations are never shared, and
      sharing can cost optimality where copies would rather differ.
    plan_cache: keep solved ILPs on disk (``$JAXDIST_CACHE_DIR/plans``, default
      ``~/.cache/jaxdist/plans``), keyed by the step's jaxpr, input shapes, mesh and these
      options, so that planning the same step again (in another process) skips the solve.
  """

  allow_all_gather: bool = True
  allow_all_to_all: bool = True
  allow_replicated_parameters: bool = True
  force_data_parallel: bool = False
  force_batch_dim_to_mesh_dim: int | None = None
  prefer_reduce_scatter: bool = False
  force_zero_stage_3: bool = False
  memory_budget_per_device: float | None = None
  partition_constraints: Any = None
  solver: str = "ilp"
  solver_time_limit_s: float | None = None
  share_repeated_layers: bool = True
  plan_cache: bool = True
  # Set by ParallelizedFunc when a micro-batched plan compiled over the budget: the
  # memory model then holds the loop's accumulators, gathered inputs and hoisted copies
  # (exact enough to fit, but its solves are slower; jaxdist.shard.planner).
  _loop_buffers: bool = False

  def _validate(self):
    if self.solver not in SOLVERS:
      raise errors.InvalidArgumentError(
          f"AutoShardingOption(solver={self.solver!r}) is not a known solver; valid: "
          f"{', '.join(map(repr, SOLVERS))}.")
    budget = self.memory_budget_per_device
    if budget is not None and not budget > 0:
      raise errors.InvalidArgumentError(
          f"AutoShardingOption(memory_budget_per_device={budget!r}) must be a positive number "
          f"of bytes, or None.")
    limit = self.solver_time_limit_s
    if limit is not None and not limit > 0:
      raise errors.InvalidArgumentError(
          f"AutoShardingOption(solver_time_limit_s={limit!r}) must be positive seconds or None.")
    if self.partition_constraints is not None and not isinstance(self.partition_constraints, dict):
      raise errors.InvalidArgumentError(
          f"AutoShardingOption(partition_constraints={self.partition_constraints!r}) must be a "
          f"dict of path pattern -> jax.sharding.PartitionSpec.")


@_options
class ShardParallel(Method):
  """Operator parallelism: an ILP chooses every tensor's sharding.

  Args:
    devices: as :class:`DataParallel`.
    num_micro_batches: gradient accumulation (as :class:`DataParallel`).
    recompute_modules: as :class:`DataParallel`.
    logical_mesh_shape: e.g. ``(2, 4)``; its product must be the device count. None
      plans on the mesh given as ``devices=`` (a ``jaxdist.LogicalMesh`` or
      ``jax.sharding.Mesh``: its shape, axis names and per-axis costs, no search), or,
      when ``devices`` is None or a device list, solves every factorization of the
      device count (1-D and 2-D) and keeps the cheapest; ``"search"`` searches the shapes
      over the given mesh's devices with its α/β (a per-axis value applies to shapes of
      the same rank, the largest to the others). Each shape's objective is in the plan.
    auto_sharding_option: an :class:`AutoShardingOption`.
    plan: a saved :class:`jaxdist.Plan` (``Plan.load(path)``) to apply instead of
      searching: its mesh shape and every input leaf's spec are taken as they are and
      only the equations in between are solved. A plan made for another model raises
      ``PlanMismatchError`` naming the first leaf path or shape that differs.
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None
  logical_mesh_shape: tuple[int, ...] | None = None
  auto_sharding_option: AutoShardingOption | None = None
  plan: Any = None

  def _validate(self):
    Method._validate(self)
    shape = self.logical_mesh_shape
    if shape is not None and shape != "search" and (not isinstance(shape, (tuple, list)) or not shape
                              or not all(isinstance(n, int) and n >= 1 for n in shape)
                              or len(shape) > 2):
      raise errors.MeshShapeError(
          f"ShardParallel(logical_mesh_shape={shape!r}): give a tuple of 1 or 2 positive ints "
          f"whose product is the device count, \"search\", or None.")
    if self.plan is not None and type(self.plan).__name__ != "Plan":
      raise errors.InvalidArgumentError(
          f"ShardParallel(plan={self.plan!r:.60}) must be a jaxdist.Plan (jaxdist.Plan.load(path)).")
    opt = self.auto_sharding_option
    if opt is not None and not isinstance(opt, AutoShardingOption):
      raise errors.InvalidArgumentError(
          f"ShardParallel(auto_sharding_option={opt!r}) must be a jaxdist.AutoShardingOption.")

  @property
  def options(self) -> AutoShardingOption:
    return self.auto_sharding_option or AutoShardingOption()


@_options
class UniformStageOption:
  """Stages of equally many layers on equal sub-meshes.

  Attributes:
    num_stages: how many stages; None: the largest number that divides the device count
      and is at most the number of layers.
    submesh_shape: the shape every stage's shard plan uses (its product must be
      devices / num_stages); None: each stage's planner searches the 1-D and 2-D shapes.
  """

  num_stages: int | None = None
  submesh_shape: tuple[int, ...] | None = None


@_options
class ManualStageOption:
  """Stages given by hand.

  Attributes:
    forward_stage_layer_ids: per stage, the (contiguous, ascending) layer indices it runs.
    submesh_shapes: per stage, its sub-mesh shape; the device counts must add up to the
      method's devices, which are handed out in order.
  """

  forward_stage_layer_ids: Any = None
  submesh_shapes: Any = None


RUNTIMES = ("auto", "spmd", "mpmd")


@_options
class PipeshardParallel(Method):
  """Pipeline parallelism: the loss is cut into layers, layers into stages on sub-meshes,
  and a schedule runs the micro-batches through them.

  Args:
    devices, recompute_modules: as :class:`DataParallel`.
    num_micro_batches: micro-batches per step (the batch must divide by it).
    layer_option: ``"manual"`` (cut at ``jaxdist.mark_pipeline_boundary()`` calls in the
      differentiated function) or a ``jaxdist.AutoLayerOption``. None (default): the
      function's boundaries where it marks any, else ``AutoLayerOption(layer_num=2)``
      (Alpa's default).
    stage_option: ``"uniform"``, ``"auto"`` (Alpa's stage DP over layer ranges and
      sub-mesh sizes, see ``jaxdist.pipeline.stages``), a :class:`UniformStageOption` or a
      :class:`ManualStageOption`.
    pipeline_schedule: ``"1f1b"`` or ``"gpipe"``.
    virtual_stages: Megatron's interleaved 1F1B when > 1: the stages are this many model
      chunks on each of ``num_stages / virtual_stages`` device groups (stage ``c`` on group
      ``c mod groups``), cutting the bubble to ``(groups − 1) / (virtual_stages ·
      num_micro_batches)`` at the price of more micro-batches in flight. Needs uniform
      stages, ``"1f1b"`` and micro-batches divisible by the number of groups (with
      ``runtime="spmd"``: the circular pipeline, under ``"gpipe"``).
    runtime: ``"mpmd"``: a driver issues per-stage programs on sub-meshes (any layers,
      any stages). ``"spmd"``: one program over a ``(stage, data)`` mesh pipelines the
      loss's stack of identical layers (``jaxdist.pipeline.spmd``; uniform stages; GPipe,
      circular, or 1F1B in lockstep, ``spmd_1f1b``). ``"auto"`` (default): SPMD when the
      schedule is ``"gpipe"`` and the layers between the boundaries are identical, MPMD
      otherwise (the driver's 1F1B has half the lockstep bubble); the plan's notes say
      which and why.
    max_pipeline_bubble_ratio: for ``"auto"``, nnScaler's cap on the number of stages
      ``s <= floor(b / (1 - b) * num_micro_batches + 1)``; None: no cap.
    max_pipeline_unbalance_ratio: for ``"auto"``, nnScaler's balance bound ``r`` in
      (0, 1]: every stage's predicted time within ``[r * G, G / r]`` of their mean ``G``;
      None: no bound.
    default_auto_sharding_option: the :class:`AutoShardingOption` of every stage's shard
      plan (its ``partition_constraints`` apply to the stages holding matching
      parameters); its ``memory_budget_per_device`` also bounds the ``"auto"`` stage search.
  """

  devices: Any = None
  num_micro_batches: int | None = 1
  recompute_modules: str | None = None
  layer_option: Any = None
  stage_option: Any = "uniform"
  pipeline_schedule: str = "1f1b"
  default_auto_sharding_option: AutoShardingOption | None = None
  max_pipeline_bubble_ratio: float | None = None
  max_pipeline_unbalance_ratio: float | None = None
  virtual_stages: int = 1
  runtime: str = "auto"

  def _validate(self):
    Method._validate(self)
    from jaxdist.pipeline.layers import AutoLayerOption
    from jaxdist.pipeline.schedule import SCHEDULES

    if self.layer_option not in (None, "manual") and not isinstance(self.layer_option,
                                                                    AutoLayerOption):
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(layer_option={self.layer_option!r}): use None (the default), "
          f"'manual' or jaxdist.AutoLayerOption(layer_num=...).")
    if (self.stage_option not in ("uniform", "auto")
        and not isinstance(self.stage_option, (UniformStageOption, ManualStageOption))):
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(stage_option={self.stage_option!r}): use 'uniform', 'auto', "
          f"jaxdist.UniformStageOption(...) or jaxdist.ManualStageOption(...).")
    ratio = self.max_pipeline_bubble_ratio
    if ratio is not None and not 0 < ratio < 1:
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(max_pipeline_bubble_ratio={ratio!r}) must be in (0, 1), or None.")
    ratio = self.max_pipeline_unbalance_ratio
    if ratio is not None and not 0 < ratio <= 1:
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(max_pipeline_unbalance_ratio={ratio!r}) must be in (0, 1], or "
          f"None.")
    if self.pipeline_schedule not in SCHEDULES:
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(pipeline_schedule={self.pipeline_schedule!r}) is not a known "
          f"schedule; valid: {', '.join(map(repr, SCHEDULES))}.")
    v = self.virtual_stages
    if not isinstance(v, int) or v < 1:
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(virtual_stages={v!r}) must be an integer >= 1.")
    if self.runtime not in RUNTIMES:
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(runtime={self.runtime!r}) is not a runtime; valid: "
          f"{', '.join(map(repr, RUNTIMES))}.")
    schedule_ok = self.pipeline_schedule == "1f1b" or (
        self.runtime == "spmd" and self.pipeline_schedule == "gpipe")
    if v > 1 and (not schedule_ok or not (
        self.stage_option == "uniform" or isinstance(self.stage_option, UniformStageOption))):
      raise errors.InvalidArgumentError(
          f"PipeshardParallel(virtual_stages={v}) interleaves uniform stages under 1F1B (or, "
          f"with runtime='spmd', GPipe); got pipeline_schedule={self.pipeline_schedule!r}, "
          f"stage_option={self.stage_option!r}. Use pipeline_schedule='1f1b' with "
          f"stage_option='uniform' or UniformStageOption.")


@_options
class CreateStateParallel(Method):
  """Creates a train state directly in the layout a train step wants (Alpa's name):
  ``jd.parallelize(init_fn, method=jd.CreateStateParallel(train_step, (batch,)))(*init_args)``
  is ``train_step.create_state(init_fn, *init_args, other_args=(batch,))``.

  Args:
    train_step: the :func:`jaxdist.parallelize`'d step whose first argument is the state.
    other_args: the step's arguments after the state (arrays or ``ShapeDtypeStruct``s),
      a tuple; a single non-tuple value is one argument.
  """

  train_step: Any = None
  other_args: Any = ()
  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None

  def _validate(self):
    from jaxdist.api import ParallelizedFunc

    if not isinstance(self.train_step, ParallelizedFunc):
      raise errors.InvalidArgumentError(
          f"CreateStateParallel(train_step={self.train_step!r}): give the train step "
          f"decorated with jaxdist.parallelize.")


@_options
class FollowParallel(Method):
  """An evaluation step that keeps a train step's layout (Alpa's name): its arguments
  that are the train step's (the state) get exactly the train step's shardings, so no
  value is resharded between training and evaluation; batch arguments are split as the
  train step splits its batch; the shard planner lays out the rest with those pinned.
  A PipeshardParallel train step run by the pipeline driver holds each stage's state on
  its own sub-mesh: the evaluation runs over all its devices, with the state that lives on
  a stage split over them on one dimension (as ZeRO-3 splits it), moved there at each
  evaluation (in a multi-process job pass the state through the train step's
  ``exe.gather`` first).

  Args:
    src_func: the :func:`jaxdist.parallelize`'d train step, compiled already (called
      once, or ``get_executable`` / ``create_state`` on it).
  """

  src_func: Any = None
  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None

  def _validate(self):
    from jaxdist.api import ParallelizedFunc

    Method._validate(self)
    if not isinstance(self.src_func, ParallelizedFunc):
      raise errors.InvalidArgumentError(
          f"FollowParallel(src_func={self.src_func!r}): give the train step decorated with "
          f"jaxdist.parallelize.")
