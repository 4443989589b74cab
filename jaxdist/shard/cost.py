"""The α-β cost model: collectives and resharding on a LogicalMesh.

For a collective over a group of ``n`` devices along mesh axes with latency ``α`` (s)
and inverse bandwidth ``β`` (s/byte), and ``b`` the bytes of the per-device *result*:

- all-reduce:      α + 2 β (n − 1)/n · b
- all-gather:      α + β (n − 1)/n · b
- reduce-scatter:  α + β (n − 1) · b        (the input is n · b)
- all-to-all:      α + β (n − 1)/n · b   (each device keeps 1/n of its data, sends the rest)

A collective over several axes uses the largest α and β among them and the product of
their sizes. Compute is ``flops / num_shards / peak_flops`` for dots and convolutions,
and every equation also pays ``output bytes per device / memory_bandwidth`` (elementwise
work is memory-bound): a replicated computation pays its full size on every device,
which is what makes splitting attractive beyond the dots.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist.mesh import LogicalMesh
from jaxdist.shard.specs import DimAxes


DISALLOWED_S = 1e3


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Collective and compute costs on one logical mesh.

  Attributes:
    mesh: the logical mesh (axis sizes, α and β per axis).
    peak_flops: per-device compute rate used to turn flops into seconds.
    memory_bandwidth: per-device bytes per second for writing an equation's outputs.
    allow_all_gather, allow_all_to_all: when False, resharding that needs that
      collective costs ``DISALLOWED_S`` instead, so the planner avoids it if it can.
  """

  mesh: LogicalMesh
  peak_flops: float = 1e14
  memory_bandwidth: float = 2e12
  allow_all_gather: bool = True
  allow_all_to_all: bool = True

  @property
  def axis_sizes(self) -> dict[str, int]:
    return dict(zip(self.mesh.axis_names, self.mesh.shape))

  def _group(self, axes) -> tuple[int, float, float]:
    axes = tuple(axes)
    if not axes:
      return 1, 0.0, 0.0
    index = [self.mesh.axis_names.index(a) for a in axes]
    n = math.prod(self.mesh.shape[i] for i in index)
    return n, max(self.mesh.alpha[i] for i in index), max(self.mesh.beta[i] for i in index)

  def all_reduce(self, axes, nbytes: float) -> float:
    n, alpha, beta = self._group(axes)
    return 0.0 if n == 1 else alpha + 2 * beta * (n - 1) / n * nbytes

  def all_gather(self, axes, nbytes: float) -> float:
    n, alpha, beta = self._group(axes)
    return 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes

  def reduce_scatter(self, axes, nbytes: float) -> float:
    n, alpha, beta = self._group(axes)
    return 0.0 if n == 1 else alpha + beta * (n - 1) * nbytes

  def all_to_all(self, axes, nbytes: float) -> float:
    n, alpha, beta = self._group(axes)
    return 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes

  def compute(self, flops: float, shards: int) -> float:
    return flops / max(shards, 1) / self.peak_flops

  def write(self, bytes_per_device: float) -> float:
    return bytes_per_device / self.memory_bandwidth

  def reshard_collectives(self, src: DimAxes, dst: DimAxes,
                          full_bytes: float) -> list[tuple[str, tuple[str, ...], float]]:
    """The collectives that move a tensor of ``full_bytes`` (unsharded) from ``src`` to
    ``dst``, as (kind, axes, per-device result bytes).

    A dimension's tiling is an ordered tuple of mesh axes (major first), and XLA's
    partitioner only changes it at the minor end: per dimension the longest common
    prefix of ``src`` and ``dst`` stays, every ``src`` axis after it is released (an
    all-to-all if ``dst`` uses that axis elsewhere, else an all-gather), and every
    ``dst`` axis after it that the tensor was not split on is a local slice (free).
    So ``(a, b) → (a,)`` gathers over ``b`` only, while ``(a, b) → (b,)`` gathers over
    both (XLA logs that as an "involuntary full rematerialization").
    """
    if src == dst:
      return []
    sizes = self.axis_sizes
    where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
    per_device = full_bytes / math.prod(sizes[a] for a in where_dst)
    out = []
    for s_axes, d_axes in zip(src, dst):
      keep = 0
      while keep < min(len(s_axes), len(d_axes)) and s_axes[keep] == d_axes[keep]:
        keep += 1
      for axis in s_axes[keep:]:
        out.append(("all-to-all" if axis in where_dst else "all-gather", (axis,), per_device))
    return out

  def collective(self, kind: str, axes, nbytes: float) -> float:
    """Seconds for one collective; a disallowed one costs ``DISALLOWED_S``."""
    if kind == "all-gather":
      return self.all_gather(axes, nbytes) if self.allow_all_gather else DISALLOWED_S
    if kind == "all-to-all":
      return self.all_to_all(axes, nbytes) if self.allow_all_to_all else DISALLOWED_S
    if kind == "reduce-scatter":
      return self.reduce_scatter(axes, nbytes)
    return self.all_reduce(axes, nbytes)

  def reshard(self, src: DimAxes, dst: DimAxes, full_bytes: float) -> float:
    """Seconds to move a tensor from ``src`` to ``dst`` (see :meth:`reshard_collectives`)."""
    return sum(self.collective(*c) for c in self.reshard_collectives(src, dst, full_bytes))
