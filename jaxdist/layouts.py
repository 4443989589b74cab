"""Fixed layouts for DataParallel, Zero2Parallel and Zero3Parallel.

A :class:`Layout` is the one type handed from a planner to the compiler: the mesh and a
``PartitionSpec`` per input and output leaf. For these methods it follows from the
roles in :class:`~jaxdist.trace.TracedStep` alone; XLA's partitioner inserts the
collectives (gradient all-reduce, parameter all-gather).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist import errors
from jaxdist import methods as m
from jaxdist.coupling import batch_coupling, warn_split
from jaxdist.mesh import LogicalMesh
from jaxdist.grad import GRAD, SEEN
from jaxdist.trace import BATCH, INPUT, OPTIMIZER, PARAM, TracedStep

REPLICATED = PartitionSpec()


@dataclasses.dataclass(frozen=True)
class Layout:
  """Shardings chosen for one traced step.

  Attributes:
    logical_mesh: the mesh the step runs on.
    in_specs: per dynamic input leaf, its sharding between steps.
    out_specs: per output leaf, its sharding.
    out_constraints: per output leaf, a sharding the value is computed in before it is
      moved to its ``out_specs`` sharding, or None. Zero2 computes each device's slice
      of the updated parameters and all-gathers it into the output buffer, so no
      gathered copy of the whole update lives in temporary memory.
    notes: remarks for the plan (leaves left replicated and why).
    num_micro_batches: gradient-accumulation micro-batches.
    batch_axes: mesh axes the batch is split over.
    grad_reduce_specs: None to let XLA reduce gradients (no ``jaxdist.grad`` marker);
      otherwise, per marker output, None (all-reduce to a replicated value) or the
      sharded spec its reduce-scatter produces (see ``jaxdist.accumulate``).
    eqn_constraints: equation index → specs its outputs are constrained to (the shard
      planner's choices), applied while the jaxpr is re-interpreted.
    operand_constraints: equation index → per operand, the spec it is resharded to
      before the equation runs, or None (where the plan reshards a value between its
      producer and this consumer; so XLA does the resharding the plan priced).
    stream_inputs: input position → its sharded spec, for ZeRO-3's parameters: they enter
      the gradient computation sharded and are all-gathered anew before each equation
      that reads them (``jaxdist.accumulate``), so a gathered copy lives only around its
      use, as in FSDP.
    rolled: a :class:`jaxdist.shard.rolled.Rolled` when the plan was made on unrolled
      scans whose iterations all got the same constraints: the step compiles with those
      scans as loops (the equation indices above are the unrolled jaxpr's).
  """

  logical_mesh: LogicalMesh
  in_specs: tuple[PartitionSpec, ...]
  out_specs: tuple[PartitionSpec, ...]
  out_constraints: tuple[PartitionSpec | None, ...]
  notes: tuple[str, ...] = ()
  num_micro_batches: int = 1
  batch_axes: tuple[str, ...] = ()
  grad_reduce_specs: tuple[PartitionSpec | None, ...] | None = None
  eqn_constraints: dict[int, tuple[PartitionSpec, ...]] | None = None
  operand_constraints: dict[int, tuple[PartitionSpec | None, ...]] | None = None
  stream_inputs: dict[int, PartitionSpec] | None = None
  rolled: object = None


def batch_spec(lmesh: LogicalMesh) -> PartitionSpec:
  """Dim 0 split over every mesh axis."""
  names = lmesh.axis_names
  return PartitionSpec(names[0] if len(names) == 1 else tuple(names))


def check_batch_divisible(step: TracedStep, parts: int, what: str) -> None:
  """Raises BatchDivisibilityError unless every batch leaf's dim 0 divides by ``parts``."""
  for leaf in step.inputs:
    if leaf.role != BATCH:
      continue
    if leaf.shape[0] % parts:
      other = next((o for o in step.inputs if o.role == BATCH and o.shape
                    and o.shape[0] != leaf.shape[0]), None)
      hint = (f"the batch's other leaves (such as {other.path}, dim 0 = {other.shape[0]}) are "
              f"split on dim 0 as examples too: if it holds no row per example (a per-class "
              f"table, a random key's data), pass it as an argument of its own; else "
              if other is not None else "")
      raise errors.BatchDivisibilityError(
          f"batch argument leaf {leaf.path} has shape {leaf.shape}: dim 0 = {leaf.shape[0]} "
          f"does not divide over {what} ({parts}); {hint}use a batch size that is a multiple "
          f"of {parts}.")


def shard_leaf_dim(shape: tuple[int, ...], lmesh: LogicalMesh) -> PartitionSpec | None:
  """Splits a state leaf over all mesh axes: on its first dimension if the device count
  divides it, else on the largest dimension it divides.

  The first: its shards are contiguous in the row-major layout, so ZeRO's reduce-scatter
  and all-gather need no transposing copy around them. Split on its larger second
  dimension, a GPT's (256, 1024) kernels were copied transposed before each gradient's
  reduce-scatter (11.7 MB per device and step) and its ZeRO-3 step ran 10-12% slower on
  8 simulated CPU devices. A shard of any other dimension is strided anyway, and the
  largest keeps the most leaves split.

  Returns None if no dimension divides.
  """
  n = lmesh.num_devices
  dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
  if not dims:
    return None
  d = 0 if dims[0] == 0 else max(dims, key=lambda i: (shape[i], -i))
  axes = batch_spec(lmesh)[0]
  return PartitionSpec(*([None] * d + [axes]))


def uses_marker(method: m.Method, step: TracedStep) -> bool:
  """Whether gradients go through the jaxdist.grad split; raises if they must and cannot.

  Raises:
    GradientMarkerError: ``num_micro_batches > 1`` and the step has no single
      top-level ``jaxdist.grad`` / ``value_and_grad``.
  """
  k = method.num_micro_batches or 1
  if step.marker_index is not None:
    return True
  if k > 1 and step.num_markers == 0:
    n = step.unseen_gradients
    found = ("found none in the step" if not n else
             f"the step's {n} jax.grad / value_and_grad call{'s' if n > 1 else ''} cannot be "
             f"split into micro-batches (one call is: at the step's top level, not under "
             f"jax.vmap, not with respect to the batch)")
    raise errors.GradientMarkerError(
        f"{method.name}(num_micro_batches={k}) needs to know where gradients are computed, and "
        f"{found}: {SEEN}.")
  if step.num_markers:
    where = (f"{step.num_markers} times" if step.num_markers > 1
             else "inside a loop, cond or custom_vjp")
    message = (f"the step calls jaxdist.grad / value_and_grad {where}; gradient accumulation "
               f"needs exactly one call at the step's top level (jitted helpers are fine).")
    if k > 1:
      raise errors.GradientMarkerError(message)
    warnings.warn(message + " Gradients are reduced by XLA instead.", errors.JaxdistWarning,
                  stacklevel=4)
  return False


def data_parallel_layout(method: m.Method, step: TracedStep, lmesh: LogicalMesh,
                         whole_batch: str | None = None) -> Layout:
  """Layout for DataParallel (no sharded state), Zero2 (optimizer) or Zero3 (all state).

  ``whole_batch``: why the step cannot run per device (its trace on a device's share of
  the batch failed): it then runs as one whole-batch program, as a coupled step does."""
  micro_batches = method.num_micro_batches or 1
  if micro_batches > 1:
    check_batch_divisible(step, lmesh.num_devices * micro_batches,
                          f"{lmesh.num_devices} devices x num_micro_batches={micro_batches}")
  else:
    check_batch_divisible(step, lmesh.num_devices, f"the {lmesh.num_devices} devices")
  if isinstance(method, m.Zero3Parallel):
    # Float inputs that are neither state nor batch (a frozen backbone passed beside the
    # trained adapters) are model weights too: split and gathered where read, as the
    # parameters are. (Integer ones, index tables, stay whole: XLA gathers one once for
    # all its readers, where jaxdist would predict a gather per reader.)
    sharded_roles = {PARAM, OPTIMIZER, INPUT}
  elif isinstance(method, m.Zero2Parallel):
    sharded_roles = {OPTIMIZER}
  else:
    sharded_roles = set()

  notes = []
  if isinstance(method, m.Zero2Parallel) and not step.roles_from_loss:
    notes.append("the step returns no batch-dependent value (such as the loss), so parameters "
                 "could not be told from optimizer state: all state is kept replicated.")
  unsharded = []
  in_specs = []
  for leaf in step.inputs:
    if leaf.role == BATCH:
      in_specs.append(batch_spec(lmesh))
    elif leaf.role in sharded_roles and (leaf.role != INPUT
                                         or jnp.issubdtype(leaf.dtype, jnp.inexact)):
      spec = shard_leaf_dim(leaf.shape, lmesh)
      if spec is None:
        if leaf.role != INPUT:
          unsharded.append(f"{leaf.path} {leaf.shape}")
        spec = REPLICATED
      in_specs.append(spec)
    else:
      in_specs.append(REPLICATED)
  if unsharded:
    notes.append(f"{len(unsharded)} leaves have no dimension divisible by "
                 f"{lmesh.num_devices} and stay replicated: " + ", ".join(unsharded))

  out_specs, out_constraints = [], []
  for k, aval in enumerate(step.out_avals):
    src = step.output_source[k]
    zero2_param = (isinstance(method, m.Zero2Parallel) and src is not None
                   and step.inputs[src].role == PARAM)
    out_constraints.append(shard_leaf_dim(aval.shape, lmesh) if zero2_param else None)
    if src is not None:
      out_specs.append(in_specs[src])
    elif (step.depends_on_batch[k] and aval.shape and step.batch_size is not None
          and aval.shape[0] == step.batch_size):
      out_specs.append(batch_spec(lmesh))
    else:
      out_specs.append(REPLICATED)
  grad_reduce_specs = None
  batch_axes = lmesh.axis_names
  per_device = uses_marker(method, step)
  coupled = batch_coupling(step) if per_device else None
  if whole_batch and per_device and micro_batches == 1:
    per_device = False
    notes.append(f"{whole_batch}; gradients are computed over the whole batch as one program")
  elif coupled and micro_batches == 1:
    # Per-device gradients would use per-device batch statistics: let XLA run the whole
    # batch as the single-device step does (gradients reduced by XLA).
    per_device = False
    notes.append(f"the step mixes examples beyond the loss's mean ({coupled}); gradients "
                 f"are computed over the whole batch as one program, as the single-device "
                 f"step does, not per device")
  elif coupled:
    # Each micro-batch runs as one program over all devices (XLA reduces its statistics
    # and its gradients across them), as accumulating by hand over the batch's k slices.
    batch_axes = ()
    notes.append(f"the step mixes examples beyond the loss's mean ({coupled}); with "
                 f"num_micro_batches={micro_batches} each micro-batch (a 1/{micro_batches} "
                 f"slice of the batch) runs as one program over all devices, its gradients "
                 f"reduced by XLA in every micro-batch")
    warn_split(coupled, f"with num_micro_batches={micro_batches}, the micro-batches")
  if per_device:
    marker = step.closed_jaxpr.jaxpr.eqns[step.marker_index]
    grad_reduce_specs = tuple(
        shard_leaf_dim(v.aval.shape, lmesh) if kind == GRAD and sharded_roles else None
        for kind, v in zip(marker.params["kinds"], marker.invars))
  stream = None
  if (isinstance(method, m.Zero3Parallel) and grad_reduce_specs is not None
      and lmesh.num_devices > 1):  # (a gather over one device is a copy)
    stream = {k: spec for k, (leaf, spec) in enumerate(zip(step.inputs, in_specs))
              if leaf.role in (PARAM, INPUT) and spec != REPLICATED}
  return Layout(lmesh, tuple(in_specs), tuple(out_specs), tuple(out_constraints), tuple(notes),
                num_micro_batches=micro_batches, batch_axes=batch_axes,
                grad_reduce_specs=grad_reduce_specs, stream_inputs=stream or None)
