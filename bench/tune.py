"""The tuning walk on the example GPT (vocab 1024, width 256, 4 blocks, batch 16, seq 64,
Adam) over 8 devices with a 45 MB per-device budget.

Goals (issue 14): the walk covers DataParallel, ZeRO, ShardParallel on at least two mesh
shapes and PipeshardParallel; classifies at least one candidate oom (or skipped by its
estimate); picks the fastest ok trial; finishes in under 5 minutes here. Writes the CSVs,
the JSON report and the plot next to this file (bench/results/tune.*).
Run: python bench/tune.py
"""

import common  # noqa: F401  (device setup)

import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))

import jaxdist as jd  # noqa: E402
from tune_gpt import make_step  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main():
  step, args = make_step()
  start = time.perf_counter()
  report = jd.tune(step, *args, memory_budget_per_device=45e6)
  elapsed = time.perf_counter() - start
  print(report.summary())
  os.makedirs(OUT, exist_ok=True)
  report.to_csv(os.path.join(OUT, "tune.csv"))
  report.failures_csv(os.path.join(OUT, "tune_failures.csv"))
  report.to_json(os.path.join(OUT, "tune.json"))
  report.plot(os.path.join(OUT, "tune.png"))
  kinds = {type(t.method).__name__ for t in report.trials if t.status != "skipped"}
  shapes = {t.name for t in report.trials
            if t.name.startswith("ShardParallel(") and t.status in ("ok", "oom")}
  failed = [t for t in report.trials if t.status == "oom"
            or (t.status == "skipped" and "estimated" in t.reason)]
  best = report.best_trial
  fastest = min((t.step_time_s for t in report.trials if t.status == "ok"), default=None)
  checks = [
      ("covers DP/ZeRO/ShardParallel/Pipeshard",
       {"Zero2Parallel", "Zero3Parallel", "ShardParallel", "PipeshardParallel"} <= kinds
       and any(t.name == "DataParallel" for t in report.trials)),
      ("ShardParallel on >= 2 mesh shapes", len(shapes) >= 2),
      ("at least one oom / skipped by estimate", bool(failed)),
      ("best is the fastest ok", best is not None and best.step_time_s == fastest),
      (f"walk under 5 minutes ({elapsed:.0f} s)", elapsed < 300),
  ]
  for what, ok in checks:
    print(f"{what}: {common.verdict(ok)}")


if __name__ == "__main__":
  main()
