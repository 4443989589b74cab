"""The collectives a pipeline's programs compile to per step, from the stages' plans.

Each program's prediction is added up as often as the step runs it: a stage's forward
and backward once per micro-batch, its gradient sum and the updates once per step.

- A stage run as planned: its forward's and backward's shard plans (each already
  combined as XLA combines, ``jaxdist.shard.combine``), and the reshards that return its
  activations and cotangents in their readers' layouts (``Stage.handover``).
- A stage run per device: its forward all-reduces the loss outputs over the devices
  (their mean or weighted sum), its backward the cotangents of inputs every device holds
  alike (parameters passed on), and its gradient sum is one all-reduce of the
  gradients, combined as the backend combines all-reduces; its handover reshards too.
- The update programs: their shard plans (none for one replicated over all devices), and
  the program before the pipeline is replicated (no collectives).

- A stage run per shard of the batch (manual over the batch axes, the other axes
  partitioned by XLA as its plan lays them out: model parallel inside each shard): its
  backward's plan over the other axes only (the batch axes are manual there, and its
  gradients go to the once-per-step sum instead); its forward's, the same plan's
  collectives on the equations that line up with the forward's (by their primitive
  sequence, as the forward takes the plan's constraints), the forward's results
  included, which the backward program leaves dead; and the reductions of a stage run
  per device, over the batch axes.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxdist import jaxpr_util
from jaxdist.pipeline.per_device import LOSS_OUTPUT, REPLICATED
from jaxdist.shard import combine
from jaxdist.shard.cost import Combining


def device_bytes(aval) -> float:
  """Bytes of one device's shard of an aval carrying its sharding."""
  shape = aval.sharding.shard_shape(aval.shape)
  return float(math.prod(shape) * aval.dtype.itemsize)


class _Total:
  """Collectives per step: kind → {"count", "result_bytes"}."""

  def __init__(self, combining: Combining):
    self.combining = combining
    self.kinds: dict[str, dict[str, float]] = {}

  def add_plan(self, predicted: dict, times: int):
    for kind, c in predicted.items():
      entry = self.kinds.setdefault(kind, {"count": 0, "result_bytes": 0.0})
      entry["count"] += c["count"] * times
      entry["result_bytes"] += c["result_bytes"] * times

  def add_all_reduces(self, avals, times: int):
    """Independent all-reduces in one program, one of each aval (with its sharding): one
    op per reduction type (XLA combines only all-reduces of one element type)."""
    by_dtype: dict[str, list[float]] = {}
    for a in avals:
      by_dtype.setdefault(str(a.dtype), []).append(
          self.combining.collective_bytes(device_bytes(a), a.dtype))
    for sizes in by_dtype.values():
      self.add_plan({"all-reduce": {"count": self.combining.count("all-reduce", sizes),
                                    "result_bytes": sum(sizes)}}, times)


def pipeline_collectives(stages, applies, k: int,
                         combining: Combining) -> dict[str, dict[str, float]]:
  """kind → {"count", "result_bytes"} per step and device for ``stages``
  (``partition.Stage``, compiled) run on ``k`` micro-batches and the update programs
  ``applies`` (``runtime.Program``)."""
  total = _Total(combining)
  for st in stages:
    if st.forward_plan is not None:
      total.add_plan(st.forward_plan.predicted_collectives, k)
      total.add_plan(st.backward_plan.predicted_collectives, k)
      total.add_plan(st.handover, k)
      continue
    pd = st.per_device
    if pd is None or st.mesh.num_devices == 1:
      continue
    total.add_plan(st.handover, k)
    if pd.axes:
      for forward in (False, True):
        total.add_plan(_per_shard(st.backward_plan, pd, forward), k)
    total.add_all_reduces([a for kind, a in zip(pd.acts_out, st.out_avals)
                           if kind[0] == LOSS_OUTPUT], k)
    total.add_all_reduces([st.in_avals[p] for p in st.float_in
                           if pd.acts_in[p][0] == REPLICATED], k)
    total.add_all_reduces([jax.ShapeDtypeStruct(st.operand_avals[p].shape, g.dtype, sharding=home)
                           for p, home, g in zip(st.diff, st.grad_homes, st.grad_avals)], 1)
  for program in applies:
    if program.plan is not None:
      total.add_plan(program.plan.predicted_collectives, 1)
  return total.kinds


def _per_shard(result, pd, forward: bool) -> dict:
  """The collectives of one shard's backward (``forward``: forward) program of a stage
  run manual over the batch axes ``pd.axes``, from the backward program's shard plan
  ``result`` (see the module docstring)."""
  plan = result.mesh_plan
  graph, keep = plan.graph, None
  if forward:
    eqns = result.step.closed_jaxpr.jaxpr.eqns
    own = [pd.loss.closed.jaxpr.eqns[i] for i in pd.stage.eqns]
    keep = {id(eqns[j]) for j in jaxpr_util.align(own, eqns).values()}
    graph = dataclasses.replace(graph, dead=frozenset())

  def axes_of(node, axes):
    eqn = graph.nodes[node].eqn
    if keep is not None and (eqn is None or id(eqn) not in keep):
      return ()
    return tuple(a for a in axes if a not in pd.axes)

  return combine.predict(graph, plan.solution.choice, plan.cost_model, axes_of=axes_of)
