"""Does a step mix examples of its batch other than by averaging the loss?

jaxdist's one-reduction-per-step path (``jaxdist.grad`` under DataParallel / ZeRO) runs
the gradient part per device on its shard of the batch. That equals the whole-batch step
only when examples interact through the final mean alone. A batch statistic (BatchNorm in
training mode: ``(x - mean_over_batch(x)) / std_over_batch(x)``) makes each device use its
own shard's statistics instead, which the single-device step does not do.

:func:`batch_coupling` follows the batch axis through the step's jaxpr: every value either
carries the batch axis at some position, is *reduced* over it (a batch statistic, a
weight gradient, the loss), or does not depend on the batch. An equation that combines a
reduced value with a value that still carries the batch axis couples examples, and so
does one that moves examples along it (a roll, a sort, a cumulative sum, a slice), pairs
them (``z @ z.T``), or indexes them by indices that are no example's own. Values whose
batch axis it cannot follow (an op without a rule below that drops the axis) are no
longer tracked, so an exotic step may go unnoticed; ordinary ones (elementwise ops,
broadcasts, reshapes, also merging the batch with the dims before or after it,
transposes, dots, convolutions, reductions, gathers, concatenations of whole batches) are
followed, and so are the bodies of loops, conditionals and calls (``jax.checkpoint``,
``custom_vjp``).
"""

from __future__ import annotations

import itertools
import math
import warnings

import jax.extend.core as jex
import jax.numpy as jnp

from jaxdist import errors
from jaxdist import jaxpr_util
from jaxdist.jaxpr_util import MARKERS
from jaxdist.shard.strategies import ELEMENTWISE
from jaxdist.trace import BATCH, PARAM, TracedStep

REDUCED = "reduced"
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
                       "argmax argmin".split())


def _shape(v):
  return tuple(getattr(v.aval, "shape", ()))


def batch_coupling(step: TracedStep) -> str | None:
  """A description of the first equation that mixes a batch statistic back into
  per-example values (None if there is none). The loss's normalizer (see
  :func:`loss_normalizer`) does not count: micro-batches and devices are combined
  weighted by it, which gives the whole batch's value."""
  size = step.batch_size
  if size is None or size < 2:
    return None
  jaxpr = step.closed_jaxpr.jaxpr
  exempt = set()
  if step.marker_index is not None:
    normalizer = loss_normalizer(jaxpr, step.marker_index, _param_vars(step, jaxpr))
    exempt = {normalizer} if normalizer is not None else set()
  state: dict = {}
  batch = [v for v, leaf in zip(jaxpr.invars, step.inputs) if leaf.role == BATCH]
  # Past the marker the values are the whole batch's (reduced), and the optimizer's
  # equations would only be mistaken for per-example work: an LSTM's weight gradient of
  # shape (32, 128) at batch size 32, divided by its global norm, looked like a batch
  # statistic mixed into examples.
  coupled = coupling_in(jaxpr, batch, size, exempt, state, stop=step.marker_index)
  if coupled or step.marker_index is None or exempt:
    return coupled
  marker = jaxpr.eqns[step.marker_index]
  values = [v for v, kind in zip(marker.invars, marker.params["kinds"]) if kind == "value"]
  return _mixed_loss(jaxpr.eqns[:step.marker_index], values[0], state) if len(values) == 1 else None


def warn_split(coupled: str, parts: str):
  """Warns that a step mixing examples (``coupled``, from :func:`batch_coupling`) runs in
  ``parts`` that do not see each other, so its results are not the single-device step's."""
  warnings.warn(
      f"the step mixes examples beyond the loss's mean ({coupled}); {parts} each compute "
      f"it on their own examples (batch statistics, in-batch negatives), so results differ "
      f"from the single-device step's. DataParallel, ZeRO or ShardParallel without "
      f"micro-batches run it as one whole-batch program.", errors.ResultsDifferWarning,
      stacklevel=3)


def loss_coupling(loss_jaxpr, num_consts: int, batched, size: int) -> str | None:
  """:func:`batch_coupling` of a pipeline's loss (its value first; ``batched``: per input,
  whether it carries the batch), its token count (:func:`normalizer_of`) not followed."""
  normalizer = normalizer_of(loss_jaxpr.eqns, loss_jaxpr.outvars[0],
                             set(loss_jaxpr.invars[num_consts:]))
  state: dict = {}
  coupled = coupling_in(loss_jaxpr, [v for v, b in zip(loss_jaxpr.invars, batched) if b], size,
                        {normalizer} - {None}, state)
  if coupled or normalizer is not None:
    return coupled
  return _mixed_loss(loss_jaxpr.eqns, loss_jaxpr.outvars[0], state)


