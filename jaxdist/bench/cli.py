"""``jaxdist bench`` / ``python -m jaxdist.bench``: run suites, write rows and plots,
print the table and each model's best hand plan against the automatic one."""

from __future__ import annotations

import argparse
import json
import sys

SIZES_HELP = ("tiny | small | paper-<name> (GPT: paper-125M ... paper-39B, MoE: paper-380M ... "
              "paper-140B, Wide-ResNet: paper-250M ... paper-13B)")


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--suite", default="all", help="gpt | moe | wresnet | all")
  p.add_argument("--size", default="tiny", help=SIZES_HELP)
  p.add_argument("--methods", default=None,
                 help="comma list of method-name substrings, e.g. DataParallel,ILP")
  p.add_argument("--out", default="bench/results/suites", help="directory for CSV, JSON, PNG")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--repeat", type=int, default=3, help="timed steps after one warm-up")
  p.add_argument("--no-scaling", action="store_true", help="skip the 1/2/4/8-device GPT runs")
  p.add_argument("--no-plots", action="store_true")
  p.add_argument("--json", action="store_true", help="print the rows as JSON")
  p.add_argument("--tune", type=float, default=None, metavar="SECONDS",
                 help="add a row per model for jd.tune's pick within SECONDS of its walk")
  p.add_argument("--readme", default=None,
                 help="also write this run's table and plots as markdown (bench/README.md)")


def main(args) -> int:
  import dataclasses

  from jaxdist import errors
  from jaxdist.bench import run as bench_run
  from jaxdist.bench.suites import SUITES

  suites = list(SUITES) if args.suite == "all" else [s.strip() for s in args.suite.split(",")]
  bad = [s for s in suites if s not in SUITES]
  if bad:
    print(f"jaxdist bench: --suite {bad[0]!r} is not a suite; valid: {', '.join(SUITES)}, all",
          file=sys.stderr)
    return 2
  try:
    rows = bench_run.run(suites, args.size,
                         args.methods.split(",") if args.methods else None,
                         args.devices, args.repeat, scaling=not args.no_scaling,
                         show=not args.json, tune_budget_s=args.tune)
  except errors.JaxdistError as e:
    print(f"jaxdist bench: {e}", file=sys.stderr)
    return 2
  csv_path, json_path = bench_run.write(rows, args.out)
  plots = [] if args.no_plots else __import__("jaxdist.bench.plots", fromlist=["plot"]).plot(
      rows, args.out)
  table = bench_run.summary(rows)
  if args.readme:
    from pathlib import Path

    readme = Path(args.readme)
    readme.write_text(bench_run.markdown(rows, plots, readme))
  if args.json:
    print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "summary": table}, indent=1))
    return 0
  print(f"\nrows appended to {csv_path} and {json_path}; plots: "
        f"{', '.join(str(p) for p in plots) or 'none'}")
  print(f"\n{'model':<14} {'devices':>7}  {'best hand plan':<24} {'ms':>8}  "
        f"{'automatic plan':<26} {'ms':>8}  auto/hand")
  for t in table:
    print(f"{t['model']:<14} {t['devices']:>7}  {str(t['best_hand']):<24} "
          f"{t['hand_ms'] or float('nan'):>8.3f}  {str(t['best_auto']):<26} "
          f"{t['auto_ms'] or float('nan'):>8.3f}  {t['ratio']:.3f}"
          f"  {'(goal <= 1.05: ' + ('PASS' if t['ratio'] <= 1.05 else 'FAIL') + ')'}")
  failed = [r for r in rows if r.status != "ok" or not r.matches_serial]
  for r in failed:
    print(f"  {r.model} {r.method}: {r.status} {r.reason or 'first-step loss differs from serial'}")
  return 0

