"""Timing a step the way benchmarks and the demo need it: warm, blocked, median."""

from __future__ import annotations

import statistics
import time

import jax


def time_steps(step, state, *args, num_steps: int = 5, warmup: int = 1):
  """Runs ``state, out = step(state, *args)`` repeatedly; returns (state, out, median_s).

  The first ``warmup`` calls (compilation, first transfers) are not timed; each timed
  call is blocked on its outputs, so the time is the step's wall time.
  """
  out = None
  for _ in range(warmup):
    state, out = step(state, *args)
    jax.block_until_ready((state, out))
  times = []
  for _ in range(num_steps):
    start = time.perf_counter()
    state, out = step(state, *args)
    jax.block_until_ready((state, out))
    times.append(time.perf_counter() - start)
  return state, out, statistics.median(times)
