"""Moving values between sub-meshes on the devices (jaxdist.pipeline.transfer)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxdist as jd
from jaxdist import models
from jaxdist.pipeline import transfer
from helpers import assert_trees_close


def _sharding(devices, shape, names, spec):
  return NamedSharding(Mesh(np.array(devices).reshape(shape), names), spec)


@pytest.mark.parametrize("src, dst, kind", [
    ((slice(0, 2), (2,), ("x",), P("x")), (slice(2, 4), (2,), ("y",), P("y")), "copy"),
    ((slice(0, 2), (2,), ("x",), P(None, "x")), (slice(2, 4), (2,), ("x",), P("x")),
     "reshard+copy"),
    ((slice(0, 4), (2, 2), ("a", "b"), P("a", "b")), (slice(4, 8), (4,), ("x",), P("x")),
     "reshard+copy"),
    ((slice(0, 8), (4, 2), ("s", "x"), P("x")), (slice(2, 4), (2,), ("x",), P("x")), "assemble"),
    ((slice(0, 8), (8,), ("all",), P()), (slice(2, 4), (2,), ("x",), P(None, "x")),
     "reshard+assemble"),
    ((slice(0, 8), (8,), ("all",), P("all")), (slice(4, 6), (2,), ("x",), P()), "reshard+copy"),
    ((slice(0, 2), (2,), ("x",), P("x")), (slice(0, 8), (8,), ("all",), P()),
     "replicate+copy+reshard"),
    ((slice(2, 4), (2,), ("x",), P("x")), (slice(0, 8), (4, 2), ("s", "x"), P("s")),
     "replicate+copy+reshard"),
])
def test_every_transfer_keeps_the_value_and_lands_in_the_target_layout(src, dst, kind):
  devices = jax.devices()
  (s_dev, *s_rest), (d_dev, *d_rest) = src, dst
  source = _sharding(devices[s_dev], *s_rest)
  target = _sharding(devices[d_dev], *d_rest)
  value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
  x = jax.device_put(value, source)
  move = transfer.transfer(x.shape, x.dtype, source, target)
  assert move.kind == kind
  y = move(x)
  assert y.sharding == target
  np.testing.assert_array_equal(np.asarray(y), value)
  for shard in y.addressable_shards:  # every device holds its own slice
    np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_stage_programs_hand_values_to_the_next_stage_in_its_layout():
  # On this MLP the shard ILP splits stage 0's output on the batch and stage 1's input on
  # the features: jax.device_put between them fetched every activation and cotangent to
  # the host (and waited for it). Now each stage program returns what crosses in the
  # layout of the program that reads it, so the move is one copy, and a micro-batch's
  # slice is assembled from shards its stage's devices already hold.
  data = models.regression_batch(16, 8)
  make = lambda: models.create_state(models.MLP(hidden=8, num_layers=4), data["x"],
                                     tx=optax.sgd(0.1, momentum=0.9))
  method = jd.PipeshardParallel(num_micro_batches=4, layer_option=jd.AutoLayerOption(layer_num=4),
                                stage_option=jd.UniformStageOption(num_stages=4))
  step = jd.parallelize(models.regression_step(jd.value_and_grad), method=method)
  exe = step.get_executable(make(), data)
  stages = exe.stages
  kinds = []
  for a, b in zip(stages, stages[1:]):
    for v, reads in zip(b.acts_in, b.in_avals):
      made = a.out_avals[a.acts_out.index(v)]
      kinds.append(transfer.transfer(made.shape, made.dtype, made.sharding, reads.sharding).kind)
    for p in b.float_in:
      v = b.acts_in[p]
      cot = a.cot_avals[a.float_out.index(a.acts_out.index(v))]
      back = b.backward.output_shardings[len(b.diff) + b.float_in.index(p)]
      kinds.append(transfer.transfer(cot.shape, cot.dtype, back, cot.sharding).kind)
  assert kinds and set(kinds) == {"copy"}, kinds
  # The micro-batches are cut where the stages reading them find their shards.
  batch = [p for p, b in enumerate(exe._batch_operand) if b]
  sliced = dict(zip(batch, exe._slicer.output_shardings))
  moves = [transfer.transfer(a.shape, a.dtype, sh, a.sharding).kind
           for st in stages for p, a in zip(st.operands, st.operand_avals) if p in sliced
           for sh in sliced[p]]
  assert moves and set(moves) == {"assemble"}, moves
  state = make()
  expected = jax.jit(models.regression_step())(make(), data)
  assert_trees_close(step(state, data), expected, rtol=1e-5, atol=1e-6)
