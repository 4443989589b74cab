"""Compiling a plan made on unrolled scans with the scans kept as loops.

The shard planner unrolls short scans (``jaxpr_util.unroll_scans``): each iteration's
equations are planned, and identical iterations share one solution (``repeats.py``).
When every iteration of a scan got the same constraints, the step need not be compiled
unrolled: the scan runs as a loop whose body carries those constraints, so a stack of
layers written with ``nn.scan`` compiles as one loop body, as it would without jaxdist.
A longer scan, or a ``while`` loop, is planned on a two-iteration stand-in; it always
compiles this way.
Conditionals, planned branch by branch with their outputs as selections, compile as
conditionals (``lax.switch``) whose branches carry their constraints: one branch runs.

The constraints are keyed by where they apply in the rolled jaxpr (calls inlined, scans
kept):

- ``("out", path)`` / ``("in", path)``: outputs / operands of the equation at ``path``
  (``(i,)`` at the top level, ``(i, j)`` for equation ``j`` of scan ``i``'s body, ...);
- ``("xs", path, q)``: the slice of the ``q``-th scanned operand one iteration reads;
- ``("ys", path, q)``: the stacked ``q``-th per-iteration result;
- ``("cond", path, q)``: the ``q``-th output of the conditional at ``path``, whose branch
  ``b``'s equations are at ``path[:-1] + ((path[-1], b), j)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jex
from jax.sharding import NamedSharding

from jaxdist import jaxpr_util


@dataclasses.dataclass(frozen=True)
class Rolled:
  """The rolled jaxpr of a planned step, its constraints (see the module doc), and the
  paths of the scans the planner unrolled (they run as loops carrying constraints)."""

  closed: jex.ClosedJaxpr
  constraints: dict
  scans: frozenset


def roll(closed: jex.ClosedJaxpr, origins: list, eqn_constraints: dict,
         operand_constraints: dict) -> Rolled | str:
  """The plan's constraints (indexed by the unrolled jaxpr's equations, whose
  ``origins`` are given) moved onto ``closed``, the rolled jaxpr; or why they cannot be:
  two iterations of a scan constrained differently."""
  out: dict = {}
  scans = set()
  for origin in origins:
    if origin is not None:
      path = origin[1][::2]
      scans.update(path[:n] for n in range(1, len(path) + (origin[0] != "eqn")))

  entries = [(i, eqn_constraints[i], "out") for i in eqn_constraints] + [
      (i, operand_constraints[i], "in") for i in operand_constraints]
  for index, specs, kind in entries:
    origin = origins[index]
    if origin is None or (kind == "in" and origin[0] != "eqn"):
      continue
    path = origin[1][::2]
    key = ((kind, path) if origin[0] == "eqn" else
           (origin[0], path, origin[3] if origin[0] == "xs" else origin[2]))
    value = specs if origin[0] == "eqn" else specs[0]
    if out.setdefault(key, value) != value:
      return (f"iterations of the scan at equation {origin[1][0]} are planned differently, "
              f"so the step compiles with its scans unrolled")
  return Rolled(closed, out, frozenset(scans))


def rolled_fn(rolled: Rolled, mesh):
  """A function of the flat inputs that evaluates the rolled jaxpr with its constraints
  (scans as ``lax.scan`` loops whose bodies carry theirs)."""
  shardings = {k: (tuple(None if s is None else NamedSharding(mesh, s) for s in v)
                   if k[0] in ("in", "out") else NamedSharding(mesh, v))
               for k, v in rolled.constraints.items()}

  def constrain(values, key):
    wanted = shardings.get(key)
    if wanted is None:
      return values
    return [x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(values, wanted)]

  def one(x, key):
    return x if key not in shardings else jax.lax.with_sharding_constraint(x, shardings[key])

  def evaluate(jaxpr, env, path):
    for i, eqn in enumerate(jaxpr.eqns):
      here = path + (i,)
      invals = constrain([jaxpr_util.read(env, v) for v in eqn.invars], ("in", here))
      if eqn.primitive.name == "scan" and here in rolled.scans:
        outs = scan(eqn, invals, here)
      elif eqn.primitive.name == "while" and here in rolled.scans:
        outs = while_loop(eqn, invals, here)
      elif eqn.primitive.name == "cond":  # always written out for planning
        outs = cond(eqn, invals, here)
      else:
        outs = jaxpr_util.bind_eqn(eqn, invals)
      for v, x in zip(eqn.outvars, constrain(outs, ("out", here))):
        if not isinstance(v, jex.DropVar):
          env[v] = x

  def carried(body, carry, here):
    """``carry`` constrained as the loop body makes it: each value the body computes
    for the next iteration has its equation's constraint, and the loop carries it so (left
    to XLA, a GRU's hidden state, planned gathered, was carried split and gathered anew in
    every iteration: 24 all-gathers the plan did not have)."""
    made = {o: (j, pos) for j, e in enumerate(body.eqns) for pos, o in enumerate(e.outvars)}
    out = []
    for x, v in zip(carry, body.outvars):
      j, pos = made.get(v, (None, None)) if not isinstance(v, jex.Literal) else (None, None)
      wanted = shardings.get(("out", here + (j,))) if j is not None else None
      out.append(x if wanted is None or wanted[pos] is None
                 else jax.lax.with_sharding_constraint(x, wanted[pos]))
    return out

  def scan(eqn, invals, here):
    p = eqn.params
    body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts = invals[:n_consts]

    def step(carry, xs):
      carry = carried(body.jaxpr, carry, here)
      xs = [one(x, ("xs", here, q)) for q, x in enumerate(xs)]
      env = dict(zip(body.jaxpr.constvars, body.consts))
      env.update(zip(body.jaxpr.invars, [*consts, *carry, *xs]))
      evaluate(body.jaxpr, env, here)
      outs = [jaxpr_util.read(env, v) for v in body.jaxpr.outvars]
      return outs[:n_carry], outs[n_carry:]

    with eqn.ctx.manager:
      carry, ys = jax.lax.scan(step, carried(body.jaxpr, invals[n_consts:n_consts + n_carry],
                                             here),
                               invals[n_consts + n_carry:], length=p["length"],
                               reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *(one(y, ("ys", here, q)) for q, y in enumerate(ys))]

  def while_loop(eqn, invals, here):
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond:n_cond + n_body]

    def body_fn(carry):
      body = p["body_jaxpr"]
      carry = carried(body.jaxpr, carry, here)
      env = dict(zip(body.jaxpr.constvars, body.consts))
      env.update(zip(body.jaxpr.invars, [*body_consts, *carry]))
      evaluate(body.jaxpr, env, here)
      return [jaxpr_util.read(env, v) for v in body.jaxpr.outvars]

    def cond_fn(carry):
      closed = p["cond_jaxpr"]
      env = dict(zip(closed.jaxpr.constvars, closed.consts))
      env.update(zip(closed.jaxpr.invars, [*cond_consts, *carry]))
      evaluate(closed.jaxpr, env, here[:-1] + ((here[-1], "cond"),))
      return jaxpr_util.read(env, closed.jaxpr.outvars[0])

    with eqn.ctx.manager:
      return list(jax.lax.while_loop(cond_fn, body_fn, carried(
          p["body_jaxpr"].jaxpr, list(invals[n_cond + n_body:]), here)))

  def cond(eqn, invals, here):
    def branch(b, closed):
      def run_branch(*operands):
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, operands))
        evaluate(closed.jaxpr, env, here[:-1] + ((here[-1], b),))
        return [jaxpr_util.read(env, v) for v in closed.jaxpr.outvars]
      return run_branch

    with eqn.ctx.manager:
      outs = jax.lax.switch(invals[0], [branch(b, c) for b, c in
                                        enumerate(eqn.params["branches"])], *invals[1:])
    return [one(y, ("cond", here, q)) for q, y in enumerate(outs)]

  def run(*leaves):
    closed = rolled.closed
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, leaves))
    evaluate(closed.jaxpr, env, ())
    return [jaxpr_util.read(env, v) for v in closed.jaxpr.outvars]

  return run
