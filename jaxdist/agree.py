"""Decisions that every process of a multi-process job must take alike.

Under ``jax.distributed`` every process runs the same Python and must issue the same
computations in the same order. A decision drawn from something that can differ between
processes (a solve stopped by its time limit, a plan one process has cached and another
has not, a measured step time) is taken by process 0 and sent to the others.
"""

from __future__ import annotations

import json

import jax
import numpy as np


def process_zeros(value):
  """``value`` as process 0 has it, in every process; ``value`` itself in a single process.

  ``value`` must be JSON-serializable (it travels as JSON: tuples come back as lists).
  Every process must call this at the same point of the program: it is a collective.
  """
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils

  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int32))[0])
  padded = np.zeros(size, np.uint8)
  padded[:min(size, data.size)] = data[:size]
  return json.loads(bytes(multihost_utils.broadcast_one_to_all(padded)).decode())
