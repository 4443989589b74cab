"""Run under `python -m jaxdist.launch`: the two processes are made to see different
things (process 1's sharding ILP stops at its time limit with another plan; each process
measures the other candidate as the slow one), and must still compile process 0's plan
and make process 0's pick. Each process prints its results."""

import dataclasses
import hashlib
import json

import jaxdist as jd

jd.init_distributed()

import jax  # noqa: E402
import optax  # noqa: E402

from jaxdist import models  # noqa: E402
from jaxdist.shard import planner, solver  # noqa: E402
from jaxdist.tune import walk  # noqa: E402

me = jax.process_index()
solve_ilp, run_trial = planner.solve_ilp, walk._Walk._trial
solved = {}


def solve_differently(graph, *args, **kwargs):
  """Process 1's solver: every group's first strategy, as if stopped by its time limit."""
  best = solve_ilp(graph, *args, **kwargs)
  choice = tuple(0 for _ in graph.group_sizes)
  solved["differs"] = choice != best.choice
  return solver.Solution(choice, solver.objective_of(graph, choice), "time_limit")


def measure_differently(self, name, method):
  """Each process times the candidate the other does not as 1000x slower."""
  trial = run_trial(self, name, method)
  if name == ("Zero2Parallel", "DataParallel")[me] and trial.step_time_s is not None:
    trial = dataclasses.replace(trial, step_time_s=trial.step_time_s * 1000)
  return trial


if me == 1:
  planner.solve_ilp = solve_differently
walk._Walk._trial = measure_differently

batch = models.regression_batch(32, 16)
make = lambda: models.create_state(models.MLP(hidden=64, num_layers=2), batch["x"],
                                   tx=optax.sgd(0.1, momentum=0.9))
fun = models.regression_step(jd.value_and_grad)
step = jd.parallelize(fun, method=jd.ShardParallel(
    logical_mesh_shape=(2, 4), auto_sharding_option=jd.AutoShardingOption(plan_cache=False)))
state = make()
plan = step.get_executable(state, batch).plan.to_json()
losses = []
for _ in range(2):
  state, metrics = step(state, batch)
  losses.append(float(metrics["loss"]))
report = jd.tune(fun, make(), batch, candidates=[jd.DataParallel(), jd.Zero2Parallel()],
                 steps=1, progress=False)
print("RESULT " + json.dumps({
    "plan": hashlib.sha256(plan.encode()).hexdigest(), "losses": losses,
    "solver_differed": solved.get("differs"), "best": report.best_trial.name,
    "times": [t.step_time_s for t in report.trials]}))