def coupling_in(jaxpr, batch_vars, size: int, exempt=frozenset(), state=None,
                stop: int | None = None) -> str | None:
  """:func:`batch_coupling` of ``jaxpr`` whose ``batch_vars`` (those with dim 0 of
  ``size``) carry the batch; ``exempt``: vars not followed (the loss's normalizer);
  ``state``: filled with each followed var's batch axis or ``REDUCED``; ``stop``: the
  first equation not looked at (all are by default)."""
  state = {} if state is None else state
  readers: dict = {}
  producer = {v: e for e in jaxpr.eqns[:stop] for v in e.outvars}
  for e in jaxpr.eqns[:stop]:
    for v in e.invars:
      if not isinstance(v, jex.Literal):
        readers.setdefault(v, []).append(e)
  for v in batch_vars:
    if _shape(v) and _shape(v)[0] == size:
      state[v] = 0
  for i, eqn in enumerate(jaxpr.eqns[:stop]):
    ins = [None if isinstance(v, jex.Literal) or v in exempt else state.get(v)
           for v in eqn.invars]
    carried = [(k, p) for k, p in enumerate(ins) if isinstance(p, int)]
    if not carried and REDUCED not in ins or _times_zero(eqn):
      continue  # (x * 0 holds nothing of x: jaxdist.recompute's tie to a cotangent)
    if eqn.primitive.name in MARKERS:  # identities, value by value
      state.update((v, s) for v, s in zip(eqn.outvars, ins) if s is not None)
      continue
    if carried and REDUCED in ins:
      return (f"equation {i} ({eqn.primitive.name}) combines a value reduced over the batch "
              f"(a batch statistic such as BatchNorm's mean) with per-example values")
    moved = _moves_examples(eqn, carried, size)
    if moved and not _zeroed(eqn.outvars[0], readers):
      return (f"equation {i} ({eqn.primitive.name}) {moved} along the batch axis (a roll, "
              f"reverse, sort, cumulative sum, or part of the examples)")
    if _pairs_examples(eqn, carried):
      return (f"equation {i} ({eqn.primitive.name}) pairs examples with each other (a "
              f"similarity matrix of the batch, in-batch negatives, pairwise distances)")
    indexed = (eqn.params["dimension_numbers"].start_index_map if eqn.primitive.name == "gather"
               else eqn.params["dimension_numbers"].scatter_dims_to_operand_dims
               if eqn.primitive.name.startswith("scatter") else ())
    if indexed and isinstance(ins[0], int) and ins[0] in indexed:
      if not isinstance(ins[1], int):
        # Indices that are no example's own pick rows of the batch: a graph's edges
        # reading their nodes (x[senders]), a shuffle (x[perm]). A per-example lookup's
        # indices carry the batch (logits[arange(n), labels]); take_along_axis batches
        # over it.
        return (f"equation {i} ({eqn.primitive.name}) indexes examples of the batch by "
                f"indices that are no example's own (a graph's edges reading their nodes, "
                f"a shuffle of the batch)")
      if isinstance(state.get(_index_column(eqn.invars[1], indexed.index(ins[0]), producer)),
                    int):
        # ... but the batch's own row is an arange's (per device, its own examples'), not
        # values read from the batch: ``weights[labels]`` with a per-class table passed in
        # the batch as long as it is reads rows of other devices' part of the table.
        return (f"equation {i} ({eqn.primitive.name}) indexes examples of the batch by "
                f"values of the batch (a table passed in the batch argument whose length "
                f"equals the batch size is split like examples: pass it as an argument of "
                f"its own)")
    if eqn.primitive.name == "scan":
      found = _scan_coupling(eqn, ins, size)
      if found:
        return f"equation {i} (scan) {found}"
    call = _called(eqn)
    if call is not None or eqn.primitive.name in ("while", "cond"):
      if call is not None:
        found, outs = _call_coupling(call, ins, size)
        found = found and f"calls a function that mixes examples: {found}"
      else:
        found, outs = (_while_coupling if eqn.primitive.name == "while" else _cond_coupling)(
            eqn, ins, size)
      if found:
        return f"equation {i} ({eqn.primitive.name}) {found}"
      state.update((v, s) for v, s in zip(eqn.outvars, outs) if s is not None)
      continue
    outs = _propagate(eqn, carried, size) if carried else [REDUCED] * len(eqn.outvars)
    for v, s in zip(eqn.outvars, outs):
      if s is not None:
        state[v] = s
  return None


def _scan_coupling(eqn, ins: list, size: int) -> str | None:
  """How a ``scan`` mixes examples (``ins``: its operands' batch axes or ``REDUCED``), or
  None: its carry reads the examples it scans over (a time-major sequence split on its
  time axis as if it were the batch), or its body mixes them (followed with the carry's
  axes as one step leaves them)."""
  body = eqn.params["jaxpr"].jaxpr
  consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
  xs = range(consts + carries, len(ins))
  along = sum(1 << k for k in xs if ins[k] == 0)
  if along and _recurs_over(body, consts, carries, along):
    return ("carries state from example to example along the batch axis (batch arguments "
            "are split on dim 0: is the sequence time-major?)")
  inner = {v: _at(s, s - (k in xs)) if isinstance(s, int) else s
           for k, (v, s) in enumerate(zip(body.invars, ins)) if s is not None}
  found, _ = _body_coupling(body, {v: s for v, s in inner.items() if s != -1},
                            body.invars[consts:consts + carries], body.outvars[:carries], size)
  return found and f"mixes examples in its body: {found}"


