"""Rows of a whole batch's random bits, drawn where only those rows are needed.

jax's partitionable threefry (``jax_threefry_partitionable``, the default) gives element
``i`` (row-major over the drawn shape) of ``random_bits(key, shape)`` the bits
``threefry2x32(key, (i >> 32, i & 0xffffffff))``, combined as ``bits1 ^ bits2``. A device
that runs one micro-batch of the step on its own rows draws ``random_bits`` of its own,
smaller shape: every device and micro-batch would get the first rows' bits. This draws
the rows ``[offset, offset + size)`` of the whole batch's bits instead, computing only
those (the same counters, offset), so dropout masks equal the single-device step's.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

from jaxdist import errors, jaxpr_util

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def supported(key, bit_width: int, full_shape: tuple[int, ...]) -> bool:
  """Whether :func:`rows` reproduces ``random_bits`` for this key, width and shape."""
  return (jax.config.jax_threefry_partitionable and bit_width in _UINT
          and math.prod(full_shape) < 2 ** 32 and getattr(key, "shape", None) == ()
          and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
          and "threefry" in str(jax.random.key_impl(key)))


def rows(key, bit_width: int, full_shape: tuple[int, ...], dim: int, size: int, offset,
         anchor=None):
  """``random_bits(key, bit_width, full_shape)`` sliced to ``[offset, offset + size)`` on
  dimension ``dim`` (``offset`` may be traced). ``anchor``: a value the draw is made to
  wait for (see :func:`row_hooks`); the bits do not depend on it."""
  shape = full_shape[:dim] + (size,) + full_shape[dim + 1:]
  strides = [math.prod(full_shape[d + 1:]) for d in range(len(full_shape))]
  data = jax.random.key_data(key)
  if anchor is not None:  # + 0 from the anchor, which XLA cannot fold (0 × x is 0 or NaN)
    data = data + (anchor.reshape(-1)[0] * 0 == 1).astype(data.dtype)
  index = jnp.asarray(offset).astype(jnp.uint32) * jnp.uint32(strides[dim])
  for d, stride in enumerate(strides):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
  k1, k2 = (jnp.broadcast_to(data[j], shape) for j in (0, 1))
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros(shape, jnp.uint32), index)
  return (bits1 ^ bits2).astype(_UINT[bit_width])


def partial_draws(eqns, full_eqns, to_full: dict[int, int], ids, parts: int) -> dict:
  """The ``random_bits`` equations among ``eqns[ids]`` that draw ``1 / parts`` of their
  counterpart in ``full_eqns`` (``to_full``: index → counterpart) on one dimension: the
  same code traced at a part of the batch. Returns index → (that dimension, full shape),
  or, for a call or a rematerialized block (``nn.remat``) drawing inside, index → the
  draws of its body (this dict again)."""
  draws = {}
  for i in ids:
    j = to_full.get(i)
    if j is None or eqns[i].primitive.name != full_eqns[j].primitive.name:
      continue
    if eqns[i].primitive.name == "random_bits":
      small, big = eqns[i].params["shape"], full_eqns[j].params["shape"]
      differ = [d for d, (a, b) in enumerate(zip(small, big)) if a != b]
      if (len(small) == len(big) and len(differ) == 1
          and big[differ[0]] == small[differ[0]] * parts):
        draws[i] = (differ[0], tuple(big))
    elif eqns[i].primitive.name in _BODIES:
      body, full_body = (jaxpr_util.call_body(e).jaxpr for e in (eqns[i], full_eqns[j]))
      inner = partial_draws(body.eqns, full_body.eqns, jaxpr_util.align(body.eqns, full_body.eqns),
                            range(len(body.eqns)), parts)
      if inner:
        draws[i] = inner
  return draws


def count(draws: dict) -> int:
  """How many random_bits equations ``draws`` (:func:`partial_draws`) holds."""
  return sum(count(d) if isinstance(d, dict) else 1 for d in draws.values())


# Calls whose bodies may draw: jit-like calls are evaluated inline, a rematerialized block
# again as one (``jax.checkpoint`` with its policy), so it is still recomputed, and a scan
# (``nn.scan``) again as one.
_BODIES = frozenset(jaxpr_util.CALLS) | {"remat2", "scan"}


def row_hooks(eqns, draws: dict, part: Callable, before=None, after=None, anchors=None,
              anchored=frozenset()):
  """``before`` / ``after`` hooks for ``jaxpr_util.eval_eqns`` that make each of
  ``draws`` (:func:`partial_draws`) draw part ``part()`` (a tracer is fine) of the whole
  batch's bits: its rows ``[part() · size, (part() + 1) · size)``. A call drawing inside
  is evaluated again with its body's draws so (XLA drops the first evaluation, unused). A
  draw this module cannot reproduce (another key type) keeps its own bits. The given
  hooks run too (``before`` first, ``after`` last).

  Each draw in ``anchored`` (indices) waits for the last floating-point value
  computed before it in program order by an equation in ``anchors`` (indices; None: any),
  say those reading the batch. XLA:CPU runs threefry as a loop over arrays of the draw's
  shape, and without the anchor it ran every draw, which depends on the key alone, at the
  start of the forward pass, keeping all the bits until their use: worth it for a mask
  the backward pass reads anyway, not for a recomputed block's (with the recomputation's
  key tied too, ``jaxdist.recompute``: a ViT with dropout under ZeRO-3 with recomputed
  blocks went from 59.5 to 34.5 MB per device)."""
  operands = {}
  anchor = [None]

  def keep_operands(i, invals):
    if before is not None:
      invals = before(i, invals)
    if i in draws:
      operands[i] = invals
    return invals

  def draw_rows(i, outs):
    if i in draws:
      invals, eqn = operands.pop(i), eqns[i]
      if isinstance(draws[i], dict):
        outs = _call_with_rows(eqn, invals, draws[i], part)
      else:
        (dim, shape), width = draws[i], eqn.params["bit_width"]
        size = eqn.params["shape"][dim]
        if supported(invals[0], width, shape):
          outs = [rows(invals[0], width, shape, dim, size, part() * size,
                       anchor[0] if i in anchored else None)]
        else:
          # Another generator (an rbg key's): its bits for a part of the shape are not the
          # whole draw's rows. The whole batch's bits are drawn here and this part's kept.
          _warn_whole_draw(invals[0], shape)
          whole = eqn.primitive.bind(*invals, **{**eqn.params, "shape": tuple(shape)})
          outs = [lax.dynamic_slice_in_dim(whole, part() * size, size, dim)]
    outs = after(i, outs) if after is not None else outs
    if anchored and (anchors is None or i in anchors):
      anchor[0] = next((o for o in outs if isinstance(o, jax.Array) and getattr(o, "size", 0)
                        and jnp.issubdtype(o.dtype, jnp.floating)), anchor[0])
    return outs

  return keep_operands, draw_rows


def _warn_whole_draw(key, shape) -> None:
  warnings.warn(
      f"random bits of shape {tuple(shape)} from an {jax.random.key_impl(key)} key are "
      f"drawn whole on every device "
      f"and micro-batch, which keeps its own rows (exact, but the whole batch's bits are "
      f"computed each time); a threefry key (jax's default, with "
      f"jax_threefry_partitionable) draws only the rows it needs.", errors.JaxdistWarning,
      stacklevel=2)


def _call_with_rows(eqn, invals, draws: dict, part: Callable) -> list:
  body = jaxpr_util.call_body(eqn)

  def evaluate(*args):
    env = dict(zip(body.jaxpr.constvars, body.consts))
    env.update(zip(body.jaxpr.invars, args))
    before, after = row_hooks(body.jaxpr.eqns, draws, part)
    jaxpr_util.eval_eqns(body.jaxpr, env, before=before, after=after)
    return [jaxpr_util.read(env, v) for v in body.jaxpr.outvars]

  if eqn.primitive.name == "remat2":
    evaluate = jax.checkpoint(evaluate, prevent_cse=eqn.params["prevent_cse"],
                              policy=eqn.params["policy"])
  if eqn.primitive.name == "scan":
    num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = (invals[:num_consts], invals[num_consts:num_consts + num_carry],
                         invals[num_consts + num_carry:])

    def iteration(carry, x):
      outs = evaluate(*consts, *carry, *x)
      return outs[:num_carry], outs[num_carry:]

    carry, ys = lax.scan(iteration, carry, xs, length=eqn.params["length"],
                         reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
    return [*carry, *ys]
  return list(evaluate(*invals))
