"""1F1B order for the SPMD pipeline runtime: forward and backward interleaved in one scan.

GPipe's order comes from differentiating the forward scan (``spmd.py``); 1F1B cannot,
since a micro-batch's backward must start while later micro-batches are still going
forward. So the stack *and the head* (the loss's equations after the stack) run as one
``jax.custom_vjp`` whose forward pass computes every gradient, micro-batch by
micro-batch, and whose backward pass scales them by the incoming cotangent.

In lockstep, at clock ``t`` stage ``s`` runs the forward of micro-batch ``t − s`` and the
backward (the chunk recomputed, then its VJP) of micro-batch ``t − (2p − 2 − s)``; the
last stage runs the head on what it just computed and starts that micro-batch's backward
in the same clock. Activations move up a ``ppermute`` chain and cotangents down another.
A stage keeps the inputs of at most ``2(p − 1 − s) + 1`` micro-batches (a ring buffer of
``2p − 1``), whatever the number of micro-batches; the price of lockstep is a bubble of
``2(p − 1)`` of the ``m + 2p − 2`` clocks (GPipe's is ``p − 1`` of ``m + p − 1``, with all
``m`` inputs kept). Idle stages skip their work (each device branches on its own clock).

The head runs per micro-batch on one device's share, so the loss and float aux are the
means over micro-batches and shares (integer aux, and float values that sum over the
batch, ``coupling.part_scale``: sums), as under gradient accumulation
and the MPMD driver; a token-weighted loss (``(l * mask).sum() / mask.sum()``) is weighted
by each share's count instead, which gives the whole batch's loss and gradients. Inputs the stack or the head read that depend on the batch are not
differentiated here (masks, labels); one that also depends on the parameters is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist.pipeline import spmd

STAGE, DATA = "stage", "data"


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_cotangent(x):
  return jnp.zeros_like(x) if _is_float(x) else np.zeros(x.shape, jax.dtypes.float0)


def ring_size(p: int, m: int) -> int:
  """Micro-batch inputs a stage's ring buffer holds."""
  return min(m, 2 * p - 1)


def max_in_flight(p: int, m: int) -> list[int]:
  """Per stage, the most micro-batches whose inputs it keeps at once."""
  return [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]


def num_clocks(p: int, m: int) -> int:
  return m + 2 * p - 2


def pipelined_loss(pipe, mesh):
  """``f(weights, carry, shared, head_inputs) -> (value, aux)`` with its gradients made in
  1F1B order (see the module docstring); ``pipe`` is the ``spmd._Pipeline``."""

  run = lambda *inputs: _run(pipe, mesh, *inputs)  # ((value, aux), gradients)

  @jax.custom_vjp
  def loss(weights, carry, shared, head_inputs):
    return run(weights, carry, shared, head_inputs)[0]  # (not differentiated: rare)

  def backward(grads, cotangents):
    g = cotangents[0]  # the value's; aux outputs are not differentiated
    return jax.tree.map(lambda x: x * g if x.dtype != jax.dtypes.float0 else x, grads)

  loss.defvjp(run, backward)
  return loss


