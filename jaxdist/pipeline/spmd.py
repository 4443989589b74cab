"""The SPMD pipeline runtime: a stack of identical layers pipelined inside one program.

For the common case of a model whose middle is a stack of identical layers (transformer
blocks), PipeshardParallel can run the whole step as *one* jitted program over a
``(stage, data)`` mesh, with no driver:

- the stack (``stack.py``) is found in the differentiated loss; the layers before it
  (embedding) and after it (head, loss) run as ordinary SPMD code on the whole batch,
  split over all devices;
- the stack's per-layer weights are stacked into ``[layers, ...]`` arrays and split
  over the ``stage`` axis: with ``v = virtual_stages`` the layers form ``p·v`` chunks
  and stage ``s`` holds chunks ``s, s + p, …`` (``v = 1``: one contiguous chunk);
- inside ``jax.shard_map`` (manual over both axes) a ``lax.scan`` over clocks runs
  every stage's chunk on the micro-batch it holds and rotates the results to the next
  stage with ``ppermute`` (a ring: from the last stage a micro-batch goes back to stage
  0 for its next chunk). At clock ``t`` stage ``s`` works on step ``k = t − s`` of its
  sequence: micro-batch ``i = (k // (p·v))·p + k mod p`` at chunk ``((k mod p·v) // p)·p
  + s``, so a micro-batch that leaves the last stage re-enters stage 0 exactly when it
  is due. Each micro-batch is split over ``data`` (a device computes on its share);
- JAX differentiates that program as a whole: the backward is the scan reversed, in
  GPipe's order (all forwards, then all backwards). Each clock's chunk is rematerialized
  (``jax.checkpoint``), so a stage keeps per clock only the activations entering it,
  ``m·v + p − 1`` of them for ``m`` micro-batches; the bubble is ``(p − 1)/(m·v + p −
  1)`` of the clocks. The stacked weights' gradients leave the ``shard_map`` once per
  step: one reduction over ``data`` per step, none per micro-batch.

With ``pipeline_schedule="1f1b"`` the stack and the head run in lockstep 1F1B order
instead (``spmd_1f1b.py``).

Under GPipe the loss is computed on the whole batch, exactly as the single-device step
computes it (for a mean loss the same as the mean over micro-batches). Inside the stack
each device sees its share of a micro-batch, so an operation that couples examples there
(BatchNorm) sees that share, as under gradient accumulation.

State layout: a weight of the stack (and optimizer leaves of its shape) is kept split
over ``stage`` on its first dimension that divides. Weights stacked by a scan (``nn.scan``)
are then already where the stages read them (with ``v = 1``); per-layer weights are
gathered into the stage layout and their gradients scattered back (an all-to-all each
way per step), so no device holds the whole stack. Everything else is replicated; the
batch is split over all devices.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdist import coupling, errors
from jaxdist import inspect as hlo_inspect
from jaxdist import jaxpr_util, rng
from jaxdist import methods as m
from jaxdist.executable import Executable, compile_flat
from jaxdist.layouts import Layout
from jaxdist.mesh import LogicalMesh
from jaxdist.pipeline import capture, layers as layers_mod, spmd_1f1b
from jaxdist.pipeline.partition import layer_starts
from jaxdist.pipeline.stack import Stack, find_repeated_stack, find_scanned_stack, find_stack
from jaxdist.plan import Plan, PlanEntry
from jaxdist.trace import BATCH, OPTIMIZER, PARAM, TracedStep

STAGE, DATA = "stage", "data"

# Why runtime="auto" leaves 1F1B to the driver.
WHY_1F1B_ON_THE_DRIVER = (
    "pipeline_schedule='1f1b' runs on the MPMD driver (its 1F1B idles p - 1 clocks per step, "
    "the SPMD runtime's lockstep 1F1B 2(p - 1); runtime='spmd' takes it)")


def clock_indices(k, p: int, v: int, m: int):
  """At step ``k`` of a stage's sequence: (micro-batch, repeat) it works on, and whether
  that is real work (``0 <= k`` and the micro-batch exists)."""
  group, within = k // (p * v), k % (p * v)
  micro, repeat = group * p + within % p, within // p
  return micro, repeat, (k >= 0) & (micro < m)


def num_clocks(p: int, v: int, m: int) -> int:
  """Clocks until the last micro-batch leaves the last stage's last chunk."""
  last = (m - 1) // p * p * v + (v - 1) * p + (m - 1) % p
  return last + p


