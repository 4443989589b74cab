"""The `jaxdist` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
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