def _while_coupling(eqn, ins: list, size: int) -> tuple[str | None, list]:
  """How a ``while`` loop mixes examples (``ins`` as for :func:`_scan_coupling`), or
  None, and its outputs' batch axes: its body mixes them, or its condition does, or it
  stops on a statistic over the batch (a fixed point iterated until every example
  converged: per device, each device would stop when its own examples had)."""
  cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
  cond_consts, body_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  carry = ins[cond_consts + body_consts:]
  found, state = _body_coupling(
      body, {v: s for v, s in zip(body.invars, ins[cond_consts:]) if s is not None},
      body.invars[body_consts:], body.outvars, size)
  if found:
    return f"mixes examples in its body: {found}", []
  carry = [s if s is not None or isinstance(o, jex.Literal) else state.get(o)
           for s, o in zip(carry, body.outvars)]
  inner = {v: s for v, s in zip(cond.invars, ins[:cond_consts] + carry) if s is not None}
  found = coupling_in(cond, (), size, state=inner)
  if found:
    return f"mixes examples in its condition: {found}", []
  test = cond.outvars[0]
  if (not isinstance(test, jex.Literal) and inner.get(test) == REDUCED
      and any(isinstance(s, int) for s in carry)):
    return ("runs until a statistic over the batch says so (a fixed point iterated until "
            "every example converged)"), []
  return None, carry


def _called(eqn):
  """The jaxpr a call-like equation runs on its operands (``jax.checkpoint``'s,
  ``custom_vjp``'s and ``custom_jvp``'s calls in a forward-only trace, a pipeline's
  loss), or None."""
  subs = list(jex.jaxprs_in_params(eqn.params))
  if (len(subs) == 1 and eqn.primitive.name not in ("while", "scan", "cond")
      and len(subs[0].invars) == len(eqn.invars) and len(subs[0].outvars) == len(eqn.outvars)):
    return subs[0]
  return None


def _call_coupling(jaxpr, ins: list, size: int) -> tuple[str | None, list]:
  """:func:`coupling_in` of a called ``jaxpr`` (a call's, a branch's) whose operands hold
  ``ins``' batch axes: what it found, and its outputs' batch axes."""
  state = {v: s for v, s in zip(jaxpr.invars, ins) if s is not None}
  found = coupling_in(jaxpr, (), size, state=state)
  return found, [None if isinstance(v, jex.Literal) else state.get(v) for v in jaxpr.outvars]


def _cond_coupling(eqn, ins: list, size: int) -> tuple[str | None, list]:
  """How a ``cond``'s branches mix examples (``ins`` as for :func:`_scan_coupling`; a
  branch that centers on the batch's mean), or None, and its outputs' batch axes (reduced
  where a branch reduces, else a branch's axis)."""
  outs = [None] * len(eqn.outvars)
  for branch in eqn.params["branches"]:
    found, branch_outs = _call_coupling(branch.jaxpr, ins[1:], size)
    if found:
      return f"mixes examples in a branch: {found}", []
    for k, s in enumerate(branch_outs):
      if outs[k] != REDUCED and (s == REDUCED or outs[k] is None):
        outs[k] = s
  return None, outs


def _body_coupling(body, inner: dict, carry_in, carry_out, size: int) -> tuple[str | None, dict]:
  """:func:`coupling_in` of a loop ``body`` whose inputs hold ``inner``'s batch axes, then
  again with the axes its carry leaves the first step with; what it found and its states."""
  for _ in range(2):
    state = dict(inner)
    found = coupling_in(body, (), size, state=state)
    if found:
      return found, state
    grown = {v: state[o] for v, o in zip(carry_in, carry_out)
             if not isinstance(o, jex.Literal) and state.get(o) is not None and v not in inner}
    if not grown:
      break
    inner = {**inner, **grown}
  return None, state


