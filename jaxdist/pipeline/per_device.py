"""One gradient reduction per step for stages whose shard plan is data parallel.

XLA partitions each stage program on its own, so a stage whose plan splits the batch
and keeps its parameters replicated all-reduces its gradients in every micro-batch's
backward. For such a stage the forward and backward run instead inside ``jax.shard_map``
over the whole sub-mesh, each device evaluating the stage's equations on its own slice
of the micro-batch. Shapes are baked into a jaxpr, so those equations come from the step
traced again at the per-device micro-batch size; its loss equations are aligned with
the micro-batch ones by their primitive sequence (jax special-cases size-1 dimensions,
so a broadcast may come or go). Each device adds its partial gradients into its own
block of an accumulator that stacks one gradient per device along the first dimension
(:func:`rows_shape`); one program per step sums the blocks (the all-reduce).

Per device, every value crossing the stage is one of:

- split: a dimension shrank by the device count (the batch): that dimension is split
  over the sub-mesh;
- replicated: same shape, not computed from the batch (a parameter passed on): the
  stage reading it sums its cotangent over the devices; the stage writing it, which
  computes it alike on every device, takes 1/devices of the cotangent on each;
- a loss output: same shape, computed from the batch (the loss, aux): its mean (float)
  or sum (int) over the devices, and its cotangent divided by the device count; a float
  output that sums over the batch (``jnp.sum`` of per-example losses) is summed instead,
  each device's weighted by ``coupling.part_scale``, and so is its cotangent.

Anything else (a batch statistic passed between stages, a stage whose equations do not
line up) keeps the stage on its shard plan, noted in the plan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import accumulate, coupling, jaxpr_util, rng
from jaxdist.pipeline import capture
from jaxdist.pipeline.partition import Stage, stage_functions
from jaxdist.shard.specs import from_partition_spec, to_partition_spec

SPLIT, REPLICATED, LOSS_OUTPUT = "split", "replicated", "loss output"


@dataclasses.dataclass(frozen=True)
class PerDeviceStage:
  """A stage's equations in the per-device trace, and how each crossing value is laid out.

  Attributes:
    loss: the per-device trace's loss.
    stage: the stage in it (operands, activations in and out in the micro stage's order).
    operands, acts_in, acts_out: per value, (kind, split dimension or None).
    num_shards: the parts a micro-batch is split into.
    scales: per activation out, a loss output's weight per device
      (``coupling.part_scale``: 1 for a sum over the batch), or None: the mean.
    axes: the mesh axes it is split over (the programs are manual over them), or empty:
      over all axes, one part per device.
  """

  loss: capture.CapturedLoss
  stage: Stage
  operands: tuple
  acts_in: tuple
  acts_out: tuple
  num_shards: int = 1
  scales: tuple = ()
  axes: tuple = ()


def _kind(micro_var, device_var, n: int, from_batch: bool, is_output: bool):
  """(kind, split dim) of one crossing value, or None if it cannot cross per device."""
  shape, local = tuple(micro_var.aval.shape), tuple(device_var.aval.shape)
  if len(shape) != len(local) or micro_var.aval.dtype != device_var.aval.dtype:
    return None
  changed = [d for d, (a, b) in enumerate(zip(shape, local)) if a != b]
  if len(changed) == 1 and shape[changed[0]] == n * local[changed[0]]:
    return (SPLIT, changed[0])
  if changed:
    return None
  if not from_batch:
    return (REPLICATED, None)
  return (LOSS_OUTPUT, None) if is_output else None


def per_device_stage(loss: capture.CapturedLoss, device_loss: capture.CapturedLoss,
                     stage: Stage, batch_operand, n: int, whole=None,
                     parts: int = 1) -> PerDeviceStage | str:
  """The stage in ``device_loss`` (traced at 1/n of the micro-batch), or why not.

  ``whole``: the loss jaxpr traced at the whole batch, of which each device's micro-batch
  is one of ``parts``: the stage's random draws are found against it."""
  jm, jd = loss.closed.jaxpr, device_loss.closed.jaxpr
  if len(jm.invars) != len(jd.invars):
    return "the per-device trace has other loss inputs"
  mapping = jaxpr_util.align(jm.eqns, jd.eqns)
  if any(i not in mapping for i in stage.eqns):
    return "its equations do not line up with the per-device trace"
  ids = tuple(mapping[i] for i in stage.eqns)
  lo, hi = min(ids), max(ids)
  extra = set(range(lo, hi + 1)) - set(ids) - set(mapping.values())
  ids = tuple(sorted(set(ids) | extra))  # equations only the per-device trace has

  producer = {v: (i, pos) for i, eqn in enumerate(jm.eqns) for pos, v in enumerate(eqn.outvars)}

  def counterpart(v):
    """``v`` of the micro trace in the per-device trace, or None."""
    if v not in producer or producer[v][0] not in mapping:
      return None
    i, pos = producer[v]
    outs = jd.eqns[mapping[i]].outvars
    return outs[pos] if len(outs) == len(jm.eqns[i].outvars) else None

  acts_in = [counterpart(v) for v in stage.acts_in]
  acts_out = [counterpart(v) for v in stage.acts_out]
  if any(v is None for v in acts_in + acts_out):
    return "an activation it exchanges has no counterpart in the per-device trace"
  defined = {v for i in ids for v in jd.eqns[i].outvars}
  reads = {v for i in ids for v in jd.eqns[i].invars
           if not isinstance(v, jex.Literal) and v not in defined}
  operand_vars = {jd.invars[k] for k in stage.operands}
  if reads - operand_vars != set(acts_in) or not set(acts_out) <= defined:
    return "its per-device equations read or write other values"
  batch_mask = sum(1 << k for k, b in enumerate(batch_operand) if b)
  outputs = set(v for v in jm.outvars if not isinstance(v, jex.Literal))
  kinds = {}
  for name, micro, device in (("operands", [jm.invars[k] for k in stage.operands],
                               [jd.invars[k] for k in stage.operands]),
                              ("acts_in", stage.acts_in, acts_in),
                              ("acts_out", stage.acts_out, acts_out)):
    from_batch = jaxpr_util.dependencies(jm, len(jm.invars), micro)
    kinds[name] = tuple(_kind(u, v, n, bool(d & batch_mask), name == "acts_out" and u in outputs)
                        for u, v, d in zip(micro, device, from_batch))
    if any(k is None for k in kinds[name]):
      return "a value it exchanges is computed from the batch but keeps its shape"
  if any(k[0] == LOSS_OUTPUT for k in kinds["acts_in"]):
    return "it reads a loss output"
  draws = {} if whole is None else rng.partial_draws(
      jd.eqns, whole.eqns, jaxpr_util.align(jd.eqns, whole.eqns), ids, parts)
  device_stage = dataclasses.replace(stage, eqns=ids, acts_in=tuple(acts_in),
                                     acts_out=tuple(acts_out), draws=draws)
  scales = tuple(coupling.part_scale(jm.eqns, u, jd.eqns, v, n) if kind[0] == LOSS_OUTPUT
                 else None for u, v, kind in zip(stage.acts_out, acts_out, kinds["acts_out"]))
  return PerDeviceStage(device_loss, device_stage, kinds["operands"], kinds["acts_in"],
                        kinds["acts_out"], n, scales)


def _spec(kind, axes) -> PartitionSpec:
  if kind[0] != SPLIT:
    return PartitionSpec()
  return PartitionSpec(*([None] * kind[1]), axes)


def _planned(fun, plan, axes, sizes):
  """``fun`` traced on its arguments' shapes and evaluated with ``plan``'s constraints on
  the equations that line up with the planned program's (batch axes dropped)."""
  planned = plan.step.closed_jaxpr.jaxpr.eqns
  layout = plan.layout

  def run(*args):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*shapes)
    eqns, ids = closed.jaxpr.eqns, range(len(closed.jaxpr.eqns))
    after = jaxpr_util.constraint_hook(None, accumulate.localize(
        planned, eqns, ids, layout.eqn_constraints or {}, axes, sizes))
    before = jaxpr_util.operand_hook(None, accumulate.localize(
        planned, eqns, ids, layout.operand_constraints or {}, axes, sizes, operands=True))
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, jax.tree.leaves(args)))
    jaxpr_util.eval_eqns(closed.jaxpr, env, after=after, before=before)
    return jax.tree.unflatten(jax.tree.structure(out_shape),
                              [jaxpr_util.read(env, v) for v in closed.jaxpr.outvars])

  return run


