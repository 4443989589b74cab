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
  """Median seconds of each ``(step, state, *args)`` in ``runs``: the median of its
  :func:`round_times` (one slow spell of a shared machine, seconds long, does not decide
  a run)."""
  return [statistics.median(samples) for samples in round_times(runs, rounds, num_steps)]


def round_times(runs, rounds: int = 3, num_steps: int = 5) -> list[list[float]]:
  """Each ``(step, state, *args)`` of ``runs`` timed in ``rounds`` interleaved rounds of
  ``num_steps`` steps (2 warm-up calls in the first round, 1 after); every other round
  runs them in reverse order, since on shared cores the run after another was measured
  up to 10% slower than the same run before it. Returns each run's median per round."""
  times = [[] for _ in runs]
  for r in range(rounds):
    order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
    for i in order:
      times[i].append(time_steps(*runs[i], num_steps=num_steps, warmup=2 if r == 0 else 1)[2])
  return times