def _recurs_over(body, consts: int, carries: int, along: int) -> bool:
  """Whether a scan ``body`` carries what it reads of the scanned operands ``along`` (a
  bit mask of its inputs) into its next steps: a recurrence over them (a time-major RNN's
  hidden state), not a sum of per-step terms that no step reads (a per-example gradient
  accumulated over the backward pass of ``lax.map``)."""
  n = len(body.invars)
  deps = jaxpr_util.dependencies(body, n, body.outvars)
  producer = {v: e for e in body.eqns for v in e.outvars}
  tainted = 0  # carry inputs holding something read from the scanned operands
  while True:
    grown = sum(1 << (consts + j) for j in range(carries) if deps[j] & (along | tainted))
    if grown == tainted:
      break
    tainted = grown
  if any(d & tainted for d in deps[carries:]):  # a step's output reads what came before
    return True
  for j in range(carries):
    if not tainted >> (consts + j) & 1:
      continue
    eqn = producer.get(body.outvars[j])
    carry = body.invars[consts + j]
    if eqn is None or eqn.primitive.name not in ("add", "add_any") or carry not in eqn.invars:
      return True
    (term,) = [v for v in eqn.invars if v is not carry] or [carry]
    if jaxpr_util.dependencies(body, n, [term])[0] & tainted:
      return True
  return False


def _batched_index_dims(eqn, carried) -> list[bool]:
  """Per batching dim of a scatter's indices, whether the batch axis of its carried
  indices or updates is that dim."""
  dn = eqn.params["dimension_numbers"]
  rank = len(_shape(eqn.invars[1]))
  index_dims = [d for d in range(rank) if d != rank - 1]  # (the last holds each index)
  update_dims = [d for d in range(len(_shape(eqn.invars[2]))) if d not in dn.update_window_dims]
  axes = {p for kk, p in carried if kk == 1}
  axes |= {index_dims[update_dims.index(p)] for kk, p in carried
           if kk == 2 and p in update_dims and update_dims.index(p) < len(index_dims)}
  return [d in axes for d in dn.scatter_indices_batching_dims]


def _index_column(indices, column: int, producer: dict):
  """The value that gives ``column`` of a gather's or scatter's ``indices`` (their last
  dim holds each index): the piece of the concatenation jnp's indexing builds them with
  (``x[arange(n), labels]``), else the indices themselves."""
  eqn = producer.get(indices)
  last = len(_shape(indices)) - 1
  if eqn is None or eqn.primitive.name != "concatenate" or eqn.params["dimension"] != last:
    return indices
  for piece in eqn.invars:
    if column < _shape(piece)[last]:
      return piece
    column -= _shape(piece)[last]
  return indices


class _Stacked(int):
  """A batch axis made by concatenating whole batches along it (two views of the batch,
  ``concatenate([x1, x2])``): a slice or split of it into whole batches takes every
  example (``z[:n]``, ``z[n:]``)."""


class _Merged(int):
  """A batch axis merged with dims before it (a time-major sequence's tokens flattened,
  ``(L, B, D) -> (L * B, D)``): its index is (outer, example, inner) with ``outer`` > 1,
  so each example's elements are spread over it rather than a contiguous block."""

  def __new__(cls, axis: int, outer: int):
    merged = super().__new__(cls, axis)
    merged.outer = outer
    return merged


def _at(p, q: int):
  """Axis ``q`` holding the batch as axis ``p`` does (stacked, merged or plainly)."""
  return _Merged(q, p.outer) if isinstance(p, _Merged) else type(p)(q)


def _outer(p, extent: int, size: int) -> int:
  """How many times the batch repeats along its axis ``p`` of ``extent``: its index is
  (outer, example, inner); 1 where examples are contiguous blocks of it."""
  if isinstance(p, _Merged):
    return p.outer
  return extent // size if isinstance(p, _Stacked) else 1


def _reshaped(p, before: tuple, after: tuple, size: int):
  """The axis of ``after`` holding the batch that axis ``p`` of ``before`` holds, or None
  where no single axis does. The batch's digit of a flat index has ``outer`` digits
  before it and ``inner`` elements after it; an axis of ``after`` holds it when its
  elements step by a divisor of ``inner`` and its extent wraps at a multiple of the
  batch's period."""
  o = _outer(p, before[p], size)
  if before[p] % (o * size):
    return None
  outer = math.prod(before[:p]) * o
  inner = before[p] // (o * size) * math.prod(before[p + 1:])
  if not math.prod(after):
    return None
  for q, extent in enumerate(after):
    stride = math.prod(after[q + 1:])
    if outer % math.prod(after[:q]) == 0 and inner % stride == 0 and (
        extent * stride) % (size * inner) == 0:
      wraps = extent * stride // (size * inner)
      return _Merged(q, wraps) if wraps > 1 else q
  return None


def _whole_batches(eqn, axis, size: int) -> bool:
  """Whether a ``slice`` or ``split`` of a stacked batch ``axis`` cuts it into whole
  batches, or a ``pad`` adds whole batches to it (a slice's transpose)."""
  p = eqn.params
  if eqn.primitive.name == "pad":
    low, high, interior = p["padding_config"][axis]
    return interior == 0 and low >= 0 and high >= 0 and low % size == 0 and high % size == 0
  if not isinstance(axis, _Stacked):
    return False
  if eqn.primitive.name == "split":
    cuts = list(itertools.accumulate(p["sizes"]))
  elif p["strides"] is None or p["strides"][axis] == 1:
    cuts = [p["start_indices"][axis], p["limit_indices"][axis]]
  else:
    return False
  return all(c % size == 0 for c in cuts)


CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


def _times_zero(eqn) -> bool:
  return eqn.primitive.name == "mul" and any(
      isinstance(x, jex.Literal) and not _shape(x) and x.val == 0 for x in eqn.invars)


def _zeroed(v, readers: dict) -> bool:
  """Whether every reader of ``v`` multiplies it by 0 (through reshapes and casts): the
  one element of a cotangent that ``jaxdist.recompute`` ties a recomputation to."""
  users = readers.get(v, [])
  return bool(users) and all(
      _zeroed(e.outvars[0], readers) if e.primitive.name in ("reshape", "convert_element_type")
      else _times_zero(e) for e in users)


def _moves_examples(eqn, carried, size: int) -> str | None:
  """How ``eqn`` moves examples along the batch axis of an operand carrying it
  (``carried``: (operand position, batch axis) pairs), or None: run per device, each
  device would reverse, shift, sort or slice its own examples only (DataParallel's update
  was 0.2 to 1.2 off serial on such steps, without a word)."""
  name, p = eqn.primitive.name, eqn.params
  for k, axis in carried:
    shape = _shape(eqn.invars[k])
    if name == "rev" and axis in p["dimensions"]:
      return "reverses examples"
    if name in CUMULATIVE and p["axis"] == axis:
      return "accumulates across examples"
    if name == "sort" and p["dimension"] == axis:
      return "sorts examples"
    if (name in ("slice", "dynamic_slice") and _shape(eqn.outvars[0])[axis] != shape[axis]
        or name == "split" and p["axis"] == axis) and not _whole_batches(eqn, axis, size):
      return "takes part of the examples"
    if name == "pad" and any(p["padding_config"][axis]) and not _whole_batches(eqn, axis, size):
      return "pads the examples"
    if name.startswith("reduce_window") and p["window_dimensions"][axis] > 1:
      return "pools across examples"
    if name == "top_k" and p.get("axis", -1) % len(shape) == axis:
      return "ranks examples"
    if name == "dynamic_update_slice" and k == 0 and _shape(eqn.invars[1])[axis] != shape[axis]:
      return "writes part of the examples"
  return None


def _pairs_examples(eqn, carried) -> bool:
  """Whether an equation meets examples with each other: a dot whose two operands both
  carry the batch and neither contract it nor batch over it together (a similarity
  matrix of the batch, ``z @ z.T``), or an elementwise one whose operands carry it on
  different axes (pairwise distances, ``x[:, None] - x[None, :]``). (A step's backward
  shows such a pairing too; a pipeline's loss is followed without its backward.)"""
  if len(carried) < 2:
    return False
  if eqn.primitive.name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    pair = (carried[0][1], carried[1][1])
    return pair not in zip(lc, rc) and pair not in zip(lb, rb)
  return eqn.primitive.name in ELEMENTWISE and len(
      {(int(a), getattr(a, "outer", 1)) for _, a in carried}) > 1


def _mixed_loss(eqns, value, state: dict) -> str | None:
  """Why the loss ``value`` (computed by ``eqns``; ``state`` as :func:`coupling_in` leaves
  it) cannot be combined from its parts (see :func:`part_scale`), or None:

  - it is no affine function of sums over the batch (``sqrt(mean(err ** 2))``, a log or a
    product of batch means): a part's value says nothing exact about the whole's;
  - it adds a sum over the batch that is no mean (``c`` times the number of elements it
    sums is not 1) to another kind of term (a mean, a weight penalty).

  From the whole batch's trace alone, so a sum divided by a count of its own
  (``x.sum() / x.shape[0]`` over tokens) counts as no mean too: such a step then runs as
  one whole-batch program, which is exact, only slower than per device."""
  producer = {o: e for e in eqns for o in e.outvars}
  if not _affine(value, producer, state):
    return ("the loss is no affine function of sums over the batch (a square root, log or "
            "product of batch means)")
  kinds = set()
  for factors, term in _terms(value, producer):
    if isinstance(term, jex.JaxprEqn) and isinstance(state.get(term.invars[0]), int):
      # A mean, also scaled (``-0.5 * jnp.mean(...)``, a VAE's KL term): one of its
      # factors divides by the number of elements summed, or all of them make 1/count.
      count = math.prod(_shape(term.invars[0]))
      mean = any(math.isclose(f * count, 1, rel_tol=1e-6) for f in factors) or math.isclose(
          math.prod(factors) * count, 1, rel_tol=1e-6)
      kinds.add("mean" if mean else "sum")
    else:
      kinds.add("other")
  if "sum" in kinds and len(kinds) > 1:
    return ("the loss adds a sum over the batch to a mean or to a term without the batch, "
            "such as a weight penalty")
  return None


_LINEAR = frozenset("add sub neg convert_element_type reduce_sum reshape squeeze copy".split())


