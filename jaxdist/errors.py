"""Typed errors and warnings.

Errors caused by the user's input derive from :class:`JaxdistError` and from the
built-in exception a Python user would expect (``ValueError`` or ``TypeError``), so
``except ValueError`` keeps working. They are raised before any compute and their
message names the argument, the bad value and what would be valid.

Our own shortfalls (an op without a sharding rule, a solver timeout) never raise: they
emit a :class:`JaxdistWarning` and fall back to a plan that is still correct.
"""

from __future__ import annotations


class JaxdistError(Exception):
  """Base class of every error jaxdist raises on purpose."""


class InvalidArgumentError(JaxdistError, ValueError):
  """An argument has a value outside what is valid (the message says what is)."""


class UnknownArgumentError(JaxdistError, TypeError):
  """A keyword argument that the callee does not take."""


class BatchArgnumsError(InvalidArgumentError):
  """``batch_argnums`` names an argument the step does not have, or leaves out one that
  meets the batch along its dim 0."""


class BatchDivisibilityError(InvalidArgumentError):
  """A batch dimension does not divide over the devices or the micro-batches."""


class MeshShapeError(InvalidArgumentError):
  """A mesh shape does not multiply to its device count, or is malformed."""


class DeviceCountError(InvalidArgumentError):
  """More devices were asked for than exist."""


class NonArrayLeafError(JaxdistError, TypeError):
  """A pytree leaf that must be an array is something else."""


class GradientMarkerError(JaxdistError, ValueError):
  """A step needs ``jaxdist.grad``/``jaxdist.value_and_grad`` and does not use it."""


class InfeasiblePlanError(JaxdistError, ValueError):
  """No plan meets the constraints (for example a per-device memory budget)."""


class PlanMismatchError(JaxdistError, ValueError):
  """A saved plan does not fit the step it is applied to."""


class JaxdistWarning(UserWarning):
  """jaxdist fell back to a simpler, still-correct plan; the message says why."""


class ResultsDifferWarning(JaxdistWarning):
  """The method computes something else than the single-device step, not just rounding
  apart: micro-batches of a step whose examples interact (batch statistics) each see
  their own examples only. ``jaxdist.tune`` picks such a candidate only if no exact one
  ran."""
