"""Re-interpreting jaxprs: evaluate, inline calls, slice, and trace dependencies."""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.extend.core as jex
from jax.interpreters import ad, batching, mlir

# jaxdist's gradient marker: an identity, dropped when it is named in ``inline``.
IDENTITY_MARKER = "jaxdist_grad_marker"
# Every identity marker jaxdist puts in a step (gradients, pipeline layers): planners
# see through them.
MARKERS = (IDENTITY_MARKER, "jaxdist_layer_marker")
# Call-like primitives whose body is inlined when a jaxpr is flattened.
CALLS = ("jit", "pjit", "closed_call", "core_call")
# What the shard planner inlines: after differentiation a custom_jvp/custom_vjp call is
# just its primal function, and a rematerialized block (jax.checkpoint, nn.remat) its body
# behind an optimization barrier (what jax lowers it to).
PLAN_CALLS = CALLS + ("custom_jvp_call", "custom_vjp_call", "remat2")
# What the shard planner flattens: PLAN_CALLS, scans of at most MAX_UNROLLED_SCAN
# iterations unrolled (a stack of layers written with nn.scan / lax.scan), so each
# iteration's equations are planned (identical iterations share one solution), and
# conditionals written out branch by branch; the step still compiles with the scans as
# loops and the conditionals as conditionals (see jaxdist.shard.rolled).
PLAN_INLINE = PLAN_CALLS + ("scan",)
MAX_UNROLLED_SCAN = 128
# With micro-batches the step compiles with its unrolled scans unrolled, and XLA's compile
# time grows faster than the iterations of a recursion it unrolls: a CTC loss's scan over
# 10, 20, 30 and 40 time steps compiled in 4.2, 11.8, 31.9 and 76.6 s unrolled, 1.6 s as
# a loop (XLA's own unroll=True took as long). There a scan over more steps than this whose
# scanned operands are no stacked weights (a loop over time, not over layers) is
# left rolled (see ``recursions``).
MAX_UNROLLED_RECURSION = 16


def identity_marker(name: str) -> jex.Primitive:
  """An identity primitive over any number of values that marks a place in a jaxpr: it
  lowers to nothing, batches value by value, and tangents pass through it unmarked."""
  p = jex.Primitive(name)
  p.multiple_results = True
  p.def_impl(lambda *xs, **params: list(xs))
  p.def_abstract_eval(lambda *avals, **params: list(avals))
  mlir.register_lowering(p, lambda ctx, *xs, **params: list(xs))
  batching.primitive_batchers[p] = lambda args, dims, **params: (p.bind(*args, **params), dims)
  ad.primitive_jvps[p] = (
      lambda primals, tangents, **params: (p.bind(*primals, **params), list(tangents)))
  return p


def read(env, v):
  """The value of a jaxpr atom: a literal's value or the variable's binding."""
  return v.val if isinstance(v, jex.Literal) else env[v]


def bind_eqn(eqn, invals: Sequence) -> list:
  """Evaluates one equation on concrete values or tracers; returns its outputs."""
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def eval_eqns(jaxpr, env: dict, eqn_ids: Iterable[int] | None = None,
              inline: Sequence[str] = (), substitute: dict | None = None,
              after: Callable | None = None, before: Callable | None = None) -> dict:
  """Evaluates equations of ``jaxpr`` in order, reading and writing ``env`` (var → value).

  Args:
    jaxpr: an open jaxpr whose invars/constvars needed are already in ``env``.
    env: bindings; updated in place and returned.
    eqn_ids: which equations to evaluate (default all), in jaxpr order.
    inline: primitive names whose bodies are evaluated instead of binding them.
    substitute: equation index → output values to use instead of evaluating it.
    after: ``after(index, outputs) -> outputs`` applied to each evaluated equation's
      outputs (to add sharding constraints).
    before: ``before(index, operands) -> operands`` applied to each evaluated
      equation's operands.
  """
  ids = range(len(jaxpr.eqns)) if eqn_ids is None else sorted(eqn_ids)
  for i in ids:
    eqn = jaxpr.eqns[i]
    if substitute and i in substitute:
      outs = substitute[i]
    else:
      invals = [read(env, v) for v in eqn.invars]
      if before is not None:
        invals = before(i, invals)
      sub = call_body(eqn) if eqn.primitive.name in inline else None
      if eqn.primitive.name in inline and eqn.primitive.name == IDENTITY_MARKER:
        outs = list(invals)
      elif sub is not None:
        inner = dict(zip(sub.jaxpr.constvars, sub.consts))
        inner.update(zip(sub.jaxpr.invars, invals))
        eval_eqns(sub.jaxpr, inner, inline=inline)
        outs = [read(inner, v) for v in sub.jaxpr.outvars]
      else:
        outs = bind_eqn(eqn, invals)
      if after is not None:
        outs = after(i, outs)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jex.DropVar):
        env[v] = x
  return env


