"""LogicalMesh: a device mesh plus the communication cost of each of its axes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxdist import errors

# Cost-model defaults per device kind, used where the user gives no α / β / peak flops:
# (α seconds per collective, β seconds per byte on the link between devices of one node,
# dense bf16 peak flops per device). Published figures (NVLink per direction, TPU ICI);
# a multi-node mesh should give its slower axis the network's α and β explicitly.
# The CPU row is a development stand-in for a fast intra-node link (simulated CPU
# devices have no real link).
DEVICE_COSTS = {
    "cpu": (1e-7, 1e-11, 1e14),
    "a100": (10e-6, 1 / 300e9, 312e12),
    "h100": (10e-6, 1 / 450e9, 989e12),
    "h200": (10e-6, 1 / 450e9, 989e12),
    "b200": (10e-6, 1 / 900e9, 2250e12),
    "tpu v5 lite": (5e-6, 1 / 200e9, 197e12),
    "tpu v5e": (5e-6, 1 / 200e9, 197e12),
    "tpu v5p": (5e-6, 1 / 600e9, 459e12),
    "gpu": (10e-6, 1 / 100e9, 1e14),
    "tpu": (5e-6, 1 / 100e9, 1e14),
}


def device_costs(device) -> tuple[float, float, float]:
  """(α, β, peak flops) for a jax device, from :data:`DEVICE_COSTS` by its kind (e.g.
  ``"NVIDIA H100 80GB HBM3"`` → ``"h100"``), else by its platform."""
  kind = str(getattr(device, "device_kind", "")).lower()
  for name, costs in DEVICE_COSTS.items():
    if name not in ("cpu", "gpu", "tpu") and name in kind:
      return costs
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
  return DEVICE_COSTS.get(platform, DEVICE_COSTS["cpu"])


@dataclasses.dataclass(frozen=True)
class LogicalMesh:
  """A logical view of devices as an n-D mesh, with per-axis α-β costs.

  The time to move ``b`` bytes along axis ``i`` is modelled as ``alpha[i] + beta[i] * b``
  (per collective step); the shard planner turns that into collective costs.

  Args:
    shape: mesh shape, e.g. ``(2, 4)``. Its product must equal the number of devices.
    axis_names: one name per axis; default ``("mesh_0", "mesh_1", ...)``.
    alpha: latency per axis in seconds; a scalar applies to every axis. Default: the
      device kind's (:data:`DEVICE_COSTS`).
    beta: inverse bandwidth per axis in seconds per byte; a scalar applies to every
      axis. Default: the device kind's.
    devices: the devices, in row-major mesh order; default all of ``jax.devices()``.
    peak_flops: per-device compute rate of the cost model; default the device kind's.

  Raises:
    MeshShapeError: the shape does not multiply to the device count, or the names or
      costs do not have one entry per axis.
    DeviceCountError: the shape needs more devices than exist.
  """

  shape: tuple[int, ...]
  axis_names: tuple[str, ...] | None = None
  alpha: float | tuple[float, ...] | None = None
  beta: float | tuple[float, ...] | None = None
  devices: tuple[Any, ...] | None = None
  peak_flops: float | None = None

  def __post_init__(self):
    shape = tuple(int(s) for s in self.shape)
    if not shape or any(s < 1 for s in shape):
      raise errors.MeshShapeError(
          f"LogicalMesh(shape={self.shape!r}): every axis size must be a positive integer.")
    object.__setattr__(self, "shape", shape)
    names = self.axis_names or tuple(f"mesh_{i}" for i in range(len(shape)))
    if len(names) != len(shape) or len(set(names)) != len(names):
      raise errors.MeshShapeError(
          f"LogicalMesh(axis_names={self.axis_names!r}): need {len(shape)} distinct names, "
          f"one per axis of shape {shape}.")
    object.__setattr__(self, "axis_names", tuple(names))
    if self.devices is None:
      available = jax.devices()
      if math.prod(shape) > len(available):
        raise errors.DeviceCountError(
            f"LogicalMesh(shape={shape}) needs {math.prod(shape)} devices; only "
            f"{len(available)} exist. Use a shape whose product is at most {len(available)}.")
      devs = tuple(available[:math.prod(shape)])
    else:
      devs = tuple(np.asarray(self.devices, dtype=object).reshape(-1))
    if math.prod(shape) != len(devs):
      raise errors.MeshShapeError(
          f"LogicalMesh(shape={shape}) has {math.prod(shape)} positions but {len(devs)} devices "
          f"were given; the shape must multiply to the device count.")
    object.__setattr__(self, "devices", devs)
    alpha, beta, peak = device_costs(devs[0])
    object.__setattr__(self, "alpha", _per_axis("alpha", self.alpha, alpha, shape))
    object.__setattr__(self, "beta", _per_axis("beta", self.beta, beta, shape))
    if self.peak_flops is None:
      object.__setattr__(self, "peak_flops", peak)
    elif not self.peak_flops > 0:
      raise errors.MeshShapeError(f"LogicalMesh(peak_flops={self.peak_flops!r}) must be > 0.")

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  @property
  def mesh(self) -> Mesh:
    """The ``jax.sharding.Mesh`` (Auto axis types, so sharding constraints drive it)."""
    return _make_mesh(self.devices, self.shape, self.axis_names)

  def axis_size(self, name: str) -> int:
    return self.shape[self.axis_names.index(name)]

  @classmethod
  def from_devices(cls, devices: Any) -> "LogicalMesh":
    """Builds a mesh from what a method's ``devices=`` accepts.

    Args:
      devices: ``None`` (every device, 1-D), a sequence of devices (1-D), a
        ``jax.sharding.Mesh`` (its shape and names) or a ``LogicalMesh`` (as is).

    Raises:
      InvalidArgumentError: ``devices`` is none of these.
    """
    if devices is None:
      return cls((len(jax.devices()),), axis_names=("devices",))
    if isinstance(devices, LogicalMesh):
      return devices
    if isinstance(devices, Mesh):
      return cls(tuple(devices.devices.shape), axis_names=tuple(devices.axis_names),
                 devices=tuple(devices.devices.reshape(-1)))
    if isinstance(devices, Sequence) and devices and all(isinstance(d, jax.Device) for d in devices):
      if len(set(devices)) != len(devices):
        raise errors.InvalidArgumentError(f"devices={list(devices)!r} lists a device twice.")
      return cls((len(devices),), axis_names=("devices",), devices=tuple(devices))
    raise errors.InvalidArgumentError(
        f"devices={devices!r} is not valid: pass None (all devices), a non-empty list of "
        f"jax devices, a jax.sharding.Mesh or a jaxdist.LogicalMesh.")


def _per_axis(name, value, default, shape):
  if value is None:
    return (default,) * len(shape)
  if np.ndim(value) == 0:
    value = float(value)
    if value < 0:
      raise errors.MeshShapeError(f"LogicalMesh({name}={value!r}) must be >= 0.")
    return (value,) * len(shape)
  value = tuple(float(v) for v in value)
  if len(value) != len(shape) or any(v < 0 for v in value):
    raise errors.MeshShapeError(
        f"LogicalMesh({name}={value!r}): need one non-negative value per axis of {shape}, "
        f"or a scalar.")
  return value


_MESH_CACHE: dict = {}


def _make_mesh(devices, shape, names) -> Mesh:
  key = (devices, shape, names)
  mesh = _MESH_CACHE.get(key)
  if mesh is None:
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(shape))
    _MESH_CACHE[key] = mesh
  return mesh
