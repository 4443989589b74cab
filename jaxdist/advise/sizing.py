"""NeMo Auto Configurator's size and time rules (8·N·T: forward, backward and
recomputation flops per parameter and token)."""

from __future__ import annotations

from jaxdist import errors


def _positive(**values) -> None:
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise errors.InvalidArgumentError(f"{name}={value!r} must be a positive number.")


def training_days(num_params: float, tokens: float, num_devices: int,
                  tflops_per_device: float) -> float:
  """Days to train ``num_params`` parameters on ``tokens`` tokens with ``num_devices``
  devices that each achieve ``tflops_per_device`` TFLOP/s:
  ``8·N·T / (86400 · devices · TFLOPS · 1e12)``."""
  _positive(num_params=num_params, tokens=tokens, num_devices=num_devices,
            tflops_per_device=tflops_per_device)
  return 8 * num_params * tokens / (86400 * num_devices * tflops_per_device * 1e12)


def model_size(days: float, tokens: float, num_devices: int, tflops_per_device: float) -> float:
  """The parameter count trainable in ``days`` on ``tokens`` tokens (inverse of
  :func:`training_days`)."""
  _positive(days=days, tokens=tokens, num_devices=num_devices, tflops_per_device=tflops_per_device)
  return days * 86400 * num_devices * tflops_per_device * 1e12 / (8 * tokens)