def eval_closed(closed: jex.ClosedJaxpr, args: Sequence) -> list:
  """The outputs of ``closed`` on ``args`` (evaluated equation by equation)."""
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  eval_eqns(closed.jaxpr, env)
  return [read(env, v) for v in closed.jaxpr.outvars]


def constraint_hook(mesh, eqn_constraints: dict) -> Callable:
  """An ``after`` hook for :func:`eval_eqns` that puts the outputs of the equations in
  ``eqn_constraints`` (index → one ``PartitionSpec`` per output) in those shardings.

  ``mesh=None`` leaves the specs bare, for the mesh in context: inside a ``shard_map``
  that is the abstract mesh whose manual axes the specs must not name.
  """
  shardings = {i: [s if mesh is None else jax.sharding.NamedSharding(mesh, s) for s in specs]
               for i, specs in eqn_constraints.items()}

  def after(i, outs):
    if i not in shardings:
      return outs
    return [jax.lax.with_sharding_constraint(o, s) for o, s in zip(outs, shardings[i])]

  return after


def operand_hook(mesh, operand_constraints: dict) -> Callable:
  """A ``before`` hook for :func:`eval_eqns`: the operands named in
  ``operand_constraints`` (index → one ``PartitionSpec`` or None per operand) are put in
  those shardings before the equation runs (``mesh=None`` as in :func:`constraint_hook`)."""
  shardings = {i: [s if mesh is None or s is None else jax.sharding.NamedSharding(mesh, s)
                   for s in specs] for i, specs in operand_constraints.items()}

  def before(i, invals):
    if i not in shardings:
      return invals
    return [x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(invals, shardings[i])]

  return before


def call_body(eqn) -> jex.ClosedJaxpr | None:
  """The body of a call-like equation (jit, remat, custom_vjp, ...) as a closed jaxpr."""
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if isinstance(body, jex.ClosedJaxpr):
    return body
  if isinstance(body, jex.Jaxpr):
    return jex.ClosedJaxpr(body, ())
  return None


def inline_calls(closed: jex.ClosedJaxpr, primitives: Sequence[str] = CALLS,
                 batch: frozenset[int] | None = None) -> jex.ClosedJaxpr:
  """The same computation with the bodies of ``primitives`` inlined at the top level
  (``closed`` itself when it calls none of them).

  Rewrites the equations (nothing is traced again): a body's equations get fresh
  variables, since one body may be called at several places, and its constants become
  constants of the result. With ``"scan"`` among ``primitives``, calls inside scan bodies
  are inlined too and a scan of at most :data:`MAX_UNROLLED_SCAN` iterations becomes its
  body once per iteration (:func:`unroll_scans`); given the ``batch`` inputs, not the
  long :func:`recursions`.
  """
  if "scan" in primitives:
    calls = tuple(p for p in primitives if p != "scan")
    inlined = _inline(closed, calls, deep=True)
    return unroll_scans(inlined, keep=recursions(inlined, batch))[0]
  return _inline(closed, primitives, deep=False)


