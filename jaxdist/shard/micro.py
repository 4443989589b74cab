"""The micro-batch loop as the shard planner prices it (``num_micro_batches`` > 1).

With gradient accumulation (``jaxdist.accumulate``) the gradient part of the step runs
once per micro-batch, in a loop, on 1/k of the batch; the gradients are reduced once,
after it. The planner still plans the whole-batch step (its plan's constraints index
that step's equations), so it prices what the loop changes:

- a value the loop computes on the micro-batch (it carries the batch dimension) moves k
  times, on its micro-batch share of its bytes each: its collectives cost k α and, for a
  value linear in the batch, the same bytes (a contrastive loss's batch x batch logits:
  1/k of them);
- a value the loop computes per micro-batch without the batch dimension (a partial
  gradient resharded inside the loop) moves k times whole: k α and k times the bytes;
- what no batch value reaches (a parameter) is the same in every iteration: XLA hoists
  its resharding out of the loop, so it moves once;
- an equation whose outputs lost the batch dimension (a weight gradient, the loss's sum)
  reduces them over the batch axes once, after the loop;
- a value with the batch dimension holds 1/k of its bytes at once (the memory budget);
- a split the micro-batch's shapes do not divide cannot be kept inside the loop
  (``accumulate.localize`` drops it, and XLA partitions the equation another way), so
  such strategies are ruled out;
- a gradient held split over a non-batch axis in the loop and split over the batch axes
  then that axis on one dim after it (``('mesh_0', 'mesh_1')`` with the batch on
  ``mesh_0``) is all-reduced and sliced by the batch index; the slice is not within the
  device's block, so XLA all-gathers the dim over the other axis first
  (:func:`gather_after_loop`).

Known approximation: which mesh axes split the batch is itself a choice of the ILP. A
partial gradient reduced over an axis that no allowed split of the batch uses is priced k
times whole; one reduced over an axis that could split the batch is priced once, as if
the chosen plan split the batch over it.
"""

from __future__ import annotations

import dataclasses
import math

import jax.extend.core as jex

from jaxdist import jaxpr_util
from jaxdist.accumulate import per_example_outputs
from jaxdist.shard.specs import num_shards
from jaxdist.trace import BATCH


@dataclasses.dataclass(frozen=True)
class MicroBatchLoop:
  """Attributes:
    k: micro-batches per step.
    looped: ids of the equations that run once per micro-batch (the gradient part,
      reached by the batch).
    micro_shapes: per value of the loop (a batch input or an output of a looped
      equation), its shape on one micro-batch (1/k of the batch); None where the
      micro-batch trace has no counterpart.
    reduced: the values reduced over the batch axes after the loop (the gradient
      marker's operands, but per-example outputs).
    batch_inputs: the batch inputs (``jaxpr`` invars); the first one's dim 0 split is
      the batch axes (the largest batch leaf, as ``planner.layout_of`` takes it).
  """

  k: int
  looped: frozenset
  micro_shapes: dict
  reduced: tuple = ()
  batch_inputs: tuple = ()

  def runs_in_loop(self, eqn) -> bool:
    return eqn is not None and id(eqn) in self.looped

  def varies(self, v) -> bool:
    return not isinstance(v, jex.Literal) and v in self.micro_shapes

  def scaled(self, v) -> bool:
    """Whether ``v`` carries the batch dimension (it shrinks on a micro-batch)."""
    if not self.varies(v):
      return False
    shape = self.micro_shapes[v]
    return shape is None or shape != tuple(getattr(v.aval, "shape", ()))

  def fraction(self, v) -> float:
    """The share of ``v``'s bytes one micro-batch holds (1 without the batch dimension)."""
    if not self.scaled(v):
      return 1.0
    shape, full = self.micro_shapes[v], getattr(v.aval, "shape", ())
    return 1.0 / self.k if shape is None else math.prod(shape) / max(math.prod(full), 1)

  def own_bytes_repeat(self, eqn) -> float:
    """How often a looped equation's own collectives move their bytes per step once
    compiled (over the axes left inside the loop): k times its outputs' micro-batch share:
    k where they lost the batch dimension (every micro-batch moves them whole), 1 where
    they are linear in it (1/k of them, k times)."""
    if not self.runs_in_loop(eqn):
      return 1
    shares = [self.fraction(v) for v in eqn.outvars if self.scaled(v)]
    return self.k * max(shares) if shares else self.k

  def repeats(self, v) -> tuple[int, float]:
    """(α, bytes) multipliers of moving ``v`` inside the loop (see the module doc)."""
    if not self.varies(v):
      return 1, 1
    return self.k, self.k * self.fraction(v)


def reduce_dim(spec, batch_axes: tuple[str, ...]) -> int | None:
  """The dim a gradient planned as ``spec`` is reduce-scattered on over ``batch_axes``
  after the loop (the first split over them as its major axes), or None (all-reduced)."""
  if not batch_axes:
    return None
  return next((d for d, axes in enumerate(spec) if axes[:len(batch_axes)] == batch_axes), None)


