"""jaxdist's per-call overhead: a DataParallel step against the same shardings by hand.

The hand-written baseline is ``jax.jit(step, in_shardings, out_shardings,
donate_argnums=0)`` with exactly the shardings jaxdist chose. Calls alternate
(jaxdist, hand, jaxdist, ...) so that machine noise hits both alike; the figure is the
median of per-pair ratios. Goal: <= 1.05. Run: python bench/overhead.py
"""

import common  # noqa: F401  (device setup)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402

PAIRS = 60


def main():
  batch = models.regression_batch(256, 256)
  model = models.MLP(hidden=256, num_layers=4)
  state = models.create_state(model, batch["x"], tx=optax.adam(1e-3))
  ours = jd.parallelize(models.regression_step(), method=jd.DataParallel())
  exe = ours.get_executable(state, batch)
  hand = jax.jit(models.regression_step(), in_shardings=exe.input_shardings,
                 out_shardings=exe.output_shardings, donate_argnums=0)
  batch = jax.device_put(batch, exe.input_shardings[1])
  s_ours = ours(state, batch)[0]
  s_hand = hand(jax.device_put(state, exe.input_shardings[0]), batch)[0]
  jax.block_until_ready((s_ours, s_hand))
  ratios, t_ours, t_hand = [], [], []
  for _ in range(PAIRS):
    start = time.perf_counter()
    s_ours, m = ours(s_ours, batch)
    jax.block_until_ready((s_ours, m))
    mid = time.perf_counter()
    s_hand, m = hand(s_hand, batch)
    jax.block_until_ready((s_hand, m))
    end = time.perf_counter()
    t_ours.append(mid - start)
    t_hand.append(end - mid)
    ratios.append(t_ours[-1] / t_hand[-1])
  ratio = statistics.median(ratios)
  print(f"DataParallel MLP 256x4, batch 256, {jax.device_count()} devices, {PAIRS} alternating pairs")
  print(f"median step: jaxdist {statistics.median(t_ours) * 1e3:.3f} ms, "
        f"hand-written jax.jit {statistics.median(t_hand) * 1e3:.3f} ms")
  print(f"median ratio jaxdist / hand = {ratio:.3f}  (goal <= 1.05: {common.verdict(ratio <= 1.05)})")


if __name__ == "__main__":
  main()
