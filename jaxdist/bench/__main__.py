import argparse
import sys

from jaxdist.bench.cli import add_arguments, main
from jaxdist.cli import _cpu_devices

parser = argparse.ArgumentParser(prog="python -m jaxdist.bench")
add_arguments(parser)
args = parser.parse_args()
_cpu_devices(args.devices)
sys.exit(main(args))