def without_axes(spec: PartitionSpec, axes) -> PartitionSpec:
  """``spec`` with the mesh ``axes`` removed from every dimension."""
  return to_partition_spec(tuple(tuple(a for a in dim if a not in axes)
                                 for dim in from_partition_spec(spec, len(spec))))


def rows_shape(n: int, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of ``n`` devices' gradients of ``shape`` stacked along its first dimension
  (scalars along a new one). Each device adds into its block as it is: with a new leading
  dimension of one row per device, XLA copied every block into the step's outputs although
  the accumulator is donated (3 MiB more per device on a 2-stage MLP's first stage)."""
  return (n * shape[0], *shape[1:]) if shape else (n,)


def rows_spec(row_axes, spec: PartitionSpec, ndim: int) -> PartitionSpec:
  """The layout of :func:`rows_shape`'s stack: blocks split over ``row_axes``, each block
  laid out as ``spec`` (a gradient's spec over the other mesh axes)."""
  axes = lambda entry: entry if isinstance(entry, tuple) else () if entry is None else (entry,)
  if not ndim:
    return PartitionSpec(axes(row_axes))
  spec = tuple(spec) + (None,) * (ndim - len(spec))
  return PartitionSpec(axes(row_axes) + axes(spec[0]), *spec[1:])


def programs(pd: PerDeviceStage, mesh, frozen: frozenset = frozenset(), indexed: bool = False,
             plan=None):
  """The stage's forward and backward as functions of global values, per device inside.

  The backward's accumulator holds one gradient per device, stacked along its first
  dimension (:func:`rows_shape`, :func:`rows_spec`); ``frozen``:
  loss operand positions not differentiated. ``indexed``: both take a list holding the
  micro-batch index last (shard ``d`` of micro-batch ``b`` draws part ``b · n + d`` of
  the whole batch's random bits); else an empty list. Manual over ``pd.axes`` (all axes
  if empty): the other axes are partitioned by XLA, with ``plan``'s constraints (the
  stage's shard-plan result for its backward program) carried over to the equations of
  each shard's programs, as for accumulation (``accumulate.localize``).
  """
  axes = tuple(pd.axes or mesh.axis_names)
  n = pd.num_shards
  part = lambda index: index * n + jax.lax.axis_index(axes)
  forward, backward, diff, float_in, float_out = stage_functions(pd.loss, pd.stage,
                                                                 frozen=frozen, part=part)
  if plan is not None and pd.axes:
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    forward = _planned(forward, plan, axes, sizes)
    backward = _planned(backward, plan, axes, sizes)
  op_specs = [_spec(k, axes) for k in pd.operands]
  in_specs = [_spec(k, axes) for k in pd.acts_in]
  out_specs = [_spec(k, axes) for k in pd.acts_out]
  row = PartitionSpec(axes)
  loss_invars = pd.loss.closed.jaxpr.invars
  scalar = [not loss_invars[pd.stage.operands[p]].aval.shape for p in diff]

  def local_forward(operands, acts_in, index):
    outs = forward(operands, acts_in, *index)
    for p, kind in enumerate(pd.acts_out):
      if kind[0] == LOSS_OUTPUT:
        x = outs[p]
        if not jnp.issubdtype(x.dtype, jnp.inexact):
          outs[p] = jax.lax.psum(x, axes)
        else:
          outs[p] = (jax.lax.pmean(x, axes) if pd.scales[p] is None
                     else jax.lax.psum(x * pd.scales[p], axes))
    return outs

  def local_backward(operands, acts_in, cotangents, accumulated, index):
    # A loss output is the devices' values weighted (by default their mean), and a
    # replicated output is computed alike on every device whose gradient rows are
    # summed: each device takes its share of the cotangent.
    cotangents = [c if pd.acts_out[p][0] == SPLIT else
                  c / n if pd.scales[p] is None else c * pd.scales[p]
                  for p, c in zip(float_out, cotangents)]
    sums, act_cots = backward(operands, acts_in, cotangents,
                              [a[0] if s else a for a, s in zip(accumulated, scalar)], *index)
    act_cots = [jax.lax.psum(c, axes) if pd.acts_in[p][0] == REPLICATED else c
                for p, c in zip(float_in, act_cots)]
    return [x[None] if s else x for x, s in zip(sums, scalar)], act_cots

  index_specs = [PartitionSpec()] if indexed else []
  manual = {"axis_names": set(axes)} if pd.axes else {}
  mapped_forward = jax.shard_map(
      local_forward, mesh=mesh, in_specs=(op_specs, in_specs, index_specs), out_specs=out_specs,
      check_vma=False, **manual)
  mapped_backward = jax.shard_map(
      local_backward, mesh=mesh, **manual,
      in_specs=(op_specs, in_specs, [out_specs[p] for p in float_out], [row] * len(diff),
                index_specs),
      out_specs=([row] * len(diff), [in_specs[p] for p in float_in]), check_vma=False)
  shardings = lambda specs: [NamedSharding(mesh, s) for s in specs]
  return (mapped_forward, mapped_backward, shardings(op_specs), shardings(in_specs),
          shardings(out_specs), NamedSharding(mesh, row))
