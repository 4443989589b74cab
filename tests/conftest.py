"""8 simulated CPU devices, configured before jax is imported anywhere."""

import os
import re
import tempfile

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                  os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# Solved plans are cached on disk (jaxdist.shard.cache): in a fresh folder per test run.
os.environ["JAXDIST_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdist-test-cache-")

import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()
