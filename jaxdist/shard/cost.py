"""The α-β cost model: collectives and resharding on a LogicalMesh.

For a collective over a group of ``n`` devices along mesh axes with latency ``α`` (s)
and inverse bandwidth ``β`` (s/byte), and ``b`` the bytes of the per-device *result*:

- all-reduce:      α + 2 β (n − 1)/n · b
- all-gather:      α + β (n − 1)/n · b
- reduce-scatter:  α + β (n − 1) · b        (the input is n · b)
- all-to-all:      α + β (n − 1)/n · b   (each device keeps 1/n of its data, sends the rest)

A collective over several axes uses the largest α and β among them and the product of
their sizes.

XLA combines collectives after partitioning: independent all-reduces (no data path from
one to the other) over the same devices become one tuple all-reduce, and on GPU and TPU
all-gathers and reduce-scatters too, up to a byte threshold per combined op. So the α of a
combinable kind is not charged per collective here: :attr:`CostModel.combining` says
which kinds combine on the backend, and the planner charges one α per combined group
(``jaxdist.shard.combine``). The β part stays per collective (bytes add up either way).

Compute is ``flops / num_shards / peak_flops`` for dots and convolutions, and every
equation that XLA does not fuse into its consumers (``graph._fused_into_consumers``) also
pays ``output bytes per device / memory_bandwidth`` (elementwise work is memory-bound): a
replicated computation pays its full size on every device, which is what makes splitting
attractive beyond the dots.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxdist.mesh import LogicalMesh
from jaxdist.shard.reshard import reshard_ops
from jaxdist.shard.specs import DimAxes


# What a disallowed collective (or a split a micro-batch loop cannot keep) costs. The ILP
# states it as more than any allowed plan costs in all (``solver.solve_ilp``): a fixed
# 1000 s was less than a 4 KB all-gather at Alpa's unit link costs (β = 1 s per byte),
# so allow_all_gather=False still planned 15 of them on an MLP; and at realistic costs,
# beside microsecond costs, it stalled HiGHS at the root (a cost range of 1e-5 to 4e5 s).
DISALLOWED_S = math.inf


@dataclasses.dataclass(frozen=True)
class Combining:
  """What XLA's collective combiners merge on one backend (and the types they move).

  Attributes:
    kinds: collective kinds whose independent instances over the same devices XLA merges
      into one op (``all-reduce``, ``all-gather``, ``reduce-scatter``).
    threshold_bytes: largest combined op in bytes (XLA starts a new one beyond it).
    threshold_count: largest number of operands of one combined op.
    promotes_half: collectives of 16-bit floats run in f32 (XLA:CPU).
  """

  kinds: frozenset = frozenset()
  threshold_bytes: float = float("inf")
  threshold_count: int = 256
  promotes_half: bool = False

  def collective_bytes(self, nbytes: float, dtype) -> float:
    """Result bytes of a collective on a value of ``nbytes`` and ``dtype`` as the backend
    runs it: with ``promotes_half`` (XLA:CPU) a 16-bit float moves as f32."""
    half = jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2
    return 2 * nbytes if self.promotes_half and half else nbytes

  def count(self, kind: str, sizes: list[float]) -> int:
    """How many ops XLA makes of independent collectives of one kind with these bytes."""
    if kind not in self.kinds:
      return len(sizes)
    return max(1, math.ceil(sum(sizes) / self.threshold_bytes),
               math.ceil(len(sizes) / self.threshold_count))


# XLA's defaults (jax 0.10.2 / its XLA): the CPU compiler runs only the all-reduce combiner,
# with no byte limit and 256 operands per op, and moves bf16 / f16 values as f32 (measured:
# all-reduces, all-gathers and all-to-alls of bf16 values compile with f32 operands); the GPU
# compiler combines all-reduce, all-gather and reduce-scatter up to 30 MiB each
# (xla_gpu_*_combine_threshold_bytes);
# TPU combines the same three kinds (its thresholds are not public; 30 MiB assumed).
COMBINING = {
    "cpu": Combining(frozenset({"all-reduce"}), promotes_half=True),
    "gpu": Combining(frozenset({"all-reduce", "all-gather", "reduce-scatter"}), 30 * 2**20),
    "tpu": Combining(frozenset({"all-reduce", "all-gather", "reduce-scatter"}), 30 * 2**20),
}


def combining_for(platform: str) -> Combining:
  """The combiner behaviour of a jax platform name (``"cpu"``, ``"gpu"``, ``"cuda"``,
  ``"rocm"``, ``"tpu"``); unknown platforms combine nothing (every α is charged)."""
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  return COMBINING.get(platform, Combining())


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Collective and compute costs on one logical mesh.

  Attributes:
    mesh: the logical mesh (axis sizes, α and β per axis).
    peak_flops: per-device compute rate used to turn flops into seconds (the planner
      passes the mesh's, which defaults to its device kind's).
    memory_bandwidth: per-device bytes per second for writing an equation's outputs.
    allow_all_gather, allow_all_to_all: when False, resharding that needs that
      collective costs ``DISALLOWED_S`` (infinite) instead: the planner avoids it
      wherever a plan can.
    combining: which kinds XLA combines; their α is left out of :meth:`collective`
      and charged once per combined group by the planner.
  """

  mesh: LogicalMesh
  peak_flops: float = 1e14
  memory_bandwidth: float = 2e12
  allow_all_gather: bool = True
  allow_all_to_all: bool = True
  combining: Combining = Combining()

  @property
  def axis_sizes(self) -> dict[str, int]:
    return dict(zip(self.mesh.axis_names, self.mesh.shape))

  def latency(self, axes) -> float:
    """α of one collective over ``axes`` (0 over a group of one device)."""
    n, alpha, _ = self._group(axes)
    return 0.0 if n == 1 else alpha

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

  def collective_permute(self, axes, nbytes: float) -> float:
    n, alpha, beta = self._group(axes)
    return 0.0 if n == 1 else alpha + beta * nbytes

  def all_to_all(self, axes, nbytes: float) -> float:
    n, alpha, beta = self._group(axes)
    return 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes

  def compute(self, flops: float, shards: int) -> float:
    return flops / max(shards, 1) / self.peak_flops

  def write(self, bytes_per_device: float) -> float:
    return bytes_per_device / self.memory_bandwidth

  def reshard_collectives(self, src: DimAxes, dst: DimAxes,
                          full_bytes: float) -> list[tuple[str, tuple[str, ...], float]]:
    """The collectives XLA's partitioner emits to move a tensor of ``full_bytes``
    (unsharded) from ``src`` to ``dst``, as (kind, axes, per-device result bytes), in
    order (``jaxdist.shard.reshard`` follows its decisions on tile assignments: a
    collective-permute where only the device order differs, all-to-alls where tile counts
    trade places between dimensions, all-gathers a dimension at a time, the last first).
    """
    ops = reshard_ops(src, dst, self.mesh.axis_names, self.mesh.shape)
    return [(kind, axes, fraction * full_bytes) for kind, axes, fraction in ops]

  def collective(self, kind: str, axes, nbytes: float) -> float:
    """Seconds for one collective, without α where XLA combines ``kind`` (the planner
    charges that α per combined group); a disallowed one costs ``DISALLOWED_S``."""
    if kind == "all-gather":
      seconds = self.all_gather(axes, nbytes) if self.allow_all_gather else DISALLOWED_S
    elif kind == "all-to-all":
      seconds = self.all_to_all(axes, nbytes) if self.allow_all_to_all else DISALLOWED_S
    elif kind == "reduce-scatter":
      seconds = self.reduce_scatter(axes, nbytes)
    elif kind == "collective-permute":
      seconds = self.collective_permute(axes, nbytes)
    else:
      seconds = self.all_reduce(axes, nbytes)
    if kind in self.combining.kinds and seconds < DISALLOWED_S:
      seconds -= self.latency(axes)
    return seconds
