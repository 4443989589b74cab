"""The `jaxdist` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["advise"]:
    from jaxdist.advise import cli as advise_cli

    return advise_cli.main(argv[1:])
  parser = argparse.ArgumentParser(prog="jaxdist", description="Automatic parallelization for JAX.")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="run the example GPT under every method and compare")
  demo.add_argument("--devices", type=int, default=8,
                    help="simulated CPU devices when no accelerator is present (default 8)")
  demo.add_argument("--batch-size", type=int, default=32)
  demo.add_argument("--steps", type=int, default=5, help="timed steps per method")
  plan = sub.add_parser("plan", help="plan a reference workload with ShardParallel and show "
                        "the predicted and the compiled collectives")
  plan.add_argument("--model", choices=("mlp", "gpt", "bert", "moe"), default="gpt")
  plan.add_argument("--mesh", default=None,
                    help="logical mesh shape such as 2x4 (default: search every shape)")
  plan.add_argument("--alpha", default=None,
                    help="latency in seconds, one value or one per mesh axis (2e-5,1e-5)")
  plan.add_argument("--beta", default=None, help="seconds per byte, as --alpha")
  plan.add_argument("--budget", type=float, default=None,
                    help="memory_budget_per_device in bytes")
  plan.add_argument("--batch-size", type=int, default=16)
  plan.add_argument("--devices", type=int, default=8,
                    help="simulated CPU devices when no accelerator is present (default 8)")
  plan.add_argument("--json", action="store_true", help="print the result as JSON")
  est = sub.add_parser("estimate", help="estimate memory per device and step time of a "
                       "step under a method, without compiling it")
  est.add_argument("target", nargs="?", default=None,
                   help="path/to/script.py:make_step, a function returning (step, args); "
                   "default: the reference workload of --model")
  est.add_argument("--model", choices=("mlp", "gpt", "bert", "moe"), default="gpt")
  est.add_argument("--method", choices=("dp", "zero2", "zero3", "shard", "pipeshard"),
                   default="shard")
  est.add_argument("--micro-batches", type=int, default=None)
  est.add_argument("--stages", type=int, default=2,
                   help="pipeshard: layers and stages (uniform; default 2)")
  est.add_argument("--recompute", default=None, help="recompute_modules, e.g. Block")
  est.add_argument("--compile", action="store_true",
                   help="also compile (nothing allocated) and show XLA's figures beside")
  est.add_argument("--calibrate", action="store_true",
                   help="measure the present devices first and store their profile")
  est.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices when no accelerator is present (default 8)")
  est.add_argument("--json", action="store_true", help="print the result as JSON")
  tune = sub.add_parser("tune", help="try the methods on a step (DataParallel, ZeRO, "
                        "ShardParallel meshes, accumulation, pipelines) and report the best")
  tune.add_argument("target", help="path/to/script.py:make_step, a function returning "
                    "(step, args)")
  tune.add_argument("--budget", default=None, help="memory budget per device, e.g. 45MB")
  tune.add_argument("--steps", type=int, default=3, help="timed steps per trial")
  tune.add_argument("--methods", default=None,
                    help="try only these, e.g. dp,zero2,zero3,shard,shard:2x4")
  tune.add_argument("--time-budget", type=float, default=None, help="seconds for the walk")
  tune.add_argument("--csv", default=None, help="write every trial as CSV")
  tune.add_argument("--failures-csv", default=None, help="write the failed/skipped trials")
  tune.add_argument("--json", default=None, help="write the report as JSON")
  tune.add_argument("--plot", default=None, help="write step time vs memory as PNG")
  tune.add_argument("--quiet", action="store_true", help="print only the final table")
  tune.add_argument("--devices", type=int, default=8,
                    help="simulated CPU devices when no accelerator is present (default 8)")
  sub.add_parser("advise", help="parallelism, memory, time and cost for models and clusters "
                 "you do not have here (jaxdist advise --help)")
  from jaxdist.bench.cli import add_arguments as bench_arguments

  bench_arguments(sub.add_parser("bench", help="benchmark suites (GPT, MoE, Wide-ResNet) under "
                                 "every method against hand plans"))
  args = parser.parse_args(argv)

  if args.command == "demo":
    _cpu_devices(args.devices)
    from jaxdist import demo as demo_module

    return demo_module.main(batch_size=args.batch_size, num_steps=args.steps)
  if args.command == "plan":
    _cpu_devices(args.devices)
    from jaxdist import explain

    return explain.main(args.model, args.mesh, args.alpha, args.beta, args.batch_size,
                        args.budget, args.json)
  if args.command == "estimate":
    _cpu_devices(args.devices)
    from jaxdist import estimate_cli

    return estimate_cli.main(args.target, args.model, args.method, args.micro_batches,
                             args.recompute, args.compile, args.calibrate, args.json,
                             args.stages)
  if args.command == "tune":
    _cpu_devices(args.devices)
    from jaxdist.tune import cli as tune_cli

    return tune_cli.main(args.target, args.budget, args.steps, args.methods, args.time_budget,
                         args.csv, args.failures_csv, args.json, args.plot, args.quiet)
  if args.command == "bench":
    _cpu_devices(args.devices)
    from jaxdist.bench import cli as bench_cli

    return bench_cli.main(args)
  return 2


def _cpu_devices(n: int) -> None:
  """Simulated CPU devices, if no computation has initialized the backend yet."""
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # already initialized (called from a running program): keep it
    pass


if __name__ == "__main__":
  sys.exit(main())
