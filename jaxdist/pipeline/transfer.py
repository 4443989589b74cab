"""Moving a value between two layouts on one process, kept on the devices.

``jax.device_put`` copies a value to another sub-mesh in one call when the two layouts
give each position of their device lists the same slice (``[a, b] → [c, d]``, both split
alike). Any other pair (a stage planned split on features feeding one split on the
batch, a micro-batch replicated on all devices going to a sub-mesh that splits it) takes
its fallback: the value is fetched to the host and split there, which also blocks the
driver until the producing program has finished. A :class:`Transfer` instead plans, once
per pair of layouts, a chain that stays on the devices and asynchronous:

- ``copy``: the layouts match position by position, one ``device_put``;
- as many devices on both sides: a compiled reshard on the source's devices into the
  target's layout, then ``copy``;
- the target's devices a block of the source's: a compiled reshard on the source into a
  *covering* layout (:func:`covering`), in which the target's devices already hold
  their shards, then the target array is assembled from those buffers (no copy);
- otherwise: replicated on the source, copied to every target device, cut there.

:func:`move_many` moves several values at once: the copies that end their chains are
issued as one ``jax.device_put`` of a list, whose Python cost (most of a copy's host
time) is then paid once per list rather than once per array.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.executable import compile_here


def _devices(sharding: NamedSharding) -> list:
  return list(sharding.mesh.devices.flat)


def _same_slices(src: NamedSharding, dst: NamedSharding, shape) -> bool:
  """Whether position i of ``src``'s devices holds the slice that position i of
  ``dst``'s holds, for every i."""
  a, b = src.devices_indices_map(shape), dst.devices_indices_map(shape)
  da, db = _devices(src), _devices(dst)
  return len(da) == len(db) and all(a[x] == b[y] for x, y in zip(da, db))


def _on(devices: list, like: NamedSharding) -> NamedSharding:
  """``like``'s mesh shape, axis names and spec on ``devices``."""
  mesh = like.mesh
  grid = np.array(devices, dtype=object).reshape(mesh.devices.shape)
  return NamedSharding(Mesh(grid, mesh.axis_names, axis_types=mesh.axis_types), like.spec)


def covering(devices: list, dst: NamedSharding) -> tuple[NamedSharding, int] | None:
  """A layout over ``devices`` under which ``dst``'s devices hold exactly ``dst``'s
  shards, with the position of ``dst``'s first device in ``devices``; None unless
  ``dst``'s device list is one of the equal blocks ``devices`` splits into.

  ``devices`` is read as ``(blocks, *dst's mesh shape)`` and the value laid out as
  ``dst`` says within each block (replicated across blocks)."""
  want = _devices(dst)
  n = len(want)
  if len(devices) % n:
    return None
  starts = [j for j in range(0, len(devices), n) if devices[j:j + n] == want]
  if not starts:
    return None
  mesh = dst.mesh
  grid = np.array(devices, dtype=object).reshape((len(devices) // n,) + mesh.devices.shape)
  name = "_block"
  while name in mesh.axis_names:
    name += "_"
  blocks = Mesh(grid, (name,) + tuple(mesh.axis_names),
                axis_types=(jax.sharding.AxisType.Auto,) + tuple(mesh.axis_types))
  return NamedSharding(blocks, dst.spec), starts[0]


def identity(x):
  return x


def _reshard(aval_shape, dtype, src: NamedSharding, dst: NamedSharding):
  """A compiled identity from ``src`` to ``dst`` (the same devices)."""
  arg = jax.ShapeDtypeStruct(aval_shape, dtype, sharding=src)
  return compile_here(jax.jit(identity, out_shardings=dst).lower(arg), src.device_set)


class Transfer:
  """Moves arrays of one shape and dtype from layout ``src`` to ``dst`` (see the module
  docstring); ``kind`` names the chain: ``copy``, ``reshard+copy``, ``assemble``,
  ``reshard+assemble`` or ``replicate+copy+reshard``."""

  def __init__(self, shape, dtype, src: NamedSharding, dst: NamedSharding):
    self.dst = dst
    self.steps = []
    self.copies_last = False  # the chain ends with a device_put to dst (not in steps)
    if _same_slices(src, dst, shape):
      self.kind, self.copies_last = "copy", True
      return
    source = _devices(src)
    if len(source) == len(_devices(dst)):
      staged = _on(source, dst)
      self.kind, self.copies_last = "reshard+copy", True
      self.steps.append(_reshard(shape, dtype, src, staged))
      return
    cover = covering(source, dst)
    if cover is not None and dst.is_fully_replicated:  # device_put reuses or copies shards
      self.kind, self.copies_last = "copy", True
      if not src.is_fully_replicated:
        self.kind = "reshard+copy"
        self.steps.append(_reshard(shape, dtype, src, NamedSharding(src.mesh, PartitionSpec())))
      return
    if cover is not None:
      layout, self._start = cover
      self.kind = "assemble"
      if not _same_slices(src, layout, shape):
        self.kind = "reshard+assemble"
        self.steps.append(_reshard(shape, dtype, src, layout))
      self.steps.append(self._assemble)
      return
    self.kind = "replicate+copy+reshard"
    here = NamedSharding(src.mesh, PartitionSpec())
    there = NamedSharding(dst.mesh, PartitionSpec())
    if not src.is_fully_replicated:
      self.steps.append(_reshard(shape, dtype, src, here))
    self.steps.append(lambda x: jax.device_put(x, there))
    if not dst.is_fully_replicated:
      self.steps.append(_reshard(shape, dtype, there, dst))

  def _assemble(self, x):
    # (x is not fully replicated: addressable_data(i) is the shard of device i)
    n = self.dst.num_devices
    return jax.make_array_from_single_device_arrays(
        x.shape, self.dst, [x.addressable_data(i) for i in range(self._start, self._start + n)],
        dtype=x.dtype)

  def before_copy(self, x: jax.Array) -> jax.Array:
    """``x`` through the chain, up to its final copy if it has one."""
    for step in self.steps:
      x = step(x)
    return x

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.before_copy(x)
    return jax.device_put(x, self.dst) if self.copies_last else x


@functools.lru_cache(maxsize=4096)
def transfer(shape, dtype, src: NamedSharding, dst: NamedSharding) -> Transfer:
  """The :class:`Transfer` for arrays of ``shape``/``dtype`` from ``src`` to ``dst``,
  planned (and its reshard programs compiled) on first use."""
  return Transfer(shape, dtype, src, dst)


def move_many(values: list, targets: list) -> list:
  """Each of ``values`` (arrays on this process with named layouts) in its layout of
  ``targets``, as :class:`Transfer` moves them, with every final copy in one
  ``jax.device_put``."""
  out = list(values)
  copies = []
  for i, (x, dst) in enumerate(zip(values, targets)):
    if x.sharding == dst:
      continue
    move = transfer(x.shape, x.dtype, x.sharding, dst)
    out[i] = move.before_copy(x)
    if move.copies_last:
      copies.append(i)
  if copies:
    moved = jax.device_put([out[i] for i in copies], [targets[i] for i in copies])
    for i, x in zip(copies, moved):
      out[i] = x
  return out