def rolled_and_unrolled(closed: jex.ClosedJaxpr, long_scans: bool = False,
                        batch: frozenset[int] | None = None):
  """For the shard planner: (``closed`` with :data:`PLAN_CALLS` inlined, also inside scan
  bodies; that with its short scans unrolled, which is ``inline_calls(closed,
  PLAN_INLINE, batch)``, and with ``long_scans`` the longer ones as stand-ins; per
  unrolled equation its origin and weight, see :func:`unroll_scans`)."""
  rolled = _inline(closed, PLAN_CALLS, deep=True)
  return (rolled, *unroll_scans(rolled, long_scans, recursions(rolled, batch)))


def recursions(closed: jex.ClosedJaxpr, batch: frozenset[int] | None) -> frozenset[int]:
  """The top-level scans of ``closed`` (equation indices) over more than
  :data:`MAX_UNROLLED_RECURSION` steps that scan no stacked weights (no scanned operand
  comes from the inputs but not from the ``batch`` ones): loops over time (an RNN, a
  CTC loss), not over stacked layers, whose forward and backward scans both scan their
  weights. None of them without ``batch``."""
  if batch is None:
    return frozenset()
  jaxpr = closed.jaxpr
  scans = [(i, e.invars[e.params["num_consts"] + e.params["num_carry"]:])
           for i, e in enumerate(jaxpr.eqns)
           if e.primitive.name == "scan" and e.params["length"] > MAX_UNROLLED_RECURSION]
  if not scans:
    return frozenset()
  mask = sum(1 << k for k in batch)
  deps = dependencies(jaxpr, len(jaxpr.invars), [v for _, xs in scans for v in xs])
  kept, at = [], 0
  for i, xs in scans:
    # (a scanned operand from inputs none of which is a batch one: stacked weights)
    if not any(d and not d & mask for d in deps[at:at + len(xs)]):
      kept.append(i)
    at += len(xs)
  return frozenset(kept)


def _inline(closed: jex.ClosedJaxpr, primitives: Sequence[str], deep: bool) -> jex.ClosedJaxpr:
  """:func:`inline_calls` without unrolling; ``deep``: inside the bodies of loops and the
  branches of conditionals too."""
  if not any(e.primitive.name in primitives
             or (deep and e.primitive.name in ("scan", "cond", "while"))
             for e in closed.jaxpr.eqns):
    return closed
  constvars, consts, eqns = list(closed.jaxpr.constvars), list(closed.consts), []

  def emit(jaxpr, sub: dict, fresh: bool) -> None:
    for eqn in jaxpr.eqns:
      invars = [v if isinstance(v, jex.Literal) else sub.get(v, v) for v in eqn.invars]
      name = eqn.primitive.name
      body = call_body(eqn) if name in primitives else None
      if name in primitives and name == IDENTITY_MARKER:
        sub.update((o, i) for o, i in zip(eqn.outvars, invars))
      elif body is not None:
        if name == "remat2" and eqn.params["prevent_cse"] and eqn.params["differentiated"]:
          invars = _barrier(invars, eqn, eqns)  # the recomputation stays a recomputation
        inner = dict(zip(body.jaxpr.invars, invars))
        for v, c in zip(body.jaxpr.constvars, body.consts):
          inner[v] = jex.Var(v.aval)
          constvars.append(inner[v])
          consts.append(c)
        emit(body.jaxpr, inner, True)
        sub.update((o, v if isinstance(v, jex.Literal) else inner.get(v, v))
                   for o, v in zip(eqn.outvars, body.jaxpr.outvars))
      else:
        outvars = eqn.outvars
        if fresh:
          outvars = [o if isinstance(o, jex.DropVar) else jex.Var(o.aval) for o in outvars]
          sub.update(zip(eqn.outvars, outvars))
        params = eqn.params
        if deep and name == "scan":
          params = dict(params, jaxpr=_inline(params["jaxpr"], primitives, deep=True))
        elif deep and name == "cond":
          params = dict(params, branches=tuple(_inline(b, primitives, deep=True)
                                               for b in params["branches"]))
        elif deep and name == "while":
          params = dict(params, body_jaxpr=_inline(params["body_jaxpr"], primitives, deep=True),
                        cond_jaxpr=_inline(params["cond_jaxpr"], primitives, deep=True))
        eqns.append(eqn.replace(invars=invars, outvars=outvars, params=params))

  top: dict = {}
  emit(closed.jaxpr, top, False)
  outvars = [v if isinstance(v, jex.Literal) else top.get(v, v) for v in closed.jaxpr.outvars]
  jaxpr = jex.Jaxpr(constvars, closed.jaxpr.invars, outvars, eqns, closed.jaxpr.effects,
                    closed.jaxpr.debug_info)
  return jex.ClosedJaxpr(jaxpr, consts)


