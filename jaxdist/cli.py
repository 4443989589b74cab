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
  args = parser.parse_args(argv)

  if args.command == "demo":
    import jax

    # Nothing has touched a device yet; this only affects the CPU backend.
    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxdist import demo as demo_module

    return demo_module.main(batch_size=args.batch_size, num_steps=args.steps)
  return 2


if __name__ == "__main__":
  sys.exit(main())
