"""Shared helpers: the serial reference step and tree comparisons."""

import jax
import numpy as np


def serial(step, *args):
  """The plain single-device step (jax.jit; inputs live on device 0)."""
  return jax.jit(step)(*args)


def to_host(tree):
  """A numpy snapshot keyed by leaf path (take it before a later step donates the arrays)."""
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_trees_close(actual, expected, rtol, atol):
  """Leaf-by-leaf allclose, matched by path (treedefs may differ in static metadata)."""
  actual, expected = to_host(actual), to_host(expected)
  assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
  for path, e in expected.items():
    np.testing.assert_allclose(actual[path], e, rtol=rtol, atol=atol, err_msg=path)


MAKE_STEP_SCRIPT = """\
import optax
import jaxdist as jd
from jaxdist import models

def make_step():
  data = models.regression_batch(32, 64, out=64)
  state = models.create_state(models.MLP(hidden=64, num_layers=2, out=64), data['x'],
                              tx=optax.sgd(0.1))
  return models.regression_step(jd.value_and_grad), (state, data)
"""


def make_step_script(directory) -> str:
  """Writes a script for `jaxdist estimate` / `jaxdist tune` (a small MLP's step) and
  returns its ``path:make_step`` target."""
  script = directory / "make.py"
  script.write_text(MAKE_STEP_SCRIPT)
  return f"{script}:make_step"
