"""Trace a user's step once and describe its inputs and outputs.

The result, :class:`TracedStep`, is what every planner reads: the jaxpr, the pytree
structures, and per input leaf its path, abstract value and role:

- ``batch``: a leaf of a ``batch_argnums`` argument;
- ``param``: state the forward computation consumes (the loss depends on it);
- ``optimizer``: state that is only updated (optimizer moments, step counters);
- ``input``: any other array argument (an RNG key, a learning rate), not returned.

State is told from other inputs by what the step returns: a non-batch argument whose
pytree structure and shapes reappear in the outputs is updated state. Parameters are
told from optimizer state by data flow in the jaxpr, never by names, so any optax
optimizer and any pytree layout works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect as pyinspect
import warnings
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
from jax import tree_util

from jaxdist import errors
from jaxdist import jaxpr_util
from jaxdist.grad import GRAD, PlainCalls, grad_marker_p, marking_jax_grads
from jaxdist.pipeline import capture
from jaxdist.recompute import tie_recomputations

BATCH, PARAM, OPTIMIZER, INPUT = "batch", "param", "optimizer", "input"

_PY_SCALAR_DTYPES = {bool: np.dtype(bool), int: np.dtype(np.int32), float: np.dtype(np.float32),
                     complex: np.dtype(np.complex64)}


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """One array leaf of the step's dynamic arguments."""

  path: str
  shape: tuple[int, ...]
  dtype: Any
  argnum: int
  role: str


@dataclasses.dataclass(frozen=True)
class TracedStep:
  """A step traced once for one abstract signature.

  Attributes:
    closed_jaxpr: the step on flat leaves (dynamic input leaves → output leaves).
    in_tree: treedef of the tuple of dynamic arguments.
    out_tree: treedef of the step's return value.
    inputs: one :class:`LeafInfo` per dynamic input leaf.
    out_avals: abstract value of each output leaf.
    out_paths: path of each output leaf, e.g. ``out[0].params['w']``.
    output_source: per output leaf, the index of the input leaf it is the updated
      value of, or None.
    donated_argnums: original argument numbers whose buffers the step may reuse.
    batch_size: the common dim 0 of the batch leaves (None without batch leaves).
    roles_from_loss: True if parameters were identified through a batch-dependent
      output (the loss); False if the step returns none and every state leaf is
      treated as a parameter.
    depends_on_batch: per output leaf, whether it depends on a batch leaf.
    marker_index: index of the one top-level gradient marker (``jaxdist.grad``) in
      ``closed_jaxpr``, or None.
    num_markers: gradient markers found anywhere in the step (0 without jaxdist.grad).
    unseen_gradients: the step's plain jax.grad / value_and_grad calls that jaxdist traced
      as written (more than one, in a loop or cond, per example or with respect to the
      batch).
    micro_jaxpr: the step traced again with each batch leaf's dim 0 divided by the
      number of micro-batches × batch shards (its gradient part is what runs per
      micro-batch: shapes are baked into a jaxpr), or None.
    micro_marker_index: the marker's index in ``micro_jaxpr``.
  """

  closed_jaxpr: Any
  in_tree: Any
  out_tree: Any
  inputs: tuple[LeafInfo, ...]
  out_avals: tuple[Any, ...]
  out_paths: tuple[str, ...]
  output_source: tuple[int | None, ...]
  donated_argnums: tuple[int, ...]
  batch_size: int | None
  roles_from_loss: bool
  depends_on_batch: tuple[bool, ...]
  marker_index: int | None = None
  num_markers: int = 0
  unseen_gradients: int = 0
  micro_jaxpr: Any = None
  micro_marker_index: int | None = None


@contextlib.contextmanager
def gc_paused():
  """Python's cycle collector off while a step is traced, planned and lowered: those
  phases allocate millions of short-lived objects beside the large jaxprs they walk, and
  the collector's passes over them took ~10% of a GPT's first call (0.3 s of 3.0 s:
  half the lowering, a fifth of the planning). Cycles left meanwhile are collected
  after, as usual; a collector the user turned off stays off."""
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()


