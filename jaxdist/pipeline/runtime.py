"""PipeshardParallel: stage programs on sub-meshes and the driver that runs a schedule.

The traced step (``jaxdist.pipeline.capture``) has one ``pipeline_loss`` equation. The
equations before it (``pre``: computing the loss's inputs) run as one jitted program over
all devices; those after it (the optimizer update) run per stage on the stage's sub-mesh
for the state that stage owns, and over all devices for what combines several stages
(scalars cross: see ``PipelineExecutable._compile_programs``). The loss's forward jaxpr
is cut into layers and stages (``partition.py``), and every stage gets two programs:

- ``forward(operands, activations in) -> activations out``, and
- ``backward(operands, activations in, cotangents out, accumulator) -> (accumulator +
  gradients of its differentiated operands, cotangents of its activations in)``, which
  recomputes the stage's forward (so a stage keeps only its *inputs* per micro-batch in
  flight, never its residuals; the fallback DESIGN.md names, at the price of one more
  forward) and adds into the accumulator it is given (donated).

Each stage is a ShardParallel program (``stage_shard.py``): the shard ILP plans its
backward over the sub-mesh's shapes, its forward with the same operand layouts, and its
optimizer update with parameters and gradients pinned to them, so a stage's state lives
as its programs read it. A stage whose plan is data parallel (parameters replicated)
runs per device instead (``per_device.py``): each device adds its partial gradients to
its own row of the accumulator and one program per step sums the rows, where XLA would
all-reduce the gradients in every micro-batch's backward.

The driver walks the schedule's instructions in clock order and issues each program
through JAX's asynchronous dispatch, moving activations and cotangents between
sub-meshes on the devices (``transfer.py``; the stage programs return them in the layout
their reader takes, so each move is one copy). What a clock's programs made is moved at
the end of that clock, its copies in one call, and the producer's copy is then dropped.

The loss and gradients are means over micro-batches (as with gradient accumulation:
the full-batch result for a loss that is a mean over examples); integer aux leaves are
summed.

Every process of a ``jax.distributed`` job runs the same driver; stages may sit on
different processes (see :func:`move` for what crosses them).

State the caller donates (``donate_argnums``) is updated in place by the stage
programs that own it, unless another program still reads it.

A stage whose plan splits the batch over some axes and its parameters over others
(model parallel within a stage) runs manual over the batch axes only and also sums its
gradients once per step. A stage whose plan shards parameters over the batch axes (ZeRO-3)
still reduces them in every micro-batch: full-size accumulator rows would undo what
sharding saves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import tree_util
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import coupling, errors
from jaxdist import inspect as hlo_inspect
from jaxdist import jaxpr_util, rng
from jaxdist import methods as m
from jaxdist.executable import (compare_collectives, compile_here, compile_layout, place,
                                place_inputs, positional)
from jaxdist.grad import SEEN
from jaxdist.mesh import LogicalMesh
from jaxdist.pipeline import (capture, layers as layers_mod, per_device, predict, stage_shard,
                              timeline, transfer)
from jaxdist.pipeline.schedule import BACKWARD, FORWARD, Schedule, make_schedule
from jaxdist.pipeline.partition import Stage, build_stages, stage_functions
from jaxdist.pipeline.predict import device_bytes
from jaxdist.plan import Plan, PlanEntry
from jaxdist.shard.cost import CostModel, combining_for
from jaxdist.shard.specs import from_partition_spec, used_axes
from jaxdist.trace import BATCH, INPUT, OPTIMIZER, PARAM, TracedStep


SMALL_OUTPUT_BYTES = 1 << 20


def _nbytes(aval) -> int:
  return math.prod(aval.shape) * aval.dtype.itemsize


def _hand_over(stage: Stage, moves):
  """Sets ``stage.handover``: the collectives of its programs' ``moves`` (planned spec,
  the sharding its reader takes, aval) per micro-batch, as XLA reshards them."""
  cost = CostModel(stage.mesh)
  sizes = cost.axis_sizes
  stage.handover = {}
  for planned, sharding, aval in moves:
    rank = len(aval.shape)
    src, dst = from_partition_spec(planned, rank), from_partition_spec(sharding.spec, rank)
    for kind, axes, nbytes in cost.reshard_collectives(src, dst, _nbytes(aval)):
      if math.prod(sizes[a] for a in axes) == 1:  # over one device: none (as combine.predict)
        continue
      entry = stage.handover.setdefault(kind, {"count": 0, "result_bytes": 0.0})
      entry["count"] += 1
      entry["result_bytes"] += nbytes


def _expressed(target: NamedSharding, mesh: jax.sharding.Mesh) -> NamedSharding | None:
  """``target``'s layout on ``mesh``'s devices (axes matched by position), if both meshes
  have one shape; else None."""
  if target.mesh.devices.shape != mesh.devices.shape:
    return None
  names = dict(zip(target.mesh.axis_names, mesh.axis_names))
  rename = lambda entry: (None if entry is None else names[entry] if isinstance(entry, str)
                          else tuple(names[a] for a in entry))
  return NamedSharding(mesh, PartitionSpec(*map(rename, target.spec)))


def replicate(x: jax.Array, full: NamedSharding) -> jax.Array:
  """``x`` (a value on a sub-mesh of ``full``'s devices) replicated over all of them.

  One process: :func:`move` (on the devices). Several: ``x`` is first replicated on its
  own sub-mesh, then copied to every other run of as many devices in ``full``'s order
  (each copy a :func:`move`, cross-process where it must be), and the copies' local
  shards are assembled into one global array.

  Raises:
    InvalidArgumentError: in a multi-process job, a sub-mesh whose size does not divide
      the device count.
  """
  if x.sharding.is_equivalent_to(full, x.ndim):
    return x
  if jax.process_count() == 1:
    return move(x, full)
  if x.sharding.device_set == full.device_set:  # one program over all of them
    return jax.jit(transfer.identity, out_shardings=full)(x)
  mesh = x.sharding.mesh
  devices = list(full.mesh.devices.flat)
  n = mesh.devices.size
  if len(devices) % n:
    raise errors.InvalidArgumentError(
        f"gathering a value from a sub-mesh of {n} devices onto all {len(devices)} across "
        f"processes needs sub-meshes whose size divides the device count.")
  here = move(x, NamedSharding(mesh, PartitionSpec()))
  shards = []
  for start in range(0, len(devices), n):
    group = np.array(devices[start:start + n], dtype=object).reshape(mesh.devices.shape)
    copy = move(here, NamedSharding(jax.sharding.Mesh(group, mesh.axis_names,
                                                      axis_types=mesh.axis_types),
                                    PartitionSpec()))
    shards += [shard.data for shard in copy.addressable_shards]
  return jax.make_array_from_single_device_arrays(x.shape, full, shards, dtype=x.dtype)


def loss_equation(jaxpr, unseen: int = 0) -> int:
  """Index of the step's one ``pipeline_loss`` equation (``unseen``: how many plain
  gradient calls the step made that jaxdist could not take, for the error).

  Raises:
    GradientMarkerError: the step differentiates with jaxdist.value_and_grad not exactly
      once at its top level.
    InvalidArgumentError: a pipeline boundary is marked outside the loss.
  """
  found = jaxpr_util.find_eqns(jaxpr, capture.pipeline_loss_p.name)
  total = jaxpr_util.count_primitive(jaxpr, capture.pipeline_loss_p.name)
  if len(found) != 1 or total != 1:
    if total > 1:
      seen = (f"found {total} (a pipeline runs one differentiated function by stages: a "
              f"GAN's two losses are not one)")
    elif total == 1:
      seen = "found it inside a loop or cond"
    else:
      seen = "found none" + (f" of its {unseen} jax.grad / value_and_grad calls usable"
                             if unseen else "")
    raise errors.GradientMarkerError(
        f"PipeshardParallel pipelines the function the step differentiates, and {seen}: "
        f"{SEEN}; jitted helpers are fine, loops and conds are not. Use "
        f"jaxdist.value_and_grad instead of jax's if it is bound elsewhere.")
  if jaxpr_util.count_primitive(jaxpr, layers_mod.boundary_p.name):
    raise errors.InvalidArgumentError(
        "jaxdist.mark_pipeline_boundary() is called outside the function passed to "
        "jaxdist.grad / value_and_grad; layer boundaries belong in the differentiated "
        "forward pass.")
  return found[0]


@dataclasses.dataclass(frozen=True)
class StageReport:
  """What one stage is and costs (``PipelineExecutable.stage_report()``).

  Attributes:
    stage: its index.
    layers: (first layer, last layer + 1).
    devices: ids of its sub-mesh's devices.
    predicted_s: the stage search's seconds per micro-batch, or None.
    forward_s, backward_s: measured seconds per micro-batch (backward recomputes forward).
    bytes_per_device: of its larger program (arguments + outputs − aliased + temp).
  """

  stage: int
  layers: tuple[int, int]
  devices: tuple[int, ...]
  predicted_s: float | None
  forward_s: float
  backward_s: float
  bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class Program:
  """Equations of the step's jaxpr run as one jit on one mesh.

  Attributes:
    reads: the variables it reads (step inputs or results of the loss equation).
    writes: the variables it returns.
    in_shardings, out_shardings: per read and per write.
    compiled: the compiled program.
    plan: the shard plan of a program planned on a stage's mesh (None: replicated).
  """

  reads: tuple
  writes: tuple
  in_shardings: tuple
  out_shardings: tuple
  compiled: object
  plan: object = None


def move(x, target: NamedSharding):
  """``x`` in ``target``, for a value the driver produced, in every process of a job.

  One process: a :class:`~jaxdist.pipeline.transfer.Transfer` (on the devices,
  asynchronous, planned once per pair of layouts). Several (each runs the same driver,
  so each calls this for every move, in the same order):

  - a value replicated over *all* devices: every process has a copy, and builds its own
    shards of ``target`` from it (no transfer);
  - a value on a sub-mesh: ``jax.device_put`` to a sub-mesh of as many devices, JAX's
    cross-host transfer, which both processes must issue (resharded first on its own
    devices where the shard shapes differ: the transfer needs them equal);
  - sub-meshes of unequal size: replicated over every device first (:func:`replicate`),
    then each process takes its shards of the target;
  - a process holding neither end: an empty placeholder of the target.

  Raises:
    InvalidArgumentError: from :func:`replicate`, a sub-mesh whose size does not divide
      the device count.
  """
  if not isinstance(x, jax.Array):
    return place(x, target)
  if x.sharding == target:
    return x
  if jax.process_count() == 1:
    if not isinstance(x.sharding, NamedSharding):
      return place(x, target)
    return transfer.transfer(x.shape, x.dtype, x.sharding, target)(x)
  here = set(jax.local_devices())
  src, dst = x.sharding.device_set, target.device_set
  if not (src | dst) & here:
    return jax.make_array_from_single_device_arrays(x.shape, target, [], dtype=x.dtype)
  if x.sharding.is_fully_replicated and src == set(jax.devices()):
    local = x.addressable_data(0)
    shards = [jax.device_put(local[index], d)
              for d, index in target.addressable_devices_indices_map(x.shape).items()]
    return jax.make_array_from_single_device_arrays(x.shape, target, shards, dtype=x.dtype)
  if target.is_fully_replicated and dst == set(jax.devices()):
    return replicate(x, target)  # a sub-mesh's value (a stage's scalar) onto all devices
  if len(src) != len(dst):  # unequal sub-meshes: through a copy on every device
    every = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
    return move(replicate(x, every), target)
  if src != dst and x.sharding.shard_shape(x.shape) != target.shard_shape(x.shape):
    # A cross-process transfer needs equal shard shapes: lay the value out as the target
    # wants on its own devices first (a local reshard, or a placeholder elsewhere).
    devices = x.sharding.mesh.devices.reshape(target.mesh.devices.shape)
    x = move(x, NamedSharding(jax.sharding.Mesh(devices, target.mesh.axis_names,
                                                axis_types=target.mesh.axis_types), target.spec))
  return jax.device_put(x, target)


def move_all(values: list, targets: list) -> list:
  """:func:`move` of each value to its target; on one process, the copies among them
  issued at once (:func:`~jaxdist.pipeline.transfer.move_many`)."""
  if jax.process_count() > 1 or not all(
      isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) for x in values):
    return [move(x, target) for x, target in zip(values, targets)]
  return transfer.move_many(values, targets)


class PipelineExecutable:
  """A step compiled for PipeshardParallel (see the module docstring).

  Attributes:
    plan: the :class:`~jaxdist.plan.Plan` (stages, layers, sub-meshes and their shard
      plans' objectives in its notes); each input's spec holds on its home's mesh
      (``input_shardings`` gives the home: a stage's sub-mesh, or all devices).
    stages: the :class:`Stage` list.
    schedule: the :class:`~jaxdist.pipeline.schedule.Schedule` the driver runs.
    stats: after a call, ``{"max_in_flight": per stage the most micro-batches whose
      inputs it held at once, "dispatched": stage programs issued, "dispatch_s": host
      seconds the driver took to issue them, "call_s": the part of it spent inside the
      stage programs' calls (the runtime's dispatch, plus the compute of programs it
      runs synchronously), "move_s": the part spent issuing moves between sub-meshes,
      "dispatch_cpu_s": the CPU time of the driver's thread over the same span (what the
      host spends: XLA runs the programs on threads of its own)}``; the rest of
      ``dispatch_s``, ``dispatch_s - call_s - move_s``, is the driver's own Python. With
      ``record_timeline = True``, also ``"timeline"``: every forward and backward program's
      :class:`~jaxdist.pipeline.timeline.Span` (see that module).
    input_shardings, output_shardings: pytrees of ``NamedSharding``.
    traced_step: the traced step (inputs, roles, jaxpr) it was compiled from.
    logical_mesh: all the devices its stages use.
    auto_sharding_objective: the stages' shard-plan objectives (backward, plus forward
      where planned, per micro-batch) combined as a pipelined step,
      ``Σ c + (micro-batches − 1) · max c``.
  """

  def __init__(self, method: m.PipeshardParallel, step: TracedStep, lmesh: LogicalMesh,
               dyn_argnums: tuple[int, ...], retrace=None, compile: bool = True):
    """``compile=False`` forms the stages and plans their backward programs and the
    update programs, compiling nothing (what ``jaxdist.estimate`` reads: ``stages``,
    ``schedule``, ``input_shardings``); it cannot run."""
    jaxpr = step.closed_jaxpr.jaxpr
    self._step, self._dyn_argnums = step, dyn_argnums
    self.traced_step, self.logical_mesh = step, lmesh
    self._retrace, self._device_losses, self._constants = retrace, {}, {}
    self._index = loss_equation(jaxpr)
    eqn = jaxpr.eqns[self._index]
    k = self._k = method.num_micro_batches or 1
    # Stages run the loss as traced at micro-batch size (shapes are baked into a jaxpr).
    micro = [e for e in step.micro_jaxpr.jaxpr.eqns if e.primitive is capture.pipeline_loss_p]
    self._loss = loss = micro[0].params["loss"]
    if len(micro) != 1 or len(micro[0].invars) != len(eqn.invars):
      raise errors.GradientMarkerError(
          "the step traced at micro-batch size calls jaxdist.value_and_grad differently than at "
          "full size; PipeshardParallel needs one call whose inputs keep their structure.")
    batch_mask = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
    deps = jaxpr_util.dependencies(jaxpr, len(step.inputs), eqn.invars)
    # Split into micro-batches: what depends on the batch, and what only its shape sizes
    # (noise or diffusion timesteps drawn per example from a key outside the loss: each
    # micro-batch takes its rows of the whole batch's draw, as the single-device step).
    self._batch_operand = [
        bool(d & batch_mask) or (k > 1 and bool(v.aval.shape) and v.aval.shape[0] % k == 0
                                 and tuple(u.aval.shape) == (v.aval.shape[0] // k,)
                                 + tuple(v.aval.shape[1:]))
        for d, v, u in zip(deps, eqn.invars, micro[0].invars)]
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    self._operand_paths = [step.inputs[position[v]].path if v in position else f"loss operand {j}"
                           for j, v in enumerate(eqn.invars)]
    for v, u, is_batch in zip(eqn.invars, micro[0].invars, self._batch_operand):
      shape = tuple(v.aval.shape)
      expected = (shape[0] // k,) + shape[1:] if is_batch and shape else shape
      if tuple(u.aval.shape) != expected:
        raise errors.InvalidArgumentError(
            f"an input of the loss has shape {shape} on the whole batch but {u.aval.shape} on "
            f"one of {k} micro-batches; PipeshardParallel splits batch-dependent inputs of the "
            f"loss on dim 0 only.")
      if is_batch and (not shape or shape[0] % k):
        raise errors.BatchDivisibilityError(
            f"PipeshardParallel(num_micro_batches={k}): a batch-dependent input of the loss has "
            f"shape {shape}, whose dim 0 does not divide into {k} micro-batches; use a batch "
            f"size that is a multiple of {k}.")
    self._lmesh = lmesh
    # Parameters whose gradient nothing reads (frozen by the optimizer: optax.set_to_zero
    # under multi_transform): no stage differentiates or accumulates them.
    read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex.Literal)}
    read |= {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    num_aux = loss.kinds.count(capture.AUX)
    self._frozen = frozenset(loss.num_consts + j - 1 - num_aux
                             for j, kind in enumerate(loss.kinds)
                             if kind == capture.GRAD and eqn.outvars[j] not in read)
    state_bytes = {role: sum(math.prod(leaf.shape) * leaf.dtype.itemsize
                             for leaf in step.inputs if leaf.role == role)
                   for role in (PARAM, OPTIMIZER)}
    state_factor = 1 + state_bytes[OPTIMIZER] / max(state_bytes[PARAM], 1)
    option = self._option = method.default_auto_sharding_option or m.AutoShardingOption()
    stage_shard.check_constraints_used(option, self._operand_paths)
    # Dropout: every stage program takes the micro-batch index, so that each micro-batch
    # draws its rows of the whole batch's bits, as the single-device step does.
    self._whole = eqn.params["loss"].closed.jaxpr
    self._coupled = coupling.loss_coupling(self._whole, loss.num_consts, self._batch_operand,
                                           step.batch_size)
    if self._coupled and k > 1 and compile:
      coupling.warn_split(self._coupled, f"PipeshardParallel's {k} micro-batches")
    self._indexed = jaxpr_util.count_primitive(loss.closed.jaxpr, "random_bits") > 0
    self._cost_cache: dict = {}  # (devices, backward program text) -> ILP objective
    self._traced: dict = {}  # a layer's equations -> (its backward program, its text)
    self.stages, starts, predicted = build_stages(
        method, loss, lmesh, state_factor, functools.partial(self._program_cost, option))
    self._predicted = predicted
    if self._indexed:
      micro_eqns = loss.closed.jaxpr.eqns
      to_whole = jaxpr_util.align(micro_eqns, self._whole.eqns)
      for stage in self.stages:
        stage.draws = rng.partial_draws(micro_eqns, self._whole.eqns, to_whole, stage.eqns, k)
    self.schedule: Schedule = make_schedule(method.pipeline_schedule, len(self.stages), k,
                                            method.virtual_stages)
    self._full = NamedSharding(lmesh.mesh, PartitionSpec())
    self._compiling = compile
    self.spmd_runtime = False  # planned only: the compile would take the SPMD runtime
    if not compile:
      for stage in self.stages:
        self._plan_backward(stage, option)
        pd = self._per_device(stage)
        if not isinstance(pd, str):  # gradients summed once, as the plan lays them out
          stage.grad_homes = [NamedSharding(stage.mesh.mesh, self._summed_spec(pd, g.sharding.spec))
                              for g in stage.grad_avals]
        stage.grad_homes = stage.grad_homes or [g.sharding for g in stage.grad_avals]
      self._compile_programs()
      return
    self._compile_stages(option)
    self._compile_programs()
    self._compile_slicer()
    self._weigher = self._compile_weigher()
    self._readers, self._clocks = self._activation_readers(), self._passes_by_clock()
    self.stats: dict = {}
    self.record_timeline = False
    collectives = predict.pipeline_collectives(
        self.stages, self._applies, k, combining_for(lmesh.devices[0].platform))
    self.plan = Plan(
        method=method.name, mesh_shape=lmesh.shape, axis_names=lmesh.axis_names,
        inputs=tuple(PlanEntry(leaf.path, leaf.shape, str(leaf.dtype), leaf.role, home.spec)
                     for leaf, home in zip(step.inputs, self._input_homes)),
        num_micro_batches=k,
        notes=(f"{len(starts)} layers starting at loss equations {list(starts)}",
               *(f"stage {s}: layers {st.layers[0]}..{st.layers[1] - 1}, {len(st.eqns)} "
                 f"equations, devices {[d.id for d in st.mesh.devices]} as a {st.mesh.shape} mesh, "
                 f"backward's shard-plan objective {st.objectives[1]:.3g} s, {st.note}"
                 for s, st in enumerate(self.stages)),
               f"schedule {self.schedule.name}: {self.schedule.num_clocks} clocks",
               *([] if not self._coupled else [
                   f"the loss mixes examples ({self._coupled}): no stage runs per device"
                   + (f", and each of the {k} micro-batches uses its own examples" if k > 1
                      else "")]),
               *([] if predicted is None else [
                   f"auto stages: predicted {[f'{c:.3g}' for c in predicted.stage_costs]} s per "
                   f"micro-batch, {predicted.step_time:.3g} s per step"])),
        predicted_collectives=collectives)
    costs = [sum(c for c in st.objectives if c is not None) for st in self.stages]
    self.auto_sharding_objective = sum(costs) + (k - 1) * max(costs)
    # In a multi-process job the small results that are not state (the loss, metrics,
    # aux scalars) are copied to every device, so that every process reads them as it
    # does under the SPMD methods; large results stay on the stage that made them.
    self._broadcast = [] if jax.process_count() == 1 else [
        o for o, (src, aval) in enumerate(zip(step.output_source, step.out_avals))
        if src is None and _nbytes(aval) <= SMALL_OUTPUT_BYTES
        and self._output_homes[o].device_set != self._full.device_set]
    for o in self._broadcast:
      self._output_homes[o] = self._full
    self.input_shardings = tree_util.tree_unflatten(step.in_tree, self._input_homes)
    self.output_shardings = tree_util.tree_unflatten(step.out_tree, self._output_homes)

  # ---- compilation -------------------------------------------------------------------

  def _reads(self, writes, elsewhere=frozenset()) -> tuple[set, tuple]:
    """The step's equations computing ``writes`` from step inputs, loss results and the
    results of the equations ``elsewhere`` (another program's), and the variables they
    read."""
    jaxpr = self._step.closed_jaxpr.jaxpr
    stop = {self._index} | set(elsewhere)
    ids = jaxpr_util.needed_eqns(jaxpr, writes, stop=stop) - stop
    defined = {v for i in ids for v in jaxpr.eqns[i].outvars}
    atoms = [v for i in sorted(ids) for v in jaxpr.eqns[i].invars] + list(writes)
    return ids, tuple(dict.fromkeys(v for v in atoms if not isinstance(v, jex.Literal)
                                    and v not in defined and v not in jaxpr.constvars))

  def _program(self, writes, sharding: NamedSharding, option=None, mesh=None,
               pins=None, keep=frozenset(), elsewhere=frozenset()) -> Program:
    """The equations of the step that compute ``writes`` from step inputs, loss results
    and the results of the equations ``elsewhere`` (earlier programs').

    Without ``option`` everything is replicated in ``sharding``; with it the program is
    planned by the shard ILP on ``mesh`` with ``pins`` (read variable → spec) fixed and
    every written state leaf laid out as the input it updates, whose buffer it reuses if
    the caller donated it and no program in ``keep`` (variables read elsewhere) needs it."""
    closed = self._step.closed_jaxpr
    jaxpr = closed.jaxpr
    ids, reads = self._reads(writes, elsewhere)

    def run(*values):
      env = dict(zip(jaxpr.constvars, closed.consts))
      env.update(zip(reads, values))
      jaxpr_util.eval_eqns(jaxpr, env, ids)
      return [jaxpr_util.read(env, v) for v in writes]

    if option is None:
      avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding) for v in reads]
      compiled = (compile_here(jax.jit(run, out_shardings=sharding).lower(*avals),
                               sharding.device_set) if self._compiling else None)
      return Program(reads, tuple(writes), (sharding,) * len(reads), (sharding,) * len(writes),
                     compiled)
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    result = {v: j for j, v in enumerate(jaxpr.eqns[self._index].outvars)}
    leaves = [self._step.inputs[position[v]] if v in position else None for v in reads]
    roles = [leaf.role if leaf else INPUT for leaf in leaves]
    paths = [leaf.path if leaf else f"loss result {result[v]}" if v in result
             else f"value {k} from another update program"
             for k, (leaf, v) in enumerate(zip(leaves, reads))]
    read_index = {v: k for k, v in enumerate(reads)}
    out_index = {v: o for o, v in enumerate(jaxpr.outvars)}
    tied = {}
    for w, v in enumerate(writes):
      src = self._step.output_source[out_index[v]] if v in out_index else None
      if src is not None and jaxpr.invars[src] in read_index:
        tied[w] = read_index[jaxpr.invars[src]]
    # State the caller donated, updated here: its buffers become the new state's.
    donated = frozenset(k for k in tied.values()
                        if leaves[k].argnum in self._step.donated_argnums and reads[k] not in keep)
    planned = stage_shard.plan_program(
        stage_shard.program_step(lambda values: run(*values),
                                 [[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in reads]],
                                 [roles], [paths], tied, donated),
        mesh, option, {read_index[v]: spec for v, spec in pins.items() if v in read_index},
        compile=self._compiling)
    return Program(reads, tuple(writes), planned.in_shardings, planned.out_shardings,
                   planned.compiled, planned.result)

  def _compile_programs(self):
    """Where state lives and the programs before and after the pipeline.

    Each equation after the loss is placed (:meth:`_place_update`): on a stage when the
    only arrays it reads live there (a parameter's update reads its gradient and
    optimizer state), over all devices when it combines values of several stages.
    Scalars cross (a global gradient norm is summed over all devices from each stage's
    part and sent back as one scalar), arrays do not: an update that reads arrays of
    several stages runs over all devices, replicated. Equations are grouped
    into programs by place and by how many crossings precede them; the programs run in
    that order. A step output lives where it is computed (outputs computed from step
    inputs alone, such as step counters, on all devices); an input lives where the
    output that updates it lives.
    """
    step = self._step
    jaxpr = step.closed_jaxpr.jaxpr
    eqn = jaxpr.eqns[self._index]
    loss = self._loss
    num_aux = loss.kinds.count(capture.AUX)
    readers = [set() for _ in eqn.invars]
    for s, st in enumerate(self.stages):
      for p in st.operands:
        readers[p].add(s)
    # The loss value and aux live on the stage computing them (the last, usually).
    producer = {v: s for s, st in enumerate(self.stages) for v in st.acts_out}
    loss_outs = loss.closed.jaxpr.outvars
    result_stages = []
    for j, kind in enumerate(loss.kinds):
      if kind == capture.GRAD:
        result_stages.append(readers[loss.num_consts + j - 1 - num_aux])
      else:
        out = loss_outs[j]
        result_stages.append({producer[out]} if out in producer else set())
    homes = [NamedSharding(st.mesh.mesh, PartitionSpec()) for st in self.stages] + [self._full]
    # A result lives on the one stage it belongs to (else on all devices); a gradient
    # there stays as its stage's backward accumulated it.
    self._result_homes = [homes[next(iter(r))] if len(r) == 1 else self._full
                          for r in result_stages]
    pins = [{} for _ in self.stages]
    for j, (kind, r) in enumerate(zip(loss.kinds, result_stages)):
      if kind == capture.GRAD and len(r) == 1:
        s = next(iter(r))
        st = self.stages[s]
        p = st.operands.index(loss.num_consts + j - 1 - num_aux)
        if p in st.diff:  # (not a frozen parameter's)
          self._result_homes[j] = st.grad_homes[st.diff.index(p)]
      for s in r if len(r) == 1 else ():
        pins[s][eqn.outvars[j]] = self._result_homes[j].spec
    # A parameter a stage owns lives as the stage's programs read it.
    for s, st in enumerate(self.stages):
      for p, a in zip(st.operands, st.operand_avals):
        pins[s][eqn.invars[p]] = a.sharding.spec
    direct = set(jaxpr.invars)
    computed = [v for v in eqn.invars if v not in direct and not isinstance(v, jex.Literal)]
    self._pre = self._program(computed, self._full) if computed else None

    group_of, floating = self._place_update(result_stages)
    producer_eqn = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    full = len(self.stages)
    groups: dict[tuple[int, int], list[int]] = {}  # (crossings, place) -> equations
    for i, g in group_of.items():
      groups.setdefault(g, []).append(i)
    positions: dict[tuple[int, int], list[int]] = {}
    results = {v: j for j, v in enumerate(eqn.outvars)}
    for o, v in enumerate(jaxpr.outvars):
      if isinstance(v, jex.Literal):
        g = (0, full)
      elif v in results:  # a loss result returned as it is: where it is made
        r = result_stages[results[v]]
        g = (0, next(iter(r)) if len(r) == 1 else full)
      elif v in floating:  # on all devices, after what it reads
        g = (max(c + (p != full) for p, c in floating[v].items()), full)
      else:  # computed from step inputs alone, or before the loss: on all devices
        g = group_of.get(producer_eqn.get(v), (0, full))
      positions.setdefault(g, []).append(o)
      groups.setdefault(g, [])
    order = sorted(groups)
    read_by = {}
    for g in order:
      for i in groups[g]:
        for v in jaxpr.eqns[i].invars:
          if not isinstance(v, jex.Literal):
            read_by.setdefault(v, set()).add(g)
    writes, reads = {}, {}
    for g in order:
      outs = [jaxpr.outvars[o] for o in positions.get(g, [])]
      crossing = [v for i in groups[g] for v in jaxpr.eqns[i].outvars
                  if read_by.get(v, set()) - {g} and v not in outs]
      writes[g] = outs + list(dict.fromkeys(crossing))
      others = {i for h in order if h != g for i in groups[h]}
      reads[g] = (frozenset(others), self._reads(writes[g], others)[1])
    self._applies = []
    self._output_homes = [self._full] * len(jaxpr.outvars)
    for g in order:
      elsewhere, _ = reads[g]
      if g[1] == full:
        program = self._program(writes[g], self._full, elsewhere=elsewhere)
      else:  # planned on the stage's mesh, the state laid out as its programs want it
        s = g[1]
        keep = {v for h in order if h != g for v in reads[h][1]}
        keep |= set(self._pre.reads) if self._pre else set()
        program = self._program(writes[g], homes[s], self._option, self.stages[s].mesh,
                                pins[s], keep=frozenset(keep), elsewhere=elsewhere)
      self._applies.append(program)
      for o, sharding in zip(positions.get(g, []), program.out_shardings):
        self._output_homes[o] = sharding
    self._input_homes = [self._full] * len(step.inputs)
    for o, src in enumerate(step.output_source):
      if src is not None:
        self._input_homes[src] = self._output_homes[o]

  def _place_update(self, result_stages) -> tuple[dict, dict]:
    """Places the equations after the loss.

    Returns ``(groups, floating)``: ``groups`` maps an equation index to ``(crossings,
    place)``, where the place is a stage index or ``len(stages)`` (all devices) and
    crossings counts the changes of place on the way from the loss results.
    Equations reading only step inputs and literals have no place, and neither have
    those that read an array step input and only placed scalars (``b1 * mu`` with a
    scheduled ``b1``): every program that needs them computes them. ``floating`` maps
    the variables of the latter to the places and crossings of what they read.
    """
    jaxpr = self._step.closed_jaxpr.jaxpr
    full = len(self.stages)
    origin = {}  # placed or floating variable -> {place: crossings}
    placed = set()
    for j, v in enumerate(jaxpr.eqns[self._index].outvars):
      r = result_stages[j]
      origin[v] = {next(iter(r)) if len(r) == 1 else full: 0}
      placed.add(v)
    # A parameter one stage reads lives there: so does its update when no gradient comes
    # into it (a frozen parameter's ``p + 0``).
    inputs = set(jaxpr.invars)
    for p, v in enumerate(jaxpr.eqns[self._index].invars):
      owners = {s for s, st in enumerate(self.stages) if p in st.operands}
      if v in inputs and len(owners) == 1 and p in self._frozen:
        origin[v] = {next(iter(owners)): 0}
        placed.add(v)
    # Only scalars move between a stage and all devices in the update (a global gradient
    # norm, a loss-scale flag): anything larger keeps an equation where it lives.
    large = lambda v: math.prod(getattr(v.aval, "shape", ())) > 1
    groups = {}
    for i in range(self._index + 1, len(jaxpr.eqns)):
      e = jaxpr.eqns[i]
      ins = [v for v in e.invars if not isinstance(v, jex.Literal)]
      known = [v for v in ins if v in origin]
      if not known:
        continue
      heavy = {next(iter(origin[v])) for v in known if v in placed and large(v)}
      floats = not heavy and any(large(v) for v in ins if v not in placed)
      sources = {}
      for v in known:
        for p, c in origin[v].items():
          sources[p] = max(sources.get(p, 0), c)
      if floats:
        for v in e.outvars:
          origin[v] = sources
        continue
      # Scalars of one stage stay there; combined with others', on all devices.
      where = (next(iter(heavy)) if len(heavy) == 1 else full if heavy
               else next(iter(sources)) if len(sources) == 1 else full)
      n = max(c + (p != where) for p, c in sources.items())
      for v in e.outvars:
        origin[v] = {where: n}
        placed.add(v)
      groups[i] = (n, where)
    floating = {v: o for v, o in origin.items() if v not in placed}
    return groups, floating

  def _compile_slicer(self):
    """One program over all devices cuts every batch operand into its micro-batches,
    each laid out so that the first stage reading it finds its shards on its own devices
    (``transfer.covering``; replicated where its sub-mesh is no block of all devices, and
    across processes, where :func:`move` takes replicated values apart locally)."""
    k = self._k
    jaxpr = self._step.closed_jaxpr.jaxpr
    operands = [p for p, b in enumerate(self._batch_operand) if b]
    invars = jaxpr.eqns[self._index].invars
    avals = [jax.ShapeDtypeStruct(invars[p].aval.shape, invars[p].aval.dtype,
                                  sharding=self._full) for p in operands]
    devices = list(self._full.mesh.devices.flat)
    outs = []
    for p in operands:
      readers = [a.sharding for st in self.stages for q, a in zip(st.operands, st.operand_avals)
                 if q == p]
      cover = (transfer.covering(devices, readers[0])
               if readers and jax.process_count() == 1 else None)
      outs.append([self._full if cover is None else cover[0]] * k)
    split = lambda xs: [[x.reshape((k, x.shape[0] // k) + x.shape[1:])[i] for i in range(k)]
                        for x in xs]
    self._slicer = jax.jit(split, out_shardings=outs).lower(avals).compile()

  @staticmethod
  def _own_bits(loss_jaxpr, stage: Stage) -> str:
    """A note on the stage's random draws not found as part of a whole-batch draw (in a
    scan, say): each draws the same bits in every micro-batch (empty if none)."""
    own = jaxpr_util.count_primitive(loss_jaxpr, "random_bits", stage.eqns) - rng.count(stage.draws)
    return (f"; {own} random draw(s) not found as part of a whole-batch draw give the same "
            f"bits in every micro-batch (right only for draws not per example)") if own else ""

  @functools.cached_property
  def _normalizer(self):
    """The loss's ``d`` if it is a token-weighted mean ``n / d`` (``coupling.normalizer_of``)."""
    loss = self._loss.closed.jaxpr
    return coupling.normalizer_of(loss.eqns, loss.outvars[0],
                                  set(loss.invars[self._loss.num_consts:]))

  @functools.cached_property
  def _scales(self) -> list[float | None]:
    """Per loss output, a micro-batch's weight in the whole batch's value
    (``coupling.part_scale``: 1 for a sum over the batch; None: the mean over
    micro-batches); the micro-batches' backward passes are seeded with the loss's."""
    micro, whole = self._loss.closed.jaxpr, self._whole
    return [None if isinstance(w, jex.Literal) else
            coupling.part_scale(whole.eqns, w, micro.eqns, v, self._k)
            for w, v in zip(whole.outvars, micro.outvars)]

  def _compile_weigher(self):
    """For a token-weighted loss ``n / d`` (``coupling.normalizer_of``): a program that
    computes each micro-batch's share ``d_b / Σ d`` from the micro-batch slices, read
    as ``(positions of the loss operands it needs, program)``; None otherwise. The loss
    and gradients are then the shares' weighted sums, which are the whole batch's."""
    closed = self._loss.closed
    jaxpr = closed.jaxpr
    d = self._normalizer
    if d is None:
      return None
    ids = jaxpr_util.needed_eqns(jaxpr, [d])
    reads = jaxpr_util.free_invars(jaxpr, ids)

    def shares(per_micro_batch):
      weights = []
      for values in per_micro_batch:
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update((jaxpr.invars[p], x) for p, x in zip(reads, values))
        jaxpr_util.eval_eqns(jaxpr, env, ids)
        weights.append(jaxpr_util.read(env, d).astype(jnp.float32))
      total = sum(weights[1:], weights[0])
      return [w / total for w in weights]

    # The loss is traced at the micro-batch size.
    avals = [[jax.ShapeDtypeStruct(jaxpr.invars[p].aval.shape, jaxpr.invars[p].aval.dtype,
                                   sharding=self._full) for p in reads]] * self._k
    return reads, jax.jit(shares, out_shardings=self._full).lower(avals).compile()

  def _program_steps(self, stage: Stage, with_forward: bool = True):
    """The stage's backward and forward (or None) programs, traced
    (``stage_shard.program_step``)."""
    loss_jaxpr = self._loss.closed.jaxpr
    forward, backward, diff, float_in, float_out = stage_functions(
        self._loss, stage, self._normalizer is not None, self._frozen)
    stage.diff, stage.float_in, stage.float_out = diff, float_in, float_out
    aval = lambda v: jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype)
    ops = [aval(loss_jaxpr.invars[p]) for p in stage.operands]
    acts_in = [aval(v) for v in stage.acts_in]
    cots = [aval(stage.acts_out[p]) for p in float_out]
    grads = [ops[p] for p in diff]
    roles = [stage_shard.operand_roles(stage, self._batch_operand), [BATCH] * len(acts_in),
             [BATCH] * len(cots), [OPTIMIZER] * len(grads)]
    layers = f"layers {stage.layers[0]}..{stage.layers[1] - 1}"
    names = [[self._operand_paths[p] for p in stage.operands],
             [f"{layers}: activation in [{p}]" for p in range(len(acts_in))],
             [f"{layers}: cotangent [{p}]" for p in range(len(cots))],
             [f"gradient of {self._operand_paths[stage.operands[p]]}" for p in diff]]
    before = len(ops) + len(acts_in) + len(cots)
    # The micro-batch index, last (its draws' part of the whole batch's bits).
    index = [[jax.ShapeDtypeStruct((), jnp.int32)]] if self._indexed else []
    index_roles, index_names = [[INPUT]] * len(index), [["micro-batch index"]] * len(index)
    with_index = lambda f: lambda *groups: f(*groups[:-1], *groups[-1]) if index else f(*groups)
    return (stage_shard.program_step(with_index(backward), [ops, acts_in, cots, grads, *index],
                                     roles + index_roles, names + index_names,
                                     tied={o: before + o for o in range(len(grads))},
                                     donated=frozenset(range(before, before + len(grads)))),
            stage_shard.program_step(with_index(forward), [ops, acts_in, *index],
                                     roles[:2] + index_roles, names[:2] + index_names)
            if with_forward else None)

  def _program_cost(self, option: m.AutoShardingOption, stage: Stage) -> float:
    """Predicted seconds per micro-batch of an uncompiled stage: the shard ILP's
    objective for its backward (recompute, backward and gradient communication as
    planned on the sub-mesh) plus its forward's compute, ``flops / (n · peak)``. Layers
    with the same backward program are solved once; each layer is traced once."""
    if stage.eqns not in self._traced:
      backward, _ = self._program_steps(stage, with_forward=False)
      self._traced[stage.eqns] = backward, str(backward.closed_jaxpr)
    backward, text = self._traced[stage.eqns]
    n = stage.mesh.num_devices
    key = (n, text)
    if key not in self._cost_cache:
      self._cost_cache[key] = stage_shard.plan_program(
          backward, stage.mesh, option, compile=False).result.objective
    jaxpr = self._loss.closed.jaxpr
    flops = sum(jaxpr_util.eqn_flops(jaxpr.eqns[i]) for i in stage.eqns)
    return self._cost_cache[key] + flops / (n * stage.mesh.peak_flops)

  def _compile_stages(self, option: m.AutoShardingOption):
    """Plans and compiles every stage's programs: the backward (which holds all of the
    stage's equations) searched over the sub-mesh's shapes, then the forward with its
    operands pinned to the backward's choice. A stage whose plan is data parallel runs
    per device instead, with one gradient reduction per step (``per_device.py``).

    Every stage is laid out first, then compiled: a program returns each activation in
    the layout of the first stage reading it, and each activation's cotangent in the
    layout its producer's backward takes, wherever that layout fits its own mesh, so
    that moving it to the other sub-mesh is one copy (``transfer.py``)."""
    self._cot_shardings = {}  # a float activation: where its producer's backward takes its cotangent
    builds = [self._lay_out_stage(stage, option) for stage in self.stages]
    reader = {}
    for stage in self.stages:
      for v, a in zip(stage.acts_in, stage.in_avals):
        reader.setdefault(v, a.sharding)
    for stage, build in zip(self.stages, builds):
      mesh = stage.mesh.mesh
      outs = {p: _expressed(reader[v], mesh) for p, v in enumerate(stage.acts_out) if v in reader}
      cots = {p: _expressed(self._cot_shardings[stage.acts_in[p]], mesh)
              for p in stage.float_in if stage.acts_in[p] in self._cot_shardings}
      build({p: sh for p, sh in outs.items() if sh is not None},
            {p: sh for p, sh in cots.items() if sh is not None})
      stage.grad_homes = stage.grad_homes or [g.sharding for g in stage.grad_avals]
      stage.zeros = compile_here(jax.jit(
          lambda grads=stage.grad_avals: [jnp.zeros(g.shape, g.dtype) for g in grads],
          out_shardings=[g.sharding for g in stage.grad_avals]).lower(), list(mesh.devices.flat))

  def _lay_out_stage(self, stage: Stage, option: m.AutoShardingOption):
    """Plans the stage and sets its programs' avals; returns ``build(outs, cots)``, which
    compiles its forward and backward with activation ``p`` out in ``outs[p]`` and the
    cotangent of activation in ``p`` in ``cots[p]`` (shardings on the stage's mesh)."""
    bwd_step, fwd_step = self._program_steps(stage)
    bwd = self._plan_backward(stage, option, bwd_step)
    n_ops, n_in = len(stage.operands), len(stage.acts_in)
    per_device = self._per_device(stage)
    if isinstance(per_device, str):
      stage.note = (f"gradients reduced in every micro-batch: {per_device}"
                    + self._own_bits(self._loss.closed.jaxpr, stage))
      fwd = stage_shard.plan_program(fwd_step, bwd.lmesh, option,
                                     dict(enumerate(bwd.result.layout.in_specs[:n_ops + n_in])),
                                     compile=False)
      stage.out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                         for a, sh in zip(fwd_step.out_avals, fwd.out_shardings)]
      stage.objectives = (fwd.result.objective, bwd.result.objective)
      stage.forward_plan = fwd.result
      build = functools.partial(self._compile_planned, stage, fwd.result, bwd.result)
    else:
      stage.note = ("data parallel per device, gradients reduced once per step"
                    if not per_device.axes else
                    f"per shard of the batch over {per_device.axes}, the other axes as "
                    f"planned; gradients reduced once per step")
      build = self._lay_out_per_device(stage, per_device, fwd_step)
      stage.per_device = per_device
      stage.objectives = (None, bwd.result.objective)
    self._cot_shardings.update((stage.acts_out[p], a.sharding)
                               for p, a in zip(stage.float_out, stage.cot_avals))
    return build

  @staticmethod
  def _compile_planned(stage: Stage, fwd, bwd, outs: dict, cots: dict):
    """Compiles a ShardParallel-planned stage's programs (see :meth:`_lay_out_stage`)."""
    specs = list(fwd.layout.out_specs)
    _hand_over(stage, [(specs[p], sh, stage.out_avals[p]) for p, sh in outs.items()]
               + [(bwd.layout.out_specs[len(stage.diff) + k], cots[p], stage.in_avals[p])
                  for k, p in enumerate(stage.float_in) if p in cots])
    for p, sh in outs.items():
      specs[p] = sh.spec
    stage.out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=outs.get(p, a.sharding))
                       for p, a in enumerate(stage.out_avals)]
    stage.forward = compile_layout(fwd.step, dataclasses.replace(fwd.layout,
                                                                 out_specs=tuple(specs)))
    specs = list(bwd.layout.out_specs)
    for k, p in enumerate(stage.float_in):
      if p in cots:
        specs[len(stage.diff) + k] = cots[p].spec
    stage.backward = compile_layout(bwd.step, dataclasses.replace(bwd.layout,
                                                                  out_specs=tuple(specs)))

  def _plan_backward(self, stage: Stage, option: m.AutoShardingOption, bwd_step=None):
    """Plans the stage's backward program (nothing compiles); sets the stage's mesh to the
    chosen shape and its programs' avals to the plan's shardings."""
    if bwd_step is None:
      bwd_step, _ = self._program_steps(stage, with_forward=False)
    bwd = stage_shard.plan_program(bwd_step, stage.mesh, option, mesh_shape=stage.mesh_shape,
                                   compile=False)
    n_ops, n_in, n_cots = len(stage.operands), len(stage.acts_in), len(stage.float_out)
    stage.mesh = bwd.lmesh
    avals = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh)
             for leaf, sh in zip(bwd_step.inputs, bwd.in_shardings)]
    stage.operand_avals = avals[:n_ops]
    stage.in_avals = avals[n_ops:n_ops + n_in]
    stage.cot_avals = avals[n_ops + n_in:n_ops + n_in + n_cots]
    stage.grad_avals = avals[n_ops + n_in + n_cots:len(avals) - self._indexed]
    stage.index_aval = avals[-1] if self._indexed else None
    stage.backward_plan = bwd.result
    return bwd

  def _per_device(self, stage: Stage):
    """The stage's per-device form (``per_device.PerDeviceStage``), or why it has none."""
    if self._retrace is None or stage.mesh.num_devices == 1:
      return "one device" if stage.mesh.num_devices == 1 else "no per-device trace"
    if self._coupled:
      return "the loss mixes examples: a device's share would use its own"
    axes = self._batch_axes(stage)
    if isinstance(axes, str):
      return axes
    axis_sizes = dict(zip(stage.mesh.axis_names, stage.mesh.shape))
    n = math.prod(axis_sizes[a] for a in axes) if axes else stage.mesh.num_devices
    jaxpr = self._step.closed_jaxpr.jaxpr
    sizes = {v.aval.shape[0] for v, b in zip(jaxpr.eqns[self._index].invars, self._batch_operand)
             if b}
    if any(size % (self._k * n) for size in sizes):
      return f"a micro-batch does not split into {n} equal parts"
    loss = self._loss.closed.jaxpr
    if self._normalizer is not None and any(self._normalizer in loss.eqns[i].invars
                                            for i in stage.eqns):
      # Per device it would divide by each device's own count.
      return "it divides the loss by a sum over the micro-batch (a token count)"
    if n not in self._device_losses:
      try:
        found = [e for e in self._retrace(self._k * n).jaxpr.eqns
                 if e.primitive is capture.pipeline_loss_p]
      except errors.BatchDivisibilityError as e:  # (the batch size is a constant in it)
        found = str(e)
      self._device_losses[n] = (found if isinstance(found, str) else
                                found[0].params["loss"] if len(found) == 1 else
                                "the per-device trace has no single loss equation")
    if isinstance(self._device_losses[n], str):
      return self._device_losses[n]
    pd = per_device.per_device_stage(self._loss, self._device_losses[n], stage,
                                     self._batch_operand, n, self._whole, self._k * n)
    return pd if isinstance(pd, str) else dataclasses.replace(pd, axes=axes)

  def _batch_axes(self, stage: Stage) -> tuple[str, ...] | str:
    """The axes the stage's backward plan splits the micro-batch over (dim 0 of its batch
    operands and activations), or why it has none that its gradients could be summed over
    once per step: the other axes stay as planned (model parallel). Empty with its
    parameters replicated: every axis, each device runs its share."""
    if all(stage.operand_avals[p].sharding.is_fully_replicated for p in stage.diff):
      return ()
    batch = [a for p, a in zip(stage.operands, stage.operand_avals) if self._batch_operand[p]]
    dims = {from_partition_spec(a.sharding.spec, len(a.shape))[0]
            for a in batch + list(stage.in_avals) if a.shape} - {()}
    if len(dims) != 1:
      return ("its plan splits the batch of its inputs over different axes" if dims else
              "its plan splits no batch dimension")
    axes = next(iter(dims))
    if any(used_axes(from_partition_spec(stage.operand_avals[p].sharding.spec,
                                         len(stage.operand_avals[p].shape))) & set(axes)
           for p in stage.diff):
      return "its plan shards parameters over the batch axes (as ZeRO-3 does)"
    return axes

  @staticmethod
  def _summed_spec(pd, planned: PartitionSpec) -> PartitionSpec:
    """Where a per-shard stage's gradient lives once summed: replicated over the axes that
    split the batch (all of them for a per-device stage), as planned on the others."""
    return per_device.without_axes(planned, pd.axes) if pd.axes else PartitionSpec()

  def _lay_out_per_device(self, stage: Stage, pd, fwd_step):
    """Sets a per-device stage's avals; returns its ``build(outs, cots)`` (see
    :meth:`_lay_out_stage`)."""
    forward, backward, op_sh, in_sh, out_sh, row = per_device.programs(
        pd, stage.mesh.mesh, self._frozen, self._indexed, stage.backward_plan)
    n, n_ops, num_diff = pd.num_shards, len(stage.operands), len(stage.diff)
    placed = lambda avals, shardings: [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                                       for a, sh in zip(avals, shardings)]
    mesh = stage.mesh.mesh
    manual = not pd.axes
    # All axes per device: everything as the per-device programs lay it out. Batch axes
    # only: operands and gradients keep the plan's layout on the other axes.
    planned_grads = [g.sharding.spec for g in stage.grad_avals]
    shapes = [g.shape for g in stage.grad_avals]
    if manual:
      stage.operand_avals = placed(stage.operand_avals, op_sh)
      stage.in_avals = placed(stage.in_avals, in_sh)
    stage.out_avals = placed(fwd_step.out_avals, out_sh)
    stage.cot_avals = [stage.out_avals[p] for p in stage.float_out]
    homes = [self._summed_spec(pd, spec) for spec in planned_grads]
    stage.grad_homes = [NamedSharding(mesh, spec) for spec in homes]
    stage.grad_avals = [jax.ShapeDtypeStruct(
        per_device.rows_shape(n, g.shape), g.dtype,
        sharding=NamedSharding(mesh, per_device.rows_spec(row.spec[0], spec, len(g.shape))))
        for g, spec in zip(stage.grad_avals, homes)]
    n_in, n_cots = len(stage.in_avals), len(stage.cot_avals)
    stage.index_aval = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(
        mesh, PartitionSpec())) if self._indexed else None
    index = [stage.index_aval] if self._indexed else []
    stage.note += self._own_bits(pd.loss.closed.jaxpr, pd.stage)

    def flat_forward(*leaves):
      return forward(list(leaves[:n_ops]), list(leaves[n_ops:n_ops + n_in]),
                     list(leaves[n_ops + n_in:]))

    def flat_backward(*leaves):
      ops, rest = list(leaves[:n_ops]), leaves[n_ops:]
      sums, cots = backward(ops, list(rest[:n_in]), list(rest[n_in:n_in + n_cots]),
                            list(rest[n_in + n_cots:n_in + n_cots + num_diff]),
                            list(rest[n_in + n_cots + num_diff:]))
      return (*sums, *cots)

    def build(outs: dict, cots: dict):
      _hand_over(stage, [(out_sh[p].spec, sh, stage.out_avals[p]) for p, sh in outs.items()]
                 + [(stage.in_avals[p].sharding.spec, sh, stage.in_avals[p])
                    for p, sh in cots.items()])
      forward_out = [outs.get(p, sh) for p, sh in enumerate(out_sh)]
      stage.out_avals = placed(stage.out_avals, forward_out)
      devices = list(stage.mesh.mesh.devices.flat)
      stage.forward = compile_here(jax.jit(flat_forward, out_shardings=forward_out).lower(
          *stage.operand_avals, *stage.in_avals, *index), devices)
      accumulator = tuple(range(n_ops + n_in + n_cots, n_ops + n_in + n_cots + num_diff))
      stage.backward = compile_here(jax.jit(
          flat_backward, donate_argnums=accumulator,
          out_shardings=(*[g.sharding for g in stage.grad_avals],
                         *[cots.get(p, stage.in_avals[p].sharding) for p in stage.float_in])
      ).lower(*stage.operand_avals, *stage.in_avals, *stage.cot_avals, *stage.grad_avals,
              *index), devices)
      stage.reduce = compile_here(
          jax.jit(lambda *rows: [r.reshape(n, *shape).sum(0) for r, shape in zip(rows, shapes)],
                  out_shardings=stage.grad_homes).lower(*stage.grad_avals), devices)

    return build

  # ---- running ------------------------------------------------------------------------

  bind_keywords = None  # as Executable's

  def __call__(self, *args, **kwargs):
    args = positional(self, args, kwargs)
    leaves = tree_util.tree_leaves(tuple(args[i] for i in self._dyn_argnums))
    return self.call_flat(leaves)

  def call_flat(self, leaves):
    """Runs one step on the flat dynamic leaves; returns the output pytree."""
    jaxpr = self._step.closed_jaxpr.jaxpr
    eqn = jaxpr.eqns[self._index]
    values = dict(zip(jaxpr.invars, place_inputs(self._step, leaves, self._input_homes)))
    if self._pre is not None:
      values.update(zip(self._pre.writes, self._run_program(self._pre, values)))
    values.update(zip(eqn.outvars, self._run_pipeline([jaxpr_util.read(values, v)
                                                        for v in eqn.invars])))
    for program in self._applies:
      values.update(zip(program.writes, self._run_program(program, values)))
    out = [jaxpr_util.read(values, v) for v in jaxpr.outvars]
    for o in self._broadcast:
      out[o] = replicate(out[o], self._full)
    return tree_util.tree_unflatten(self._step.out_tree, out)

  @staticmethod
  def _run_program(program: Program, values: dict) -> list:
    return program.compiled(*[move(values[v], sh)
                              for v, sh in zip(program.reads, program.in_shardings)])

  def _run_pipeline(self, operands):
    loss, k = self._loss, self._k
    jaxpr = loss.closed.jaxpr
    # One program over all devices slices every batch operand into its micro-batches
    # (eager indexing of a global array is avoided: across processes it blocked).
    sliced = iter(self._slicer([x for x, b in zip(operands, self._batch_operand) if b]))
    micro = [next(sliced) if b else None for b in self._batch_operand]
    shares = None
    if self._weigher is not None:  # a token-weighted loss: micro-batch b's share d_b / Σ d
      reads, weigher = self._weigher
      shares = weigher([[micro[p][b] if self._batch_operand[p] else move(operands[p], self._full)
                         for p in reads] for b in range(k)])
    stage_ops, fixed = {}, {}

    def ops_for(s, b):
      """Stage ``s``'s operands for micro-batch ``b``; those that are no micro-batch
      slices placed once per step."""
      if (s, b) not in stage_ops:
        st = self.stages[s]
        if s not in fixed:
          fixed[s] = [None if self._batch_operand[p] else move(operands[p], a.sharding)
                      for p, a in zip(st.operands, st.operand_avals)]
        stage_ops[s, b] = [move(micro[p][b], a.sharding) if x is None else x
                           for p, a, x in zip(st.operands, st.operand_avals, fixed[s])]
      return stage_ops[s, b]

    # An activation is moved to each later stage that reads it, and a cotangent to its
    # producer's backward, at the end of the clock that made it: the moves of one clock
    # are issued together (one device_put for their copies, see transfer.move_many).
    ready, saved, cots, accumulated = {}, {}, {}, {}
    outputs = {}
    in_flight = [0] * len(self.stages)
    peak = [0] * len(self.stages)
    dispatched = 0
    out_index = {}  # a loss may return one value twice
    for i, v in enumerate(jaxpr.outvars):
      out_index.setdefault(v, []).append(i)
    readers = self._readers
    clock = time.perf_counter
    call_s = move_s = 0.0
    groups = self.schedule.num_stages // self.schedule.virtual_stages
    recorder = timeline.Recorder(groups) if self.record_timeline else None
    last_backward = {}  # stage -> the recorder's index of its latest backward
    start, start_cpu = clock(), time.thread_time()
    for instructions in self._clocks:
      acts_made, cots_made = [], []  # (key, value, target layout)
      for ins in instructions:
        s, b, st = ins.stage, ins.micro_batch, self.stages[ins.stage]
        if ins.kind == FORWARD:
          t0 = clock()
          ops = ops_for(s, b)
          acts_in = [ready.pop((b, v, s)) for v in st.acts_in]
          t1 = clock()
          outs = st.run_forward(ops, acts_in, self._index_operand(st, b))
          move_s += t1 - t0
          call_s += clock() - t1
          if recorder is not None:
            recorder.issued(FORWARD, s, b, s % groups, t1, outs)
          for v, x in zip(st.acts_out, outs):
            acts_made += [((b, v, r), x, sharding) for r, sharding in readers.get(v, ())]
            for i in out_index.get(v, ()):
              outputs[b, i] = x
          saved[s, b] = (ops, acts_in)
          in_flight[s] += 1
          peak[s] = max(peak[s], in_flight[s])
        elif ins.kind == BACKWARD:
          ops, acts_in = saved.pop((s, b))
          cot_out = []
          for p, a in zip(st.float_out, st.cot_avals):
            v = st.acts_out[p]
            c = cots.pop((b, v), None)
            if v is jaxpr.outvars[0]:  # the loss value: d(mean over micro-batches)/d(value_b)
              c = (self._constant(a, 1.0 / k if self._scales[0] is None else self._scales[0])
                   if shares is None else shares[b].astype(a.dtype))
            t0 = clock()
            cot_out.append(move(c, a.sharding) if c is not None else self._constant(a, 0.0))
            move_s += clock() - t0
          if recorder is not None and s in last_backward:  # before its accumulator is donated
            recorder.wait_for(last_backward[s])
          t0 = clock()
          if s not in accumulated:
            accumulated[s] = st.zeros()
          accumulated[s], act_cots = st.run_backward(ops, acts_in, cot_out, accumulated[s],
                                                     self._index_operand(st, b))
          call_s += clock() - t0
          if recorder is not None:
            last_backward[s] = recorder.issued(BACKWARD, s, b, s % groups, t0,
                                               (accumulated[s], act_cots))
          for p, c in zip(st.float_in, act_cots):
            v = st.acts_in[p]
            cots_made.append(((b, v), c, self._cot_shardings[v]))
          in_flight[s] -= 1
        dispatched += 1
      made = acts_made + cots_made
      if made:
        t0 = clock()
        moved = move_all([x for _, x, _ in made], [target for _, _, target in made])
        move_s += clock() - t0
        for (key, _, _), x in zip(acts_made, moved):
          ready[key] = x
        for (key, _, _), c in zip(cots_made, moved[len(acts_made):]):
          cots[key] = c if key not in cots else cots[key] + c
    self.stats = {"max_in_flight": peak, "dispatched": dispatched,
                  "dispatch_s": clock() - start, "call_s": call_s, "move_s": move_s,
                  "dispatch_cpu_s": time.thread_time() - start_cpu}
    if recorder is not None:
      self.stats["timeline"] = recorder.spans(len(self.stages))
    # A gradient stays on the stage that reads its operand; if several stages read it,
    # their sums are added where its result lives (all devices).
    num_aux = loss.kinds.count(capture.AUX)
    home = {loss.num_consts + j - 1 - num_aux: h
            for j, (kind, h) in enumerate(zip(loss.kinds, self._result_homes))
            if kind == capture.GRAD}
    grads = {}
    for s, sums in accumulated.items():
      if self.stages[s].reduce is not None:  # a per-device stage's one reduction
        sums = self.stages[s].reduce(*sums)
      for p, g in zip(self.stages[s].diff, sums):
        pos = self.stages[s].operands[p]
        g = move(g, home[pos])
        grads[pos] = g if pos not in grads else grads[pos] + g
    results = []
    passed = {v: p for p, v in enumerate(jaxpr.invars)}
    batch = sum(1 << p for p, b in enumerate(self._batch_operand) if b)
    deps = jaxpr_util.dependencies(jaxpr, len(jaxpr.invars), jaxpr.outvars)
    for i, kind in enumerate(loss.kinds):
      if kind == capture.GRAD:
        pos = loss.num_consts + i - 1 - num_aux
        v = jaxpr.invars[pos]
        if pos in self._frozen:  # nothing reads it
          results.append(None)
          continue
        results.append(grads[pos] if pos in grads
                       else move(np.zeros(v.aval.shape, v.aval.dtype), home[pos]))
        continue
      out = jaxpr.outvars[i]
      if isinstance(out, jex.Literal) or out in passed:  # returned as it came in, no stage
        # made it (nnx.value_and_grad's aux: the parameters)
        results.append(move(out.val if isinstance(out, jex.Literal) else operands[passed[out]],
                            self._result_homes[i]))
        continue
      parts = [move(outputs[b, i], self._result_homes[i]) for b in range(k)]
      if kind == capture.AUX and parts[0].shape != self._whole.outvars[i].aval.shape:
        results.append(jnp.concatenate(parts))  # per example (logits): in batch order
        continue
      if kind == capture.VALUE and shares is not None:
        parts = [x * move(w.astype(x.dtype), self._result_homes[i]) for x, w in zip(parts, shares)]
        results.append(sum(parts[1:], parts[0]))
        continue
      total = sum(parts[1:], parts[0])
      if not jnp.issubdtype(total.dtype, jnp.inexact):
        # (a count over the batch is summed; an integer no batch value reaches, nnx's rng
        # counter in the module state it returns as aux, is the same in every micro-batch)
        results.append(total if deps[i] & batch else parts[0])
      else:
        results.append(total / k if self._scales[i] is None else total * self._scales[i])
    return results

  def _activation_readers(self) -> dict:
    """Activation variable -> (stage, layout) of each stage that reads it."""
    readers = {}
    for s, stage in enumerate(self.stages):
      for v, a in zip(stage.acts_in, stage.in_avals):
        readers.setdefault(v, []).append((s, a.sharding))
    return readers

  def _passes_by_clock(self) -> list[list]:
    """The schedule's forward and backward instructions, grouped by clock."""
    clocks = {}
    for ins in self.schedule.instructions:
      if ins.kind in (FORWARD, BACKWARD):
        clocks.setdefault(ins.clock, []).append(ins)
    return [clocks[c] for c in sorted(clocks)]

  def _index_operand(self, stage: Stage, b: int) -> list:
    """The stage programs' last operand for micro-batch ``b``: ``[b]`` placed, or none."""
    return [] if stage.index_aval is None else [self._constant(stage.index_aval, b)]

  def _constant(self, aval, value: float) -> jax.Array:
    """``value`` everywhere in ``aval``'s shape, placed once (backward programs do not
    donate their cotangents, so it is reused)."""
    key = (aval.shape, str(aval.dtype), aval.sharding, value)
    if key not in self._constants:
      self._constants[key] = move(np.full(aval.shape, value, aval.dtype), aval.sharding)
    return self._constants[key]

  def stage_report(self, repeats: int = 3) -> list[StageReport]:
    """Per stage: its layers and devices, the stage search's predicted seconds per
    micro-batch (``stage_option="auto"``; else None), its forward and backward measured
    here (median of ``repeats`` runs on zeros of the micro-batch shapes) and the bytes per
    device of its larger program."""
    reports = []
    for s, st in enumerate(self.stages):
      zeros = lambda avals: [place(np.zeros(a.shape, a.dtype), a.sharding) for a in avals]
      args = (zeros(st.operand_avals), zeros(st.in_avals))
      cots, index = zeros(st.cot_avals), self._index_operand(st, 0)

      def timed(run):
        times = []
        for _ in range(repeats + 1):  # the first run warms up
          start = time.perf_counter()
          jax.block_until_ready(run())
          times.append(time.perf_counter() - start)
        return float(np.median(times[1:]))

      memory = max(int(a.argument_size_in_bytes + a.output_size_in_bytes
                       - a.alias_size_in_bytes + a.temp_size_in_bytes)
                   for a in (st.forward.memory_analysis(), st.backward.memory_analysis()))
      reports.append(StageReport(
          s, st.layers, tuple(d.id for d in st.mesh.devices),
          None if self._predicted is None else self._predicted.stage_costs[s],
          timed(lambda: st.run_forward(*args, index)),
          timed(lambda: st.run_backward(*args, cots, st.zeros(), index)), memory))
    return reports

  def gather(self, tree):
    """``tree`` (a state this step returned) with every array replicated over all the
    method's devices: one global layout, for checkpointing (orbax) or evaluation. In a
    multi-process job every process must call it, in the same order (see :func:`replicate`)."""
    return jax.tree.map(lambda x: replicate(x, self._full) if isinstance(x, jax.Array) else x,
                        tree)

  # ---- introspection --------------------------------------------------------------------

  def _programs(self):
    return ([self._pre.compiled] if self._pre else []) + [
        p for st in self.stages for p in (st.forward, st.backward)] + [
            st.reduce for st in self.stages if st.reduce is not None] + [
                a.compiled for a in self._applies]

  def get_hlo_text(self) -> list[str]:
    """One HLO text per program: pre (if the loss's inputs need computing), each stage's
    forward and backward, the per-device stages' gradient reductions, then the updates
    (one per stage holding state, and one over all devices for what no stage owns)."""
    return [p.as_text() for p in self._programs()]

  def memory_analysis(self) -> list:
    return [p.memory_analysis() for p in self._programs()]

  def cost_analysis(self) -> list:
    return [p.cost_analysis() for p in self._programs()]

  def get_total_allocation_size(self) -> int:
    """Bytes per device at the busiest devices' peak (:meth:`device_peaks`), or of the
    largest program where that is more (an update program)."""
    largest = max(_program_bytes(a) for a in self.memory_analysis())
    return int(max(largest, *self.device_peaks().values()))

  def device_peaks(self) -> dict[str, float]:
    """Per stage (``"stage <s>"``), the bytes per device its devices hold while its
    backward program runs: that program (arguments + outputs − aliased + temporaries),
    the optimizer state the devices keep for the update, the stage's inputs kept for the
    schedule's other micro-batches in flight, and the step's micro-batch slices (cut at
    the start, on every device). Stages sharing devices (``virtual_stages`` > 1) add up
    their programs' arguments, state and inputs; the largest of their programs' own
    outputs and temporaries comes on top."""
    in_flight = self.schedule.max_in_flight()
    keys = [frozenset(d.id for d in st.mesh.devices) for st in self.stages]
    groups: dict[frozenset, list[tuple[float, float]]] = {}
    for s, (st, key) in enumerate(zip(self.stages, keys)):
      a = st.backward.memory_analysis()
      kept = (a.argument_size_in_bytes + self.optimizer_bytes(st)
              + sum(device_bytes(v) for v in st.in_avals) * max(in_flight[s] - 1, 0))
      groups.setdefault(key, []).append((kept, _program_bytes(a) - a.argument_size_in_bytes))
    slices = self.batch_slice_bytes()
    peak = {key: sum(k for k, _ in g) + max(r for _, r in g) + slices
            for key, g in groups.items()}
    return {f"stage {s}": float(peak[key]) for s, key in enumerate(keys)}

  def batch_slice_bytes(self) -> float:
    """Per device, the micro-batch slices of the loss's batch inputs: all of them are
    cut at the start of a step, replicated over every device."""
    loss_eqn = self._step.closed_jaxpr.jaxpr.eqns[self._index]
    return float(sum(_nbytes(v.aval)
                     for v, is_batch in zip(loss_eqn.invars, self._batch_operand) if is_batch))

  def optimizer_bytes(self, stage) -> float:
    """Per device, the optimizer state that lives on ``stage``'s devices (as the update
    programs' plans lay it out)."""
    devices = set(stage.mesh.mesh.devices.flat)
    return float(sum(
        math.prod(home.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf, home in zip(self._step.inputs, self._input_homes)
        if leaf.role == OPTIMIZER and home.device_set == devices))

  def check_communication(self, tolerance: float = 0.10) -> list[str]:
    """Compares the plan's predicted collectives per step (the stage plans' predictions
    added up over the driver's programs and micro-batches, ``pipeline/predict.py``) with
    what XLA compiled, one line per kind as ``Executable.check_communication`` gives them."""
    return compare_collectives(self.plan.predicted_collectives, self.communication(),
                               tolerance)

  def communication(self) -> dict[str, hlo_inspect.CollectiveStats]:
    """Collectives inside the programs for one step (stage programs × micro-batches);
    transfers between sub-meshes (``device_put``) are not collectives and not counted."""
    total: dict[str, hlo_inspect.CollectiveStats] = {}
    times = ([1] if self._pre else []) + [self._k] * (2 * len(self.stages)) + [1] * (
        sum(st.reduce is not None for st in self.stages) + len(self._applies))
    for text, n in zip(self.get_hlo_text(), times):
      for kind, stats in hlo_inspect.collective_summary(text).items():
        scaled = hlo_inspect.CollectiveStats(stats.count * n, stats.result_bytes * n,
                                             stats.wire_bytes * n)
        total[kind] = total.get(kind, hlo_inspect.CollectiveStats()) + scaled
    return total


def _program_bytes(a) -> float:
  return float(a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
               + a.temp_size_in_bytes)