def gather_after_loop(spec, batch_axes: tuple[str, ...], nbytes: float, sizes: dict):
  """The all-gather XLA adds after the loop to a gradient planned as ``spec`` (``(kind,
  axes, per-device result bytes)``), or None. Inside the loop the gradient is split over
  its non-batch axes only; on its reduce dim the batch axes come first, so the slice by
  the batch index takes rows other devices hold (measured: a GPT's embedding gradient,
  ``(None, ('mesh_0', 'mesh_1'))`` with the batch on mesh_0, all-gathered whole over
  mesh_1 before the slice)."""
  d = reduce_dim(spec, batch_axes)
  rest = () if d is None else spec[d][len(batch_axes):]
  if not rest or math.prod(sizes[a] for a in rest) == 1:
    return None
  others = math.prod(sizes[a] for e, axes in enumerate(spec) if e != d for a in axes
                     if a not in batch_axes)
  return ("all-gather", rest, nbytes / others)


def entry_spec(rank: int, batch_axes: tuple[str, ...], read=None):
  """The layout a batch leaf enters the loop's region in (``accumulate``'s
  ``shard_map``): dim 0 split over the batch axes (and nothing else: the loop reshapes it
  into micro-batches), the other dims over the other axes as the spec ``read`` its first
  reader in the loop wants them (None: whole)."""
  others = (read or ((),) * rank)[1:]
  return (tuple(batch_axes),) + tuple(tuple(a for a in axes if a not in batch_axes)
                                      for axes in others)


def permute_on_entry(spec, batch_axes: tuple[str, ...], nbytes: float, sizes: dict):
  """The collective-permute XLA adds where a parameter planned as ``spec`` enters the
  loop's region, or None. The region holds it split over its non-batch axes only; where a
  batch axis comes before another on one dim, the device's block of the region's layout
  is not within its own, so XLA moves the blocks before it all-gathers over the batch
  axes (measured: an embedding ``(None, ('mesh_0', 'mesh_1'))``, the batch on mesh_0)."""
  for axes in spec:
    big = [a for a in axes if sizes[a] > 1]
    first_other = next((i for i, a in enumerate(big) if a not in batch_axes), len(big))
    if any(a in batch_axes for a in big[:first_other]) and first_other < len(big):
      return ("collective-permute", tuple(axes), nbytes / num_shards(spec, sizes))
  return None


def batch_varying(jaxpr, step, values) -> set:
  """The ``values`` of ``jaxpr`` (``step``'s) that a batch input reaches."""
  mask = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
  return {v for v, d in zip(values, jaxpr_util.dependencies(jaxpr, len(step.inputs), values))
          if d & mask}


def micro_batch_loop(jaxpr, step, micro_jaxpr, k: int) -> MicroBatchLoop:
  """The loop of ``step`` (whose planned, inlined jaxpr is ``jaxpr``, with its gradient
  marker at ``step.marker_index``) from ``micro_jaxpr``: the same step traced at 1/k of
  the batch and inlined alike. Equations the two traces do not line up (jax special-cases
  a size-1 dimension) count as carrying the batch dimension if a batch value reaches them."""
  looped, varying = _looped(jaxpr, step)
  micro_eqns = micro_jaxpr.jaxpr.eqns
  to_micro = {j: i for i, j in jaxpr_util.align(micro_eqns, jaxpr.eqns).items()}
  shapes = {}
  for j in looped:
    eqn = jaxpr.eqns[j]
    twin = micro_eqns[to_micro[j]] if j in to_micro else None
    if twin is not None and len(twin.outvars) != len(eqn.outvars):
      twin = None
    for pos, v in enumerate(eqn.outvars):
      if v in varying:
        micro = tuple(twin.outvars[pos].aval.shape) if twin is not None else ()
        shapes[v] = micro if len(micro) == len(v.aval.shape) else None
  for v, leaf in zip(jaxpr.invars, step.inputs):
    if leaf.role == BATCH and leaf.shape:
      shapes[v] = (leaf.shape[0] // k,) + tuple(leaf.shape[1:])
  marker = jaxpr.eqns[step.marker_index]
  reduced = tuple(v for v, each in zip(marker.invars, per_example_outputs(step))
                  if not each and not isinstance(v, jex.Literal))
  batch = sorted(((math.prod(leaf.shape), i) for i, leaf in enumerate(step.inputs)
                  if leaf.role == BATCH and leaf.shape), reverse=True)
  return MicroBatchLoop(k, frozenset(id(jaxpr.eqns[j]) for j in looped), shapes, reduced,
                        tuple(jaxpr.invars[i] for _, i in batch))


def looped_eqns(jaxpr, step) -> frozenset:
  """``MicroBatchLoop.looped`` without the micro-batch trace: the ids of the equations
  the gradient marker needs that a batch value reaches."""
  return frozenset(id(jaxpr.eqns[j]) for j in _looped(jaxpr, step)[0])


def _looped(jaxpr, step) -> tuple[list[int], set]:
  """The indices of the looped equations, and the batch-varying values among the
  marker's needs."""
  marker = jaxpr.eqns[step.marker_index]
  needed = jaxpr_util.needed_eqns(jaxpr, marker.invars)
  varying = batch_varying(jaxpr, step, [v for i in needed for v in jaxpr.eqns[i].outvars
                                        if not isinstance(v, jex.DropVar)])
  return [j for j in needed if any(v in varying for v in jaxpr.eqns[j].outvars)], varying
