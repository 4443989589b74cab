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
# XLA's executables through JAX's persistent cache, in one folder for both xdist workers
# (and the processes tests launch): many tests compile the same serial reference steps.
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"jaxdist-test-xla-{_run}") if _run
                      else tempfile.mkdtemp(prefix="jaxdist-test-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()
