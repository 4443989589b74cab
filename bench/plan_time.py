"""Planning cost: the first call of ShardParallel (trace + ILP + XLA compile) against XLA's
compile of the same GPT step with hand-written data-parallel shardings.

GPT: vocab 2048, width 512, batch 8 x 128, Adam, 8 devices; 6 and 12 blocks. Goal: ratio
<= 2 at both depths. ShardParallel is given the logical mesh shape (8,) here, so one ILP
is solved; a full shape search solves one per factorization of the device count.

Importing cvxpy (and the scipy.stats it pulls in) takes over a second once per process,
on the first ShardParallel plan; it is timed on its own line and left out of the ratio,
which compares trace + ILP + compile with trace + compile. The ratio with the import
charged to the first depth is printed too. Run: python bench/plan_time.py
"""

import common  # noqa: F401  (device setup)

import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import models  # noqa: E402


def measure(depth):
  config = models.GPTConfig(vocab=2048, width=512, heads=8, depth=depth, seq_len=128)
  batch = models.token_batch(8, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  dp = jd.parallelize(models.lm_step(), method=jd.DataParallel()).get_executable(state, batch)
  start = time.perf_counter()
  jax.jit(models.lm_step(), in_shardings=dp.input_shardings,
          out_shardings=dp.output_shardings).lower(state, batch).compile()
  hand_s = time.perf_counter() - start
  start = time.perf_counter()
  exe = jd.parallelize(models.lm_step(), method=jd.ShardParallel(
      logical_mesh_shape=(8,))).get_executable(state, batch)
  ours_s = time.perf_counter() - start
  eqns = len(exe._step.closed_jaxpr.jaxpr.eqns)
  return hand_s, ours_s, eqns


def main():
  start = time.perf_counter()
  import cvxpy  # noqa: F401
  import_s = time.perf_counter() - start
  print(f"one-time per process: import cvxpy {import_s:.2f} s")
  ok = True
  print(f"{'blocks':>6} {'equations':>9} {'hand compile s':>15} {'ShardParallel s':>16} {'ratio':>6} "
        f"{'with import':>12}")
  for depth in (6, 12):
    hand_s, ours_s, eqns = measure(depth)
    ratio = ours_s / hand_s
    ok &= ratio <= 2
    print(f"{depth:>6} {eqns:>9} {hand_s:>15.2f} {ours_s:>16.2f} {ratio:>6.2f} "
          f"{(ours_s + import_s) / hand_s:>12.2f}  (goal <= 2: {common.verdict(ratio <= 2)})")
  return ok


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
