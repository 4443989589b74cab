"""``jaxdist.grad`` / ``jaxdist.value_and_grad``: jax's, plus a marker in the jaxpr.

The marker is an identity primitive over the results (value, aux and gradient
leaves). While jaxdist traces a step, the method's ``recompute_modules`` is applied to
the function being differentiated (``jaxdist.recompute``). It tells the planner where "compute gradients" ends and "apply gradients"
begins, so that gradients can be accumulated over micro-batches and reduced across
devices once per step. Outside ``jaxdist.parallelize`` it is a plain identity. Under
``PipeshardParallel`` the function is not differentiated while the step is traced: it is
captured as one equation that the pipeline runs stage by stage (``jaxdist.pipeline.capture``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from jaxdist.jaxpr_util import IDENTITY_MARKER, identity_marker
from jaxdist.pipeline import capture
from jaxdist.recompute import with_recompute

VALUE, AUX, GRAD = capture.VALUE, capture.AUX, capture.GRAD

grad_marker_p = identity_marker(IDENTITY_MARKER)


def _mark(value, aux, grads, has_value: bool, has_aux: bool):
  parts = ([value] if has_value else []) + ([aux] if has_aux else []) + [grads]
  part_kinds = ([VALUE] if has_value else []) + ([AUX] if has_aux else []) + [GRAD]
  leaves, tree = jax.tree.flatten(parts)
  kinds = []
  for part, kind in zip(parts, part_kinds):
    kinds += [kind] * len(jax.tree.leaves(part))
  return tree.unflatten(grad_marker_p.bind(*leaves, kinds=tuple(kinds)))


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **kwargs) -> Callable:
  """Like ``jax.value_and_grad``, and marks the results for jaxdist.

  With ``num_micro_batches = k`` the batch is split into k micro-batches; the value,
  aux and gradients returned are the means over micro-batches (and devices). That
  equals the full-batch result when the loss is a mean over the examples of the
  batch. For a loss that sums over examples the gradient comes out divided by the
  number of micro-batches times batch shards: scale the loss, or use a mean.
  Integer aux leaves (counts) are summed instead of averaged.

  Args:
    fun, argnums, has_aux, **kwargs: as ``jax.value_and_grad``.

  Returns:
    A function returning ``(value, grads)`` or ``((value, aux), grads)``.
  """
  vg = jax.value_and_grad(with_recompute(fun), argnums=argnums, has_aux=has_aux, **kwargs)

  def run(*args, **kw):
    if capture.active():  # PipeshardParallel is tracing: the pipeline differentiates
      (value, aux), grads = capture.captured_value_and_grad(with_recompute(fun), argnums,
                                                            has_aux, args, kw)
      return ((value, aux) if has_aux else value), grads
    if has_aux:
      (value, aux), grads = vg(*args, **kw)
      value, aux, grads = _mark(value, aux, grads, True, True)
      return (value, aux), grads
    value, grads = vg(*args, **kw)
    value, grads = _mark(value, None, grads, True, False)
    return value, grads

  return run


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **kwargs) -> Callable:
  """Like ``jax.grad``, and marks the gradients for jaxdist (see :func:`value_and_grad`)."""
  g = jax.grad(with_recompute(fun), argnums=argnums, has_aux=has_aux, **kwargs)

  def run(*args, **kw):
    if capture.active():
      (_, aux), grads = capture.captured_value_and_grad(with_recompute(fun), argnums, has_aux,
                                                        args, kw)
      return (grads, aux) if has_aux else grads
    if has_aux:
      grads, aux = g(*args, **kw)
      aux, grads = _mark(None, aux, grads, False, True)
      return grads, aux
    (grads,) = _mark(None, None, g(*args, **kw), False, False)
    return grads

  return run