def _affine(value, producer, state: dict) -> bool:
  """Whether ``value`` is made of sums over the batch (``reduce_sum`` over values carrying
  it) and values that do not depend on the batch, by additions, subtractions, casts,
  sums and products or quotients with values that do not depend on the batch."""
  stack, seen = [value], set()
  while stack:
    v = stack.pop()
    if isinstance(v, jex.Literal) or v in seen or state.get(v) is None:
      continue  # does not depend on the batch
    seen.add(v)
    eqn = producer.get(v)
    if eqn is None:
      return False
    name, ins = eqn.primitive.name, eqn.invars
    if name == "reduce_sum" and isinstance(state.get(ins[0]), int):
      continue  # a sum over the batch
    dependent = [x for x in ins if not isinstance(x, jex.Literal) and state.get(x) is not None]
    if name in _LINEAR:
      stack.extend(dependent)
    elif (name in ("mul", "div") and len(dependent) == 1
          and (name == "mul" or ins[0] is dependent[0])):  # scaled by a batch-free value
      stack.append(dependent[0])
    else:
      return False
  return True


def _param_vars(step: TracedStep, jaxpr) -> set:
  return {v for v, leaf in zip(jaxpr.invars, step.inputs) if leaf.role == PARAM}


def _scaled_sum(v, producer):
  """``(c, s)`` if ``v`` is ``c`` times the ``reduce_sum`` equation ``s`` (through casts
  and scaling by constants: a mean is a scaled sum), else None: :func:`_terms`' one term."""
  terms = _terms(v, producer)
  if len(terms) != 1 or not isinstance(terms[0][1], jex.JaxprEqn):
    return None
  return math.prod(terms[0][0]), terms[0][1]


def _terms(v, producer, factors: tuple = ()) -> list:
  """``v`` as a sum of terms ``c · t`` (through casts, negation, scaling by literals,
  additions and subtractions): ``[(factors, t)]`` where ``c`` is the product of
  ``factors`` (each scaling met on the way, a division as its inverse) and ``t`` is a
  ``reduce_sum`` equation or, for any other term, the variable itself."""
  eqn = None if isinstance(v, jex.Literal) else producer.get(v)
  if eqn is None:
    return [(factors, v)]
  name, ins = eqn.primitive.name, eqn.invars
  if name == "reduce_sum":
    return [(factors, eqn)]
  if name == "convert_element_type":
    return _terms(ins[0], producer, factors)
  if name == "neg":
    return _terms(ins[0], producer, factors + (-1.0,))
  if name in ("mul", "div") and isinstance(ins[1], jex.Literal) and not _shape(ins[1]):
    c = float(ins[1].val)
    return _terms(ins[0], producer, factors + ((c if name == "mul" else 1 / c),))
  if name == "mul" and isinstance(ins[0], jex.Literal) and not _shape(ins[0]):
    return _terms(ins[1], producer, factors + (float(ins[0].val),))
  if name in ("add", "sub") and not any(isinstance(x, jex.Literal) for x in ins):
    return (_terms(ins[0], producer, factors)
            + _terms(ins[1], producer, factors + ((-1.0,) if name == "sub" else ())))
  return [(factors, v)]


def part_scale(whole_eqns, whole_value, part_eqns, part_value, parts: int) -> float | None:
  """The weight of one part of the batch (a device's share, a micro-batch) in the whole
  batch's ``value``: the parts' values and gradients, each multiplied by it, add up to the
  whole batch's. Where ``value`` is ``c`` times a sum over the batch in both traces (a mean
  is ``1 / size`` times one, ``jnp.sum(...) / 1000`` is ``1 / 1000`` times one, in either
  trace), the weight is ``c_whole / c_part``: 1 for a sum, ``1 / parts`` for a mean; so it
  is for a sum of such terms that all have the same weight.

  Returns None for a mean (weight ``1 / parts``, which callers divide by ``parts``), and
  where ``value`` is none of these (it is then averaged over the parts: exact for means
  plus terms that do not depend on the batch, such as a weight penalty). Warns where
  terms summed over the batch meet other terms or terms of another weight (``sum(l) +
  penalty``): no weight per part gives the whole batch's value then.
  """
  terms = [_terms(v, {o: e for e in eqns for o in e.outvars})
           for eqns, v in ((whole_eqns, whole_value), (part_eqns, part_value))]
  if len(terms[0]) != len(terms[1]):
    return None
  weights = set()
  for (f_whole, whole), (f_part, part) in zip(*terms):
    c_whole, c_part = math.prod(f_whole), math.prod(f_part)
    summed = (isinstance(whole, jex.JaxprEqn) and isinstance(part, jex.JaxprEqn)
              and c_part != 0
              # Over the batch: the summed operand shrinks with the part, the sum does not.
              and _shape(whole.invars[0]) != _shape(part.invars[0])
              and _shape(whole.outvars[0]) == _shape(part.outvars[0]))
    scale = c_whole / c_part if summed else None
    weights.add(None if summed and math.isclose(scale, 1 / parts, rel_tol=1e-6) else
                scale if summed else "other")
  if len(weights) == 1:
    weight = weights.pop()
    return None if weight == "other" else weight
  if weights - {None, "other"}:
    warnings.warn(
        f"the loss adds a sum over the batch to a term of another kind (a mean over the "
        f"batch, or a term without the batch such as a weight penalty); its {parts} parts "
        f"(devices' shares, micro-batches) are averaged, which gives the whole batch's value "
        f"only for means plus terms without the batch. Divide the summed terms by the batch "
        f"size, or use ShardParallel without micro-batches (one whole-batch program).",
        errors.JaxdistWarning, stacklevel=2)
  return None