def unroll_scans(closed: jex.ClosedJaxpr, long_scans: bool = False,
                 keep: frozenset[int] = frozenset()):
  """``closed`` with every scan of at most :data:`MAX_UNROLLED_SCAN` iterations written
  out once per iteration, each iteration reading its slice of the scanned operands and
  the per-iteration results stacked, and every conditional written out branch by branch,
  each output a ``select_n`` of the branches' on the branch index (nested ones too, also
  inside each other); and per equation of the result its origin in ``closed``:

  - ``("eqn", path)``: the equation at ``path``: ``(i,)`` is ``closed``'s equation ``i``;
    ``(i, r, j)`` equation ``j`` of the body of scan ``i`` in iteration ``r``;
    ``((i, b), 0, j)`` equation ``j`` of branch ``b`` of conditional ``i``; and so on
    when nested;
  - ``("xs", path, r, q)``: iteration ``r``'s slice of the ``q``-th scanned operand of
    the scan at ``path``; ``("ys", path, q)``: the stacking of its ``q``-th result;
  - ``("cond", path, q)``: the selection of the conditional's ``q``-th output;
  - None: a reshape inside that stacking.

  With ``long_scans``, a longer scan is written out as two of its iterations (the
  second reads the first one's carry, so a plan that keeps the carry's layout is seen to
  loop), its per-iteration results broadcast from the last one to the stacked shape:
  a stand-in to plan on, not to evaluate. Its equations' weight (the third result, per
  equation) is ``length / 2``: how many times each runs per step. A ``while`` loop's
  body is written out twice the same way, weight 1/2 (its trip count is unknown: priced
  as one iteration, as XLA's module counts it), each time after the loop condition.
  ``keep``: top-level scans (equation indices) to leave as they are.
  """
  def flattened(e, top=None):
    name = e.primitive.name
    return name == "cond" or (name == "while" and long_scans) or (name == "scan" and (
        long_scans or e.params["length"] <= MAX_UNROLLED_SCAN) and top not in keep)

  if not any(flattened(e, i) for i, e in enumerate(closed.jaxpr.eqns)):
    n = len(closed.jaxpr.eqns)
    return closed, [("eqn", (i,)) for i in range(n)], [1.0] * n
  constvars, consts = list(closed.jaxpr.constvars), list(closed.consts)
  eqns, origins, weights = [], [], []

  def emit(jaxpr, sub: dict, fresh: bool, path: tuple, weight: float = 1.0) -> None:
    unread = _unread_in_body(jaxpr) if fresh else frozenset()
    for i, eqn in enumerate(jaxpr.eqns):
      invars = [v if isinstance(v, jex.Literal) else sub.get(v, v) for v in eqn.invars]
      if flattened(eqn, None if path else i):
        flatten = {"scan": _unrolled_scan, "cond": _branches,
                   "while": _while_stand_in}[eqn.primitive.name]
        outs = flatten(eqn, invars, path + (i,), emit, constvars, consts, eqns, origins, weight)
        weights.extend([weight] * (len(eqns) - len(weights)))  # a conditional's selections
        sub.update((o, v) for o, v in zip(eqn.outvars, outs) if not isinstance(o, jex.DropVar))
        continue
      outvars = eqn.outvars
      if fresh:
        outvars = [o if isinstance(o, jex.DropVar) else
                   jex.DropVar(o.aval) if o in unread else jex.Var(o.aval) for o in outvars]
        sub.update(zip(eqn.outvars, outvars))
      eqns.append(eqn.replace(invars=invars, outvars=outvars))
      origins.append(("eqn", path + (i,)))
      weights.append(weight)

  top: dict = {}
  emit(closed.jaxpr, top, False, ())
  outvars = [v if isinstance(v, jex.Literal) else top.get(v, v) for v in closed.jaxpr.outvars]
  jaxpr = jex.Jaxpr(constvars, closed.jaxpr.invars, outvars, eqns, closed.jaxpr.effects,
                    closed.jaxpr.debug_info)
  return jex.ClosedJaxpr(jaxpr, consts), origins, weights


