"""Planning cost: the first call of ShardParallel (trace + ILP + XLA compile) against XLA's
compile of the same GPT step with hand-written shardings.

GPT: vocab 2048, width 512, batch 8 x 128, Adam, 8 devices; 6 and 12 blocks. ShardParallel
is given the logical mesh shape (8,), so one ILP is solved (a full shape search solves one
per factorization of the device count).

Two hand references, each jax.jit's trace + lower + compile of the step with nothing but
input and output shardings (XLA propagates the rest):
- "plan by hand": the shardings the plan chose. The gap to it is what jaxdist adds: tracing
  for the planner, the ILP, lowering through the jaxpr, and the constraints that pin the
  plan inside the step. Goals (issue 10): first call <= 1.5x (goal 1.0x) at both depths,
  a second planning of the same step (a new ParallelizedFunc, as in a new process: the
  solved ILP comes from the on-disk plan cache) <= 1.1x, and the first call's growth from
  6 to 12 blocks <= 1.2x the reference's. It is not the plan's program: from the inputs'
  and outputs' shardings alone XLA's propagation places the insides its own way (the
  compiled collectives and step time of both are printed), and the plan's program, with
  its layout pinned inside the step, takes XLA longer to compile (the "compile" phase
  below). Pinning fewer equations (only those whose layout XLA would not derive from
  their operands: 1396 -> 350 of a 6-block GPT's 3268 equations) compiled the same
  program no faster, within this machine's noise (medians 4.17 vs 4.19 s).
- "data parallel by hand": the shardings an expert would write first. Under the default
  CPU costs the plan is a different program (it shards parameters and optimizer state,
  all-gathering weights where they are read), which XLA takes longer to compile; the step
  time of both is printed, so the compile is weighed against what it buys.

Importing cvxpy (and the scipy.stats it pulls in) takes over a second once per process,
on the first ShardParallel plan; it is timed on its own line and left out of the ratios.
The machine is noisy (8 simulated devices on 2 cores) and a process's later compiles run
slower than its first (a warm-up round is discarded): each figure is the least of ROUNDS
rounds whose order rotates (a new jit, a new ParallelizedFunc and a new plan cache each
round); the rounds are printed too. Run: python bench/plan_time.py
"""

import common  # noqa: F401  (device setup)

import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist import inspect as hlo_inspect, models  # noqa: E402
from jaxdist.measure import time_steps  # noqa: E402

ROUNDS = 3  # each figure is the least of this many samples


def hand_compile(state, batch, shardings):
  """jax.jit's trace + lower + compile of a new step function with these shardings."""
  return jax.jit(models.lm_step(), in_shardings=shardings[0],
                 out_shardings=shardings[1]).trace(state, batch).lower().compile()


def hand_seconds(state, batch, shardings) -> float:
  start = time.perf_counter()
  hand_compile(state, batch, shardings)
  return time.perf_counter() - start


def collectives(hlo_text: str) -> str:
  return ", ".join(f"{k} {v.count}x {v.result_bytes / 2**20:.1f} MiB"
                   for k, v in sorted(hlo_inspect.collective_summary(hlo_text).items()))


def ours_seconds(state, batch, method) -> tuple[float, float, dict, dict]:
  """The first call of a new ParallelizedFunc with a new plan cache, then of another one
  that finds the plan in that cache; their seconds and phases."""
  os.environ["JAXDIST_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdist-plan-time-")
  start = time.perf_counter()
  first = jd.parallelize(models.lm_step(), method=method).get_executable(state, batch)
  first_s = time.perf_counter() - start
  start = time.perf_counter()
  again = jd.parallelize(models.lm_step(), method=method).get_executable(state, batch)
  return first_s, time.perf_counter() - start, first.timings, again.timings