def is_array(x) -> bool:
  """An array, or an abstract one (``jax.ShapeDtypeStruct``: traced and planned, not run)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_array_leaf(x) -> bool:
  """A leaf that can be traced: an array, or a Python number inside an array pytree."""
  return is_array(x) or type(x) in _PY_SCALAR_DTYPES


def leaf_signature(x) -> tuple:
  """(shape, dtype) of an array leaf, as the cache key of compiled steps uses it."""
  dtype = _PY_SCALAR_DTYPES.get(type(x))
  if dtype is not None:
    return ((), dtype)
  return (tuple(x.shape), x.dtype)


def arg_names(fun, num_args: int) -> list[str]:
  """Names for the step's positional arguments, from its signature where it has one."""
  try:
    params = [p for p in pyinspect.signature(fun).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  names = [p.name for p in params[:num_args]]
  return names + [f"args[{i}]" for i in range(len(names), num_args)]


def trace_step(fun, args: tuple, static_argnums: tuple[int, ...], batch_argnums: tuple[int, ...],
               donate_argnums: str | tuple[int, ...]) -> TracedStep:
  """Traces ``fun(*args)`` once and classifies its inputs.

  Args:
    fun: the user's step.
    args: the positional arguments of the first call.
    static_argnums: arguments passed as Python values (not traced).
    batch_argnums: arguments whose leaves are split on dim 0.
    donate_argnums: ``"auto"`` (every non-batch argument the step returns updated) or
      explicit argument numbers.

  Raises:
    NonArrayLeafError: a dynamic argument holds a leaf that is not an array.
  """
  names = arg_names(fun, len(args))
  dyn_argnums = tuple(i for i in range(len(args)) if i not in static_argnums)
  leaves, paths, argnum_of_leaf = [], [], []
  for i in dyn_argnums:
    for key_path, leaf in tree_util.tree_flatten_with_path(args[i])[0]:
      path = names[i] + tree_util.keystr(key_path)
      if not is_array_leaf(leaf):
        raise errors.NonArrayLeafError(
            f"argument {names[i]!r} has a leaf at {path} of type {type(leaf).__name__} "
            f"({leaf!r:.60}); traced arguments may hold only arrays and Python numbers. Make it "
            f"a static argument (static_argnums) or a pytree node field (flax struct.field("
            f"pytree_node=False)).")
      leaves.append(leaf)
      paths.append(path)
      argnum_of_leaf.append(i)
  in_tree = tree_util.tree_structure(tuple(args[i] for i in dyn_argnums))

  # A scalar in a batch argument (a dropout key in the batch dict, a step count) has no
  # examples to split: the whole batch shares it, as if it were an argument of its own.
  is_batch = [a in batch_argnums and np.ndim(x) > 0 for a, x in zip(argnum_of_leaf, leaves)]
  closed, out_tree, out_paths, marker_index, num_markers, unseen = _trace_flat(
      fun, args, dyn_argnums, in_tree, leaves, is_batch=is_batch)
  out_avals = tuple(v.aval for v in closed.jaxpr.outvars)
  sigs = [leaf_signature(x) for x in leaves]

  output_source, state_argnums = _match_state(args, dyn_argnums, sigs, argnum_of_leaf,
                                              out_tree, out_avals, batch_argnums)
  if donate_argnums == "auto":
    donated = tuple(sorted(state_argnums))
  else:
    donated = tuple(donate_argnums)

  batch_mask = sum(1 << k for k, b in enumerate(is_batch) if b)
  out_deps = jaxpr_util.output_dependencies(closed.jaxpr, len(leaves))
  state_leaves = {src for src in output_source if src is not None}
  loss_deps = 0
  for k, dep in enumerate(_loss_dependencies(closed.jaxpr, len(leaves), output_source,
                                             out_deps)):
    if output_source[k] is None and dep & batch_mask:
      loss_deps |= dep
  roles_from_loss = bool(loss_deps & ~batch_mask)
  roles = []
  for k in range(len(leaves)):
    if is_batch[k]:
      roles.append(BATCH)
    elif k not in state_leaves:
      roles.append(INPUT)
    elif not roles_from_loss or loss_deps >> k & 1:
      roles.append(PARAM)
    else:
      roles.append(OPTIMIZER)

  batch_dims = {sigs[k][0][0] for k in range(len(leaves)) if is_batch[k] and sigs[k][0]}
  inputs = tuple(LeafInfo(paths[k], sigs[k][0], sigs[k][1], argnum_of_leaf[k], roles[k])
                 for k in range(len(leaves)))
  if batch_dims:
    feeds = 0
    for k, dep in enumerate(out_deps):
      if output_source[k] is None and dep & batch_mask:
        feeds |= dep
    _check_batch_arguments(fun, args, dyn_argnums, in_tree, leaves, inputs, batch_argnums,
                           min(batch_dims), feeds, names)
  return TracedStep(
      closed_jaxpr=closed, in_tree=in_tree, out_tree=out_tree, inputs=inputs,
      out_avals=out_avals, out_paths=out_paths,
      output_source=tuple(output_source), donated_argnums=donated,
      batch_size=min(batch_dims) if batch_dims else None, roles_from_loss=roles_from_loss,
      depends_on_batch=tuple(bool(d & batch_mask) for d in out_deps),
      marker_index=marker_index, num_markers=num_markers, unseen_gradients=unseen)


def _check_batch_arguments(fun, args, dyn_argnums, in_tree, leaves, inputs, batch_argnums,
                           batch_size: int, feeds: int, names) -> None:
  """Finds arguments that look like batch data left out of ``batch_argnums``: every
  leaf has the batch size as its dim 0 and feeds what the step returns from the batch
  (labels passed beside the inputs, say). Methods that cut the batch per device or per
  micro-batch would pair a part of the inputs with all of such an argument: a shape error
  deep in the step, or, where one side broadcasts, a wrong result. If the step no longer
  traces with the batch arguments halved, the argument meets the batch along dim 0:
  that raises here; otherwise a warning names it.

  Raises:
    BatchArgnumsError: naming the argument and the ``batch_argnums`` that would hold it.
  """
  by_arg: dict[int, list[int]] = {}
  for k, leaf in enumerate(inputs):
    if leaf.role == INPUT:
      by_arg.setdefault(leaf.argnum, []).append(k)
  suspects = [a for a, ks in by_arg.items()
              if len(ks) == len(tree_util.tree_leaves(args[a]))
              and all(inputs[k].shape and inputs[k].shape[0] == batch_size for k in ks)
              and any(feeds >> k & 1 for k in ks)]
  if not suspects:
    return
  described = ", ".join(f"argument {a} ({names[a]})" for a in suspects)
  wanted = tuple(sorted(set(batch_argnums) | set(suspects)))
  halved = None
  if batch_size % 2 == 0 and batch_size > 2:
    halved = [jax.ShapeDtypeStruct((x.shape[0] // 2,) + x.shape[1:], x.dtype)
              if info.role == BATCH else jax.ShapeDtypeStruct(np.shape(x), info.dtype)
              for x, info in zip(leaves, inputs)]
  try:
    if halved is not None:
      _trace_flat(fun, args, dyn_argnums, in_tree, halved)
  except (TypeError, ValueError) as e:
    raise errors.BatchArgnumsError(
        f"{described} has dim 0 = {batch_size}, the batch size, and meets the batch along it, "
        f"but batch_argnums={tuple(batch_argnums)!r} leaves it out: jaxdist splits only the "
        f"batch arguments over devices and micro-batches, so the step fails on a part of the "
        f"batch ({type(e).__name__}: {str(e)[:200]}). Pass batch_argnums={wanted!r}.") from e
  warnings.warn(
      f"{described} has dim 0 = {batch_size}, the batch size, and feeds the step's result, "
      f"but is not in batch_argnums={tuple(batch_argnums)!r}: every device gets all of it. If "
      f"it holds one row per example, pass batch_argnums={wanted!r}.",
      errors.JaxdistWarning, stacklevel=5)


def _loss_dependencies(jaxpr, num_inputs: int, output_source, out_deps: list[int]) -> list[int]:
  """Per output, the inputs it depends on, where a new state value the step reads again
  stands for its own leaf: a GAN's generator loss reads the discriminator's updated
  weights, which depend on the discriminator's optimizer state; that state is not a
  parameter of the loss (counted as one, ZeRO-2 kept it whole)."""
  made = {o for eqn in jaxpr.eqns for o in eqn.outvars}
  read = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jex.Literal)}
  stand_ins = {v: 1 << src for v, src in zip(jaxpr.outvars, output_source)
               if src is not None and v in made and v in read}
  if not stand_ins:
    return out_deps
  return jaxpr_util.dependencies(jaxpr, num_inputs, jaxpr.outvars, stand_ins)


def _trace_flat(fun, args, dyn_argnums, in_tree, flat_args, mark: bool = True,
                is_batch=None):
  """make_jaxpr of ``fun`` on flat dynamic leaves (arrays or ShapeDtypeStructs).

  Returns (closed_jaxpr, out_tree, out_paths, marker_index, num_markers, the number of
  the step's jax.grad calls traced as written, unseen by jaxdist). When the
  step uses jaxdist.grad, jit bodies are inlined so that a marker inside a jitted helper
  is visible at the top level; one inside a loop or a custom_vjp stays hidden.
  ``mark``: the step's own ``jax.grad`` calls are jaxdist's (:func:`marking_jax_grads`);
  ``is_batch``: per leaf, whether it is batch data (None: not known).
  """
  out_store = {}

  def flat_fun(*flat):
    dyn = tree_util.tree_unflatten(in_tree, flat)
    full = list(args)
    for i, value in zip(dyn_argnums, dyn):
      full[i] = value
    out = fun(*full)
    out_leaves, out_store["tree"] = tree_util.tree_flatten(out)
    out_store["paths"] = tuple(
        "out" + tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(out)[0])
    return out_leaves

  # Traced on shapes and dtypes alone: arrays placed by an earlier step carry their mesh
  # into the jaxpr's types (a scan's results), which inside a shard_map over that mesh
  # would clash with its manual axes.
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
              if isinstance(x, jax.Array) else x for x in flat_args]
  with marking_jax_grads(fun) if mark else contextlib.nullcontext(PlainCalls()) as plain_calls:
    closed = jax.make_jaxpr(flat_fun)(*abstract)
  if plain_calls.count and not _one_usable_gradient(closed, flat_args, is_batch):
    # A plain jax.grad nested in a loop, a cond, a custom_vjp, called more than once or
    # with respect to the batch: the step is traced again as written (XLA reduces its
    # gradients). (A new function: make_jaxpr would return its cached trace of ``flat_fun``.)
    closed = jax.make_jaxpr(lambda *flat: flat_fun(*flat))(*abstract)
    unseen = plain_calls.count
  else:
    unseen = 0
  marker_index = None
  num_markers = jaxpr_util.count_primitive(closed.jaxpr, grad_marker_p.name)
  if num_markers:
    closed = jaxpr_util.without_dead_gradients(jaxpr_util.inline_calls(closed),
                                               grad_marker_p.name, GRAD)
  closed = tie_recomputations(closed)
  if num_markers:
    found = jaxpr_util.find_eqns(closed.jaxpr, grad_marker_p.name)
    if num_markers == 1 and len(found) == 1:
      marker_index = found[0]
  return closed, out_store["tree"], out_store["paths"], marker_index, num_markers, unseen


