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
``0 × cotangent``, which XLA does not fold for floats), so it can only run
when the backward pass reaches the block: 47 MB on the same GPT.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxdist import errors, jaxpr_util

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
        f"in the function the step differentiates. Modules that exist: {known}.")

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

  The recomputation reads the inputs tied to the first cotangent (:func:`_tie_all`), so
  it cannot be scheduled before the cotangent exists (see the module docstring); so does
  a random key it closes over. Values ``f`` closes over (flax parameters, keys) become
  inputs, and parameters get their gradients too. Non-array arguments are closed over.
  """
  leaves, tree = jax.tree.flatten(args)
  is_arr = [isinstance(x, jax.Array) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_arr) if a]

  def on_arrays(*arrs):
    it = iter(arrs)
    return f(*tree.unflatten([next(it) if a else x for x, a in zip(leaves, is_arr)]))

  # Every value f closes over becomes an input (jax.closure_convert would hoist only the
  # floats: a random key would stay a constant of the recomputation, out of the tie's reach).
  closed, out_shape = jax.make_jaxpr(on_arrays, return_shape=True)(*arrays)
  jaxpr, consts = closed.jaxpr, list(closed.consts)
  num_args = len(arrays)

  def converted(*xs):  # the arguments, then what f closes over
    env = dict(zip([*jaxpr.invars, *jaxpr.constvars], xs))
    jaxpr_util.eval_eqns(jaxpr, env)
    return jax.tree.unflatten(jax.tree.structure(out_shape),
                              [jaxpr_util.read(env, v) for v in jaxpr.outvars])

  @jax.custom_vjp
  def checkpointed(*xs):
    return converted(*xs)

  def fwd(*xs):
    return converted(*xs), xs

  def bwd(xs, cotangent):
    float_args = any(jnp.issubdtype(x.dtype, jnp.inexact) for x in xs[:num_args])
    pick = [k < num_args or not float_args or _is_key(x) for k, x in enumerate(xs)]
    tied = iter(_tie_all([x for x, p in zip(xs, pick) if p], jax.tree.leaves(cotangent)[0]))
    _, vjp = jax.vjp(converted, *[next(tied) if p else x for x, p in zip(xs, pick)])
    return vjp(cotangent)

  checkpointed.defvjp(fwd, bwd)
  return checkpointed(*arrays, *consts)


def _is_key(x) -> bool:
  """A random key: typed (``jax.random.key``) or raw (``uint32``, ``jax.random.PRNGKey``)."""
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or x.dtype == jnp.uint32


def _tie_all(xs, c) -> list:
  """Each of ``xs`` made to depend on the cotangent ``c`` without changing it: ``x + 0 ×
  c`` elementwise where ``x`` is a float of ``c``'s shape (a block's input, split as its
  cotangent is, so no device needs another's part); a float with ``c``'s dim 0 plus ``0 ×
  c`` summed over its other dims, one zero per row (a residual a checkpoint policy saved,
  attention scores say: split over the batch as ``c`` is); else :func:`_tied` to ``0 ×
  c[0, ..., 0]``. Tied to that element, ShardParallel gathered each block's batch-split
  cotangent whole (a 4-block GPT: 4 all-gathers of 1 MB per step); tied to ``max(0 ×
  c)``, a reduction over the batch, the step read as one mixing examples (``coupling``)."""
  zero, rows = None, None
  out = []
  for x in xs:
    floating = jnp.issubdtype(x.dtype, jnp.inexact)
    if x.shape == c.shape and floating:
      out.append(x + (c * 0).astype(x.dtype))
      continue
    if floating and x.ndim and c.ndim and x.shape[0] == c.shape[0]:
      if rows is None:  # one zero per row of dim 0 (the batch's, where both have it)
        rows = jnp.sum(c * 0, axis=tuple(range(1, c.ndim)))
      out.append(x + rows.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype))
      continue
    if zero is None:
      zero = jax.lax.reshape(jax.lax.slice(c, (0,) * c.ndim, (1,) * c.ndim), ()) * 0
    out.append(_tied(x, zero))
  return out


def _tied(x, zero):
  """``x`` made to depend on ``zero`` (``0 × a cotangent element``) without changing it:
  a float plus it, an integer or a key plus ``(zero == 1)``, which is never true (0 × c is
  0 or NaN) and which XLA cannot fold. A key matters: the dropout draws of a recomputed
  block depend only on it, and XLA:CPU could otherwise generate every recomputed block's
  bits at the start of the backward pass and keep them (with ``jaxdist.rng``'s anchors,
  a ViT with dropout under ZeRO-3 and recomputed blocks: 59.5 MB per device, 34.5 with)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return x + zero.astype(x.dtype)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(x)
    return jax.random.wrap_key_data(data + (zero == 1).astype(data.dtype),
                                    impl=jax.random.key_impl(x))
  if jnp.issubdtype(x.dtype, jnp.integer):
    return x + (zero == 1).astype(x.dtype)
  return x