def _run(pipe, mesh, weights, carry, shared, head_inputs):
  """((value, aux), cotangents of the inputs) from the 1F1B scan."""
  p, d, m = pipe.p, pipe.d, pipe.m
  chunk = pipe.stack.num_layers // p
  stacked = [w.reshape(p, chunk, *w.shape[1:]) for w in weights]
  split = lambda x: spmd.split_micro_batches(x, d, m)
  carry_split = [split(x) for x in carry]
  shared_split = [split(x) if b else x for x, b in zip(shared, pipe.shared_batched)]
  head_split = [split(x) if b else x for x, b in zip(head_inputs, pipe.head_batched)]
  spec = lambda batched: [P(DATA) if b else P() for b in batched]
  size = ring_size(p, m)
  # Differentiated here: floats that do not depend on the batch.
  shared_diff = [not b and _is_float(x) for x, b in zip(shared, pipe.shared_batched)]
  weights_diff = [_is_float(w) for w in weights]  # not per-layer keys (nn.scan's split rngs)
  head_diff = [not b and _is_float(x) for x, b in zip(head_inputs, pipe.head_batched)]

  def body(ws, xs, shs, his):
    ws = [w[0] for w in ws]
    xs = [x[0] for x in xs]
    shs = [x[0] if b else x for x, b in zip(shs, pipe.shared_batched)]
    his = [x[0] if b else x for x, b in zip(his, pipe.head_batched)]
    stage = lax.axis_index(STAGE)
    last = stage == p - 1

    def at(values, batched, i):  # one micro-batch's share of the batched inputs
      return [x[i] if b else x for x, b in zip(values, batched)]

    def chunk_forward(ws, x, sh, micro):
      return lax.scan(lambda x, w: (pipe._layer(w, x, sh, micro), None), x, ws)[0]

    def chunk_backward(ws, x, sh, ct, micro):
      diff = [v for v, t in zip(sh, shared_diff) if t]
      float_ws = [w for w, t in zip(ws, weights_diff) if t]

      def f(float_ws, x, diff):
        it, its = iter(diff), iter(float_ws)
        return chunk_forward([next(its) if t else w for w, t in zip(ws, weights_diff)], x,
                             [next(it) if t else v for v, t in zip(sh, shared_diff)], micro)

      _, vjp = jax.vjp(f, float_ws, x, diff)
      return vjp(ct)

    # A token-weighted loss n / c: each micro-batch share's loss counts c_share / Σ c
    # (the whole batch's value); otherwise 1 / (shares), or for a loss that sums over
    # the batch its weight (coupling.part_scale).
    if pipe.normalizer is not None:
      counts = sum(pipe.count(at(his, pipe.head_batched, i)) for i in range(m))
      total = lax.psum(counts, DATA)
      share = lambda hi: pipe.count(hi) / total
    else:
      share = lambda hi: jnp.float32(1 / (m * d) if pipe.scales[0] is None else pipe.scales[0])

    def head(y, hi, micro):
      diff = [v for v, t in zip(hi, head_diff) if t]

      def f(y, diff):
        it = iter(diff)
        outs = pipe.head(y, [next(it) if t else v for v, t in zip(hi, head_diff)], micro)
        return outs[0], outs[1:]

      value, vjp, aux = jax.vjp(f, y, diff, has_aux=True)
      weight = share(hi).astype(value.dtype)
      dy, ddiff = vjp(jnp.ones_like(value) * weight)
      return value * weight, aux, dy, ddiff

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    y_shape = [x[0] for x in xs]
    head_shape = jax.eval_shape(head, y_shape, at(his, pipe.head_batched, 0), 0)
    chunk_shape = jax.eval_shape(chunk_backward, ws, y_shape, at(shs, pipe.shared_batched, 0),
                                 y_shape, 0)
    filled = lambda shapes: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    init = dict(
        up=zeros(y_shape), down=zeros(y_shape),
        ring=[jnp.zeros((size, *x.shape[1:]), x.dtype) for x in xs],
        value=filled(head_shape[0]), aux=filled(head_shape[1]), dhead=filled(head_shape[3]),
        dws=filled(chunk_shape[0]), dshared=filled(chunk_shape[2]), dcarry=zeros(xs))

    def clock(state, t):
      f = t - stage
      f_ok = (f >= 0) & (f < m)
      fi = jnp.clip(f, 0, m - 1)
      x = [jnp.where(stage == 0, a[fi], b) for a, b in zip(xs, state["up"])]
      sh = at(shs, pipe.shared_batched, fi)
      y = lax.cond(f_ok, chunk_forward, lambda ws, x, sh, micro: x, ws, x, sh, fi)
      slot = fi % size
      ring = [lax.dynamic_update_index_in_dim(r, jnp.where(f_ok, a, r[slot]), slot, 0)
              for r, a in zip(state["ring"], x)]
      value, aux, dy, dhead = lax.cond(
          f_ok & last, head, lambda y, hi, micro: filled(head_shape),
          y, at(his, pipe.head_batched, fi), fi)
      b = t - (2 * p - 2 - stage)
      b_ok = (b >= 0) & (b < m)
      bi = jnp.clip(b, 0, m - 1)
      ct = [jnp.where(last, a, c) for a, c in zip(dy, state["down"])]
      dws, dx, dsh = lax.cond(
          b_ok, chunk_backward, lambda ws, x, sh, ct, micro: filled(chunk_shape),
          ws, [r[bi % size] for r in ring], at(shs, pipe.shared_batched, bi), ct, bi)
      dcarry = [lax.dynamic_update_index_in_dim(
          acc, jnp.where(b_ok & (stage == 0), g, acc[bi]), bi, 0)
          for acc, g in zip(state["dcarry"], dx)]
      add = lambda a, b: jax.tree.map(jnp.add, a, b)
      return dict(
          up=[lax.ppermute(a, STAGE, [(j, j + 1) for j in range(p - 1)]) for a in y],
          down=[lax.ppermute(a, STAGE, [(j + 1, j) for j in range(p - 1)]) for a in dx],
          ring=ring, value=state["value"] + value, aux=add(state["aux"], aux),
          dhead=add(state["dhead"], dhead), dws=add(state["dws"], dws),
          dshared=add(state["dshared"], dsh), dcarry=dcarry), None

    state, _ = lax.scan(clock, init, jnp.arange(num_clocks(p, m)))
    both = (STAGE, DATA)
    value = lax.psum(state["value"], both)  # each micro-batch share's weighted
    scales = pipe.scales[1:]
    aux = [lax.psum(a, both) if not _is_float(a) else
           lax.psum(a, both) / (m * d) if scales[j] is None else lax.psum(a, both) * scales[j]
           for j, a in enumerate(state["aux"])]
    return (value, aux, [lax.psum(g, DATA)[None] for g in state["dws"]],
            [g[None] for g in state["dcarry"]], lax.psum(state["dshared"], both),
            lax.psum(state["dhead"], both))

  value, aux, dws, dcarry, dshared, dhead = jax.shard_map(
      body, mesh=mesh,
      in_specs=([P(STAGE)] * len(stacked), [P(DATA)] * len(carry_split),
                spec(pipe.shared_batched), spec(pipe.head_batched)),
      out_specs=(P(), [P()] * pipe.num_aux, [P(STAGE)] * sum(weights_diff),
                 [P(STAGE, None, DATA)] * len(carry), [P()] * sum(shared_diff),
                 [P()] * sum(head_diff)),
      check_vma=False)(stacked, carry_split, shared_split, head_split)
  dws = iter(dws)
  dws = [next(dws).reshape(w.shape) if t else _zero_cotangent(w)
         for w, t in zip(weights, weights_diff)]
  dcarry = [g[0].reshape(m, d, -1, *g.shape[3:]).swapaxes(0, 1).reshape(x.shape)
            for g, x in zip(dcarry, carry)]
  dshared, dhead = iter(dshared), iter(dhead)
  grads = (dws, dcarry,
           [next(dshared) if t else _zero_cotangent(x) for x, t in zip(shared, shared_diff)],
           [next(dhead) if t else _zero_cotangent(x) for x, t in zip(head_inputs, head_diff)])
  return (value, aux), grads