def measure(depth):
  config = models.GPTConfig(vocab=2048, width=512, heads=8, depth=depth, seq_len=128)
  batch = models.token_batch(8, config)
  state = models.create_state(models.GPT(config), batch["tokens"][:, :-1], tx=optax.adam(1e-3))
  method = jd.ShardParallel(logical_mesh_shape=(8,))
  # Warm-up round (discarded): both methods' shardings, and each path run once.
  dp = jd.parallelize(models.lm_step(), method=jd.DataParallel())
  dp_exe = dp.get_executable(state, batch)
  ours_seconds(state, batch, method)
  sp = jd.parallelize(models.lm_step(), method=method)
  sp_exe = sp.get_executable(state, batch)
  refs = {"plan": (sp_exe.input_shardings, sp_exe.output_shardings),
          "dp": (dp_exe.input_shardings, dp_exe.output_shardings)}
  jobs = ("plan", "dp", "ours")
  samples = {"plan": [], "dp": [], "first": [], "cached": []}
  phases = None
  for r in range(ROUNDS):
    for job in jobs[r % 3:] + jobs[:r % 3]:
      if job == "ours":
        first_s, cached_s, first_t, cached_t = ours_seconds(state, batch, method)
        samples["first"].append(first_s)
        samples["cached"].append(cached_s)
        if first_s == min(samples["first"]):
          phases = first_t, cached_t
      else:
        samples[job].append(hand_seconds(state, batch, refs[job]))
  least = {k: min(v) for k, v in samples.items()}
  # The plan by hand is another program: XLA's propagation from the inputs and outputs
  # alone does not place the insides as the plan does.
  by_hand = hand_compile(state, batch, refs["plan"])
  programs = {"plan": collectives(sp_exe.get_hlo_text()),
              "plan by hand": collectives(by_hand.as_text())}
  steps = {name: time_steps(f, state, batch, num_steps=2, warmup=1)[2]
           for name, f in (("plan", sp), ("dp", dp), ("plan by hand", by_hand))}
  eqns = len(sp_exe.traced_step.closed_jaxpr.jaxpr.eqns)
  return least, samples, phases, steps, eqns, programs


def describe(timings):
  return "  ".join(f"{k[:-2]} {timings.get(k, 0.0):.2f}"
                   for k in ("trace_s", "plan_s", "lower_s", "compile_s"))


def main():
  start = time.perf_counter()
  import cvxpy  # noqa: F401
  import_s = time.perf_counter() - start
  print(f"one-time per process: import cvxpy {import_s:.2f} s; each figure is the least of "
        f"{ROUNDS} rounds (seconds)")
  print(f"{'blocks':>6} {'equations':>9} {'plan by hand':>12} {'first call':>10} {'ratio':>6} "
        f"{'cached':>7} {'ratio':>6}   {'data parallel by hand':>21} {'ratios':>11}")
  ok, rows = True, {}
  for depth in (6, 12):
    least, samples, phases, steps, eqns, programs = rows[depth] = measure(depth)
    first, cached = least["first"] / least["plan"], least["cached"] / least["plan"]
    ok &= first <= 1.5 and cached <= 1.1
    print(f"{depth:>6} {eqns:>9} {least['plan']:>12.2f} {least['first']:>10.2f} {first:>6.2f} "
          f"{least['cached']:>7.2f} {cached:>6.2f}   {least['dp']:>21.2f} "
          f"{least['first'] / least['dp']:>5.2f} {least['cached'] / least['dp']:>5.2f}  "
          f"(goals: first <= 1.5 {common.verdict(first <= 1.5)}, cached <= 1.1 "
          f"{common.verdict(cached <= 1.1)})")
    print(f"{'':>6} rounds: " + "; ".join(
        f"{k} " + ", ".join(f"{s:.2f}" for s in v) for k, v in samples.items()))
    print(f"{'':>6} first call by phase: {describe(phases[0])}; cached: {describe(phases[1])}")
    print(f"{'':>6} compiled collectives: the plan {programs['plan']}; the plan by hand "
          f"{programs['plan by hand']}")
    print(f"{'':>6} step time: the plan {steps['plan']:.2f} s, the plan by hand "
          f"{steps['plan by hand']:.2f} s, data parallel {steps['dp']:.2f} s")
  growth = ((rows[12][0]["first"] / rows[6][0]["first"])
            / (rows[12][0]["plan"] / rows[6][0]["plan"]))
  ok &= growth <= 1.2
  print(f"first call's growth 6 -> 12 blocks over the plan by hand's: {growth:.2f} "
        f"(goal <= 1.2: {common.verdict(growth <= 1.2)})")
  return ok


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
