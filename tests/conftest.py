"""8 simulated CPU devices, configured before jax is imported anywhere."""

import atexit
import os
import re
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                  os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's LLVM code generation without optimization: the tests' steps are tiny, so
# compiling is most of their time (a test file of pipelines: 134 s -> 90 s), and what
# they check is decided before code generation (the partitioned HLO's collectives, buffer
# assignment's bytes; the numbers agree with serial within the same tolerances).
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# And with XLA:CPU's older elemental emitters, which compile a step in 0.6x the time of the
# default fusion emitters (the whole suite: 960 s instead of 1335 s on 2 cores). The HLO
# passes are the default compiler's; buffer assignment nearly: of 59 memory estimates
# checked against XLA's bytes, one moved, by 1.4% (a 16 KB temporary fewer).
if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# Code generation on one thread: two pytest workers already share the 2 cores.
if "--xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
# Solved plans are cached on disk (jaxdist.shard.cache): in a fresh folder per test run.
os.environ["JAXDIST_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdist-test-cache-")
# XLA's executables through JAX's persistent cache, many tests compiling the same serial
# reference steps: one folder, made by the process that starts pytest and removed when it
# exits, which xdist's workers (and the processes tests launch) inherit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdist-test-xla-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()
