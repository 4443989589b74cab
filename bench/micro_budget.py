"""ShardParallel under a memory budget with micro-batches, against ZeRO's fixed layouts.

The GPT of compare_hand.py (vocab 2048, width 512, 4 blocks, Adam) at batch 32 in
num_micro_batches=4, on 8 simulated devices, with compare_hand's link costs: one NVLink
node (8,), and the two-level mesh (2, 4). Budgets: 0.7 and 0.5 x DataParallel's compiled
bytes at k=4. Per row: the compiled bytes per device, the step time projected from the compiled HLO (compare_hand.projected_seconds), the re-plans
the compiled bytes forced (the first with the micro-batch loop's buffers in the planner's
memory model), and the seconds to plan and compile. Goal: the ShardParallel plan fits the
0.7 budget on both meshes. At 0.5 on one node no ShardParallel plan can fit (the batch is
split over the only axis, so the loop holds every parameter gathered and every gradient
whole; only Zero3Parallel, which streams the parameters, fits): that row is printed, not
judged.
Run: python bench/micro_budget.py
"""

import common  # noqa: F401  (device setup)

import time  # noqa: E402
import warnings  # noqa: E402

import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import errors, models  # noqa: E402

from compare_hand import CONFIG, PEAK_FLOPS, REGIMES, projected_seconds  # noqa: E402

K = 4


def main():
  batch = models.token_batch(32, CONFIG)
  state = models.create_state(models.GPT(CONFIG), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  step = models.lm_step(jd.value_and_grad)
  ok = True
  for name in ("nvlink", "two-level (IB x NVLink)"):
    regime = REGIMES[name]
    mesh = jd.LogicalMesh(regime["shape"], alpha=regime["alpha"], beta=regime["beta"],
                          peak_flops=PEAK_FLOPS)
    print(f"\n{name}, mesh {regime['shape']}, k={K}")
    print(f"{'plan':<28} {'compiled MB':>11} {'projected ms':>12} "
          f"{'re-plans':>8} {'plan+compile s':>14}")
    dp_bytes = None
    for label, method in [("DataParallel", jd.DataParallel), ("Zero2Parallel", jd.Zero2Parallel),
                          ("Zero3Parallel", jd.Zero3Parallel)]:
      exe = jd.parallelize(step, method=method(devices=mesh, num_micro_batches=K)
                           ).get_executable(state, batch)
      dp_bytes = dp_bytes or exe.get_total_allocation_size()
      print(f"{label:<28} {exe.get_total_allocation_size() / 1e6:>11.1f} "
            f"{projected_seconds(exe, regime) * 1e3:>12.3f}")
    for fraction in (0.7, 0.5):
      budget = fraction * dp_bytes
      func = jd.parallelize(step, method=jd.ShardParallel(
          devices=mesh, num_micro_batches=K, auto_sharding_option=jd.AutoShardingOption(
              memory_budget_per_device=budget, plan_cache=False)))
      start = time.perf_counter()
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.JaxdistWarning)
        exe = func.get_executable(state, batch)
      seconds = time.perf_counter() - start
      note = next(n for n in exe.plan.notes if n.startswith("memory_budget_per_device"))
      replans = int(note.split(" re-plan")[0].rsplit(" ", 1)[-1]) if "re-plan" in note else 0
      used = exe.get_total_allocation_size()
      fits = used <= budget
      ok &= fits or fraction < 0.7
      print(f"{f'ShardParallel, {fraction} x DP':<28} {used / 1e6:>11.1f} "
            f"{projected_seconds(exe, regime) * 1e3:>12.3f} {replans:>8} {seconds:>14.1f}  "
            f"(budget {budget / 1e6:.1f} MB: "
            f"{common.verdict(fits) if fraction >= 0.7 else 'fits' if fits else 'over'})")
  return ok


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
