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

A stage that runs per shard of the batch with other axes partitioned by XLA (a
model-parallel plan inside each shard) is not predicted: its plan's collectives over the
batch axes move into the once-per-step sum, and which of the rest XLA keeps per shard the
plan does not say. Such stages are named in the result instead.
"""

from __future__ import annotations

import math

import jax

from jaxdist.pipeline.per_device import LOSS_OUTPUT, REPLICATED
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
                         combining: Combining) -> tuple[dict[str, dict[str, float]], list[str]]:
  """(kind → {"count", "result_bytes"} per step and device, the stages left out and why)
  for ``stages`` (``partition.Stage``, compiled) run on ``k`` micro-batches and the update
  programs ``applies`` (``runtime.Program``)."""
  total, left_out = _Total(combining), []
  for s, st in enumerate(stages):
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
      left_out.append(f"stage {s} runs per shard of the batch over {pd.axes} with its other "
                      f"axes partitioned by XLA")
      continue
    total.add_all_reduces([a for kind, a in zip(pd.acts_out, st.out_avals)
                           if kind[0] == LOSS_OUTPUT], k)
    total.add_all_reduces([st.in_avals[p] for p in st.float_in
                           if pd.acts_in[p][0] == REPLICATED], k)
    total.add_all_reduces([jax.ShapeDtypeStruct(st.operand_avals[p].shape, g.dtype, sharding=home)
                           for p, home, g in zip(st.diff, st.grad_homes, st.grad_avals)], 1)
  for program in applies:
    if program.plan is not None:
      total.add_plan(program.plan.predicted_collectives, 1)
  return total.kinds, left_out
