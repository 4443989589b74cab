"""Each stage program is a ShardParallel program: planned by the shard ILP on its sub-mesh.

A stage program (``partition.stage_functions``) is traced on flat leaves into a
:class:`~jaxdist.trace.TracedStep` of its own, whose input roles tell the planner what
each leaf is: the stage's differentiated operands are parameters, micro-batch slices,
activations and cotangents are batch, and the gradient accumulator is state updated in
place (donated). The backward (which recomputes the forward, so it holds every equation
the stage has) is planned first, searching the sub-mesh's 1-D and 2-D shapes; the forward
is then planned with its operands pinned to the backward's choice, so that parameters and
saved inputs are laid out once for both programs.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import tree_util
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import errors
from jaxdist import methods as m
from jaxdist.executable import compile_layout
from jaxdist.mesh import LogicalMesh
from jaxdist.shard.planner import (ShardPlanResult, path_matches, pattern_help,
                                   plan_shard_parallel)
from jaxdist.trace import BATCH, INPUT, PARAM, LeafInfo, TracedStep


@dataclasses.dataclass(frozen=True)
class PlannedProgram:
  """One stage program and its plan.

  Attributes:
    compiled: the compiled program (flat leaves in, flat leaves out).
    result: the shard planner's result (layout, objective, mesh objectives).
    in_shardings, out_shardings: per flat leaf.
  """

  compiled: object
  result: ShardPlanResult
  in_shardings: tuple
  out_shardings: tuple

  @property
  def lmesh(self) -> LogicalMesh:
    return self.result.layout.logical_mesh


def program_step(fun, groups, roles, paths, tied: dict[int, int] | None = None,
                 donated: frozenset[int] = frozenset()) -> TracedStep:
  """``fun(*groups)`` traced on flat leaves, each group a list of ``ShapeDtypeStruct``.

  ``roles``, ``paths``: per group, one role and one name per leaf (the names that
  ``partition_constraints`` patterns match). ``tied``: output position → the flat input
  position it is the new value of (planned with the same sharding). ``donated``: flat
  input positions whose buffers the program may reuse (marked as argument 1, the rest 0).
  """
  flat, in_tree = tree_util.tree_flatten(tuple(groups))
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
  out_tree = []

  def flat_fun(*leaves):
    out, tree = tree_util.tree_flatten(fun(*tree_util.tree_unflatten(in_tree, leaves)))
    out_tree.append(tree)
    return out

  closed = jax.make_jaxpr(flat_fun)(*avals)
  named = [(a, role, path) for group, group_roles, group_paths in zip(groups, roles, paths)
           for a, role, path in zip(group, group_roles, group_paths)]
  inputs = [LeafInfo(path, tuple(a.shape), a.dtype, int(k in donated), role)
            for k, (a, role, path) in enumerate(named)]
  out_avals = tuple(v.aval for v in closed.jaxpr.outvars)
  batch = [leaf.shape[0] for leaf in inputs if leaf.role == BATCH and leaf.shape]
  return TracedStep(
      closed_jaxpr=closed, in_tree=in_tree, out_tree=out_tree[0], inputs=tuple(inputs),
      out_avals=out_avals, out_paths=tuple(f"out[{o}]" for o in range(len(out_avals))),
      output_source=tuple((tied or {}).get(o) for o in range(len(out_avals))),
      donated_argnums=(1,) if donated else (),
      batch_size=max(batch) if batch else None, roles_from_loss=True,
      depends_on_batch=(True,) * len(out_avals))


def plan_program(step: TracedStep, lmesh: LogicalMesh, option: m.AutoShardingOption,
                 pinned: dict[int, PartitionSpec] | None = None, compile: bool = True,
                 mesh_shape: tuple[int, ...] | None = None) -> PlannedProgram:
  """Plans ``step`` and compiles it: over every 1-D and 2-D shape of ``lmesh``'s devices
  (or ``mesh_shape`` only), or, with ``pinned`` (input position → spec), on ``lmesh``
  itself with those inputs fixed and the rest chosen.

  Of ``option.partition_constraints`` only the patterns matching a leaf of ``step``
  apply (a stage holds some of the parameters; :func:`check_constraints_used` checks
  that each pattern matches somewhere). Pins are constraints on the exact leaf paths,
  ahead of the user's patterns."""
  constraints = {step.inputs[k].path: spec for k, spec in (pinned or {}).items()}
  for pattern, spec in (option.partition_constraints or {}).items():
    if any(path_matches(pattern, leaf.path) for leaf in step.inputs):
      constraints.setdefault(pattern, spec)
  option = dataclasses.replace(option, partition_constraints=constraints or None)
  method = m.ShardParallel(auto_sharding_option=option,
                           logical_mesh_shape=mesh_shape if pinned is None else lmesh.shape)
  result = plan_shard_parallel(method, step, lmesh)
  layout = result.layout
  mesh = layout.logical_mesh.mesh
  ins = tuple(NamedSharding(mesh, s) for s in layout.in_specs)
  outs = tuple(NamedSharding(mesh, s) for s in layout.out_specs)
  compiled = compile_layout(result.step, layout) if compile else None
  return PlannedProgram(compiled, result, ins, outs)


def operand_roles(stage, batch_operand) -> list[str]:
  """Per stage operand: parameter if differentiated, batch if batch-dependent, else input."""
  return [PARAM if p in stage.diff else BATCH if batch_operand[k] else INPUT
          for p, k in enumerate(stage.operands)]


def check_constraints_used(option: m.AutoShardingOption, paths) -> None:
  """Raises InvalidArgumentError for a ``partition_constraints`` pattern matching none of
  ``paths`` (the pipelined step's operand names)."""
  for pattern in option.partition_constraints or {}:
    if not any(path_matches(pattern, path) for path in paths):
      raise errors.InvalidArgumentError(
          f"default_auto_sharding_option.partition_constraints pattern {pattern!r} matches no "
          f"parameter of the pipelined loss; {pattern_help(pattern, paths)}")
