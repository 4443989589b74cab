"""Finding the stack of identical layers in a loss (what the SPMD pipeline runtime runs).

Layers come from the loss's boundaries or its clustering (``layers.py``). A *stack* is
the longest run of consecutive layers whose equations are the same, equation by
equation (primitive, shapes, parameters, literals), and which read their inputs the
same way. Each input of the run's first layer (the *template*) then has one role:

- a *weight*: a different value in every layer, from before the stack (``block_i``'s
  kernel, or that kernel cast to bf16); the runtime stacks them into one
  ``[layers, ...]`` array;
- a *carry*: for every later layer, a value the layer before computed at the same
  place (the hidden state); the first layer reads it from before the stack;
- *shared*: the same value in every layer (an attention mask computed before the stack,
  a batch input).

Anything else (a layer reading a value two layers back, a per-layer value computed
before the stack, a value of an inner layer read after the stack) means the layers are
not a stack, and the reason is returned instead.
"""

from __future__ import annotations

import dataclasses

import jax.extend.core as jex
import numpy as np

from jaxdist import jaxpr_util
from jaxdist.pipeline import layers as layers_mod
from jaxdist.shard.repeats import find_repeats

# How many repeated runs (most matrix work first) are tried as the stack.
MAX_CANDIDATES = 4


@dataclasses.dataclass(frozen=True)
class Stack:
  """A run of identical layers of a loss jaxpr, or a scan over stacked layers.

  Attributes:
    source: how it was found (for the plan's notes).
    num_layers: how many layers.
    layers: (first, last + 1) layer indices of a run of layers (None for a scan).
    start, end: its equation range in the loss jaxpr.
    scan: for a scan over stacked weights, its equation's index (``start``); the layer
      is its body. None: the layer is the run's first layer (the *template*).
    template: equation ids of one layer in its jaxpr (the loss's or the scan body's).
    weight_vars: the template's per-layer inputs.
    weights: per weight input, the loss value it is in each layer (a run of layers: a
      parameter, or a value computed from it before the stack, say cast to bf16), or
      ``()`` for a scan.
    stacked: per weight input, the loss value holding all layers' (a scan's ``xs``).
    carry_in: the template's carried inputs; ``carry_init``: their values before the
      stack (loss vars).
    carry_src: per carried input, the template's value that the next layer reads there.
    carry_out: per carried input, the loss var holding the last layer's value.
    shared: the template's inputs that every layer reads; ``shared_init``: their values
      (loss vars or literals).
  """

  source: str
  num_layers: int
  layers: tuple[int, int] | None
  start: int
  end: int
  scan: int | None
  template: tuple[int, ...]
  weight_vars: tuple
  weights: tuple[tuple, ...]
  stacked: tuple
  carry_in: tuple
  carry_init: tuple
  carry_src: tuple
  carry_out: tuple
  shared: tuple
  shared_init: tuple


def _key(eqn) -> tuple:
  """What must agree for two equations to be the same computation."""
  params = tuple(sorted((k, str(v)) for k, v in eqn.params.items()))
  avals = tuple(str(v.aval) for v in list(eqn.invars) + list(eqn.outvars))
  literals = tuple(repr(v.val) if isinstance(v, jex.Literal) else None for v in eqn.invars)
  return eqn.primitive.name, avals, params, literals


def layer_eqns(jaxpr, starts) -> list[list[int]]:
  """Per layer, its equation ids (boundary markers left out)."""
  skip = set(i for i, e in enumerate(jaxpr.eqns) if e.primitive is layers_mod.boundary_p)
  ends = list(starts[1:]) + [len(jaxpr.eqns)]
  return [[i for i in range(a, b) if i not in skip] for a, b in zip(starts, ends)]


def _longest_run(keys: list) -> tuple[int, int]:
  best, first = (0, 0), 0
  for layer in range(1, len(keys) + 1):
    if layer == len(keys) or keys[layer] != keys[first] or not keys[first]:
      if layer - first > best[1] - best[0]:
        best = (first, layer)
      first = layer
  return best


