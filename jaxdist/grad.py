"""``jaxdist.grad`` / ``jaxdist.value_and_grad``: jax's, plus a marker in the jaxpr.

The marker is an identity primitive over the results (value, aux and gradient
leaves). While jaxdist traces a step, the method's ``recompute_modules`` is applied to
the function being differentiated (``jaxdist.recompute``). It tells the planner where "compute gradients" ends and "apply gradients"
begins, so that gradients can be accumulated over micro-batches and reduced across
devices once per step. Outside ``jaxdist.parallelize`` it is a plain identity. Under
``PipeshardParallel`` the function is not differentiated while the step is traced: it is
captured as one equation that the pipeline runs stage by stage (``jaxdist.pipeline.capture``).

A step written with plain ``jax.grad`` / ``jax.value_and_grad`` gets the same: while
jaxdist traces a step (:func:`marking_jax_grads`), those two names of the ``jax`` module
are jaxdist's, and so are the names of the step's module bound to them (``from jax import
grad``). A function bound elsewhere before the step runs (a default argument, another
module's name) stays jax's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence

import jax

from jaxdist.jaxpr_util import IDENTITY_MARKER, identity_marker
from jaxdist.pipeline import capture
from jaxdist.recompute import with_recompute

VALUE, AUX, GRAD = capture.VALUE, capture.AUX, capture.GRAD

grad_marker_p = identity_marker(IDENTITY_MARKER)

# jax's own functions: jaxdist's calls them even while ``jax.grad`` names jaxdist's.
jax_grad, jax_value_and_grad = jax.grad, jax.value_and_grad

# For error messages: which gradients jaxdist sees.
SEEN = ("jaxdist sees the gradient of a step that calls jax.grad / jax.value_and_grad by "
        "that name, or by a name the step's module binds to them (`from jax import grad`), "
        "exactly once, at its top level (not a function bound elsewhere before the step "
        "runs, as a default argument or another module's import binds it), or "
        "jaxdist.grad / jaxdist.value_and_grad (same signature)")


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
  vg = jax_value_and_grad(with_recompute(fun), argnums=argnums, has_aux=has_aux, **kwargs)

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
  g = jax_grad(with_recompute(fun), argnums=argnums, has_aux=has_aux, **kwargs)

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


@dataclasses.dataclass
class PlainCalls:
  """The plain ``jax.grad`` / ``value_and_grad`` calls one trace made jaxdist's."""

  count: int = 0
  inside: bool = False  # tracing the function one of them differentiates


_MARKING: contextvars.ContextVar[PlainCalls | None] = contextvars.ContextVar(
    "jaxdist_marking", default=None)
_lock = threading.Lock()
_patched = 0  # traces (in any thread) under marking_jax_grads
_rebound: list[tuple[dict, str, Callable]] = []  # module globals made jaxdist's meanwhile
_recelled: list[tuple[object, Callable]] = []  # closure cells made jaxdist's meanwhile


@contextlib.contextmanager
def marking_jax_grads(fun: Callable | None = None):
  """While active, ``jax.grad`` / ``jax.value_and_grad`` called in this context (not in
  a nested one: a gradient inside a differentiated function stays jax's) are
  :func:`grad` / :func:`value_and_grad`, so that a plain step gets what ``jaxdist.grad``
  gives: gradients reduced once per step, accumulation, recomputation, pipelines. So are
  the names of ``fun``'s module bound to them (``from jax import value_and_grad``) and
  its closure's cells holding them (a step made by ``make_step(jax.value_and_grad)``).
  Yields the :class:`PlainCalls` it made jaxdist's; the caller decides whether the marked
  trace is usable (one call, at the step's top level). Other threads see jax's functions."""
  global _patched
  calls = PlainCalls()
  token = _MARKING.set(calls)
  with _lock:
    if _patched == 0:
      jax.grad, jax.value_and_grad = _MARKING_GRAD, _MARKING_VALUE_AND_GRAD
    _patched += 1
    for namespace in _module_namespaces(fun):
      for name, value in list(namespace.items()):
        marking = _MARKING_OF.get(id(value))
        if marking is not None and value is marking[0]:
          namespace[name] = marking[1]
          _rebound.append((namespace, name, value))
    for cell in _closure_cells(fun):
      try:
        value = cell.cell_contents
      except ValueError:  # (an empty cell)
        continue
      marking = _MARKING_OF.get(id(value))
      if marking is not None and value is marking[0]:
        cell.cell_contents = marking[1]
        _recelled.append((cell, value))
  try:
    yield calls
  finally:
    _MARKING.reset(token)
    with _lock:
      _patched -= 1
      if _patched == 0:
        jax.grad, jax.value_and_grad = jax_grad, jax_value_and_grad
        for namespace, name, value in _rebound:
          if namespace.get(name) is _MARKING_OF[id(value)][1]:
            namespace[name] = value
        _rebound.clear()
        for cell, value in _recelled:
          if cell.cell_contents is _MARKING_OF[id(value)][1]:
            cell.cell_contents = value
        _recelled.clear()


def _functions(fun) -> list:
  """The Python functions ``fun`` is or wraps (``functools.partial``, ``__wrapped__`` as
  ``jax.jit`` sets it, a bound method's function)."""
  out, seen = [], set()
  while fun is not None and id(fun) not in seen:
    seen.add(id(fun))
    if isinstance(fun, functools.partial):
      fun = fun.func
      continue
    fun = getattr(fun, "__func__", fun)
    out.append(fun)
    fun = getattr(fun, "__wrapped__", None)
  return out


def _module_namespaces(fun) -> list[dict]:
  """The globals of the Python functions ``fun`` is or wraps."""
  namespaces = []
  for f in _functions(fun):
    namespace = getattr(f, "__globals__", None)
    if (isinstance(namespace, dict) and namespace is not globals()
        and all(namespace is not n for n in namespaces)):
      namespaces.append(namespace)
  return namespaces


def _closure_cells(fun) -> list:
  """The closure cells of the Python functions ``fun`` is or wraps: a step made by a
  factory that was handed ``jax.value_and_grad`` (``make_step(jax.value_and_grad)``)."""
  return [cell for f in _functions(fun) for cell in (getattr(f, "__closure__", None) or ())]


def _marking(marked: Callable, plain: Callable) -> Callable:
  """``plain`` (jax's transform), or ``marked`` (jaxdist's) where a trace marks."""

  @functools.wraps(plain)
  def transform(fun, *args, **kwargs):
    plain_fun = plain(fun, *args, **kwargs)  # (jax checks the arguments)

    @functools.wraps(plain_fun)
    def run(*a, **kw):
      calls = _MARKING.get()
      if calls is None or calls.inside or len(args) > 2:  # (holomorphic=... by position)
        return plain_fun(*a, **kw)
      calls.count += 1
      calls.inside = True
      try:
        return marked(fun, *args, **kwargs)(*a, **kw)
      finally:
        calls.inside = False

    return run

  return transform


_MARKING_GRAD = _marking(grad, jax_grad)
_MARKING_VALUE_AND_GRAD = _marking(value_and_grad, jax_value_and_grad)
_MARKING_OF = {id(jax_grad): (jax_grad, _MARKING_GRAD),
               id(jax_value_and_grad): (jax_value_and_grad, _MARKING_VALUE_AND_GRAD)}