def _one_usable_gradient(closed, flat_args, is_batch) -> bool:
  """Whether ``closed`` has one gradient (a marker, or a pipeline's captured loss), at its
  top level once calls are inlined, and a marker has no gradient shaped like a batch leaf
  and like no other input (a gradient with respect to the examples, an adversarial or
  saliency step's: no partial sum the devices could add), nor one per example, an
  input's shape behind the batch size (``jax.vmap(jax.grad(...))``: per-example
  gradients, clipped one by one in DP-SGD)."""
  names = (grad_marker_p.name, capture.pipeline_loss_p.name)
  if sum(jaxpr_util.count_primitive(closed.jaxpr, n) for n in names) != 1:
    return False
  found = [e for e in jaxpr_util.inline_calls(closed).jaxpr.eqns if e.primitive.name in names]
  if len(found) != 1 or found[0].primitive is not grad_marker_p or is_batch is None:
    return len(found) == 1
  shapes = [tuple(x.shape) if hasattr(x, "shape") else np.shape(x) for x in flat_args]
  batch = {s for s, b in zip(shapes, is_batch) if b}
  other = {s for s, b in zip(shapes, is_batch) if not b}
  sizes = {s[0] for s in batch if s}

  def per_example(shape) -> bool:  # jax.grad under vmap over the batch (DP-SGD's clipping)
    return bool(shape) and shape[0] in sizes and shape[1:] in other and shape not in other

  return not any(kind == GRAD and ((v.aval.shape in batch and v.aval.shape not in other)
                                   or per_example(v.aval.shape))
                 for v, kind in zip(found[0].invars, found[0].params["kinds"]))