def _constant(v, producer) -> float | None:
  """The value of a scalar literal, possibly cast (as ``jnp.clip`` passes its bound)."""
  while not isinstance(v, jex.Literal):
    eqn = producer.get(v)
    if eqn is None or eqn.primitive.name != "convert_element_type":
      return None
    v = eqn.invars[0]
  return float(v.val) if not _shape(v) else None


def _integral(v, producer) -> bool:
  """Whether ``v`` holds whole numbers by its type: an integer or boolean array, or a
  cast of one (a mask as ``mask.astype(float)``)."""
  while True:
    if jnp.issubdtype(v.aval.dtype, jnp.integer) or v.aval.dtype == jnp.bool_:
      return True
    eqn = None if isinstance(v, jex.Literal) else producer.get(v)
    if eqn is None or eqn.primitive.name != "convert_element_type":
      return False
    v = eqn.invars[0]


def _unclamped(v, producer):
  """The count under a clamp: ``c`` if ``v`` is ``max(c, m)`` (through casts; the idiom
  ``maximum(mask.sum(), 1)`` that avoids 0 / 0) where ``c`` is ``s`` times a sum of whole
  numbers and ``0 < m <= s``, so the clamp changes no count but 0. Weighted by ``c``,
  micro-batches then combine to the whole batch's ``n / max(c, m)`` exactly (a share with
  ``c = 0`` adds nothing, as the whole batch's sum gets nothing from it). ``v`` itself
  otherwise."""
  u = v
  while (not isinstance(u, jex.Literal) and u in producer
         and producer[u].primitive.name == "convert_element_type"):
    u = producer[u].invars[0]
  eqn = None if isinstance(u, jex.Literal) else producer.get(u)
  if eqn is None or eqn.primitive.name != "max" or len(eqn.invars) != 2:
    return v
  for count, bound in (eqn.invars, reversed(eqn.invars)):
    m = _constant(bound, producer)
    summed = None if isinstance(count, jex.Literal) else _scaled_sum(count, producer)
    if m is not None and summed is not None:
      scale, total = summed
      if 0 < m <= scale and _integral(total.invars[0], producer):
        return count
  return v


def loss_normalizer(jaxpr, marker_index: int, params: set):
  """The variable ``d`` of a loss ``n / d`` (the value ``jaxdist.grad``'s marker at
  ``marker_index`` marks) where both are sums over the batch (or means over the same
  count) and ``d`` does not depend on the parameters: a token-weighted mean, ``(loss * mask).sum() / mask.sum()``. Such a
  loss over the whole batch is the ``d``-weighted mean of the micro-batches' (and
  devices') losses, and so are its gradients. None otherwise."""
  marker = jaxpr.eqns[marker_index]
  values = [v for v, kind in zip(marker.invars, marker.params["kinds"]) if kind == "value"]
  return normalizer_of(jaxpr.eqns[:marker_index], values[0], params) if len(values) == 1 else None


def token_weighted(step: TracedStep) -> bool:
  """Whether the step's loss is a token-weighted mean (:func:`loss_normalizer`): with
  ``jaxdist.grad``, the devices' token counts are then summed beside the gradients (XLA
  combines the two all-reduces), which are divided by the sum after their reduction."""
  if step.marker_index is None:
    return False
  jaxpr = step.closed_jaxpr.jaxpr
  return loss_normalizer(jaxpr, step.marker_index, _param_vars(step, jaxpr)) is not None


def padding_guard(jaxpr):
  """A ``before`` hook for ``jaxpr_util.eval_eqns`` on a loss ``jaxpr`` whose value is a
  token-weighted ``n / d`` (:func:`normalizer_of`): the division takes a ``d`` of 0 as 1,
  so a share of the batch that is padding only (``n = d = 0``) adds a loss and gradients
  of 0 instead of 0 / 0."""
  division = next(i for i, e in enumerate(jaxpr.eqns) if jaxpr.outvars[0] in e.outvars)

  def guard(i, operands):
    if i != division:
      return operands
    n, d = operands
    return [n, jnp.where(d == 0, jnp.ones_like(d), d)]

  return guard