def tie_recomputations(closed, in_loops: bool = False):
  """``closed`` with every recomputation of a ``jax.checkpoint`` / ``nn.remat`` block in
  the backward pass tied to its incoming cotangent, as :func:`tied_checkpoint` ties
  jaxdist's own (see the module docstring).

  Such a recomputation is a differentiated ``remat2`` equation with ``prevent_cse``;
  jax puts the cotangents last among its operands (``ad_checkpoint.remat_transpose``),
  so its last operand is one. The operands the step computes (activations; not its
  inputs, whose recomputation such as a weight's transpose is cheap) are replaced by
  tied copies (:func:`_tie_all`). Without this, XLA:CPU recomputed every block right
  after the forward pass and a model written with ``nn.remat`` kept all its activations
  (a 4-block GPT: the same temporaries as without ``nn.remat`` under DataParallel,
  ZeRO-3 and ShardParallel; tied, 0.34x, 0.34x and 0.36x of them).

  Equations at the top level only, unless ``in_loops``: one inside a loop already waits
  for its iteration of the backward pass. A loop the step will compile unrolled (the
  shard planner's, with micro-batches) is no loop: with ``in_loops`` the recomputations
  in scan bodies are tied too, every operand but the cotangent and the scan's constants
  (a layer's weights sliced from ``nn.scan``'s stacked parameters included). Untied, a
  4-layer ``nn.scan(nn.remat(Block))`` GPT under ShardParallel with 2 micro-batches
  compiled to 22.9 MB per device against 17.3 MB with one."""
  jaxpr = closed.jaxpr
  produced = {o for e in jaxpr.eqns for o in e.outvars}
  eqns = _tied_eqns(jaxpr.eqns, lambda v: v in produced, in_loops)
  if eqns is jaxpr.eqns:
    return closed
  return jex.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _tied_eqns(eqns: list, tied, in_loops: bool) -> list:
  """``eqns`` with their recomputations' operands where ``tied(operand)`` tied to the
  cotangent (see :func:`tie_recomputations`); ``eqns`` itself if none is."""
  out, changed = [], False
  for eqn in eqns:
    if in_loops and eqn.primitive.name == "scan":
      body = eqn.params["jaxpr"]
      consts = set(body.jaxpr.invars[:eqn.params["num_consts"]])
      inner = _tied_eqns(body.jaxpr.eqns, lambda v, c=consts: v not in c, True)
      if inner is not body.jaxpr.eqns:
        body = jex.ClosedJaxpr(body.jaxpr.replace(eqns=inner), body.consts)
        eqn = eqn.replace(params=dict(eqn.params, jaxpr=body))
        changed = True
    elif _recomputation(eqn):
      *rest, cotangent = eqn.invars
      tie = [k for k, v in enumerate(rest) if not isinstance(v, jex.Literal)
             and tied(v) and v is not cotangent]
      if tie and not isinstance(cotangent, jex.Literal) and math.prod(
          cotangent.aval.shape) and jnp.issubdtype(cotangent.aval.dtype, jnp.inexact):
        call = _tie_call(cotangent.aval, tuple(rest[k].aval for k in tie))
        outs = [jex.Var(rest[k].aval) for k in tie]
        out.append(jex.new_jaxpr_eqn(
            [cotangent, *(rest[k] for k in tie)], outs, call.primitive, call.params,
            call.effects, eqn.source_info, eqn.ctx))
        invars = list(eqn.invars)
        for k, o in zip(tie, outs):
          invars[k] = o
        eqn = eqn.replace(invars=invars)
        changed = True
    out.append(eqn)
  return out if changed else eqns


def _recomputation(eqn) -> bool:
  return (eqn.primitive.name == "remat2" and eqn.params.get("differentiated")
          and eqn.params.get("prevent_cse") and len(eqn.invars) > 1)


@functools.lru_cache(maxsize=256)
def _tie_call(cotangent, avals):
  """A jit call equation computing :func:`_tie_all` of values of ``avals``."""
  def tie(c, *xs):
    return _tie_all(xs, c)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (cotangent, *avals)]
  return jax.make_jaxpr(jax.jit(tie))(*shapes).jaxpr.eqns[0]
