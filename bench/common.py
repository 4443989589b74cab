"""Shared setup for bench scripts: 8 simulated CPU devices unless the user set a count."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  jax.config.update("jax_num_cpu_devices", 8)


def verdict(ok: bool) -> str:
  return "PASS" if ok else "FAIL"
