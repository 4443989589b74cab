"""Capture the differentiated loss of a step, so that a pipeline can run it by stages.

While ``PipeshardParallel`` traces a step, ``jaxdist.value_and_grad(loss_fn)(params)``
does not differentiate: it traces ``loss_fn`` forward only and binds one
``pipeline_loss`` equation whose operands are every value ``loss_fn`` closes over
(batch slices, RNG keys, ...) followed by the differentiated leaves, and whose results
are the value, the aux leaves and the gradients. In the step's jaxpr that equation
separates the part before (computing the loss's inputs) from the part after (the
optimizer update), and its ``loss`` parameter holds the forward jaxpr the pipeline
splits into stages. Outside a pipeline trace the primitive lowers to the plain
``jax.value_and_grad`` of that jaxpr, so the step stays an ordinary JAX function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.extend.core as jex
from jax.interpreters import batching, mlir

from jaxdist import errors, jaxpr_util

VALUE, AUX, GRAD = "value", "aux", "grad"


@dataclasses.dataclass(frozen=True, eq=False)
class CapturedLoss:
  """The forward of a differentiated loss (hashed by identity, as a primitive parameter).

  Attributes:
    closed: the loss on flat inputs: ``num_consts`` closed-over values, then the
      differentiated leaves; outputs: the value, then the aux leaves.
    num_consts: how many leading inputs are closed-over values (not differentiated).
    kinds: per result of the ``pipeline_loss`` equation, "value", "aux" or "grad".
  """

  closed: jex.ClosedJaxpr
  num_consts: int
  kinds: tuple[str, ...]

  def value_and_grad(self, *operands):
    """The results of the equation: value, aux leaves, gradients (plain JAX)."""
    consts, diff = operands[:self.num_consts], operands[self.num_consts:]
    num_aux = self.kinds.count(AUX)

    def loss(diff_leaves):
      outs = jaxpr_util.eval_closed(self.closed, (*consts, *diff_leaves))
      return outs[0], outs[1:1 + num_aux]

    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(list(diff))
    return [value, *aux, *grads]


pipeline_loss_p = jex.Primitive("jaxdist_pipeline_loss")
pipeline_loss_p.multiple_results = True
pipeline_loss_p.def_impl(lambda *xs, loss: loss.value_and_grad(*xs))


def _abstract(*avals, loss):
  outs = loss.closed.out_avals
  return [outs[0], *outs[1:], *avals[loss.num_consts:]]


pipeline_loss_p.def_abstract_eval(_abstract)


def _vmapped(*args, **kwargs):
  raise errors.GradientMarkerError(
      "PipeshardParallel pipelines the function the step differentiates, and this step "
      "differentiates it under jax.vmap (per-example gradients, as DP-SGD takes them): a "
      "pipeline cannot split a vmapped gradient into stages. Use DataParallel, ZeRO or "
      "ShardParallel for this step.")


batching.primitive_batchers[pipeline_loss_p] = _vmapped
mlir.register_lowering(pipeline_loss_p, mlir.lower_fun(
    lambda *xs, loss: loss.value_and_grad(*xs), multiple_results=True))

_CAPTURING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdist_pipeline",
                                                                  default=False)


@contextlib.contextmanager
def capturing():
  """Makes jaxdist.grad / value_and_grad traced inside bind ``pipeline_loss``."""
  token = _CAPTURING.set(True)
  try:
    yield
  finally:
    _CAPTURING.reset(token)


def active() -> bool:
  return _CAPTURING.get()


def captured_value_and_grad(fun, argnums, has_aux: bool, args, kwargs):
  """``((value, aux), grads)`` of ``fun(*args, **kwargs)`` through one ``pipeline_loss``."""
  argnums_t = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  diff = [args[i] for i in argnums_t]
  diff_leaves, diff_tree = jax.tree.flatten(diff)
  out_info = {}

  def forward(*leaves):
    full = list(args)
    for i, value in zip(argnums_t, diff_tree.unflatten(leaves)):
      full[i] = value
    out = fun(*full, **kwargs)
    value, aux = out if has_aux else (out, None)
    aux_leaves, out_info["aux_tree"] = jax.tree.flatten(aux)
    return [value, *aux_leaves]

  from jaxdist.pipeline.layers import hoist_boundaries

  # Jitted helpers inlined and boundaries hoisted out of remat'd blocks: the layer
  # construction sees the whole forward pass.
  closed = hoist_boundaries(jaxpr_util.inline_calls(
      jax.make_jaxpr(forward)(*[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in diff_leaves])))
  # The closed-over values become leading operands of the equation.
  open_jaxpr = closed.jaxpr.replace(constvars=[],
                                   invars=[*closed.jaxpr.constvars, *closed.jaxpr.invars])
  num_aux = len(closed.jaxpr.outvars) - 1
  kinds = (VALUE,) + (AUX,) * num_aux + (GRAD,) * len(diff_leaves)
  loss = CapturedLoss(jex.ClosedJaxpr(open_jaxpr, ()), len(closed.consts), kinds)
  outs = pipeline_loss_p.bind(*closed.consts, *diff_leaves, loss=loss)
  value, aux = outs[0], out_info["aux_tree"].unflatten(outs[1:1 + num_aux])
  grads = diff_tree.unflatten(outs[1 + num_aux:])
  grads = grads[0] if isinstance(argnums, int) else tuple(grads)
  return (value, aux), grads
