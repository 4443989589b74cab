"""Activation memory with micro-batches and with recomputation, on a GPT whose
activations dominate (long sequence, narrow width), 8 devices, DataParallel and
ShardParallel (on a 1-D mesh: the same plan at every k, so the rows compare).

Goals, per method: temp bytes per device with num_micro_batches=4 <= 0.5 x with 1; recomputing the
transformer blocks (recompute_modules="Block") cuts temp bytes by a printed factor; every
configuration still matches the serial step. Run: python bench/accumulation.py
"""

import common  # noqa: F401  (device setup)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402

CONFIG = models.GPTConfig(vocab=256, width=64, heads=4, depth=4, seq_len=256)
BATCH = 64


def main():
  batch = models.token_batch(BATCH, CONFIG)
  make = lambda: models.create_state(models.GPT(CONFIG), batch["tokens"][:, :-1],
                                     tx=optax.sgd(0.1, momentum=0.9))
  params_mb = sum(x.nbytes for x in jax.tree.leaves(make().params)) / 1e6
  serial_state, serial_metrics = jax.jit(models.lm_step())(make(), batch)
  print(f"GPT width {CONFIG.width}, {CONFIG.depth} blocks, seq {CONFIG.seq_len}, batch {BATCH}, "
        f"parameters {params_mb:.2f} MB, {jax.device_count()} devices")
  print(f"{'method':>13} {'micro-batches':>13} {'recompute':>9} {'temp MB/device':>15} "
        f"{'x k=1':>7} {'max |Δ param|':>14} {'Δ loss':>9}")
  runs = [("DataParallel", jd.DataParallel, {}, recompute, k)
          for recompute in (None, "Block") for k in (1, 2, 4, 8)]
  runs += [("ShardParallel", jd.ShardParallel, {"logical_mesh_shape": (8,)}, recompute, k)
           for recompute, k in ((None, 1), (None, 4), ("Block", 1), ("Block", 4))]
  temp = {}
  ok = goals = True
  for name, cls, kwargs, recompute, k in runs:
    method = cls(num_micro_batches=k, recompute_modules=recompute, **kwargs)
    step = jd.parallelize(models.lm_step(jd.value_and_grad), method=method)
    exe = step.get_executable(make(), batch)
    temp[name, recompute, k] = exe.memory_analysis().temp_size_in_bytes
    state, metrics = step(make(), batch)
    dparam = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(state.params),
                                 jax.tree.leaves(serial_state.params)))
    dloss = abs(float(metrics["loss"]) - float(serial_metrics["loss"]))
    ok &= dparam <= 1e-5 and dloss <= 1e-5 * float(serial_metrics["loss"])
    print(f"{name:>13} {k:>13} {recompute or '-':>9} {temp[name, recompute, k] / 1e6:>15.2f} "
          f"{temp[name, recompute, k] / temp[name, None, 1]:>7.3f} {dparam:>14.1e} {dloss:>9.1e}")
  print()
  for name in ("DataParallel", "ShardParallel"):
    ratio = temp[name, None, 4] / temp[name, None, 1]
    goals &= ratio <= 0.5
    print(f"{name}: k=4 / k=1 temp bytes: {ratio:.3f} (goal <= 0.5: {common.verdict(ratio <= 0.5)})")
    for k in (1, 4):
      print(f"{name}: recomputing the blocks divides temp bytes by "
            f"{temp[name, None, k] / temp[name, 'Block', k]:.2f} at k={k}")
  print(f"every configuration matches the serial step (params 1e-5, loss rtol 1e-5): "
        f"{common.verdict(ok)}")
  return ok and goals


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