@functools.lru_cache(maxsize=256)
def _unread_in_body(jaxpr) -> frozenset:
  """The variables of a loop body or branch that nothing needs: read by no equation whose
  results are needed, and no output of it (jax keeps some, a max's JVP residue in a while
  loop's body; XLA removes them). Unrolled, they are dropped where they are made."""
  needed = needed_eqns(jaxpr, [*jaxpr.outvars, *(v for e in jaxpr.eqns if e.effects
                                                  for v in e.invars)])
  return frozenset(o for i, eqn in enumerate(jaxpr.eqns) if i not in needed and not eqn.effects
                   for o in eqn.outvars if not isinstance(o, jex.DropVar))


def _unrolled_scan(eqn, invars: list, path: tuple, emit: Callable, constvars: list,
                   consts: list, eqns: list, origins: list, weight: float) -> list:
  """Emits a scan's iterations (``emit(jaxpr, substitution, fresh, path, weight)``
  appends a body's equations) and returns the atoms of the scan's outputs; a scan
  longer than :data:`MAX_UNROLLED_SCAN` as the two-iteration stand-in of
  :func:`unroll_scans`."""
  p = eqn.params
  body, length, n_consts, n_carry = p["jaxpr"], p["length"], p["num_consts"], p["num_carry"]
  stand_in = length > MAX_UNROLLED_SCAN
  inner_consts = {}
  for v, c in zip(body.jaxpr.constvars, body.consts):  # one constant per scan, not per step
    inner_consts[v] = jex.Var(v.aval)
    constvars.append(inner_consts[v])
    consts.append(c)
  scan_consts, carry = invars[:n_consts], invars[n_consts:n_consts + n_carry]
  xs = invars[n_consts + n_carry:]

  def helper(closed, operands, origin, w):
    inner = dict(zip(closed.jaxpr.invars, operands))
    start = len(eqns)
    emit(closed.jaxpr, inner, True, (), w)
    origins[start:] = [None] * (len(eqns) - start - 1) + [origin]
    return [v if isinstance(v, jex.Literal) else inner.get(v, v) for v in closed.jaxpr.outvars]

  steps = list(reversed(range(length)) if p["reverse"] else range(length))
  inner_weight = weight * (length / 2 if stand_in else 1)
  ys = [{} for _ in body.jaxpr.outvars[n_carry:]]
  for r in steps[:2] if stand_in else steps:
    sliced = [helper(_index_jaxpr(x.aval, r), [x], ("xs", path, r, q), inner_weight)[0]
              for q, x in enumerate(xs)]
    inner = dict(inner_consts)
    inner.update(zip(body.jaxpr.invars, [*scan_consts, *carry, *sliced]))
    emit(body.jaxpr, inner, True, path + (r,), inner_weight)
    outs = [v if isinstance(v, jex.Literal) else inner.get(v, v) for v in body.jaxpr.outvars]
    carry = outs[:n_carry]
    for y, v in zip(ys, outs[n_carry:]):
      y[r] = v
  if stand_in:
    stacked = [helper(_broadcast_jaxpr(y[steps[1]].aval, length), [y[steps[1]]],
                      ("ys", path, q), weight)[0] for q, y in enumerate(ys)]
  else:
    stacked = [helper(_stack_jaxpr(y[0].aval, length), [y[r] for r in range(length)],
                      ("ys", path, q), weight)[0] for q, y in enumerate(ys)]
  return [*carry, *stacked]


