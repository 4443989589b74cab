"""Compute gradients per micro-batch and device, reduce once, then apply them.

The traced step is split at the gradient marker (``jaxdist.grad``):

- the *gradient part*, every equation the marker's operands depend on, runs inside
  ``jax.shard_map`` over the batch mesh axes. Differentiation already happened when
  the step was traced (outside any mesh), so these equations, evaluated on one
  device's shard of the batch, give that device's partial gradient, unreduced; a
  ``lax.scan`` over the ``k`` micro-batches sums them, so only one micro-batch's
  activations are live at a time;
- after the loop each marked value is reduced across devices exactly once: a
  ``psum`` (replicated result), or a ``psum_scatter`` (reduce-scatter) where the
  layout wants the gradient sharded (ZeRO); on one device, nothing. Float values are
  then divided by ``k × devices`` (after the reduction, float16 before it): the mean
  over micro-batches and batch shards, which is the
  full-batch value for a loss that is a mean over examples; a loss (or aux) that is a
  constant times a sum over the batch (``jnp.sum``, ``-ll.sum() / 100``) is weighted
  by ``coupling.part_scale`` instead (1 for a plain sum), so the parts add up;
- the *apply part*, the equations that produce the step's outputs from the marked
  values (the optimizer update), runs as ordinary sharded code with the reduced
  values substituted for the marker's outputs.

Under ShardParallel the plan's sharding constraints are applied on both sides: inside
the ``shard_map`` (which is manual only over the batch axes) each constraint loses its
batch axes and keeps the model axes, mapped onto the micro-batch trace equation by
equation. Without batch axes (a plan that does not split the batch) there is no
``shard_map``: the loop runs as ordinary sharded code and nothing is reduced by hand.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import coupling, errors
from jaxdist import jaxpr_util, rng
from jaxdist.shard.specs import from_partition_spec, to_partition_spec
from jaxdist.shard.strategies import ELEMENTWISE
from jaxdist.trace import BATCH, PARAM, TracedStep


@dataclasses.dataclass(frozen=True)
class GradSplit:
  """Where the step splits around its gradient marker.

  Attributes:
    marker: index of the marker equation in the step's (global-batch) jaxpr.
    kinds: per marker output, "value", "aux" or "grad".
    apply_eqns: equations of the global jaxpr that produce the step's outputs from the
      marked values (the marker itself excluded).
    grad_jaxpr: the jaxpr the gradient part comes from, traced at micro-batch shape.
    grad_marker: the marker's index in ``grad_jaxpr``.
    grad_eqns: equations of ``grad_jaxpr`` that compute the marker's operands.
    grad_inputs: positions of the step inputs the gradient part reads.
    per_example: per marker output, whether it is an aux output with a batch dimension
      (dim 0: logits returned for metrics): concatenated over micro-batches and devices
      in batch order, not averaged.
  """

  marker: int
  kinds: tuple[str, ...]
  apply_eqns: frozenset[int]
  grad_jaxpr: object
  grad_marker: int
  grad_eqns: frozenset[int]
  grad_inputs: tuple[int, ...]
  per_example: tuple[bool, ...] = ()


# The equations that make a second pass over the batch expensive (and, under ZeRO-3, gather
# the parameters they read).
HEAVY = ("dot_general", "conv_general_dilated")


def _heavy_batch_work(jaxpr, ids, step: TracedStep) -> bool:
  """Whether a matmul or convolution among the equations ``ids`` reads the batch (a
  second forward pass); metrics from the aux and the labels are cheap on the whole batch."""
  tainted = {jaxpr.invars[k] for k, leaf in enumerate(step.inputs) if leaf.role == BATCH}
  for i in sorted(ids):
    eqn = jaxpr.eqns[i]
    if any(not isinstance(v, jex.Literal) and v in tainted for v in eqn.invars):
      if any(jaxpr_util.count_primitive(jaxpr, name, [i]) for name in HEAVY):
        return True
      tainted.update(eqn.outvars)
  return False


def per_example_outputs(step: TracedStep) -> tuple[bool, ...]:
  """Per output of the gradient marker: an aux output whose dim 0 is the batch (smaller in
  the micro-batch trace, the other dims alike), concatenated rather than averaged."""
  full = step.closed_jaxpr.jaxpr.eqns[step.marker_index]
  if step.micro_jaxpr is None:  # not traced at the micro-batch size (yet): dim 0 the batch
    return tuple(kind == "aux" and bool(v.aval.shape) and v.aval.shape[0] == step.batch_size
                 for kind, v in zip(full.params["kinds"], full.invars))
  micro = step.micro_jaxpr.jaxpr.eqns[step.micro_marker_index]
  out = []
  for kind, u, v in zip(full.params["kinds"], micro.invars, full.invars):
    shape, local = tuple(v.aval.shape), tuple(u.aval.shape)
    out.append(kind == "aux" and bool(shape) and len(shape) == len(local)
               and shape[1:] == local[1:] and shape[0] != local[0] and shape[0] % local[0] == 0)
  return tuple(out)


def reduced_outputs(step: TracedStep) -> tuple[bool, ...]:
  """Per input of the gradient marker, whether its reduction over the batch stays in the
  compiled step: it depends on the batch (XLA turns an all-reduce of a value every device
  holds alike into a multiply: ``nnx.value_and_grad`` returns the module's state as aux)
  and something reads it after the marker (a scaled loss beside its unscaled aux is
  dropped)."""
  jaxpr = step.closed_jaxpr.jaxpr
  marker = jaxpr.eqns[step.marker_index]
  batch = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
  deps = jaxpr_util.dependencies(jaxpr, len(step.inputs), marker.invars)
  read = {id(v) for e in jaxpr.eqns[step.marker_index + 1:] for v in e.invars}
  read |= {id(v) for v in jaxpr.outvars}
  return tuple(bool(d & batch) and id(o) in read for d, o in zip(deps, marker.outvars))


def split_at_marker(step: TracedStep, micro_batches: bool = False) -> GradSplit:
  """Finds the gradient and apply parts of ``step`` (which must have one marker);
  ``micro_batches``: warn if the apply part runs a forward pass on the batch (it is not
  split into the micro-batches)."""
  jaxpr = step.closed_jaxpr.jaxpr
  marker_eqn = jaxpr.eqns[step.marker_index]
  apply_eqns = (jaxpr_util.needed_eqns(jaxpr, jaxpr.outvars, stop=[step.marker_index])
                - {step.marker_index})
  if micro_batches and _heavy_batch_work(jaxpr, apply_eqns, step):
    warnings.warn(
        "the step uses the batch outside jaxdist.grad / value_and_grad (for example metrics "
        "from a second forward pass); that part runs on the whole batch at once, not per "
        "micro-batch. Return such values as aux of jaxdist.value_and_grad(..., has_aux=True).",
        errors.JaxdistWarning, stacklevel=4)

  if step.micro_jaxpr is None:
    grad_closed, grad_marker = step.closed_jaxpr, step.marker_index
  else:
    grad_closed, grad_marker = step.micro_jaxpr, step.micro_marker_index
  grad_marker_eqn = grad_closed.jaxpr.eqns[grad_marker]
  kinds = tuple(marker_eqn.params["kinds"])
  per_example = per_example_outputs(step)
  for kind, micro, full, each in zip(kinds, grad_marker_eqn.invars, marker_eqn.invars,
                                     per_example):
    shape, local = tuple(full.aval.shape), tuple(micro.aval.shape)
    if shape != local and not each:
      raise errors.InvalidArgumentError(
          f"a {kind} output of jaxdist.value_and_grad has shape {shape} on the whole batch but "
          f"{local} on one micro-batch shard: "
          + ("only aux outputs may have a batch dimension (dim 0: they are concatenated in "
             "batch order); the value and gradients are averaged over micro-batches and "
             "devices." if kind != "aux" else
             "an aux output's batch dimension must be dim 0 (it is concatenated there)."))
  grad_eqns = jaxpr_util.needed_eqns(grad_closed.jaxpr, grad_marker_eqn.invars)
  return GradSplit(step.marker_index, kinds, frozenset(apply_eqns), grad_closed, grad_marker,
                   frozenset(grad_eqns),
                   tuple(jaxpr_util.free_invars(grad_closed.jaxpr, grad_eqns)),
                   tuple(per_example))


def local_constraints(step: TracedStep, split: GradSplit, eqn_constraints: dict,
                      batch_axes: tuple[str, ...], axis_sizes: dict[str, int],
                      operands: bool = False) -> dict:
  """The plan's constraints on the gradient part, for one device's micro-batch shard
  (:func:`localize`; ``eqn_constraints`` index the step's jaxpr)."""
  return localize(step.closed_jaxpr.jaxpr.eqns, split.grad_jaxpr.jaxpr.eqns, split.grad_eqns,
                  eqn_constraints, batch_axes, axis_sizes, operands)


def _without(pspec: PartitionSpec, ndim: int, axes: tuple[str, ...]):
  """``pspec``'s axes per dimension, less ``axes`` (manual inside the ``shard_map``)."""
  return tuple(tuple(a for a in dim if a not in axes) for dim in from_partition_spec(pspec, ndim))


def localize(full, micro, ids, eqn_constraints: dict, batch_axes: tuple[str, ...],
             axis_sizes: dict[str, int], operands: bool = False) -> dict:
  """A plan's constraints (``eqn_constraints``, indexing the equations ``full``) on the
  equations ``micro[ids]``: the same code traced at one device's share of the batch.

  Except where jax special-cases a size-1 dimension (a broadcast more or less), the two
  line up; they are aligned by their primitive sequence, and an equation without a
  counterpart is left to XLA. Batch axes are dropped (they are manual inside the
  ``shard_map``), and so is an axis that does not divide the share's dimension. A value
  that lost its batch dimension on a one-row share (``take_along_axis``'s indices: jax
  makes that dim a slice, not a batch dim) keeps the spec of its other dims. With
  ``operands`` the specs are per operand (None: unconstrained) instead of per output.
  """
  to_full = jaxpr_util.align(micro, full)
  out = {}
  for i in ids:
    j = to_full.get(i)
    side = (lambda e: e.invars) if operands else (lambda e: e.outvars)
    if j not in eqn_constraints or len(side(full[j])) != len(side(micro[i])):
      continue
    specs = []
    for pspec, v, w in zip(eqn_constraints[j], side(micro[i]), side(full[j])):
      shape = tuple(getattr(v.aval, "shape", ()))
      if pspec is None:
        specs.append(None)
        continue
      dims = _local_dims(pspec, tuple(getattr(w.aval, "shape", ())), shape, batch_axes)
      if dims is None:
        break  # not the same value (a size-1 batch traces differently): left to XLA
      local = [axes if shape[d] % math.prod(axis_sizes[a] for a in axes) == 0 else ()
               for d, axes in enumerate(dims)]
      specs.append(to_partition_spec(tuple(local)))
    else:
      out[i] = tuple(specs)
  return out


def _local_dims(pspec: PartitionSpec, full: tuple[int, ...], local: tuple[int, ...],
                batch_axes: tuple[str, ...]):
  """``pspec`` (of a value shaped ``full``) less the batch axes, per dim of its
  counterpart shaped ``local``: the same dims, or ``full``'s but one not split over other
  axes (the batch dim, dropped on a one-row share); None if they do not correspond."""
  if len(pspec) > len(full):
    return None
  dims = _without(pspec, len(full), batch_axes)
  if len(local) == len(full):
    return dims
  if len(local) != len(full) - 1:
    return None
  for d in range(len(full)):
    if full[d] > 1 and not dims[d] and full[:d] + full[d + 1:] == local:
      return dims[:d] + dims[d + 1:]
  return None


def part_scales(step: TracedStep, split: GradSplit, parts: int) -> list[float | None]:
  """Per marker output, the weight of one micro-batch shard's value in the whole batch's
  (``coupling.part_scale``: 1 for a loss that sums over the batch; None for a mean, which
  is divided by ``parts``); gradients take the loss value's."""
  if step.micro_jaxpr is None:
    return [None] * len(split.kinds)
  whole = step.closed_jaxpr.jaxpr
  part = split.grad_jaxpr.jaxpr
  pairs = zip(whole.eqns[step.marker_index].invars, part.eqns[split.grad_marker].invars)
  scales = [coupling.part_scale(whole.eqns, w, part.eqns, p, parts)
            if kind != "grad" and not isinstance(w, jex.Literal) else None
            for kind, (w, p) in zip(split.kinds, pairs)]
  value = next((c for c, kind in zip(scales, split.kinds) if kind == "value"), None)
  return [value if kind == "grad" else c for c, kind in zip(scales, split.kinds)]


def split_step_fn(step: TracedStep, mesh, batch_axes: tuple[str, ...], num_micro_batches: int,
                  reduce_specs: tuple[PartitionSpec | None, ...],
                  eqn_constraints: dict | None = None,
                  operand_constraints: dict | None = None,
                  stream_inputs: dict | None = None,
                  input_specs: tuple[PartitionSpec, ...] | None = None):
  """The step as a function of flat input leaves, gradients accumulated and reduced once.

  Args:
    step: a traced step with exactly one gradient marker and, when the batch is split,
      its micro-batch trace (``trace.with_micro_batch_trace``).
    mesh: the ``jax.sharding.Mesh``.
    batch_axes: mesh axes the batch is split over (the shard_map's manual axes).
    num_micro_batches: k >= 1.
    reduce_specs: per marker output, None for a replicated result (psum), or the
      sharded spec of a reduce-scatter (exactly one dimension split over
      ``batch_axes``).
    eqn_constraints: the shard plan's constraints (equation index → specs), or None.
    operand_constraints: the plan's reshardings (equation index → per operand spec or
      None), or None.
    stream_inputs: input position → sharded spec of parameters that enter sharded and
      are gathered before each equation reading them (ZeRO-3), or None.
    input_specs: the plan's spec of every input, or None. With micro-batches, the
      non-batch inputs the loop reads keep theirs inside it: a loop-invariant value's
      layout in the loop is XLA's to choose otherwise (a replicated MoE router kernel,
      read split two ways and sliced for free in the plan, was carried split one way
      and moved to the other by an all-to-all in every micro-batch).
  """
  split = split_at_marker(step, micro_batches=num_micro_batches > 1)
  closed = step.closed_jaxpr
  jaxpr = closed.jaxpr
  grad_jaxpr = split.grad_jaxpr.jaxpr
  grad_marker_eqn = grad_jaxpr.eqns[split.grad_marker]
  num_shards = math.prod(mesh.shape[a] for a in batch_axes)
  k = num_micro_batches
  # The axis name(s) of the shard_map's collectives; None: no shard_map (batch not split).
  axes = (batch_axes[0] if len(batch_axes) == 1 else batch_axes) if batch_axes else None
  is_batch = [step.inputs[i].role == BATCH for i in split.grad_inputs]
  grad_after = apply_after = grad_before = apply_before = None
  inner_mesh = None if batch_axes else mesh
  # Marker operands the plan splits over non-batch axes inside the region: XLA would
  # gather such an operand whole before a reduce-scatter over the batch axes, so those
  # are all-reduced (on their shards) and sliced instead.
  split_inside = set()
  if eqn_constraints:
    apply_after = jaxpr_util.constraint_hook(mesh, eqn_constraints)
    inside = local_constraints(step, split, eqn_constraints, batch_axes, dict(mesh.shape))
    # Inside the shard_map the specs are bare: they refer to the region's abstract mesh.
    grad_after = jaxpr_util.constraint_hook(inner_mesh, inside)
    producer = {o: (i, p) for i, e in enumerate(grad_jaxpr.eqns) for p, o in enumerate(e.outvars)}
    for j, v in enumerate(grad_marker_eqn.invars):
      i, p = producer.get(v, (None, None))
      if i in inside and inside[i][p] is not None and any(e is not None for e in inside[i][p]):
        split_inside.add(j)
  if operand_constraints:
    apply_before = jaxpr_util.operand_hook(mesh, operand_constraints)
    inside = local_constraints(step, split, operand_constraints, batch_axes, dict(mesh.shape),
                               operands=True)
    grad_before = jaxpr_util.operand_hook(inner_mesh, inside)

  restart = lambda micro_batch=None: None
  if stream_inputs and axes is not None:
    mask = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
    outs = [v for e in grad_jaxpr.eqns for v in e.outvars]
    varying = {v for v, d in zip(outs, jaxpr_util.dependencies(grad_jaxpr, len(step.inputs), outs))
               if d & mask}
    grad_before, grad_after, restart = streaming_hooks(
        grad_jaxpr, {grad_jaxpr.invars[i]: spec for i, spec in stream_inputs.items()},
        axes, varying, grad_before, grad_after)
  micro_index = [0]
  grad_before, grad_after = random_bits_hooks(
      step, split, axes, num_shards, k, lambda: micro_index[0], grad_before, grad_after)

  # A token-weighted loss (n / d, both sums over the batch): the value and gradients are
  # combined weighted by each micro-batch's d, which gives the whole batch's.
  normalizer = coupling.loss_normalizer(
      grad_jaxpr, split.grad_marker,
      {grad_jaxpr.invars[i] for i, leaf in enumerate(step.inputs) if leaf.role == PARAM})
  weighted = [normalizer is not None and kind != "aux" for kind in split.kinds]
  scales = part_scales(step, split, k * num_shards)
  # An integer output that no batch value reaches (nnx's rng counter in the module state it
  # returns as aux) is the same in every micro-batch and on every device: kept as it is.
  # Summed, as a count over the batch is, it came out k x devices times too large.
  marker = step.closed_jaxpr.jaxpr.eqns[step.marker_index]
  batch_mask = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
  as_is = {j for j, (v, d) in enumerate(zip(marker.invars, jaxpr_util.dependencies(
               jaxpr, len(step.inputs), marker.invars)))
           if not d & batch_mask and not jnp.issubdtype(v.aval.dtype, jnp.inexact)}

  def grads_one(values):
    restart(next((x for x, b in zip(values, is_batch)
                  if b and jnp.issubdtype(x.dtype, jnp.number) and x.size), None))
    env = dict(zip(grad_jaxpr.constvars, split.grad_jaxpr.consts))
    env.update((grad_jaxpr.invars[i], x) for i, x in zip(split.grad_inputs, values))
    jaxpr_util.eval_eqns(grad_jaxpr, env, split.grad_eqns, after=grad_after, before=grad_before)
    # (as arrays: a literal, an aux of 1.0, is a Python number). An input returned as it
    # came in that nothing else reads (an unused module's parameter in nnx's aux) is not
    # an input of the region: a stand-in here, the input itself after it (``passed``).
    outs = [jnp.zeros(v.aval.shape, v.aval.dtype) if j in passed and v not in env
            else jnp.asarray(jaxpr_util.read(env, v), v.aval.dtype)
            for j, v in enumerate(grad_marker_eqn.invars)]
    if normalizer is None:
      return outs, jnp.float32(0)
    d = jaxpr_util.read(env, normalizer)
    # An all-padding micro-batch (d = 0) adds nothing (its own loss is 0 / 0).
    return [jnp.where(d > 0, d.astype(x.dtype) * x, jnp.zeros_like(x))
            if w and jnp.issubdtype(x.dtype, jnp.inexact) else x
            for x, w in zip(outs, weighted)], d.astype(jnp.float32)

  per_example = split.per_example
  pinned = {}
  for i, (k_in, b) in enumerate(zip(split.grad_inputs, is_batch)):
    if b or input_specs is None or k_in in (stream_inputs or {}):
      continue
    pinned[i] = to_partition_spec(_without(input_specs[k_in], len(step.inputs[k_in].shape),
                                           batch_axes))
  pin = lambda x, i: x if i not in pinned else jax.lax.with_sharding_constraint(
      x, pinned[i] if inner_mesh is None else NamedSharding(inner_mesh, pinned[i]))

  # Run as one program over all devices (no batch axes), micro-batch i is the batch's i-th
  # 1/k slice, which lies on a 1/k of the devices: each is spread over all of them as the
  # plan splits the batch, once, before the loop (else XLA gathers every slice in the loop
  # and computes what reads it, a first conv's kernel gradient, whole on every device).
  spread_specs = {i: PartitionSpec(None, *to_partition_spec(input_specs[k_in]))
                  for i, (k_in, b) in enumerate(zip(split.grad_inputs, is_batch))
                  if b and inner_mesh is not None and input_specs is not None
                  and step.inputs[k_in].shape}
  spread = lambda x, i: x if i not in spread_specs else jax.lax.with_sharding_constraint(
      x, NamedSharding(inner_mesh, spread_specs[i]))

  # Marked values that are inputs the gradient part returns as they came in (the
  # parameters nnx.value_and_grad returns as its aux) are read outside the region: inside
  # it, a ZeRO-3 parameter is this device's shard, and a reduction would mix the shards;
  # nor are they summed over micro-batches (a shard added to a whole-shaped sum).
  at = {v: i for i, v in enumerate(grad_jaxpr.invars)}
  passed = {j: at[v] for j, v in enumerate(grad_marker_eqn.invars)
            if not isinstance(v, jex.Literal) and v in at and step.inputs[at[v]].role != BATCH}

  def local(*values):
    if k == 1:
      sums, weight = grads_one(values)
    else:
      micro = [spread(x.reshape(k, x.shape[0] // k, *x.shape[1:]), i)
               for i, (x, b) in enumerate(zip(values, is_batch)) if b]

      def body(acc, xs):
        micro_index[0], xs = xs
        it = iter(xs)
        outs, d = grads_one([next(it) if b else pin(x, i)
                             for i, (x, b) in enumerate(zip(values, is_batch))])
        rows = [o for o, e in zip(outs, per_example) if e]  # collected, not summed
        outs = [(j, o) for j, (o, e) in enumerate(zip(outs, per_example)) if not e]
        return ([a if j in passed else o if j in as_is else a + o
                 for a, (j, o) in zip(acc[0], outs)], acc[1] + d), rows

      init = [jnp.zeros(v.aval.shape, v.aval.dtype)
              for v, e in zip(grad_marker_eqn.invars, per_example) if not e]
      (sums, weight), rows = jax.lax.scan(body, (init, jnp.float32(0)), (jnp.arange(k), micro))
      micro_index[0] = 0
      sums, rows = iter(sums), iter(rows)
      sums = [next(rows).reshape(-1, *v.aval.shape[1:]) if e else next(sums)
              for v, e in zip(grad_marker_eqn.invars, per_example)]
    if normalizer is not None and axes is not None and num_shards > 1:
      weight = jax.lax.psum(weight, axes)
    reduced = []
    for j, (x, spec) in enumerate(zip(sums, reduce_specs)):
      if per_example[j] or j in as_is:  # this device's rows, in batch order; or as it is
        reduced.append(x)
        continue

      def scaled(x, j=j):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
          return x
        if weighted[j]:
          return x / weight.astype(x.dtype)
        return x / (k * num_shards) if scales[j] is None else x * scales[j]

      # Scaled after the reduction, on the (scattered) result: XLA:CPU does not fuse an
      # elementwise op into a collective's operand, so scaling before it wrote a second
      # whole gradient (an embedding table's scatter-added gradient under ZeRO-2: two
      # 5.1 MB buffers). float16 is scaled first: its sum could overflow.
      early = x.dtype == jnp.float16 or axes is None or num_shards == 1
      if early:
        x = scaled(x)
      if axes is None or num_shards == 1:
        out = x
      elif spec is None:
        out = jax.lax.psum(x, axes)
      elif j in split_inside:
        dim = next(d for d, entry in enumerate(spec) if entry is not None)
        size = x.shape[dim] // num_shards
        out = jax.lax.dynamic_slice_in_dim(
            jax.lax.psum(x, axes), jax.lax.axis_index(axes) * size, size, dim)
      else:
        dim = next(d for d, entry in enumerate(spec) if entry is not None)
        out = jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
      reduced.append(out if early else scaled(out))
    return tuple(reduced)

  streamed = stream_inputs if axes is not None else None
  in_specs = tuple(PartitionSpec(axes) if b else
                   (streamed or {}).get(i, PartitionSpec())
                   for i, b in zip(split.grad_inputs, is_batch))
  out_specs = tuple(PartitionSpec(axes) if e else PartitionSpec() if s is None else s
                    for s, e in zip(reduce_specs, split.per_example))
  # check_vma=False: the re-bound equations mix per-device and replicated operands
  # without the casts jnp code would insert; every output is reduced explicitly above.
  region = local if axes is None else jax.shard_map(
      local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(batch_axes),
      check_vma=False)

  def run(*leaves):
    marked = list(region(*[leaves[i] for i in split.grad_inputs]))
    for j, i in passed.items():
      marked[j] = leaves[i]
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, leaves))
    jaxpr_util.eval_eqns(jaxpr, env, split.apply_eqns | {split.marker},
                         substitute={split.marker: marked}, after=apply_after,
                         before=apply_before)
    return [jaxpr_util.read(env, v) for v in jaxpr.outvars]

  return run


def random_bits_hooks(step: TracedStep, split: GradSplit, axes, num_shards: int, k: int,
                      micro_index, before=None, after=None):
  """``before`` / ``after`` hooks that make the gradient part's random bits (dropout
  masks) the whole batch's: a ``random_bits`` whose shape is the full-batch one's with
  one dimension divided by the micro-batch count × batch shards draws this device's
  micro-batch rows of the full-batch bits (``jaxdist.rng``). Without this every device
  and micro-batch would draw the first rows' bits for its own rows. ``micro_index()`` is
  the micro-batch being evaluated (a tracer inside the loop). The given hooks run too."""
  full_eqns, micro_eqns = step.closed_jaxpr.jaxpr.eqns, split.grad_jaxpr.jaxpr.eqns
  draws = rng.partial_draws(micro_eqns, full_eqns, jaxpr_util.align(micro_eqns, full_eqns),
                            split.grad_eqns, num_shards * k)
  if not draws:
    return before, after

  def part():  # this device's micro-batch
    device = jax.lax.axis_index(axes) if axes is not None else 0
    return device * k + micro_index()

  # A draw whose mask the backward pass does not read (a recomputed block's: the backward
  # draws again) waits for the activations computed before it (see rng.row_hooks); one
  # whose mask is kept for the backward may run early, as XLA likes.
  marker = micro_eqns[split.grad_marker]
  values = [v for v, kind in zip(marker.invars, marker.params["kinds"]) if kind == "value"]
  producer = {v: i for i, e in enumerate(micro_eqns) for v in e.outvars}
  loss = producer.get(values[0], len(micro_eqns)) if values else len(micro_eqns)
  varying = {v for v, leaf in zip(split.grad_jaxpr.jaxpr.invars, step.inputs) if leaf.role == BATCH}
  anchors, derived = set(), {}  # derived: a value computed elementwise from a draw → the draw
  last_read = collections.defaultdict(int)
  for i, eqn in enumerate(micro_eqns):
    ins = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
    if any(v in varying for v in ins):
      varying.update(eqn.outvars)
      anchors.add(i)
    for v in ins:
      if v in derived:  # the mask follows through ops on the bits and scalars alone
        last_read[derived[v]] = i
        if (eqn.primitive.name in ELEMENTWISE | {"bitcast_convert_type"}
            and all(u is v or math.prod(u.aval.shape) == 1 for u in ins)):
          derived.update((o, derived[v]) for o in eqn.outvars)
    if i in draws and not isinstance(draws[i], dict):
      derived.update((o, i) for o in eqn.outvars)
  anchored = {d for d in draws if last_read[d] <= loss}
  return rng.row_hooks(micro_eqns, draws, part, before, after, anchors, anchored)


def streaming_hooks(jaxpr, streamed: dict, axes, varying: set, before=None, after=None):
  """``before`` / ``after`` hooks for :func:`jaxpr_util.eval_eqns` inside the gradient
  ``shard_map`` that all-gather each streamed parameter (var → its sharded spec) anew
  before every equation reading it.

  Each gather is tied to the latest value evaluated before its equation that depends on
  the micro-batch (``varying``: such vars of ``jaxpr``; ``p + 0 · one element``, which
  XLA does not fold for floats; the element made finite first), or before any, to the
  micro-batch itself. So XLA can neither merge the gathers of the forward and the
  backward nor hoist them to the start, nor out of the micro-batch loop (a gather that
  depends on nothing in the loop is loop-invariant: XLA ran it once before the loop and
  kept the whole parameter through it): a gathered copy lives from that point to its
  reader. The given hooks run too (before first, after last). Returns (before, after,
  restart): call ``restart(x)`` before each evaluation with one of the micro-batch's
  arrays (the tie must come from the evaluation being traced).
  """
  dims = {v: next(d for d, e in enumerate(spec) if e is not None) for v, spec in streamed.items()}
  last = [None]

  def gather_before(i, invals):
    if before is not None:
      invals = before(i, invals)
    eqn = jaxpr.eqns[i]
    out = list(invals)
    for k, v in enumerate(eqn.invars):
      if not isinstance(v, jex.Literal) and v in dims:
        x = out[k]
        if last[0] is not None and jnp.issubdtype(x.dtype, jnp.inexact):
          # (nan_to_num: a NaN there, a padding-only share's 0 / 0 loss, must not spread.)
          tie = jnp.nan_to_num(last[0].reshape(-1)[0].astype(jnp.float32)) * 0
          x = x + tie.astype(x.dtype)
        out[k] = jax.lax.all_gather(x, axes, axis=dims[v], tiled=True)
    return out

  def record_after(i, outs):
    if after is not None:
      outs = after(i, outs)
    ties = [o for o, v in zip(outs, jaxpr.eqns[i].outvars)
            if v in varying and hasattr(o, "dtype") and jnp.issubdtype(o.dtype, jnp.number)
            and o.size]
    if ties:
      last[0] = ties[0]
    return outs

  def restart(micro_batch=None):
    last[0] = micro_batch

  return gather_before, record_after, restart