def normalizer_of(eqns, value, params: set):
  """:func:`loss_normalizer` of the loss ``value`` computed by ``eqns``."""
  producer = {o: e for e in eqns for o in e.outvars}
  if value not in producer:
    return None
  eqn = producer[value]
  if eqn.primitive.name != "div" or _shape(eqn.outvars[0]) or any(
      isinstance(v, jex.Literal) or _shape(v) for v in eqn.invars):
    return None
  # Both sums, or both means over the same count: each micro-batch's n / d, weighted by
  # its d, then adds up to the whole batch's (a sum over a mean would be off by the
  # number of micro-batches).
  num, den = eqn.invars[0], _unclamped(eqn.invars[1], producer)
  sums = _scaled_sum(num, producer), _scaled_sum(den, producer)
  if None in sums or not math.isclose(sums[0][0], sums[1][0], rel_tol=1e-6):
    return None
  cone = {den}
  for e in reversed(eqns):
    if any(o in cone for o in e.outvars):
      cone.update(v for v in e.invars if not isinstance(v, jex.Literal))
  return None if cone & params else den


def _propagate(eqn, carried, size) -> list:
  name = eqn.primitive.name
  k, p = carried[0]
  out_shapes = [_shape(v) for v in eqn.outvars]
  if name in REDUCTIONS:
    axes = tuple(eqn.params.get("axes", ()))
    if p in axes:
      return [REDUCED] * len(eqn.outvars)
    return [_at(p, p - sum(a < p for a in axes))] * len(eqn.outvars)
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract, batch = (lc, lb) if k == 0 else (rc, rb)
    if p in contract:
      return [REDUCED]
    if p in batch:
      return [_at(p, batch.index(p))]
    lhs_rank = len(_shape(eqn.invars[0]))
    lfree = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    if k == 0:
      return [_at(p, len(lb) + lfree.index(p))]
    rfree = [d for d in range(len(_shape(eqn.invars[1]))) if d not in rc and d not in rb]
    return [_at(p, len(lb) + len(lfree) + rfree.index(p))]
  if name == "conv_general_dilated":
    dn = eqn.params["dimension_numbers"]
    if k == 0 and p == dn.lhs_spec[0]:
      return [_at(p, dn.out_spec[0])]
    return [REDUCED]  # a kernel gradient: the batch is contracted
  if name == "broadcast_in_dim":
    return [_at(p, eqn.params["broadcast_dimensions"][p])] + [None] * (len(eqn.outvars) - 1)
  if name == "transpose":
    return [_at(p, list(eqn.params["permutation"]).index(p))]
  if name.startswith("scatter") and k > 0:  # (``k == 0``: the operand, followed below)
    dn, operand = eqn.params["dimension_numbers"], _shape(eqn.invars[0])
    windows = [d for d in range(len(operand))
               if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for kk, pp in carried:  # the batch rides along a window of the updates
      if kk == 2 and pp in dn.update_window_dims:
        return [_at(pp, windows[dn.update_window_dims.index(pp)])] * len(eqn.outvars)
    # Each example scattered into its own row (a cross entropy's gradient at its label,
    # jax's batched form of it included): the batch is that dim. Scattered to positions
    # their indices choose otherwise (``segment_sum`` over the batch: class prototypes,
    # counts): a sum over examples, as a reduction is.
    extent = _shape(eqn.invars[k])[p]
    rows = [d for i, d in zip(_batched_index_dims(eqn, carried), dn.operand_batching_dims) if i]
    rows += [d for d in dn.scatter_dims_to_operand_dims if operand[d] == extent]
    return [_at(p, rows[0]) if rows else REDUCED] * len(eqn.outvars)
  if name == "concatenate" and eqn.params["dimension"] == p:  # two views of the batch
    stacked = len(carried) == len(eqn.invars) and all(
        a == p and not isinstance(a, _Merged) for _, a in carried)
    return [_Stacked(p) if stacked else None]
  if (name in ("slice", "split") and isinstance(p, _Stacked)
      or name == "pad" and any(eqn.params["padding_config"][p])):  # whole batches (checked)
    return [_Stacked(p) if s[p] > size else int(p) for s in out_shapes]
  if name in ("reshape", "squeeze", "expand_dims"):
    # Merging the batch with the dims after it keeps examples contiguous blocks
    # (``(B, L, D) -> (B * L, D)``: tokens); with dims before it spreads them
    # (``(L, B, D) -> (L * B, D)``); splitting them again gives the batch axis back.
    return [_reshaped(p, _shape(eqn.invars[0]), out_shapes[0], size)]
  # Everything else (elementwise, select, gather, concatenate, slices, custom calls):
  # the batch axis stays where it was if the output still has it there, as large.
  extent = _shape(eqn.invars[k])[p]
  return [p if len(s) > p and s[p] == extent else None for s in out_shapes]