def output_clocks(p: int, v: int, m: int) -> np.ndarray:
  """Per micro-batch, the clock at which the last stage finishes it."""
  return np.array([i // p * p * v + (v - 1) * p + i % p + p - 1 for i in range(m)])


def split_micro_batches(x, d: int, m: int):
  """``[batch, ...] -> [d, m, batch / (d·m), ...]``: ``d`` blocks of rows, one per data
  index (the batch is split over ``(data, stage)``), each cut into ``m`` micro-batches;
  a device of data index ``j`` holds block ``j``'s share of every micro-batch."""
  return x.reshape(d, m, x.shape[0] // (d * m), *x.shape[1:])


def num_stages(method: m.PipeshardParallel, stack_len: int, n: int) -> int | str:
  """Device groups ``p`` of the SPMD pipeline (the stack makes ``p·v`` chunks), or why none."""
  v, opt = method.virtual_stages, method.stage_option
  if not (opt == "uniform" or isinstance(opt, m.UniformStageOption)):
    return f"stage_option={opt!r} places stages one by one (the MPMD driver does)"
  if isinstance(opt, m.UniformStageOption) and opt.submesh_shape is not None \
     and len(opt.submesh_shape) != 1:
    return f"UniformStageOption(submesh_shape={opt.submesh_shape!r}) is not 1-D"
  size = opt.submesh_shape[0] if isinstance(opt, m.UniformStageOption) and opt.submesh_shape \
      else None  # devices per stage, if given
  if isinstance(opt, m.UniformStageOption) and opt.num_stages is not None:
    if opt.num_stages % v:
      return f"{opt.num_stages} stages are not {v} chunks per device group"
    p = opt.num_stages // v
    if n % p or stack_len % (p * v) or p < 2 or size not in (None, n // p):
      return (f"{p} device groups of {v} chunks (of {size or n // max(p, 1)} devices each) do "
              f"not split the {stack_len} identical layers and the {n} devices evenly")
    return p
  fits = [p for p in range(2, n + 1) if n % p == 0 and stack_len % (p * v) == 0
          and size in (None, n // p)]
  if not fits:
    return (f"no number of stages >= 2 divides both the {n} devices and the {stack_len} "
            f"identical layers into {v} chunk(s) per stage"
            + (f" with {size} devices each" if size else ""))
  return max(fits)


def _first_divisible_dim(shape, parts: int) -> P:
  for d, size in enumerate(shape):
    if size % parts == 0 and size >= parts:
      return P(*([None] * d + [STAGE]))
  return P()


def build(method: m.PipeshardParallel, step: TracedStep, lmesh: LogicalMesh, index: int,
          dyn_argnums: tuple[int, ...], retrace) -> Executable | str:
  """The step compiled as one SPMD pipeline program, or why it cannot be.

  ``index``: the ``pipeline_loss`` equation's; ``retrace(divisor)``: the step's jaxpr
  traced at 1/divisor of the batch.
  """
  pipe = plan(method, step, lmesh, index, retrace)
  if isinstance(pipe, str):
    return pipe
  loss = step.closed_jaxpr.jaxpr.eqns[index].params["loss"]
  return _compile(method, step, lmesh, index, loss, pipe, dyn_argnums)


def plan(method: m.PipeshardParallel, step: TracedStep, lmesh: LogicalMesh, index: int,
         retrace) -> "_Pipeline | str":
  """The SPMD pipeline of the step (nothing compiled), or why there is none."""
  jaxpr = step.closed_jaxpr.jaxpr
  eqn = jaxpr.eqns[index]
  loss: capture.CapturedLoss = eqn.params["loss"]
  loss_jaxpr = loss.closed.jaxpr
  stack = None
  marked = any(e.primitive in (layers_mod.boundary_p, layers_mod.layer_marker_p)
               for e in loss_jaxpr.eqns)
  if not marked:  # weights already stacked: a scan over layers
    stack = find_scanned_stack(loss_jaxpr, loss.num_consts)
  if stack is None and layers_mod.resolve_layer_option(method.layer_option,
                                                        loss_jaxpr) == "manual":
    starts = layer_starts(method, loss_jaxpr)
    stack = find_stack(loss_jaxpr, loss.num_consts, starts)
    if not isinstance(stack, str) and (stack.layers[0] > 1 or stack.layers[1] < len(starts) - 1):
      return (f"only layers {stack.layers[0]}..{stack.layers[1] - 1} of {len(starts)} are "
              f"identical; the SPMD runtime pipelines one stack of identical layers between "
              f"the first layer and the last")
  elif stack is None:  # the identical layers themselves, wherever the clustering would cut
    found = find_repeated_stack(loss_jaxpr, loss.num_consts)
    stack = found if isinstance(found, str) else found[0]
  if isinstance(stack, str):
    return stack
  n, k, v = lmesh.num_devices, method.num_micro_batches or 1, method.virtual_stages
  p = num_stages(method, stack.num_layers, n)
  if isinstance(p, str):
    return p
  d = n // p
  batch = step.batch_size
  if batch is None or batch % (k * d):
    return (f"the batch ({batch}) does not split into {k} micro-batches over {d} devices per "
            f"stage")
  one_f_one_b = method.pipeline_schedule == "1f1b"
  if v > 1 and (one_f_one_b or k % p):
    return (f"virtual_stages={v} runs GPipe's order with micro-batches in multiples of the "
            f"{p} stages (has pipeline_schedule={method.pipeline_schedule!r}, {k} micro-batches)")
  # Which inputs of the stack depend on the batch (they are split into micro-batches).
  batch_mask = sum(1 << i for i, leaf in enumerate(step.inputs) if leaf.role == BATCH)
  operand_deps = jaxpr_util.dependencies(jaxpr, len(step.inputs), eqn.invars)
  in_mask = sum(1 << j for j, dep in enumerate(operand_deps) if dep & batch_mask)
  coupled = coupling.loss_coupling(
      loss_jaxpr, loss.num_consts, [in_mask >> j & 1 for j in range(len(loss_jaxpr.invars))],
      batch)
  if coupled:
    return (f"the loss mixes examples ({coupled}), and the SPMD runtime runs the stack on "
            f"micro-batches and device shares that do not see each other")
  head = _head_inputs(loss_jaxpr, stack) if one_f_one_b else []
  inits = stack.carry_init + stack.shared_init
  per_layer = [x for xs in stack.weights for x in xs] + list(stack.stacked)
  atoms = [x for x in (*inits, *per_layer, *head) if not isinstance(x, jex.Literal)]
  deps = dict(zip(atoms, jaxpr_util.dependencies(loss_jaxpr, len(loss_jaxpr.invars), atoms)))
  batched = [x in deps and bool(deps[x] & in_mask) for x in inits]
  if any(deps[x] & in_mask for x in per_layer if x in deps):
    return "a per-layer input of the stack depends on the batch"
  head_batched = [x in deps and bool(deps[x] & in_mask) for x in head]
  if one_f_one_b:
    params_mask = sum(1 << j for j in range(loss.num_consts, len(loss_jaxpr.invars)))
    for x, is_batched in zip([*inits[len(stack.carry_init):], *head],
                             [*batched[len(stack.carry_init):], *head_batched]):
      if is_batched and deps[x] & params_mask and jnp.issubdtype(x.aval.dtype, jnp.inexact):
        return (f"1F1B: {x} ({x.aval.str_short()}), read by the stack or the head, depends on "
                f"both the batch and the parameters (its gradient is not carried)")
      if is_batched and (not x.aval.shape or x.aval.shape[0] != batch):
        return (f"1F1B: the head's input {x} ({x.aval.str_short()}) depends on the batch but its "
                f"dim 0 is not the batch size {batch}")
    if not all(jnp.issubdtype(x.aval.dtype, jnp.inexact) for x in stack.carry_init):
      return "1F1B: the stack carries a value that is not a float"
  for position, (x, is_batched) in enumerate(zip(inits, batched)):
    shape = tuple(x.aval.shape)
    if position < len(stack.carry_init) and not is_batched:
      return f"the stack's carried input {x} ({x.aval.str_short()}) does not depend on the batch"
    if is_batched and (not shape or shape[0] != batch):
      return (f"the stack's input {x} ({x.aval.str_short()}) depends on the batch but its "
              f"dim 0 is not the batch size {batch}")
  try:
    micro = retrace(k * d)
  except errors.BatchDivisibilityError as e:  # (the batch size is a constant in the step)
    return str(e)
  micro_eqns = [e for e in micro.jaxpr.eqns if e.primitive is capture.pipeline_loss_p]
  local = micro_eqns[0].params["loss"].closed.jaxpr if len(micro_eqns) == 1 else None
  if local is None or [e.primitive for e in local.eqns] != [e.primitive for e in loss_jaxpr.eqns]:
    return "the loss traced at one device's share of a micro-batch has different equations"
  for j, (full, share) in enumerate(zip(eqn.invars, micro_eqns[0].invars)):
    if one_f_one_b and not in_mask >> j & 1 and full.aval.shape != share.aval.shape:
      return (f"1F1B: the loss's input {j} ({full.aval.str_short()}) is sized by the batch "
              f"but does not depend on it (values drawn per example from a key before the "
              f"loss): the lockstep runtime does not split it into micro-batches")
  if one_f_one_b:
    for j, (full, share) in enumerate(zip(loss_jaxpr.outvars[1:], local.outvars[1:])):
      if j < loss.kinds.count(capture.AUX) and full.aval.shape != share.aval.shape:
        return (f"1F1B: aux output {j} ({full.aval.str_short()}) has a batch dimension; the "
                f"lockstep 1F1B runtime sums aux over micro-batches and does not collect "
                f"per-example values (GPipe and the MPMD runtime do)")
  if stack.scan is None:
    body, consts, corr = local, {}, _correspondence(loss_jaxpr, local)
  else:
    closed = local.eqns[stack.scan].params["jaxpr"]
    body, consts = closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts))
    corr = _correspondence(loss_jaxpr.eqns[stack.scan].params["jaxpr"].jaxpr, body)
  normalizer = coupling.normalizer_of(loss_jaxpr.eqns, loss_jaxpr.outvars[0],
                                      set(loss_jaxpr.invars[loss.num_consts:]))
  # The traces at the two sizes have the same equations, one for one.
  whole_body = (loss_jaxpr if stack.scan is None
                else loss_jaxpr.eqns[stack.scan].params["jaxpr"].jaxpr)
  same = lambda eqns: {i: i for i in range(len(eqns))}
  draws = rng.partial_draws(body.eqns, whole_body.eqns, same(body.eqns), stack.template, k * d)
  head_draws = rng.partial_draws(local.eqns, loss_jaxpr.eqns, same(local.eqns),
                                 range(stack.end, len(local.eqns)), k * d) if one_f_one_b else {}
  return _Pipeline(stack, body, consts, corr, p, d, v, k, method.pipeline_schedule,
                   batched[len(stack.carry_init):], local, _correspondence(loss_jaxpr, local),
                   head, head_batched, loss.kinds.count(capture.AUX),
                   normalizer if one_f_one_b else None, draws, head_draws,
                   tuple(None if isinstance(w, jex.Literal) else
                         coupling.part_scale(loss_jaxpr.eqns, w, local.eqns, x, k * d)
                         for w, x in zip(loss_jaxpr.outvars, local.outvars)))


def _head_inputs(jaxpr, stack: Stack) -> list:
  """The values the loss's equations after the stack read, other than its outputs."""
  ids = range(stack.end, len(jaxpr.eqns))
  defined = {v for i in ids for v in jaxpr.eqns[i].outvars} | set(stack.carry_out)
  reads = [v for i in ids for v in jaxpr.eqns[i].invars] + list(jaxpr.outvars)
  return list(dict.fromkeys(v for v in reads if not isinstance(v, jex.Literal)
                            and v not in defined))


def _correspondence(full, local) -> dict:
  """Full-batch loss var -> the same var in the loss traced at a micro-batch share."""
  out = dict(zip(full.constvars, local.constvars))
  out.update(zip(full.invars, local.invars))
  for a, b in zip(full.eqns, local.eqns):
    out.update(zip(a.outvars, b.outvars))
  return out


@dataclasses.dataclass
class _Pipeline:
  """The stack run as a pipelined ``shard_map`` (see the module docstring).

  Attributes:
    stack: what runs pipelined.
    jaxpr, consts: the jaxpr holding one layer's equations (the loss's or the scan's
      body) traced at one device's share of a micro-batch, and its constants.
    local: full-batch var of that jaxpr -> the same var at the share.
    p, d, v, m: stages, devices per stage, chunks per stage, micro-batches.
    schedule: "gpipe" or "1f1b".
    shared_batched: per shared input of the stack, whether it is split by micro-batch.
    loss_local, loss_corr: the loss traced at the share; full-batch var -> its var.
    head_inputs, head_batched: under 1F1B, what the loss's equations after the stack
      read (full-batch vars), and whether each is split by micro-batch.
    num_aux: the loss's aux outputs.
    normalizer: under 1F1B, the ``d`` of a token-weighted loss ``n / d``
      (``coupling.normalizer_of``; full-batch var), or None.
    draws, head_draws: the layer's (in ``jaxpr``) and, under 1F1B, the head's (in
      ``loss_local``) random draws that are a share of a whole-batch draw
      (``rng.partial_draws``): a share draws its rows of the whole batch's bits.
    scales: per loss output, a share's weight in the whole batch's value under 1F1B
      (``coupling.part_scale``: 1 for a sum over the batch), or None: the mean.
  """

  stack: Stack
  jaxpr: object
  consts: dict
  local: dict
  p: int
  d: int
  v: int
  m: int
  schedule: str
  shared_batched: list
  loss_local: object
  loss_corr: dict
  head_inputs: list
  head_batched: list
  num_aux: int
  normalizer: object = None
  draws: dict = dataclasses.field(default_factory=dict)
  head_draws: dict = dataclasses.field(default_factory=dict)
  scales: tuple = ()

  def share(self, micro):
    """Which share of the whole batch this device's part of micro-batch ``micro`` is
    (``split_micro_batches``' order: data index, then micro-batch)."""
    return lax.axis_index(DATA) * self.m + micro

  def _layer(self, weights, carry, shared, micro=None):
    """One layer on one device's share of micro-batch ``micro`` (the template, traced at
    that size)."""
    s, loc = self.stack, self.local
    env = dict(self.consts)
    env.update(zip([loc[x] for x in s.weight_vars], weights))
    env.update(zip([loc[x] for x in s.carry_in], carry))
    env.update(zip([loc[x] for x in s.shared], shared))
    before = after = None
    if self.draws and micro is not None:
      before, after = rng.row_hooks(self.jaxpr.eqns, self.draws, lambda: self.share(micro))
    jaxpr_util.eval_eqns(self.jaxpr, env, s.template, before=before, after=after)
    return [jaxpr_util.read(env, x if isinstance(x, jex.Literal) else loc[x])
            for x in s.carry_src]

  def head(self, carry_out, head_inputs, micro=None) -> list:
    """The loss's equations after the stack on one device's share of micro-batch
    ``micro``: the loss value, then the aux outputs."""
    jaxpr, loc = self.loss_local, self.loss_corr
    env = dict(zip([loc[x] for x in self.stack.carry_out], carry_out))
    env.update(zip([loc[x] for x in self.head_inputs], head_inputs))
    before = None if self.normalizer is None else coupling.padding_guard(jaxpr)
    after = None
    if self.head_draws and micro is not None:
      before, after = rng.row_hooks(jaxpr.eqns, self.head_draws, lambda: self.share(micro),
                                    before)
    jaxpr_util.eval_eqns(jaxpr, env, range(self.stack.end, len(jaxpr.eqns)), before=before,
                         after=after)
    return [jaxpr_util.read(env, x) for x in jaxpr.outvars]

  def count(self, head_inputs):
    """The loss's normalizer on one device's share of a micro-batch, from the head's
    inputs (it depends on the batch alone)."""
    jaxpr, loc = self.loss_local, self.loss_corr
    env = dict(zip([loc[x] for x in self.head_inputs], head_inputs))
    target = loc[self.normalizer]
    ids = set(jaxpr_util.needed_eqns(jaxpr, [target])) & set(range(self.stack.end, len(jaxpr.eqns)))
    jaxpr_util.eval_eqns(jaxpr, env, ids)
    return jaxpr_util.read(env, target).astype(jnp.float32)

  def __call__(self, mesh, weights, carry, shared):
    """The stack's outputs on the whole batch from its inputs on the whole batch."""
    p, v, m = self.p, self.v, self.m
    chunk = self.stack.num_layers // (p * v)
    stacked = [w.reshape(v, p, chunk, *w.shape[1:]) for w in weights]
    d = self.d
    split = lambda x: split_micro_batches(x, d, m)
    carry = [split(x) for x in carry]
    shared = [split(x) if b else x for x, b in zip(shared, self.shared_batched)]
    mb_spec = P(DATA)
    shared_specs = [mb_spec if b else P() for b in self.shared_batched]
    clocks = num_clocks(p, v, m)

    def chunk_forward(ws, repeat, x, side, micro):
      def one(x, w):
        return self._layer(w, x, side, micro), None
      return lax.scan(one, x, [w[repeat] for w in ws])[0]

    # A stage idle at this clock (the bubble) skips its chunk (each device branches on its
    # own predicate); the chunk is rematerialized in the backward pass, so a clock's
    # residuals are its inputs.
    run_chunk = jax.checkpoint(lambda real, ws, repeat, x, side, micro: lax.cond(
        real, chunk_forward, lambda ws, repeat, x, side, micro: x, ws, repeat, x, side, micro))

    def body(ws, xs, sides):
      ws = [w[:, 0] for w in ws]
      xs = [x[0] for x in xs]
      sides = [y[0] if b else y for y, b in zip(sides, self.shared_batched)]
      stage = lax.axis_index(STAGE)
      state = [jnp.zeros_like(x[0]) for x in xs]

      def clock(state, t):
        micro, repeat, real = clock_indices(t - stage, p, v, m)
        micro, repeat = jnp.clip(micro, 0, m - 1), jnp.clip(repeat, 0, v - 1)
        fresh = (stage == 0) & (repeat == 0)
        x = [jnp.where(fresh, a[micro], b) for a, b in zip(xs, state)]
        side = [y[micro] if b else y for y, b in zip(sides, self.shared_batched)]
        y = run_chunk(real, ws, repeat, x, side, micro)
        ring = [(j, (j + 1) % p) for j in range(p)]
        return [lax.ppermute(a, STAGE, ring) for a in y], y

      _, ys = lax.scan(clock, state, jnp.arange(clocks))
      return [y[None] for y in ys]

    ys = jax.shard_map(
        body, mesh=mesh, in_specs=([P(None, STAGE)] * len(stacked), [mb_spec] * len(carry),
                                   shared_specs),
        out_specs=[P(STAGE, None, DATA)] * len(carry),
        # The layer's equations were traced outside the shard_map, so they carry no
        # varying-axes types; unchecked, the transpose sums the cotangents of inputs that
        # do not mention an axis over it (the one gradient reduction).
        check_vma=False)(stacked, carry, shared)
    done = output_clocks(p, v, m)
    return [y[p - 1, done].reshape(m, d, -1, *y.shape[3:]).swapaxes(0, 1)
            .reshape(-1, *y.shape[3:]) for y in ys]


class SpmdPipelineExecutable(Executable):
  """A PipeshardParallel step compiled by the SPMD runtime: one program, no driver.

  As for every pipeline, ``get_hlo_text()``, ``memory_analysis()`` and
  ``cost_analysis()`` return lists (here of one program), and ``stats`` after a call
  holds ``max_in_flight`` (per stage, the most micro-batches whose inputs it keeps for
  the backward: all of them under GPipe), ``dispatched`` (1) and ``dispatch_s``.
  """

  def __init__(self, *args, in_flight: list[int], **kwargs):
    super().__init__(*args, **kwargs)
    self._in_flight = in_flight
    self.stats: dict = {}

  def call_flat(self, leaves):
    start = time.perf_counter()
    out = super().call_flat(leaves)
    self.stats = {"max_in_flight": list(self._in_flight), "dispatched": 1,
                  "dispatch_s": time.perf_counter() - start}
    return out

  def gather(self, tree):
    """``tree`` (a state this step returned) with every array replicated over all the
    devices, as ``PipelineExecutable.gather`` (every process calls it, in the same order)."""
    full = NamedSharding(self.layout.logical_mesh.mesh, P())
    return jax.tree.map(lambda x: jax.device_put(x, full) if isinstance(x, jax.Array) else x,
                        tree)

  def get_hlo_text(self) -> list[str]:
    return [self._compiled.as_text()]

  def check_communication(self, tolerance: float = 0.10) -> list[str]:
    """The compiled collectives, one line per kind, each marked as not predicted: this
    runtime's plan has no collective model (the permutes per clock, the stacked
    weights' gradient reductions), so there is nothing to compare them with."""
    del tolerance
    return hlo_inspect.unpredicted(self.communication(), "SPMD pipeline")

  def memory_analysis(self) -> list:
    return [self._compiled.memory_analysis()]

  def cost_analysis(self) -> list:
    return [self._compiled.cost_analysis()]

  def communication(self) -> dict[str, hlo_inspect.CollectiveStats]:
    if self._communication is None:
      self._communication = hlo_inspect.collective_summary(self._compiled.as_text())
    return self._communication


def _loss_value_and_grad(loss: capture.CapturedLoss, stack: Stack, pipe: _Pipeline, mesh):
  """``pipeline_loss``'s results (value, aux, gradients) with the stack pipelined."""
  jaxpr = loss.closed.jaxpr
  num_aux = loss.kinds.count(capture.AUX)
  batch_spec = NamedSharding(mesh, P((DATA, STAGE)))

  def forward(consts, diff):
    operands = [*consts, *diff]
    env = dict(zip(jaxpr.invars, operands))
    jaxpr_util.eval_eqns(jaxpr, env, range(stack.start))
    weights = ([jnp.stack([env[x] for x in per_layer]) for per_layer in stack.weights]
               or [env[x] for x in stack.stacked])
    if pipe.schedule == "1f1b":  # the stack and the head, differentiated by hand
      value, aux = spmd_1f1b.pipelined_loss(pipe, mesh)(
          weights, [env[x] for x in stack.carry_init],
          [jaxpr_util.read(env, x) for x in stack.shared_init],
          [jaxpr_util.read(env, x) for x in pipe.head_inputs])
      return value, aux
    outs = pipe(mesh, weights, [env[x] for x in stack.carry_init],
                [jaxpr_util.read(env, x) for x in stack.shared_init])
    # The head runs on the whole batch, split over every device.
    outs = [lax.with_sharding_constraint(o, batch_spec) if o.shape[0] % mesh.size == 0 else o
            for o in outs]
    env.update(zip(stack.carry_out, outs))
    jaxpr_util.eval_eqns(jaxpr, env, range(stack.end, len(jaxpr.eqns)))
    results = [jaxpr_util.read(env, x) for x in jaxpr.outvars]
    return results[0], results[1:1 + num_aux]

  def value_and_grad(*operands):
    consts, diff = operands[:loss.num_consts], list(operands[loss.num_consts:])
    (value, aux), grads = jax.value_and_grad(
        lambda d: forward(consts, d), has_aux=True)(diff)
    return [value, *aux, *grads]

  return value_and_grad


def _compile(method, step: TracedStep, lmesh: LogicalMesh, index: int,
             loss: capture.CapturedLoss, pipe: _Pipeline, dyn_argnums):
  start, stack = time.perf_counter(), pipe.stack
  smesh = LogicalMesh((pipe.p, pipe.d), axis_names=(STAGE, DATA), devices=tuple(lmesh.devices),
                      alpha=max(lmesh.alpha), beta=max(lmesh.beta), peak_flops=lmesh.peak_flops)
  mesh = smesh.mesh
  jaxpr = step.closed_jaxpr.jaxpr
  eqn = jaxpr.eqns[index]
  value_and_grad = _loss_value_and_grad(loss, stack, pipe, mesh)
  # Layouts: stacked weights (and optimizer leaves shaped like them) split over stage.
  position = {var: i for i, var in enumerate(jaxpr.invars)}
  operand = {x: j for j, x in enumerate(loss.closed.jaxpr.invars)}
  weight_operands = [operand[x] for x in (*(x for per_layer in stack.weights for x in per_layer),
                                          *stack.stacked) if x in operand]
  stacked_inputs = {position[eqn.invars[j]] for j in weight_operands if eqn.invars[j] in position}
  stacked_shapes = {step.inputs[i].shape for i in stacked_inputs}
  n = pipe.p * pipe.d
  in_specs = []
  for i, leaf in enumerate(step.inputs):
    if leaf.role == BATCH:
      in_specs.append(P((DATA, STAGE)) if leaf.shape and leaf.shape[0] % n == 0 else
                      P(DATA) if leaf.shape and leaf.shape[0] % pipe.d == 0 else P())
    elif i in stacked_inputs or (leaf.role in (PARAM, OPTIMIZER) and leaf.shape in stacked_shapes):
      in_specs.append(_first_divisible_dim(leaf.shape, pipe.p))
    else:
      in_specs.append(P())
  out_specs = [P() if src is None else in_specs[src] for src in step.output_source]

  def run(*leaves):
    env = dict(zip(jaxpr.constvars, step.closed_jaxpr.consts))
    env.update(zip(jaxpr.invars, leaves))
    jaxpr_util.eval_eqns(jaxpr, env, range(index))
    outs = value_and_grad(*[jaxpr_util.read(env, x) for x in eqn.invars])
    env.update(zip(eqn.outvars, outs))
    jaxpr_util.eval_eqns(jaxpr, env, range(index + 1, len(jaxpr.eqns)))
    return tuple(jaxpr_util.read(env, x) for x in jaxpr.outvars)

  timings = {"trace_s": 0.0, "plan_s": time.perf_counter() - start}
  compiled = compile_flat(run, step, tuple(NamedSharding(mesh, s) for s in in_specs),
                          tuple(NamedSharding(mesh, s) for s in out_specs), timings)
  p, v, k = pipe.p, pipe.v, pipe.m
  if pipe.schedule == "1f1b":
    clocks = spmd_1f1b.num_clocks(p, k)
    in_flight = spmd_1f1b.max_in_flight(p, k)
    order = (f"schedule 1f1b in one program, in lockstep: {clocks} clocks for {k} "
             f"micro-batches, each clock a forward and a backward per stage, bubble "
             f"{2 * (p - 1) / clocks:.3f} of the clocks; the head runs per micro-batch")
  else:
    clocks, in_flight = num_clocks(p, v, k), [k] * p
    order = (f"schedule gpipe in one program: {clocks} clocks for {k} micro-batches, bubble "
             f"{(p - 1) / clocks:.3f} of the clocks")
  notes = (
      f"runtime spmd: {stack.source} (loss equations {stack.start}..{stack.end - 1}); they "
      f"run as a pipeline of "
      f"{p} stages x {v} chunk(s) of {stack.num_layers // (p * v)} layer(s) over a "
      f"({p}, {pipe.d}) (stage, data) mesh, the rest on all devices",
      order,
      f"per layer: {len(stack.weight_vars)} weight(s) "
      f"({'stacked by the scan' if stack.scan is not None else 'stacked in the program'}), "
      f"{len(stack.carry_in)} carried value(s), {len(stack.shared)} shared",
      "collectives are not predicted for this runtime (check_communication lists the "
      "compiled ones)",
  )
  layout = Layout(logical_mesh=smesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                  out_constraints=(None,) * len(out_specs), notes=notes, num_micro_batches=k,
                  batch_axes=(STAGE, DATA))
  plan = Plan(method=method.name, mesh_shape=smesh.shape, axis_names=smesh.axis_names,
              inputs=tuple(PlanEntry(leaf.path, leaf.shape, str(leaf.dtype), leaf.role, spec)
                           for leaf, spec in zip(step.inputs, in_specs)),
              num_micro_batches=k, notes=notes)
  return SpmdPipelineExecutable(step, layout, compiled, plan, dyn_argnums, timings,
                                in_flight=in_flight)
