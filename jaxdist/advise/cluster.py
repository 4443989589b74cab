"""Cluster: how many devices of which kind, how many per node, and their links
(device presets in ``strategies/advise/devices.json``)."""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
from typing import Any

from jaxdist import errors
from jaxdist.advise.specs import _load


def devices() -> dict[str, dict[str, Any]]:
  """The device presets: name → memory, peak flops, bandwidths, latencies, $/hour (a
  copy: edit a cluster's figures with ``Cluster(..., overrides=...)``)."""
  return copy.deepcopy(_load("devices.json"))


@dataclasses.dataclass(frozen=True)
class DeviceKind:
  name: str
  description: str
  memory_bytes: float
  peak_bf16_flops: float
  peak_fp8_flops: float | None
  hbm_bandwidth: float
  intra_node_bandwidth: float
  intra_node_latency_s: float
  inter_node_bandwidth: float
  inter_node_latency_s: float
  matmul_efficiency: float
  price_per_hour: float
  devices_per_node: int


@dataclasses.dataclass(frozen=True)
class Cluster:
  """``num_devices`` devices of kind ``device`` (a :func:`devices` preset name), in nodes of
  ``devices_per_node`` that share the fast link (NVLink; for TPUs, a slice on ICI; default
  the preset's: 8 for GPUs).

  ``overrides`` replaces preset fields, e.g. ``{"price_per_hour": 1.9,
  "inter_node_bandwidth": 100e9}``.
  """

  num_devices: int
  devices_per_node: int | None = None
  device: str = "h100-80gb"
  overrides: dict | None = None

  def __post_init__(self):
    table = _load("devices.json")
    if not isinstance(self.device, str) or self.device.lower() not in table:
      raise errors.InvalidArgumentError(
          f"Cluster(device={self.device!r}) is not a device preset; valid: {', '.join(table)}.")
    if self.devices_per_node is None:
      object.__setattr__(self, "devices_per_node", table[self.device.lower()]["devices_per_node"])
    for field in ("num_devices", "devices_per_node"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.InvalidArgumentError(f"Cluster({field}={value!r}) must be a positive integer.")
    if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
      raise errors.InvalidArgumentError(
          f"Cluster(num_devices={self.num_devices}) must be a multiple of devices_per_node="
          f"{self.devices_per_node} (whole nodes), or at most one node.")
    unknown = set(self.overrides or {}) - {f.name for f in dataclasses.fields(DeviceKind)}
    if unknown:
      raise errors.InvalidArgumentError(
          f"Cluster(overrides=...) has unknown field(s) {sorted(unknown)}; valid: "
          f"{[f.name for f in dataclasses.fields(DeviceKind) if f.name != 'name']}.")

  devices = staticmethod(devices)

  @property
  def kind(self) -> DeviceKind:
    preset = dict(_load("devices.json")[self.device.lower()], **(self.overrides or {}))
    return DeviceKind(name=self.device.lower(), **preset)

  @property
  def num_nodes(self) -> int:
    return max(1, self.num_devices // self.devices_per_node)

  @property
  def price_per_hour(self) -> float:
    return self.kind.price_per_hour * self.num_devices

  def with_devices(self, n: int) -> "Cluster":
    return dataclasses.replace(self, num_devices=n)

  def link(self, span: int) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a collective over a group whose members lie within
    ``span`` consecutive devices: the node's link if it fits in one node, else the network."""
    k = self.kind
    if span <= self.devices_per_node:
      return k.intra_node_latency_s, k.intra_node_bandwidth
    return k.inter_node_latency_s, k.inter_node_bandwidth

  @classmethod
  def detect(cls) -> "Cluster":
    """The devices present (``jax.devices()``), mapped to the nearest preset by kind; a
    CPU maps to ``h100-80gb`` figures (for planning only) and says so in :func:`topology`."""
    info = topology()
    return cls(num_devices=info["num_devices"],
               devices_per_node=max(1, info["num_devices"] // max(1, info["num_processes"])),
               device=info["preset"])


_KIND_TO_PRESET = (("h100", "h100-80gb"), ("h200", "h200"), ("b200", "b200"),
                   ("a100-sxm4-40gb", "a100-40gb"), ("a100", "a100-80gb"),
                   ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"))


def topology() -> dict[str, Any]:
  """What is present: device count and kinds, processes, memory per device (from
  ``memory_stats()`` where the backend reports it), the matching preset, and on GPU hosts
  with ``nvidia-smi`` its NVLink/PCIe matrix (``nvidia-smi topo -m``)."""
  import jax

  devs = jax.devices()
  kinds = sorted({str(d.device_kind) for d in devs})
  kind = kinds[0].lower()
  preset = next((p for key, p in _KIND_TO_PRESET if key in kind), "h100-80gb")
  memory = None
  try:
    stats = devs[0].memory_stats() or {}
    memory = stats.get("bytes_limit")
  except Exception:  # backends without memory statistics (CPU)
    memory = None
  info = {"num_devices": len(devs), "num_local_devices": jax.local_device_count(),
          "num_processes": jax.process_count(), "platform": devs[0].platform,
          "device_kinds": kinds, "memory_bytes_per_device": memory, "preset": preset,
          "preset_is_a_stand_in": not any(key in kind for key, _ in _KIND_TO_PRESET),
          "gpu_topology": None}
  if devs[0].platform == "gpu" and shutil.which("nvidia-smi"):
    try:
      info["gpu_topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                            text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
      pass
  return info
