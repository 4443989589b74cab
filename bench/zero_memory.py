"""Per-device bytes of ZeRO-2 and ZeRO-3 against DataParallel.

Workload: Adam MLP, hidden 512, 4 layers, batch 256, 8 devices. Goals:
Zero2Parallel <= 0.60 x DataParallel, Zero3Parallel <= 0.45 x DataParallel.
Bytes per device = arguments + outputs - donated aliases + temporaries, from XLA's
compiled memory analysis. Run: python bench/zero_memory.py
"""

import common  # noqa: F401  (device setup)

import jax  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402

GOALS = {"Zero2Parallel": 0.60, "Zero3Parallel": 0.45}


def measure(value_and_grad, label):
  batch = models.regression_batch(256, 512)
  state = models.create_state(models.MLP(hidden=512, num_layers=4), batch["x"],
                              tx=optax.adam(1e-3))
  param_mb = sum(x.nbytes for x in jax.tree.leaves(state.params)) / 1e6
  print(f"\n{label}: Adam MLP 512x4, batch 256, {jax.device_count()} devices, "
        f"parameters {param_mb:.2f} MB")
  print(f"{'method':<15} {'MB/device':>10} {'args':>8} {'temp':>8} {'x DP':>7}  goal")
  base = None
  ok = True
  for cls in (jd.DataParallel, jd.Zero2Parallel, jd.Zero3Parallel):
    exe = jd.parallelize(models.regression_step(value_and_grad), method=cls()).get_executable(
        state, batch)
    total = exe.get_total_allocation_size()
    ma = exe.memory_analysis()
    base = base or total
    goal = GOALS.get(cls.__name__)
    ratio = total / base
    status = "" if goal is None else f"<= {goal:.2f} {common.verdict(ratio <= goal)}"
    ok &= goal is None or ratio <= goal
    print(f"{cls.__name__:<15} {total / 1e6:>10.2f} {ma.argument_size_in_bytes / 1e6:>8.2f} "
          f"{ma.temp_size_in_bytes / 1e6:>8.2f} {ratio:>7.3f}  {status}")
  return ok


if __name__ == "__main__":
  measure(jax.value_and_grad, "jax.value_and_grad")
  ok = measure(jd.value_and_grad, "jaxdist.value_and_grad (gradients reduced by jaxdist)")
  print("\nWith plain jax.value_and_grad XLA reduces the gradients; on CPU it combines all of them "
        "into one all-reduce whose input and output coexist (2x parameter bytes of temp).")
  raise SystemExit(0 if ok else 1)
