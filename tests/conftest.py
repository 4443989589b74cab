"""8 simulated CPU devices, configured before jax is imported anywhere."""

import os
import re

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                  os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()
