"""Parallelization methods: small declarative option records, no planning logic.

A method says *what* kind of parallelism to use and on which devices; the planners in
``jaxdist.layouts`` (and later ``jaxdist.shard`` / ``jaxdist.pipeline``) decide *how*.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxdist import errors
from jaxdist.recompute import RecomputeRequest


def _method(cls):
  """Makes ``cls`` a frozen dataclass whose constructor rejects unknown keywords by name."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  init = cls.__init__
  valid = [f.name for f in dataclasses.fields(cls)]

  @functools.wraps(init)
  def checked_init(self, *args, **kwargs):
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
      raise errors.UnknownArgumentError(
          f"{cls.__name__}() got unknown argument(s) {', '.join(map(repr, unknown))}; "
          f"valid arguments are: {', '.join(valid)}.")
    init(self, *args, **kwargs)
    self._validate()

  cls.__init__ = checked_init
  return cls


class Method:
  """Base of every method. ``devices`` and ``num_micro_batches`` are common to all."""

  devices: Any
  num_micro_batches: int | None
  recompute_modules: str | None

  def _validate(self):
    if self.recompute_modules is not None:
      RecomputeRequest.parse(self.recompute_modules, type(self).__name__)
    n = self.num_micro_batches
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
      raise errors.InvalidArgumentError(
          f"{type(self).__name__}(num_micro_batches={n!r}): must be None or an integer >= 1.")

  @property
  def name(self) -> str:
    return type(self).__name__


@_method
class DataParallel(Method):
  """Batch arguments split on dim 0 over all devices; everything else replicated.

  One gradient all-reduce per step (XLA may combine the per-leaf reductions).

  Args:
    devices: None (all devices), a list of devices, a ``jax.sharding.Mesh`` or a
      ``jaxdist.LogicalMesh``. The batch is split over every mesh axis.
    num_micro_batches: split the batch into this many micro-batches and accumulate
      gradients (needs ``jaxdist.grad`` / ``jaxdist.value_and_grad``).
    recompute_modules: comma-separated flax module names (path suffixes or class
      names) whose activations are recomputed in the backward pass instead of kept;
      ``"ROOT"`` for the whole model (needs ``jaxdist.grad`` / ``value_and_grad``).
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None


@_method
class Zero2Parallel(Method):
  """Data parallel with optimizer state sharded over the devices (ZeRO stage 2).

  Parameters stay replicated between steps; optimizer state is split on one dimension
  per leaf (the largest that divides by the device count; a leaf that divides nowhere
  stays replicated and the plan says so); gradients are reduced and the update is
  computed on the local shard, then parameters are gathered.

  Args: as :class:`DataParallel`.
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None


@_method
class Zero3Parallel(Method):
  """ZeRO stage 3: parameters are sharded between steps too and gathered for compute.

  Args: as :class:`DataParallel`.
  """

  devices: Any = None
  num_micro_batches: int | None = None
  recompute_modules: str | None = None
