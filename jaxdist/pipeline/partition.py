"""Cutting the loss into stages: layers, stage ranges and sub-meshes, and each stage's
forward and backward functions (compiled by ``runtime.PipelineExecutable``).

Layers come from ``layers.py`` (manual boundaries or the clustering DP); consecutive
layers form stages uniformly, by hand (``ManualStageOption``), or by Alpa's stage DP
(``stages.py``) with costs from the shard ILP.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxdist import coupling, errors
from jaxdist import jaxpr_util, rng
from jaxdist import methods as m
from jaxdist.mesh import LogicalMesh
from jaxdist.pipeline import capture, layers as layers_mod
from jaxdist.pipeline.stages import StagePlan, auto_stages

STAGE_AXIS = "mesh_0"  # as ShardParallel names a 1-D mesh


@dataclasses.dataclass
class Stage:
  """One stage: its equations of the loss jaxpr, its sub-mesh and its two programs.

  Attributes:
    layers: (first, last + 1) layer indices.
    eqns: equation indices of the loss jaxpr it evaluates.
    mesh: its sub-mesh: 1-D until compiled, then the shape its shard plan chose.
    mesh_shape: the sub-mesh shape given by the stage option, or None (searched).
    objectives: its forward's and backward's shard-plan objectives (seconds; the forward's
      None where the stage runs per device).
    grad_homes: where each gradient lives once the step's micro-batches are summed.
    reduce: for a stage run per device, the program summing the devices' gradient rows
      (the step's one all-reduce); else None.
    note: how the stage runs (per device, or why not).
    operands: positions of the ``pipeline_loss`` operands it reads.
    acts_in: loss-jaxpr variables it reads from earlier stages.
    acts_out: variables it computes that later stages or the loss outputs read.
    forward, backward, zeros: compiled programs (set when compiled): the backward adds
      a micro-batch's gradients to a donated accumulator, which ``zeros`` creates.
    operand_avals, in_avals, out_avals: the programs' operands, activations in and out
      (shapes and shardings on the sub-mesh; set when compiled).
    diff: positions in ``operands`` of the float parameters it differentiates.
    float_in, float_out: positions of float activations in and out (those with
      cotangents).
    backward_plan: the shard planner's result for the backward program (set when planned).
    forward_plan: the shard planner's result for the forward program, where the stage runs
      as planned (not per device); else None.
    per_device: its ``per_device.PerDeviceStage`` where it runs per device (or per shard
      of the batch); else None.
    handover: the collectives its two programs add per micro-batch to return activations
      and cotangents in the layouts their readers take (kind → {"count",
      "result_bytes"}; set when compiled).
    draws: its ``random_bits`` equations (dropout masks) that draw part of the whole
      batch's bits (``rng.partial_draws``): equation → (dimension, whole-batch shape).
    index_aval: where its programs take the micro-batch index as their last operand (the
      part of the whole batch's bits they draw), or None: programs take none.
  """

  layers: tuple[int, int]
  eqns: tuple[int, ...]
  mesh: LogicalMesh
  operands: tuple[int, ...]
  acts_in: tuple
  acts_out: tuple
  forward: object = None
  backward: object = None
  zeros: object = None
  operand_avals: list = dataclasses.field(default_factory=list)
  in_avals: list = dataclasses.field(default_factory=list)
  out_avals: list = dataclasses.field(default_factory=list)
  cot_avals: list = dataclasses.field(default_factory=list)
  grad_avals: list = dataclasses.field(default_factory=list)
  objectives: tuple[float | None, float] | None = None
  grad_homes: list = dataclasses.field(default_factory=list)
  reduce: object = None
  note: str = ""
  mesh_shape: tuple[int, ...] | None = None
  diff: list = dataclasses.field(default_factory=list)
  float_in: list = dataclasses.field(default_factory=list)
  float_out: list = dataclasses.field(default_factory=list)
  backward_plan: object = None
  forward_plan: object = None
  per_device: object = None
  handover: dict = dataclasses.field(default_factory=dict)
  draws: dict = dataclasses.field(default_factory=dict)
  index_aval: object = None

  def run_forward(self, operands, acts_in, index=()) -> list:
    """``index``: ``[micro-batch index]`` if ``index_aval`` is set, else empty."""
    return list(self.forward(*operands, *acts_in, *index))

  def run_backward(self, operands, acts_in, cotangents, accumulated, index=()):
    """(the accumulator plus this micro-batch's gradients, cotangents of acts_in)."""
    outs = self.backward(*operands, *acts_in, *cotangents, *accumulated, *index)
    return list(outs[:len(self.diff)]), list(outs[len(self.diff):])


def _is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def layer_starts(method: m.PipeshardParallel, jaxpr) -> tuple[int, ...]:
  opt = layers_mod.resolve_layer_option(method.layer_option, jaxpr)
  if opt == "manual":
    return layers_mod.manual_starts(
        jaxpr, "PipeshardParallel(layer_option='manual'), in the function passed to "
        "jaxdist.grad / value_and_grad")
  return layers_mod.cluster_layers(jaxpr, opt.layer_num, opt.eps).starts


def _auto_stage_layout(method: m.PipeshardParallel, loss: capture.CapturedLoss, starts,
                       lmesh: LogicalMesh, state_factor: float, program_cost) -> StagePlan:
  """Alpa's stage DP with the cost per micro-batch of layers i..j-1 on n devices

      Σ_{i ≤ l < j} program_cost(layer l alone on n devices)  +  β · A

  (the shard ILP's objective for each layer's forward and backward programs on the
  sub-mesh, summed; A the bytes of activations the stage receives), and a memory check:
  ``P · (state_factor + 1) + in_flight · A / n + W / n ≤ budget`` per device, with P the
  stage's parameter bytes and W the bytes its equations write for one micro-batch (the
  working set).
  """
  jaxpr = loss.closed.jaxpr
  n_eqns = len(jaxpr.eqns)
  ends = starts[1:] + (n_eqns,)
  cross = layers_mod.crossing_bytes(jaxpr)
  params = set(jaxpr.invars[loss.num_consts:])
  param_vars, written = [], []
  for a, b in zip(starts, ends):
    eqns = jaxpr.eqns[a:b]
    param_vars.append({v for e in eqns for v in e.invars
                       if not isinstance(v, jex.Literal) and v in params})
    written.append(sum(layers_mod.var_bytes(v) for e in eqns for v in e.outvars))
  beta = lmesh.beta[0]
  k = method.num_micro_batches or 1
  devices = lmesh.devices

  @functools.lru_cache(maxsize=None)  # the DP asks for the same ranges many times
  def param_bytes(i, j):
    return sum(layers_mod.var_bytes(v) for v in set().union(*param_vars[i:j]))

  @functools.lru_cache(maxsize=None)
  def layer_cost(layer, n):
    return program_cost(make_stage(loss, starts, layer, layer + 1, devices[:n], lmesh))

  def cost(i, j, n):
    return sum(layer_cost(layer, n) for layer in range(i, j)) + beta * cross[starts[i]]

  opt = method.default_auto_sharding_option
  budget = opt.memory_budget_per_device if opt is not None else None

  def fits(i, j, n, in_flight):
    need = (param_bytes(i, j) * (state_factor + 1) + in_flight * cross[starts[i]] / n
            + sum(written[i:j]) / n)
    return need <= budget

  return auto_stages(cost, len(starts), lmesh.num_devices, k, fits=fits if budget else None,
                     max_bubble_ratio=method.max_pipeline_bubble_ratio,
                     max_unbalance_ratio=method.max_pipeline_unbalance_ratio)


def _stage_layout(method: m.PipeshardParallel, num_layers: int, lmesh: LogicalMesh):
  """Per stage (first layer, last layer + 1), its device count and its sub-mesh shape
  (None: the stage's shard planner searches the shapes)."""
  n = lmesh.num_devices
  opt = method.stage_option
  if isinstance(opt, m.ManualStageOption):
    ids = [list(s) for s in opt.forward_stage_layer_ids or []]
    flat = [i for s in ids for i in s]
    if not ids or flat != list(range(num_layers)) or any(not s for s in ids):
      raise errors.InvalidArgumentError(
          f"ManualStageOption(forward_stage_layer_ids={opt.forward_stage_layer_ids!r}) must "
          f"list the layers 0..{num_layers - 1} in order, each stage a non-empty run.")
    shapes = list(opt.submesh_shapes or [])
    sizes = [math.prod(s) for s in shapes]
    if len(shapes) != len(ids) or sum(sizes) != n:
      raise errors.InvalidArgumentError(
          f"ManualStageOption(submesh_shapes={opt.submesh_shapes!r}): need one shape per stage "
          f"({len(ids)}) whose device counts add up to the {n} devices.")
    return [(s[0], s[-1] + 1) for s in ids], sizes, [tuple(s) for s in shapes]
  v = method.virtual_stages  # stages per device group (interleaved 1F1B)
  num_stages = opt.num_stages if isinstance(opt, m.UniformStageOption) else None
  if num_stages is None:  # as many as possible: the most equal sub-meshes, one layer or more each
    num_stages = v * max(d for d in range(1, max(1, min(n, num_layers // v)) + 1) if n % d == 0)
  if num_stages > num_layers:
    raise errors.InvalidArgumentError(
        f"PipeshardParallel: {num_stages} stages but only {num_layers} layers; use at most "
        f"{num_layers} stages or more layers.")
  if num_stages % v:
    raise errors.InvalidArgumentError(
        f"PipeshardParallel(virtual_stages={v}): {num_stages} stages do not make {v} chunks "
        f"per device group; use a number of stages divisible by {v}.")
  groups = num_stages // v
  if n % groups:
    raise errors.InvalidArgumentError(
        f"PipeshardParallel: {groups} equal sub-meshes do not tile the {n} devices; use a "
        f"number of stages (over virtual_stages) that divides {n}, or ManualStageOption.")
  shape = opt.submesh_shape if isinstance(opt, m.UniformStageOption) else None
  if shape is not None and math.prod(shape) != n // groups:
    raise errors.InvalidArgumentError(
        f"UniformStageOption(submesh_shape={shape!r}) has {math.prod(shape)} devices, but "
        f"{groups} sub-meshes of {n} devices have {n // groups} each.")
  bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
  return (list(zip(bounds, bounds[1:])), [n // groups] * num_stages,
          [None if shape is None else tuple(shape)] * num_stages)


def make_stage(loss: capture.CapturedLoss, starts, first: int, last: int, devices,
               like: LogicalMesh) -> Stage:
  """The stage running layers ``first..last-1`` of the loss on ``devices`` (uncompiled),
  with the link costs (the largest α and β) and peak flops of the method's mesh ``like``."""
  jaxpr = loss.closed.jaxpr
  layer_ends = starts[1:] + (len(jaxpr.eqns),)
  skip = set(jaxpr_util.find_eqns(jaxpr, layers_mod.boundary_p.name))
  operand_index = {v: k for k, v in enumerate(jaxpr.invars)}
  ids = tuple(i for i in range(starts[first], layer_ends[last - 1]) if i not in skip)
  defined = {v for i in ids for v in jaxpr.eqns[i].outvars}
  reads = [v for i in ids for v in jaxpr.eqns[i].invars
           if not isinstance(v, jex.Literal) and v not in defined]
  reads = list(dict.fromkeys(reads))
  later = {v for i in range(layer_ends[last - 1], len(jaxpr.eqns)) for v in jaxpr.eqns[i].invars
           if not isinstance(v, jex.Literal)}
  later |= {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
  return Stage(
      layers=(first, last), eqns=ids,
      mesh=LogicalMesh((len(devices),), axis_names=(STAGE_AXIS,), devices=tuple(devices),
                       alpha=max(like.alpha), beta=max(like.beta), peak_flops=like.peak_flops),
      operands=tuple(operand_index[v] for v in reads if v in operand_index),
      acts_in=tuple(v for v in reads if v not in operand_index),
      acts_out=tuple(v for v in dict.fromkeys(v for i in ids for v in jaxpr.eqns[i].outvars)
                     if v in later and not isinstance(v, jex.DropVar)))


def build_stages(method: m.PipeshardParallel, loss: capture.CapturedLoss, lmesh: LogicalMesh,
                 state_factor: float = 1.0, program_cost=None):
  """Cuts the loss into layers and stages.

  Returns the stages, the layer starts and, for ``stage_option="auto"``, the
  :class:`~jaxdist.pipeline.stages.StagePlan` with its predicted times (else None).
  ``state_factor``: bytes of state (parameters and optimizer state) per parameter byte.
  ``program_cost(stage)``: predicted seconds per micro-batch of an uncompiled stage's
  programs, for ``"auto"`` (see :func:`_auto_stage_layout`).
  """
  jaxpr = loss.closed.jaxpr
  starts = layer_starts(method, jaxpr)
  predicted = None
  if method.stage_option == "auto":
    predicted = _auto_stage_layout(method, loss, starts, lmesh, state_factor, program_cost)
    ranges, sizes = list(predicted.layer_ranges), list(predicted.submesh_sizes)
    shapes = [None] * len(ranges)
  else:
    ranges, sizes, shapes = _stage_layout(method, len(starts), lmesh)
  devices = list(lmesh.devices)
  stages, offset = [], 0
  groups = len(ranges) // method.virtual_stages  # interleaved: stage c on group c mod groups
  for c, ((first, last), size, shape) in enumerate(zip(ranges, sizes, shapes)):
    if method.virtual_stages > 1:
      offset = (c % groups) * size
    stages.append(make_stage(loss, starts, first, last, devices[offset:offset + size], lmesh))
    stages[-1].mesh_shape = shape
    offset += size
  return stages, starts, predicted


def stage_functions(loss: capture.CapturedLoss, stage: Stage, token_weighted: bool = False,
                    frozen: frozenset = frozenset(), part: Callable = lambda index: index):
  """The stage's forward and backward on its operands and activations, and the positions
  of its differentiated operands and float activations in and out.

  Both take the micro-batch ``index`` last (None: the stage draws nothing): each of the
  stage's ``draws`` then draws part ``part(index)`` of the whole batch's bits (the
  dropout masks of those rows in the single-device step).

  ``token_weighted``: the loss is ``n / d`` (``coupling.normalizer_of``); its division is
  guarded by ``coupling.padding_guard`` (a micro-batch of padding only adds 0, not 0 / 0).
  ``frozen``: loss operand positions not differentiated (gradients nothing reads).
  """
  jaxpr = loss.closed.jaxpr
  operand_vars = [jaxpr.invars[k] for k in stage.operands]
  diff = [p for p, k in enumerate(stage.operands)
          if k >= loss.num_consts and k not in frozen and _is_float(jaxpr.invars[k].aval)]
  float_in = [p for p, v in enumerate(stage.acts_in) if _is_float(v.aval)]
  float_out = [p for p, v in enumerate(stage.acts_out) if _is_float(v.aval)]

  guard = coupling.padding_guard(jaxpr) if token_weighted else None

  def forward(operands, acts_in, index=None):
    env = dict(zip(operand_vars, operands))
    env.update(zip(stage.acts_in, acts_in))
    before, after = guard, None
    if stage.draws and index is not None:
      before, after = rng.row_hooks(jaxpr.eqns, stage.draws, lambda: part(index), before)
    jaxpr_util.eval_eqns(jaxpr, env, stage.eqns, before=before, after=after)
    return [env[v] for v in stage.acts_out]

  def backward(operands, acts_in, cotangents, accumulated, index=None):
    """Adds this micro-batch's gradients to ``accumulated`` (donated by the caller)."""
    def differentiable(diff_ops, float_acts):
      ops, acts = list(operands), list(acts_in)
      for p, x in zip(diff, diff_ops):
        ops[p] = x
      for p, x in zip(float_in, float_acts):
        acts[p] = x
      outs = forward(ops, acts, index)
      return [outs[p] for p in float_out]

    _, vjp = jax.vjp(differentiable, [operands[p] for p in diff], [acts_in[p] for p in float_in])
    op_grads, act_cots = vjp(list(cotangents))
    return [a + g for a, g in zip(accumulated, op_grads)], act_cots

  return forward, backward, diff, float_in, float_out