def find_stack(jaxpr, num_consts: int, starts) -> Stack | str:
  """The stack of identical layers of the loss ``jaxpr`` cut at ``starts``, or why not."""
  ids = layer_eqns(jaxpr, starts)
  keys = [tuple(_key(jaxpr.eqns[i]) for i in layer) for layer in ids]
  first, last = _longest_run(keys)
  if last - first < 2:
    return (f"no two consecutive layers of the {len(ids)} are identical (same equations on "
            f"the same shapes)")
  template = ids[first]
  defined_in = {}  # var -> layer index of the run that defines it
  for layer in range(first, last):
    for i in ids[layer]:
      for v in jaxpr.eqns[i].outvars:
        defined_in[v] = layer
  reads = []  # the template's inputs, in order of first use
  for i in template:
    for v in jaxpr.eqns[i].invars:
      if not isinstance(v, jex.Literal) and defined_in.get(v) != first and v not in reads:
        reads.append(v)
  # Per layer, template var -> that layer's var at the same place.
  maps = []
  for layer in range(first, last):
    mapping = {}
    for ti, li in zip(template, ids[layer]):
      te, le = jaxpr.eqns[ti], jaxpr.eqns[li]
      for tv, lv in zip(list(te.invars) + list(te.outvars), list(le.invars) + list(le.outvars)):
        if isinstance(tv, jex.Literal):
          continue
        if mapping.setdefault(tv, lv) is not lv:
          return f"layers {first} and {layer} read their inputs differently"
    maps.append(mapping)
  weight_vars, weights, carry_in, carry_src, shared = [], [], [], [], []
  template_defs = {v for i in template for v in jaxpr.eqns[i].outvars}
  # Per layer, its value -> the template's value computed at the same place.
  backs = [{lv: t for t, lv in mp.items() if t in template_defs} for mp in maps]
  for tv in reads:
    seen = [mp[tv] for mp in maps]
    if all(v is tv for v in seen):
      shared.append(tv)
    elif len(set(seen)) == len(seen) and not any(v in defined_in for v in seen):
      weight_vars.append(tv)  # a value of its own in each layer, from before the stack
      weights.append(tuple(seen))
    else:
      # A carry: in layer r > first, the value layer r - 1 computed at one template place.
      sources = set()
      for r in range(1, len(maps)):
        sources.add(backs[r - 1].get(seen[r]))
      if len(sources) != 1 or None in sources:
        return (f"layer {first}'s input {tv} is neither the same value in every layer, a "
                f"parameter of its own in each, nor the previous layer's output")
      carry_in.append(tv)
      carry_src.append(sources.pop())
  carry_out = tuple(maps[-1][v] for v in carry_src)
  start, end = starts[first], (starts[last] if last < len(starts) else len(jaxpr.eqns))
  later = {v for i in range(end, len(jaxpr.eqns)) for v in jaxpr.eqns[i].invars
           if not isinstance(v, jex.Literal)}
  later |= {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
  leaked = [v for v in later if v in defined_in and v not in carry_out]
  if leaked:
    return (f"a value computed inside layer {defined_in[leaked[0]]} of the run "
            f"{first}..{last - 1} is read after it")
  if not weight_vars:
    return f"layers {first}..{last - 1} are identical but have no parameters of their own"
  return Stack(source=f"layers {first}..{last - 1} of {len(ids)} are identical",
               num_layers=last - first, layers=(first, last), start=start, end=end, scan=None, template=tuple(template),
               weight_vars=tuple(weight_vars), weights=tuple(weights), stacked=(),
               carry_in=tuple(carry_in), carry_init=tuple(carry_in), carry_src=tuple(carry_src),
               carry_out=carry_out, shared=tuple(shared), shared_init=tuple(shared))


def find_repeated_stack(jaxpr, num_consts: int) -> tuple[Stack, tuple[int, ...]] | str:
  """The stack among the loss's equations without given layers: a tandem repeat of its
  equations (as the shard planner finds repeated layers; a block under ``nn.remat`` is
  one equation), the one doing the most matrix work first, its copies taken as layers
  from the first phase at which they read their inputs as a stack.

  Returns the stack and the layer starts it was found with, or why there is none.
  """
  flops = np.cumsum([0.0] + [jaxpr_util.eqn_flops(e) for e in jaxpr.eqns])
  work = lambda r: flops[r.start + r.period * r.copies] - flops[r.start]
  repeats = sorted((r for r in find_repeats(jaxpr.eqns, 1) if work(r) > 0), key=work,
                   reverse=True)
  if not repeats:
    return "no run of equations with matrix products repeats in the loss"
  reason = "no repeated run of equations forms a stack of layers"
  for best in repeats[:MAX_CANDIDATES]:
    end = best.start + best.period * best.copies
    for start in range(best.start, best.start + best.period):
      copies = (end - start) // best.period
      if copies < 2:
        break
      cuts = {0, *(start + i * best.period for i in range(copies + 1))} - {len(jaxpr.eqns)}
      starts = tuple(sorted(cuts))
      found = find_stack(jaxpr, num_consts, starts)
      if isinstance(found, Stack) and found.num_layers == copies:
        return dataclasses.replace(found, source=f"{copies} repeated runs of {best.period} "
                                   f"equations are identical layers"), starts
      if isinstance(found, str):
        reason = f"{copies} repeated runs of {best.period} equations: {found}"
  return reason


def find_scanned_stack(jaxpr, num_consts: int) -> Stack | None:
  """The loss's forward scan over stacked weights (``nn.scan`` / ``lax.scan`` over
  layers), the one doing the most work, whose per-layer outputs nothing reads; or None."""
  weights = set(jaxpr.invars[num_consts:])
  read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jex.Literal)}
  read |= {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
  best = None
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "scan" or eqn.params["reverse"] or eqn.params["length"] < 2:
      continue
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    xs = eqn.invars[nc + ncarry:]
    if not any(v in weights for v in xs) or any(v in read for v in eqn.outvars[ncarry:]):
      continue
    flops = jaxpr_util.eqn_flops(eqn)
    if best is None or flops > best[0]:
      best = (flops, i, eqn)
  if best is None:
    return None
  _, i, eqn = best
  nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
  body = eqn.params["jaxpr"].jaxpr
  return Stack(
      source=f"the scan at loss equation {i} runs {eqn.params['length']} layers",
      num_layers=eqn.params["length"], layers=None, start=i, end=i + 1, scan=i,
      template=tuple(range(len(body.eqns))), weight_vars=tuple(body.invars[nc + ncarry:]),
      weights=(), stacked=tuple(eqn.invars[nc + ncarry:]),
      carry_in=tuple(body.invars[nc:nc + ncarry]), carry_init=tuple(eqn.invars[nc:nc + ncarry]),
      carry_src=tuple(body.outvars[:ncarry]), carry_out=tuple(eqn.outvars[:ncarry]),
      shared=tuple(body.invars[:nc]), shared_init=tuple(eqn.invars[:nc]))
