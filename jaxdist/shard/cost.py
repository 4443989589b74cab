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
from jaxdist.shard.specs import DimAxes


DISALLOWED_S = 1e3


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
      collective costs ``DISALLOWED_S`` instead, so the planner avoids it if it can.
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
    """The collectives that move a tensor of ``full_bytes`` (unsharded) from ``src`` to
    ``dst``, as (kind, axes, per-device result bytes).

    A dimension's tiling is an ordered tuple of mesh axes (major first), and XLA's
    partitioner only changes it at the minor end: per dimension the longest common
    prefix of ``src`` and ``dst`` stays, every ``src`` axis after it is released (an
    all-to-all if ``dst`` uses that axis elsewhere, else an all-gather), and every
    ``dst`` axis after it that the tensor was not split on is a local slice (free).
    So ``(a, b) → (a,)`` gathers over ``b`` only, while ``(a, b) → (b,)`` gathers over
    both (XLA logs that as an "involuntary full rematerialization"). Axes released from
    one dimension that all move to one other dimension go in one all-to-all over them
    together; those it gathers, in one all-gather over them together, of the value before
    any new split is sliced out (or, where each new shard of the dimension lies within
    one old shard, as in ``(a,) → (b,)`` with ``b`` splitting it as finely, in one
    collective-permute). Axes moving to several dimensions at once are beyond XLA's
    all-to-all resharding: it gathers them (a full rematerialization too). So are axes
    that one dimension receives from two or more others (``(b, a, -) → (-, -, (a, b))``):
    XLA gathers each source dimension's released axes, the last dimension first, and
    slices the new split out of the result (measured on jax 0.10.2).
    """
    if src == dst:
      return []
    sizes = self.axis_sizes
    where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
    per_device = full_bytes / math.prod(sizes[a] for a in where_dst)
    keeps = []  # per dim, the length of the tiling prefix src and dst share
    for s_axes, d_axes in zip(src, dst):
      keep = 0
      while keep < min(len(s_axes), len(d_axes)) and s_axes[keep] == d_axes[keep]:
        keep += 1
      keeps.append(keep)
    released = [s_axes[keep:] for s_axes, keep in zip(src, keeps)]
    sources: dict[int, set] = {}
    for d, axes in enumerate(released):
      for a in axes:
        if a in where_dst and where_dst[a] != d:
          sources.setdefault(where_dst[a], set()).add(d)
    if any(len(dims) > 1 for dims in sources.values()):
      out, split = [], [a for axes in src for a in axes]
      for axes in reversed(released):
        if axes:
          split = [a for a in split if a not in axes]
          out.append(("all-gather", axes, full_bytes / math.prod(sizes[a] for a in split)))
      return out
    out, gone = [], set()
    # XLA reshards the last dimension first: a gather's result is what is left split
    # after it and the gathers of the later dimensions.
    for d in reversed(range(len(src))):
      moving = tuple(a for a in released[d] if a in where_dst)
      if len({where_dst[a] for a in moving}) > 1:
        others = math.prod(sizes[a] for axes in src for a in axes if a not in released[d])
        out.append(("all-gather", released[d], full_bytes / others))
        continue
      if len(moving) > 1:
        out.append(("all-to-all", moving, per_device))
      else:
        out += [("all-to-all", (a,), per_device) for a in moving]
      gathered = tuple(a for a in released[d] if a not in where_dst)
      added = tuple(a for a in dst[d][keeps[d]:] if not any(a in axes for axes in src))
      if gathered and added and (math.prod(sizes[a] for a in added)
                                 % math.prod(sizes[a] for a in gathered) == 0):
        # Every new shard lies within one old shard: one device sends it.
        out.append(("collective-permute", gathered + added, per_device))
      elif gathered:  # gathered before any new split is sliced out of it
        gone.update(gathered)
        kept = math.prod(sizes[a] for axes in src for a in axes if a not in gone)
        out.append(("all-gather", gathered, full_bytes / kept))
    return out

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
