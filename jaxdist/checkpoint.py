"""Checkpoints of sharded state with orbax: each process writes its own shards, and a
restore reads each shard straight into the layout asked for (the one a compiled step
wants, on any mesh: a DataParallel checkpoint restores into a ShardParallel or
PipeshardParallel run and back). Nothing is gathered onto one device.

    jd.checkpoint.save("ckpt", state, step=100)
    state = jd.checkpoint.restore("ckpt", like=state, executable=train_step.get_executable(state, batch))
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxdist import errors


def _checkpointer():
  import orbax.checkpoint as ocp  # heavy: imported on use

  return ocp.StandardCheckpointer()


def _directory(path, step) -> Path:
  path = Path(path).absolute()
  return path if step is None else path / str(int(step))


def save(path, state, *, step: int | None = None) -> Path:
  """Writes ``state`` (a pytree of ``jax.Array``s, sharded or not, and Python scalars) to
  ``path/<step>`` (or ``path`` without a step), overwriting; returns the directory. Every
  process of a multi-process job must call it."""
  directory = _directory(path, step)
  checkpointer = _checkpointer()
  checkpointer.save(directory, state, force=True)
  checkpointer.wait_until_finished()
  return directory


def latest_step(path) -> int | None:
  """The largest step saved under ``path`` (None if there is none)."""
  try:
    steps = [int(p.name) for p in Path(path).iterdir() if p.is_dir() and p.name.isdigit()]
  except FileNotFoundError:
    return None
  return max(steps, default=None)


def restore(path, like, *, executable=None, step: int | None = None, argnum: int = 0):
  """Reads a checkpoint into the shardings of ``executable``'s argument ``argnum`` (the
  state a compiled step takes), or else of ``like``'s own leaves.

  Args:
    path: the directory given to :func:`save`.
    like: a pytree of the state's structure: arrays, ``jax.ShapeDtypeStruct``s (from
      ``jax.eval_shape``) or Python scalars.
    executable: a ``jaxdist.Executable`` (or pipeline executable) whose input layout the
      state is restored into; None: ``like``'s shardings (``ShapeDtypeStruct.sharding``
      or the arrays' own).
    step: which step under ``path`` (None: ``path`` itself if it holds a checkpoint, else
      the latest step).
    argnum: the position of the state among the step's dynamic arguments.

  Raises:
    InvalidArgumentError: nothing is saved at ``path``, or ``like`` does not match the
      executable's argument.
  """
  if step is None and not (Path(path) / "_CHECKPOINT_METADATA").exists():
    step = latest_step(path)
  directory = _directory(path, step)
  if not directory.exists():
    raise errors.InvalidArgumentError(
        f"checkpoint.restore: nothing saved at {os.fspath(directory)!r}.")
  leaves, tree = jax.tree.flatten(like)
  if executable is not None:
    shardings = jax.tree.leaves(executable.input_shardings[argnum])
    if len(shardings) != len(leaves):
      raise errors.InvalidArgumentError(
          f"checkpoint.restore: like= has {len(leaves)} leaves, the executable's argument "
          f"{argnum} has {len(shardings)}; pass the state the step takes.")
  else:
    shardings = [getattr(x, "sharding", None) for x in leaves]
  target = []
  for x, sharding in zip(leaves, shardings):
    shape, dtype = jax.numpy.shape(x), jax.numpy.result_type(x)
    target.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
  return _checkpointer().restore(directory, jax.tree.unflatten(tree, target))
