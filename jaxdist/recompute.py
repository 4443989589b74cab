"""Recomputation of chosen modules' activations in the backward pass.

``recompute_modules`` (as in nnScaler) is a comma-separated list of module names. A
name matches a flax linen module whose path ends with it (``block_0``,
``block_0/Dense_1``) or whose class is called so (``Block``); ``ROOT`` recomputes the
whole function being differentiated. It is applied by :func:`jaxdist.value_and_grad`
while jaxdist traces the step: the matching module calls are wrapped in
:func:`tied_checkpoint`.

Why not plain ``jax.checkpoint``: its recomputation depends only on the saved inputs,
and ``jax.checkpoint`` orders it after the forward pass with an optimization barrier.
XLA:CPU removes such barriers before it schedules (measured on jax 0.10.2), so every
block's recomputation could run as soon as the forward finished, and nothing was saved
(a depth-8 GPT: 309 MB of temporaries with or without it). :func:`tied_checkpoint`
makes the recomputation data-dependent on the incoming cotangent instead (adding
``0 × one cotangent element``, which XLA does not fold for floats), so it can only run
when the backward pass reaches the block: 47 MB on the same GPT.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from jaxdist import errors

ROOT = "ROOT"


@dataclasses.dataclass
class RecomputeRequest:
  """What to recompute during one trace, and what the trace saw (for error messages)."""

  names: tuple[str, ...]
  matched: set = dataclasses.field(default_factory=set)
  seen: dict = dataclasses.field(default_factory=dict)
  _inside: bool = False

  @classmethod
  def parse(cls, spec: str, owner: str) -> "RecomputeRequest":
    if not isinstance(spec, str) or not [n for n in spec.split(",") if n.strip()]:
      raise errors.InvalidArgumentError(
          f"{owner}(recompute_modules={spec!r}): give a comma-separated string of module names "
          f"(flax module path suffixes or class names), or 'ROOT' for the whole model.")
    return cls(tuple(n.strip() for n in spec.split(",") if n.strip()))

  def check_all_matched(self, owner: str) -> None:
    """Raises InvalidArgumentError naming the names that matched no module."""
    missing = [n for n in self.names if n not in self.matched]
    if not missing:
      return
    if self.seen:
      known = ", ".join(f"{path or '<root>'} ({cls})" for path, cls in list(self.seen.items())[:40])
    else:
      known = ("none: the differentiated function calls no flax linen module (use 'ROOT', or "
               "nnx.remat / jax.checkpoint in the model)")
    raise errors.InvalidArgumentError(
        f"{owner}(recompute_modules=...): {', '.join(map(repr, missing))} matched no module "
        f"called under jaxdist.grad / value_and_grad. Modules that exist: {known}.")

  def interceptor(self, next_fun, args, kwargs, context):
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    path = "/".join(context.module.path)
    cls = type(context.module).__name__
    self.seen.setdefault(path, cls)
    hits = [n for n in self.names if n in (cls, path) or path.endswith("/" + n)]
    if self._inside or not hits:
      return next_fun(*args, **kwargs)
    self.matched.update(hits)
    self._inside = True
    try:
      return tied_checkpoint(lambda *a: next_fun(*a, **kwargs), *args)
    finally:
      self._inside = False


_ACTIVE: contextvars.ContextVar[RecomputeRequest | None] = contextvars.ContextVar(
    "jaxdist_recompute", default=None)


@contextlib.contextmanager
def recomputing(request: RecomputeRequest | None):
  """Makes ``request`` apply to jaxdist.grad / value_and_grad calls traced inside."""
  token = _ACTIVE.set(request)
  try:
    yield request
  finally:
    _ACTIVE.reset(token)


def with_recompute(fun):
  """``fun`` with the active recompute request applied (a no-op without one)."""

  def run(*args, **kwargs):
    request = _ACTIVE.get()
    if request is None:
      return fun(*args, **kwargs)
    if ROOT in request.names:
      request.matched.add(ROOT)
      return tied_checkpoint(lambda *a: fun(*a, **kwargs), *args)
    from flax import linen as nn

    with nn.intercept_methods(request.interceptor):
      return fun(*args, **kwargs)

  return run


def tied_checkpoint(f, *args):
  """``f(*args)``, saving only its inputs; the backward pass recomputes ``f``.

  The recomputation reads the inputs plus ``0 × (first cotangent element)``, so it
  cannot be scheduled before the cotangent exists (see the module docstring). Values
  ``f`` closes over (flax parameters) are hoisted by ``jax.closure_convert`` and get
  their gradients too. Non-array arguments are closed over.
  """
  leaves, tree = jax.tree.flatten(args)
  is_arr = [isinstance(x, jax.Array) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_arr) if a]

  def on_arrays(*arrs):
    it = iter(arrs)
    return f(*tree.unflatten([next(it) if a else x for x, a in zip(leaves, is_arr)]))

  converted, consts = jax.closure_convert(on_arrays, *arrays)
  num_args = len(arrays)

  @jax.custom_vjp
  def checkpointed(*xs):
    return converted(*xs)

  def fwd(*xs):
    return converted(*xs), xs

  def bwd(xs, cotangent):
    zero = jax.tree.leaves(cotangent)[0].reshape(-1)[0] * 0
    tie = lambda x: x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x
    float_args = any(jnp.issubdtype(x.dtype, jnp.inexact) for x in xs[:num_args])
    tied = [tie(x) if (k < num_args or not float_args) else x for k, x in enumerate(xs)]
    _, vjp = jax.vjp(converted, *tied)
    return vjp(cotangent)

  checkpointed.defvjp(fwd, bwd)
  return checkpointed(*arrays, *consts)