def with_micro_batch_trace(fun, args, static_argnums: tuple[int, ...], step: TracedStep,
                           divisor: int, inline: tuple[str, ...] = (),
                           tie_in_loops: bool = False,
                           batch: frozenset[int] | None = None) -> TracedStep:
  """``step`` plus the trace of ``fun`` on batch leaves of dim 0 / ``divisor``.

  ``inline``: call primitives to inline in the micro-batch trace, so that its equations
  line up with a step whose jaxpr was inlined the same way (the shard planner's);
  ``tie_in_loops``: its recomputations in loops tied too, as that step's were
  (``recompute.tie_recomputations``); ``batch``: as ``jaxpr_util.inline_calls``'s.
  """
  dyn_argnums = tuple(i for i in range(len(args)) if i not in static_argnums)
  leaves = tree_util.tree_leaves(tuple(args[i] for i in dyn_argnums))
  flat = [jax.ShapeDtypeStruct((info.shape[0] // divisor,) + info.shape[1:], info.dtype)
          if info.role == BATCH else x for x, info in zip(leaves, step.inputs)]
  # Plain gradients are jaxdist's here as they were in ``step`` (a fallback stays one).
  marked = any(jaxpr_util.count_primitive(step.closed_jaxpr.jaxpr, n)
               for n in (grad_marker_p.name, capture.pipeline_loss_p.name))
  try:
    closed, _, _, marker_index, _, _ = _trace_flat(
        fun, args, dyn_argnums, step.in_tree, flat, mark=marked,
        is_batch=[info.role == BATCH for info in step.inputs])
  except errors.JaxdistError:
    raise
  except Exception as e:  # (the whole batch traced: the step depends on its size)
    raise errors.BatchDivisibilityError(
        f"the step does not trace on 1/{divisor} of its batch ({step.batch_size} -> "
        f"{step.batch_size // divisor} examples): {type(e).__name__}: {e}. Does it take the "
        f"batch size as a constant (jnp.eye(B), jnp.arange(B), a reshape to B)? Read it "
        f"from the batch's shape instead.") from e
  if tie_in_loops:
    closed = tie_recomputations(closed, in_loops=True)
  if inline:
    closed, marker_index = inline_keeping_marker(closed, inline, batch)
  return dataclasses.replace(step, micro_jaxpr=closed, micro_marker_index=marker_index)


def inline_keeping_marker(closed, inline: tuple[str, ...], batch=None):
  """``closed`` with ``inline`` calls inlined; returns it and its single marker's index."""
  closed = jaxpr_util.inline_calls(closed, inline, batch)
  found = jaxpr_util.find_eqns(closed.jaxpr, grad_marker_p.name)
  return closed, (found[0] if len(found) == 1 else None)


def _match_state(args, dyn_argnums, sigs, argnum_of_leaf, out_tree, out_avals, batch_argnums):
  """Finds outputs that are updated values of non-batch arguments.

  An argument is updated state if the whole output, or one top-level element of a
  tuple/list/dict output, has its pytree structure and leaf shapes and dtypes.
  Returns (per output leaf the input leaf it updates or None, the set of such argnums).
  """
  out_sigs = [(tuple(a.shape), a.dtype) for a in out_avals]
  dummy = tree_util.tree_unflatten(out_tree, list(range(len(out_avals))))
  candidates = [dummy]
  if isinstance(dummy, (tuple, list)):
    candidates += list(dummy)
  elif isinstance(dummy, dict):
    candidates += list(dummy.values())
  output_source = [None] * len(out_avals)
  used, state = set(), set()
  for a in dyn_argnums:
    arg_leaf_ids = [k for k, b in enumerate(argnum_of_leaf) if b == a]
    if a in batch_argnums or not arg_leaf_ids:
      continue
    arg_tree = tree_util.tree_structure(args[a])
    for c, cand in enumerate(candidates):
      if c in used:
        continue
      cand_leaves, cand_tree = tree_util.tree_flatten(cand)
      if cand_tree != arg_tree or [out_sigs[o] for o in cand_leaves] != [sigs[k] for k in arg_leaf_ids]:
        continue
      used.add(c)
      state.add(a)
      for o, k in zip(cand_leaves, arg_leaf_ids):
        output_source[o] = k
      break
  return output_source, state