def _while_stand_in(eqn, invars: list, path: tuple, emit: Callable, constvars: list,
                    consts: list, eqns: list, origins: list, weight: float) -> list:
  """Emits a while loop's condition and body twice, the second time on the first one's
  carry (the stand-in of :func:`unroll_scans`; the condition's equations are at
  ``path[:-1] + ((path[-1], "cond"), r, j)``); returns the second body's carry."""
  p = eqn.params
  n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
  hoisted = {}
  for closed in (p["cond_jaxpr"], p["body_jaxpr"]):
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
      hoisted[v] = jex.Var(v.aval)
      constvars.append(hoisted[v])
      consts.append(c)
  cond_consts, body_consts = invars[:n_cond], invars[n_cond:n_cond + n_body]
  carry = invars[n_cond + n_body:]
  for r in range(2):
    for closed, operands, where in ((p["cond_jaxpr"], cond_consts, path[:-1] + ((path[-1], "cond"), r)),
                                    (p["body_jaxpr"], body_consts, path + (r,))):
      inner = dict(hoisted)
      inner.update(zip(closed.jaxpr.invars, [*operands, *carry]))
      emit(closed.jaxpr, inner, True, where, weight / 2)
    carry = [v if isinstance(v, jex.Literal) else inner.get(v, v)
             for v in p["body_jaxpr"].jaxpr.outvars]
  return carry


def _branches(eqn, invars: list, path: tuple, emit: Callable, constvars: list,
              consts: list, eqns: list, origins: list, weight: float) -> list:
  """Emits every branch of a conditional on its operands (``emit`` as in
  :func:`_unrolled_scan`), then per output a ``select_n`` of the branches' results on
  the branch index (which ``cond`` keeps in range); returns the selections."""
  index, operands = invars[0], invars[1:]
  results = []
  for b, branch in enumerate(eqn.params["branches"]):
    inner = {}
    for v, c in zip(branch.jaxpr.constvars, branch.consts):
      inner[v] = jex.Var(v.aval)
      constvars.append(inner[v])
      consts.append(c)
    inner.update(zip(branch.jaxpr.invars, operands))
    emit(branch.jaxpr, inner, True, path[:-1] + ((path[-1], b), 0), weight)
    results.append([v if isinstance(v, jex.Literal) else inner.get(v, v)
                    for v in branch.jaxpr.outvars])
  outs = []
  for q, (outvar, cases) in enumerate(zip(eqn.outvars, zip(*results))):
    outs.append(jex.Var(outvar.aval))
    eqns.append(jex.new_jaxpr_eqn([index, *cases], [outs[-1]], jax.lax.select_n_p, {},
                                  jex.no_effects, eqn.source_info, eqn.ctx))
    origins.append(("cond", path, q))
  return outs


@functools.lru_cache(maxsize=4096)
def _index_jaxpr(aval, r: int) -> jex.ClosedJaxpr:
  """``x[r]`` of a value of ``aval`` (a slice and a squeeze)."""
  return jax.make_jaxpr(lambda x: jax.lax.index_in_dim(x, r, keepdims=False))(
      jax.ShapeDtypeStruct(aval.shape, aval.dtype))


@functools.lru_cache(maxsize=1024)
def _broadcast_jaxpr(aval, length: int) -> jex.ClosedJaxpr:
  """``length`` copies of a value of ``aval`` along a new leading dim."""
  return jax.make_jaxpr(lambda y: jax.lax.broadcast_in_dim(
      y, (length, *aval.shape), tuple(range(1, 1 + len(aval.shape)))))(
          jax.ShapeDtypeStruct(aval.shape, aval.dtype))


