"""Layer construction: where a forward function splits into pipeline layers.

Manual: ``jaxdist.mark_pipeline_boundary()`` inside the forward function, and
``jaxdist.manual_layer_construction(fun)``. Automatic:
``jaxdist.automatic_layer_construction(fun, layer_num=...)`` clusters the equations of
``fun``'s jaxpr into ``layer_num`` contiguous layers (Alpa's algorithm, see
:func:`cluster_layers`).

Either way the wrapped function traces ``fun`` once, then evaluates its jaxpr layer by
layer: with ``remat_layer=True`` each layer runs under
:func:`jaxdist.recompute.tied_checkpoint` (only its inputs are saved, its activations
are recomputed in the backward pass), and between layers a *layer marker* (an
identity over the values that cross the boundary) records the layers in the step's
jaxpr for the pipeline planner.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend.core as jex
import numpy as np
from jax.interpreters import ad, batching, mlir

from jaxdist import errors
from jaxdist import jaxpr_util
from jaxdist.recompute import tied_checkpoint

# mark_pipeline_boundary(): no operands, no results; lowers to nothing.
boundary_p = jex.Primitive("jaxdist_pipeline_boundary")
boundary_p.multiple_results = True
boundary_p.def_impl(lambda: [])
boundary_p.def_abstract_eval(lambda: [])
mlir.register_lowering(boundary_p, lambda ctx: [])
batching.primitive_batchers[boundary_p] = lambda args, dims: ([], [])
ad.primitive_jvps[boundary_p] = lambda primals, tangents: (boundary_p.bind(), [])

# The values crossing into layer ``layer``: an identity (tangents pass through unmarked).
layer_marker_p = jaxpr_util.identity_marker(jaxpr_util.MARKERS[1])


@dataclasses.dataclass(frozen=True)
class AutoLayerOption:
  """Automatic layer construction (for ``PipeshardParallel(layer_option=...)``).

  Attributes:
    layer_num: how many layers to cluster the forward pass into.
    remat_layer: recompute each layer's activations in the backward pass.
    eps: a layer may cost up to ``(1 + eps) × total flops / layer_num``.
  """

  layer_num: int
  remat_layer: bool = False
  eps: float = 0.5

  def __post_init__(self):
    if isinstance(self.layer_num, bool) or not isinstance(self.layer_num, int) or self.layer_num < 1:
      raise errors.InvalidArgumentError(
          f"AutoLayerOption(layer_num={self.layer_num!r}) must be an integer >= 1.")
    if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
      raise errors.InvalidArgumentError(
          f"AutoLayerOption(eps={self.eps!r}) must be a number >= 0.")


@dataclasses.dataclass(frozen=True)
class Layers:
  """A split of a jaxpr's equations into contiguous layers.

  Attributes:
    starts: index of each layer's first equation (``starts[0] == 0``).
    flops: per layer, its dot and convolution flops.
    in_bytes: per layer, bytes of values computed by earlier layers that cross into it
      or past it (the activations a pipeline stage boundary there would send).
  """

  starts: tuple[int, ...]
  flops: tuple[float, ...]
  in_bytes: tuple[float, ...]


def mark_pipeline_boundary() -> None:
  """Marks a pipeline layer boundary at this point of the forward function.

  Takes effect inside :func:`manual_layer_construction`; elsewhere it does nothing.
  """
  boundary_p.bind()


def var_bytes(v) -> float:
  aval = v.aval
  return float(math.prod(getattr(aval, "shape", ())) * getattr(getattr(aval, "dtype", None),
                                                                "itemsize", 4))


def crossing_bytes(jaxpr) -> np.ndarray:
  """``c[j]``: bytes of values defined by equations before ``j`` and used at ``j`` or later
  (equation inputs or the jaxpr's outputs); ``c[0] = 0``. Inputs of the jaxpr are not
  counted: every layer can read them."""
  n = len(jaxpr.eqns)
  last = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jex.Literal):
        last[v] = i
  for v in jaxpr.outvars:
    if not isinstance(v, jex.Literal):
      last[v] = n
  diff = np.zeros(n + 2)
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      if v in last and last[v] > i:
        diff[i + 1] += var_bytes(v)
        diff[last[v] + 1] -= var_bytes(v)
  return np.cumsum(diff)[:n + 1]


def cluster_layers(jaxpr, layer_num: int, eps: float = 0.5) -> Layers:
  """Splits ``jaxpr``'s equations into ``layer_num`` contiguous, non-empty layers.

  Alpa's layer clustering: with ``avg = total / layer_num`` flops (dots and
  convolutions; if the jaxpr has none, every equation costs 1), a layer must cost
  between ``avg / (1 + eps)`` and ``(1 + eps) · avg`` (the upper bound is raised to the
  costliest single equation if that alone exceeds it; the lower bound is dropped if no
  split meets it, and the upper bound raised to the most balanced split's if none meets
  it either: three dots of 1, 4 and 1 units in two layers). Among the splits within the bounds a dynamic program minimizes the
  largest number of bytes crossing a boundary, then their sum::

      f[l][i] = min over j < i with cost(j..i) in bounds of  max(f[l-1][j], c[j])

  where ``c[j]`` is :func:`crossing_bytes` at boundary ``j``.

  Raises:
    InvalidArgumentError: more layers than equations.
  """
  n = len(jaxpr.eqns)
  if layer_num > n:
    raise errors.InvalidArgumentError(
        f"layer_num={layer_num} is more than the forward function's {n} equations; use at "
        f"most {n} layers.")
  cost = np.array([jaxpr_util.eqn_flops(e) for e in jaxpr.eqns])
  if not cost.any():
    cost = np.ones(n)
  prefix = np.concatenate(([0.0], np.cumsum(cost)))
  avg = prefix[-1] / layer_num
  high = max((1 + eps) * avg, float(cost.max()))
  cross = crossing_bytes(jaxpr)
  starts = _layer_dp(prefix, cross, layer_num, high, avg / (1 + eps))
  if starts is None:
    starts = _layer_dp(prefix, cross, layer_num, high, 0.0)
  if starts is None:  # no split within the upper bound: the most balanced one's bound
    starts = _layer_dp(prefix, cross, layer_num, _balanced_bound(cost, layer_num), 0.0)
  ends = starts[1:] + (n,)
  return Layers(starts, tuple(float(prefix[e] - prefix[s]) for s, e in zip(starts, ends)),
                tuple(float(cross[s]) if s else 0.0 for s in starts))


def _balanced_bound(cost, layer_num: int) -> float:
  """The smallest largest-layer cost of a split into ``layer_num`` contiguous layers
  (bisection on the bound; a bound is feasible if greedy packing needs at most
  ``layer_num`` layers), slightly raised so that the split itself meets it."""
  def layers_needed(bound):
    count, total = 1, 0.0
    for c in cost:
      if total + c > bound:
        count, total = count + 1, 0.0
      total += c
    return count

  low, high = float(cost.max()), float(cost.sum())
  for _ in range(60):
    mid = (low + high) / 2
    low, high = (low, mid) if layers_needed(mid) <= layer_num else (mid, high)
  return high * (1 + 1e-9) + 1e-9


def _layer_dp(prefix, cross, layer_num, high, low) -> tuple[int, ...] | None:
  n = len(prefix) - 1
  tol = 1e-9 * max(prefix[-1], 1.0)
  best_max = np.full((layer_num + 1, n + 1), np.inf)
  best_sum = np.full((layer_num + 1, n + 1), np.inf)
  arg = np.zeros((layer_num + 1, n + 1), dtype=np.int64)
  best_max[0, 0] = best_sum[0, 0] = 0.0
  # The layer [j, i) is within bounds for first[i] <= j <= last[i] (prefix is sorted).
  first = np.searchsorted(prefix, prefix - high - tol, side="left")
  last = np.searchsorted(prefix, prefix - low + tol, side="right") - 1
  for layer in range(1, layer_num + 1):
    for i in range(layer, n + 1):
      j0, j1 = max(first[i], layer - 1), min(last[i], i - 1) + 1  # non-empty layers
      if j0 >= j1:
        continue
      js = np.arange(j0, j1)
      at = np.where(js > 0, cross[js], 0.0)
      m = np.maximum(best_max[layer - 1, j0:j1], at)
      s = best_sum[layer - 1, j0:j1] + at
      k = np.lexsort((s, m))[0]
      if np.isfinite(m[k]):
        best_max[layer, i], best_sum[layer, i], arg[layer, i] = m[k], s[k], js[k]
  if not np.isfinite(best_max[layer_num, n]):
    return None
  starts, i = [], n
  for layer in range(layer_num, 0, -1):
    i = int(arg[layer, i])
    starts.append(i)
  return tuple(reversed(starts))


def _trace(fun, args):
  leaves, tree = jax.tree.flatten(args)
  out_tree = {}

  def flat(*xs):
    out, out_tree["tree"] = jax.tree.flatten(fun(*tree.unflatten(xs)))
    return out

  closed = jax.make_jaxpr(flat)(*[jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))
                                  for x in leaves])
  return hoist_boundaries(jaxpr_util.inline_calls(closed)), leaves, out_tree["tree"]


def _segments(jaxpr, starts, skip=frozenset()):
  """Per run ``[start, next start)`` of equations (``skip`` dropped): its equation ids, the
  values it reads from before it, and the values it defines that are read after it."""
  ends = tuple(starts[1:]) + (len(jaxpr.eqns),)
  for start, end in zip(starts, ends):
    ids = [i for i in range(start, end) if i not in skip]
    defined = {v for i in ids for v in jaxpr.eqns[i].outvars}
    later = {v for i in range(end, len(jaxpr.eqns)) for v in jaxpr.eqns[i].invars
             if not isinstance(v, jex.Literal)}
    later |= {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    needed = []
    for i in ids:
      for v in jaxpr.eqns[i].invars:
        if not isinstance(v, jex.Literal) and v not in defined and v not in needed:
          needed.append(v)
    live_out = [v for v in dict.fromkeys(v for i in ids for v in jaxpr.eqns[i].outvars)
                if v in later and not isinstance(v, jex.DropVar)]
    yield ids, needed, live_out


def _segment_fn(jaxpr, ids, needed, live_out):
  def run(*values):
    local = dict(zip(needed, values))
    jaxpr_util.eval_eqns(jaxpr, local, ids)
    return [local[v] for v in live_out]

  return run


def run_layers(closed, leaves, starts: tuple[int, ...], remat_layer: bool,
               skip: frozenset[int] = frozenset()) -> list:
  """Evaluates ``closed`` on ``leaves`` layer by layer (equations in ``skip`` dropped),
  marking the values that cross each boundary and, with ``remat_layer``, recomputing
  each layer in the backward pass. Returns the outputs."""
  jaxpr = closed.jaxpr
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, leaves))
  for index, (ids, needed, live_out) in enumerate(_segments(jaxpr, starts, skip)):
    layer_fn = _segment_fn(jaxpr, ids, needed, live_out)
    values = [env[v] for v in needed]
    outs = tied_checkpoint(layer_fn, *values) if remat_layer and ids else layer_fn(*values)
    if index + 1 < len(starts) and outs:
      outs = layer_marker_p.bind(*outs, layer=index + 1)
    env.update(zip(live_out, outs))
  return [jaxpr_util.read(env, v) for v in jaxpr.outvars]


CHECKPOINTS = ("remat2", "checkpoint")


def _has_boundary(jaxpr) -> bool:
  return jaxpr_util.count_primitive(jaxpr, boundary_p.name) > 0


def hoist_boundaries(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
  """The same function with its :func:`mark_pipeline_boundary` calls at the top level.

  A call (``jax.jit``, flax/nnx jitted helpers) that contains a boundary is inlined; a
  checkpointed body (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``) that contains one
  is split there into checkpointed parts with the same policy, so recomputation still
  applies on both sides. Boundaries inside loops or conds stay where they are (a
  boundary cannot cut a loop).
  """
  jaxpr = closed.jaxpr
  if jaxpr_util.count_primitive(jaxpr, boundary_p.name) == len(jaxpr_util.find_eqns(
      jaxpr, boundary_p.name)):
    return closed  # none, or all at the top level already

  def run(*args):
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    _eval_hoisting(jaxpr, env)
    return [jaxpr_util.read(env, v) for v in jaxpr.outvars]

  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in jaxpr.invars]
  return jax.make_jaxpr(run)(*specs)


def _eval_hoisting(jaxpr, env) -> None:
  for eqn in jaxpr.eqns:
    invals = [jaxpr_util.read(env, v) for v in eqn.invars]
    name = eqn.primitive.name
    sub = jaxpr_util.call_body(eqn) if name in jaxpr_util.CALLS else None
    if sub is not None and _has_boundary(sub.jaxpr):
      inner = dict(zip(sub.jaxpr.constvars, sub.consts))
      inner.update(zip(sub.jaxpr.invars, invals))
      _eval_hoisting(sub.jaxpr, inner)
      outs = [jaxpr_util.read(inner, v) for v in sub.jaxpr.outvars]
    elif name in CHECKPOINTS and _has_boundary(eqn.params["jaxpr"]):
      outs = _split_checkpoint(eqn, invals)
    else:
      outs = jaxpr_util.bind_eqn(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jex.DropVar):
        env[v] = x


def _split_checkpoint(eqn, invals) -> list:
  body = eqn.params["jaxpr"]
  body = hoist_boundaries(body if isinstance(body, jex.ClosedJaxpr) else jex.ClosedJaxpr(body, ()))
  jaxpr = body.jaxpr
  env = dict(zip(jaxpr.constvars, body.consts))
  env.update(zip(jaxpr.invars, invals))
  marks = jaxpr_util.find_eqns(jaxpr, boundary_p.name)
  starts = tuple(dict.fromkeys([0] + [m + 1 for m in marks if m + 1 < len(jaxpr.eqns)]))
  for index, (ids, needed, live_out) in enumerate(_segments(jaxpr, starts, frozenset(marks))):
    if index:  # the boundary that ended the previous part
      boundary_p.bind()
    if not ids:
      continue
    part = jax.checkpoint(_segment_fn(jaxpr, ids, needed, live_out),
                          prevent_cse=eqn.params.get("prevent_cse", True),
                          policy=eqn.params.get("policy"))
    env.update(zip(live_out, part(*[env[v] for v in needed])))
  return [jaxpr_util.read(env, v) for v in jaxpr.outvars]


def automatic_layer_construction(fun=None, *, layer_num: int, remat_layer: bool = False,
                                 eps: float = 0.5):
  """``fun`` split into ``layer_num`` layers by :func:`cluster_layers`.

  Use it on the function you differentiate (the loss), inside the train step:
  ``jd.value_and_grad(jd.automatic_layer_construction(loss_fn, layer_num=4))``.

  Args:
    fun: the forward function; omit it to get a decorator.
    layer_num: the number of layers.
    remat_layer: recompute each layer's activations in the backward pass.
    eps: balance tolerance of the layers' flops (see :func:`cluster_layers`).

  Raises:
    InvalidArgumentError: ``layer_num`` or ``eps`` is invalid, or ``layer_num`` exceeds
      the number of equations (when traced).
  """
  option = AutoLayerOption(layer_num, remat_layer, eps)
  if fun is None:
    return lambda f: automatic_layer_construction(f, layer_num=layer_num,
                                                  remat_layer=remat_layer, eps=eps)

  def run(*args):
    closed, leaves, out_tree = _trace(fun, args)
    layers = cluster_layers(closed.jaxpr, option.layer_num, option.eps)
    return out_tree.unflatten(run_layers(closed, leaves, layers.starts, option.remat_layer))

  return run


def resolve_layer_option(layer_option, jaxpr):
  """``PipeshardParallel.layer_option`` for the loss ``jaxpr``: as given, or for the
  default (None) ``"manual"`` where the forward pass marks boundaries (also only inside a
  loop, so that the error says why they cannot cut it) and else Alpa's default,
  ``AutoLayerOption(layer_num=2)``."""
  if layer_option is not None:
    return layer_option
  marked = (jaxpr_util.find_eqns(jaxpr, boundary_p.name)
            or jaxpr_util.find_eqns(jaxpr, layer_marker_p.name) or _has_boundary(jaxpr))
  return "manual" if marked else AutoLayerOption(layer_num=2)


def manual_starts(jaxpr, owner: str) -> tuple[int, ...]:
  """The first equation of each layer when ``jaxpr`` is cut at its boundary markers.

  Raises:
    InvalidArgumentError: ``jaxpr`` has no boundary marker (``owner`` names the caller).
  """
  marks = jaxpr_util.find_eqns(jaxpr, boundary_p.name)
  if marks:
    return tuple(dict.fromkeys([0] + [m + 1 for m in marks if m + 1 < len(jaxpr.eqns)]))
  # Layers already made by manual_/automatic_layer_construction: each starts at its marker.
  layer_marks = jaxpr_util.find_eqns(jaxpr, layer_marker_p.name)
  if layer_marks:
    return tuple(dict.fromkeys([0] + layer_marks))
  where = ("; it is called inside a loop or cond, which a boundary cannot cut"
           if _has_boundary(jaxpr) else "")
  raise errors.InvalidArgumentError(
      f"{owner}: the function marks no layer boundary{where}; call "
      f"jaxdist.mark_pipeline_boundary() between layers of its forward pass (anywhere in "
      f"it, also inside modules, jitted helpers and remat'd blocks; not inside a loop), or "
      f"cut it automatically (jaxdist.automatic_layer_construction, AutoLayerOption).")


def manual_layer_construction(fun=None, *, remat_layer: bool = False):
  """``fun`` split into layers at its :func:`mark_pipeline_boundary` calls.

  Raises:
    InvalidArgumentError: ``fun`` marks no boundary (when traced).
  """
  if fun is None:
    return lambda f: manual_layer_construction(f, remat_layer=remat_layer)

  def run(*args):
    closed, leaves, out_tree = _trace(fun, args)
    starts = manual_starts(closed.jaxpr, f"manual_layer_construction("
                           f"{getattr(fun, '__name__', fun)!r})")
    marks = jaxpr_util.find_eqns(closed.jaxpr, boundary_p.name)
    return out_tree.unflatten(run_layers(closed, leaves, starts, remat_layer, frozenset(marks)))

  return run
