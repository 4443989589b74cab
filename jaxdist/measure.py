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


def time_in_rounds(runs, rounds: int = 3, num_steps: int = 5) -> list[float]:
  """Median seconds of each ``(step, state, *args)`` in ``runs``, timed in ``rounds``
  interleaved rounds of ``num_steps`` steps (2 warm-up calls in the first round, 1 after):
  each run's figure is the median of its rounds' medians, so one slow spell of a shared
  machine (seconds long) does not decide a run."""
  times = [[] for _ in runs]
  for r in range(rounds):
    for run, samples in zip(runs, times):
      samples.append(time_steps(*run, num_steps=num_steps, warmup=2 if r == 0 else 1)[2])
  return [statistics.median(samples) for samples in times]
