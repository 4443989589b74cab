"""Tensor shardings as the planner sees them: one tuple of mesh axes per tensor dim.

``DimAxes`` is a tuple with an entry per tensor dimension; each entry is a tuple of
mesh axis names that split that dimension (empty: not split). It converts to and from
``PartitionSpec``; unlike a PartitionSpec it is hashable and has a fixed length.
"""

from __future__ import annotations

import itertools
import math

from jax.sharding import PartitionSpec

DimAxes = tuple[tuple[str, ...], ...]


def replicated(rank: int) -> DimAxes:
  return ((),) * rank


def to_partition_spec(spec: DimAxes) -> PartitionSpec:
  entries = [None if not a else (a[0] if len(a) == 1 else a) for a in spec]
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec, rank: int) -> DimAxes:
  entries = list(pspec) + [None] * (rank - len(pspec))
  return tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries)


def used_axes(spec: DimAxes) -> set[str]:
  return {a for axes in spec for a in axes}


def num_shards(spec: DimAxes, axis_sizes: dict[str, int]) -> int:
  return math.prod(axis_sizes[a] for axes in spec for a in axes)


def divides(shape: tuple[int, ...], spec: DimAxes, axis_sizes: dict[str, int]) -> bool:
  return all(shape[d] % math.prod(axis_sizes[a] for a in axes) == 0
             for d, axes in enumerate(spec))


def enumerate_specs(shape: tuple[int, ...], axis_sizes: dict[str, int],
                    max_split_dims: int = 2) -> list[DimAxes]:
  """Every way to split ``shape`` over the mesh axes of size > 1, divisible only.

  Each mesh axis is used for at most one dimension; a dimension may take several axes
  (in mesh order). At most ``max_split_dims`` dimensions are split. Replicated first.
  """
  axes = [a for a, n in axis_sizes.items() if n > 1]
  rank = len(shape)
  out = []
  # Assign each axis to a dimension or to nothing (-1).
  for choice in itertools.product(range(-1, rank), repeat=len(axes)):
    spec = [[] for _ in range(rank)]
    for axis, d in zip(axes, choice):
      if d >= 0:
        spec[d].append(axis)
    spec = tuple(tuple(a) for a in spec)
    if sum(1 for a in spec if a) > max_split_dims:
      continue
    if divides(shape, spec, axis_sizes) and spec not in out:
      out.append(spec)
  out.sort(key=lambda s: (len(used_axes(s)), s))
  return out