@functools.lru_cache(maxsize=1024)
def _stack_jaxpr(aval, length: int) -> jex.ClosedJaxpr:
  """``stack(ys)`` of ``length`` values of ``aval`` along a new leading dim."""
  y = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
  return jax.make_jaxpr(lambda *ys: jax.lax.concatenate(
      [jax.lax.reshape(v, (1, *aval.shape)) for v in ys], 0))(*[y] * length)


def _barrier(invars: list, eqn, eqns: list) -> list:
  """Appends to ``eqns`` an optimization barrier on each of ``invars``' variables (as jax
  lowers a differentiated ``jax.checkpoint``, which puts one over all of them: XLA may
  not merge the recomputation with the forward pass; one per value keeps each a value
  the planner's elementwise rule follows) and returns ``invars`` with the barriers'
  outputs in their place."""
  out = []
  for v in invars:
    if not isinstance(v, jex.Literal):
      fresh = jex.Var(v.aval)
      eqns.append(jex.new_jaxpr_eqn([v], [fresh], _barrier_primitive(), {}, jex.no_effects,
                                    eqn.source_info, eqn.ctx))
      v = fresh
    out.append(v)
  return out


@functools.cache
def _barrier_primitive() -> jex.Primitive:
  return jax.make_jaxpr(jax.lax.optimization_barrier)(0.0).eqns[0].primitive


def needed_eqns(jaxpr, outvars: Sequence, stop: Iterable[int] = ()) -> set[int]:
  """Indices of the equations needed to compute ``outvars``.

  Equations in ``stop`` are included when needed, but their inputs are not followed
  (their outputs will be substituted).
  """
  stop = set(stop)
  producer = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      producer[v] = i
  needed, todo = set(), [v for v in outvars if not isinstance(v, jex.Literal)]
  while todo:
    i = producer.get(todo.pop())
    if i is None or i in needed:
      continue
    needed.add(i)
    if i not in stop:
      todo += [v for v in jaxpr.eqns[i].invars if not isinstance(v, jex.Literal)]
  return needed


def without_dead_gradients(closed: jex.ClosedJaxpr, marker_name: str,
                           dead_kind: str) -> jex.ClosedJaxpr:
  """``closed`` without the marker outputs of kind ``dead_kind`` that nothing reads, and
  without the equations that then compute nothing read (effect-free ones only).

  A parameter frozen by its optimizer (``optax.set_to_zero`` under
  ``optax.multi_transform``) has a gradient nothing reads; XLA drops its computation and
  reduction, and so must the plan's prices and the estimates.
  """
  jaxpr = closed.jaxpr
  live = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
  kept = []
  changed = False
  for eqn in reversed(jaxpr.eqns):
    used = [not isinstance(v, jex.DropVar) and v in live for v in eqn.outvars]
    if eqn.primitive.name == marker_name and "kinds" in eqn.params:
      keep = [u or kind != dead_kind for u, kind in zip(used, eqn.params["kinds"])]
      if not all(keep):
        changed = True
        pick = lambda xs: [x for x, k in zip(xs, keep) if k]
        eqn = eqn.replace(invars=pick(eqn.invars), outvars=pick(eqn.outvars),
                          params=dict(eqn.params, kinds=tuple(pick(eqn.params["kinds"]))))
    elif not any(used) and not eqn.effects:
      changed = True
      continue
    kept.append(eqn)
    live.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
  if not changed:
    return closed
  return jex.ClosedJaxpr(jaxpr.replace(eqns=kept[::-1]), closed.consts)


def free_invars(jaxpr, eqn_ids: Iterable[int]) -> list[int]:
  """Positions of ``jaxpr.invars`` read by the given equations."""
  used = {v for i in eqn_ids for v in jaxpr.eqns[i].invars if not isinstance(v, jex.Literal)}
  return [k for k, v in enumerate(jaxpr.invars) if v in used]


