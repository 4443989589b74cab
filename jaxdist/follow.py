"""FollowParallel: an evaluation step laid out like a compiled train step.

The train step's last executable gives the mesh and each input's sharding. An argument of
the evaluation step whose leaves have the train step's shapes at the same argument
position (the state) takes the train step's specs; a batch leaf is split on dim 0 over
the axes the train step splits its batch over (when they divide it); other leaves are
replicated. The shard planner then lays out the evaluation step with those inputs pinned.

A PipeshardParallel train step run by the driver keeps each stage's state on the stage's
sub-mesh, and one program cannot read arrays on different device sets: its evaluation step
runs over all the pipeline's devices, a state leaf that lives on all of them keeps its
sharding, and one that lives on a stage's sub-mesh is split over every device on one
dimension (as ZeRO-3 lays it out: no device holds a whole leaf). Each call moves those
leaves from their stages (a copy per evaluation, not per train step). In a multi-process
job, pass the state through the train step's ``exe.gather`` first: values cross processes
only between sub-meshes of one size.
"""

from __future__ import annotations

import math

from jax import tree_util
from jax.sharding import PartitionSpec

from jaxdist import errors
from jaxdist import methods as m
from jaxdist.layouts import shard_leaf_dim
from jaxdist.mesh import LogicalMesh
from jaxdist.plan import Plan, PlanEntry
from jaxdist.trace import BATCH, TracedStep


def shard_method(method: m.FollowParallel, step: TracedStep) -> tuple[m.ShardParallel, LogicalMesh]:
  """The ShardParallel method (with a plan pinning every input) and mesh that follow
  ``method.src_func``'s layout for ``step``."""
  src = method.src_func
  exe = src.last_executable()
  if exe is None:
    raise errors.InvalidArgumentError(
        "FollowParallel(src_func=...) follows a compiled train step: call the train step "
        "once (or get_executable / create_state on it) before the evaluation step.")
  src_step = exe.traced_step
  if hasattr(exe, "layout"):
    lmesh, specs = exe.layout.logical_mesh, exe.layout.in_specs
  else:  # the pipeline driver: all its devices, state off the stages split over them
    lmesh = exe.logical_mesh
    everywhere = set(lmesh.devices)
    specs = [home.spec if home.device_set == everywhere
             else shard_leaf_dim(leaf.shape, lmesh) or PartitionSpec()
             for leaf, home in zip(src_step.inputs, tree_util.tree_leaves(exe.input_shardings))]
  by_arg: dict[int, list] = {}
  for leaf, spec in zip(src_step.inputs, specs):
    by_arg.setdefault(leaf.argnum, []).append((leaf, spec))
  # (The pipeline driver takes its batch whole: its evaluation splits it over every axis.)
  batch_axes = _batch_axes(src_step, specs) or (() if hasattr(exe, "layout") else
                                                tuple(lmesh.axis_names))
  sizes = dict(zip(lmesh.axis_names, lmesh.shape))
  mine: dict[int, list] = {}
  for leaf in step.inputs:
    mine.setdefault(leaf.argnum, []).append(leaf)
  entries = []
  for leaf in step.inputs:
    theirs = by_arg.get(leaf.argnum, [])
    same = (len(theirs) == len(mine[leaf.argnum])
            and all(t.shape == l.shape for (t, _), l in zip(theirs, mine[leaf.argnum])))
    if same:
      spec = theirs[mine[leaf.argnum].index(leaf)][1]
    elif (leaf.role == BATCH and batch_axes and leaf.shape
          and leaf.shape[0] % math.prod(sizes[a] for a in batch_axes) == 0):
      spec = PartitionSpec(batch_axes if len(batch_axes) > 1 else batch_axes[0])
    else:
      spec = PartitionSpec()
    entries.append(PlanEntry(leaf.path, leaf.shape, str(leaf.dtype), leaf.role, spec))
  plan = Plan(method="ShardParallel", mesh_shape=lmesh.shape, axis_names=lmesh.axis_names,
              inputs=tuple(entries))
  return m.ShardParallel(devices=lmesh, plan=plan), lmesh


def _batch_axes(step: TracedStep, specs) -> tuple[str, ...]:
  """The mesh axes the train step splits its batch's dim 0 over."""
  for leaf, spec in zip(step.inputs, specs):
    if leaf.role == BATCH and len(spec) and spec[0] is not None:
      return spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  return ()