def eqn_flops(eqn) -> float:
  """Flops of a dot_general or convolution (2 per multiply-add), summed through the
  bodies of calls and loops (a scan's body once per iteration, a while loop's once: its
  trip count is unknown), the costliest branch of a conditional; 0 for other equations."""
  name = eqn.primitive.name
  out = getattr(eqn.outvars[0].aval, "shape", ()) if eqn.outvars else ()
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * math.prod(out) * math.prod(rhs) / out_features
  if name == "scan":
    return eqn.params["length"] * sum(map(eqn_flops, eqn.params["jaxpr"].jaxpr.eqns))
  if name == "cond":
    return max(sum(map(eqn_flops, b.jaxpr.eqns)) for b in eqn.params["branches"])
  return sum(eqn_flops(e) for sub in jex.jaxprs_in_params(eqn.params) for e in sub.eqns)


def find_eqns(jaxpr, primitive_name: str) -> list[int]:
  return [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == primitive_name]


def count_primitive(jaxpr, primitive_name: str, eqn_ids: Iterable[int] | None = None) -> int:
  """How often ``primitive_name`` occurs (in the equations ``eqn_ids``, default all),
  sub-jaxprs included."""
  eqns = jaxpr.eqns if eqn_ids is None else [jaxpr.eqns[i] for i in eqn_ids]
  return sum((eqn.primitive.name == primitive_name)
             + sum(count_primitive(sub, primitive_name) for sub in jex.jaxprs_in_params(eqn.params))
             for eqn in eqns)


def output_dependencies(jaxpr, num_inputs: int) -> list[int]:
  """For each output of ``jaxpr``, the set of inputs it depends on, as a bit mask.

  Call-like equations (jit, custom_jvp/vjp, remat, closed_call) are followed inside;
  loops and conditionals are treated as depending on all their operands.
  """
  return dependencies(jaxpr, num_inputs, jaxpr.outvars)


def dependencies(jaxpr, num_inputs: int, atoms: Sequence, stand_ins: dict | None = None
                 ) -> list[int]:
  """For each of ``atoms`` (variables of ``jaxpr``), its input bit mask (as
  :func:`output_dependencies`). ``stand_ins``: variables made by top-level equations →
  the mask their readers see instead of the variable's own (a step's new state standing
  for its old leaf)."""
  deps = {}
  for k, v in enumerate(jaxpr.invars[:num_inputs]):
    deps[v] = 1 << k
  _propagate(jaxpr, deps, stand_ins or {})
  return [0 if isinstance(v, jex.Literal) else deps.get(v, 0) for v in atoms]


def _propagate(jaxpr, deps: dict, stand_ins: dict | None = None) -> list[int]:
  def get(v):
    return 0 if isinstance(v, jex.Literal) else deps.get(v, 0)

  for eqn in jaxpr.eqns:
    in_deps = [get(v) for v in eqn.invars]
    subs = list(jex.jaxprs_in_params(eqn.params))
    if (len(subs) == 1 and eqn.primitive.name not in ("while", "scan", "cond")
        and len(subs[0].invars) == len(eqn.invars) and len(subs[0].outvars) == len(eqn.outvars)):
      out_deps = _propagate(subs[0], dict(zip(subs[0].invars, in_deps)))
    else:
      union = 0
      for d in in_deps:
        union |= d
      out_deps = [union] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, out_deps):
      deps[v] = stand_ins.get(v, d) if stand_ins else d
  return [get(v) for v in jaxpr.outvars]


def align(eqns, other_eqns) -> dict[int, int]:
  """Equation index in ``eqns`` → its counterpart in ``other_eqns``: the same code traced
  at two batch sizes, aligned by the primitive sequence (jax special-cases a size-1
  dimension, a broadcast more or less; those stay unmatched)."""
  matcher = difflib.SequenceMatcher(None, [e.primitive.name for e in eqns],
                                    [e.primitive.name for e in other_eqns], autojunk=False)
  out = {}
  for a, b, n in matcher.get_matching_blocks():
    out.update(zip(range(a, a + n), range(b, b + n)))
  return out
