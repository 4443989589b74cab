"""Run N local processes as one JAX cluster, and join such a cluster from a script.

Usage::

    python -m jaxdist.launch --num-processes 2 --devices-per-process 4 -- python train.py

Each process gets CPU devices, gloo collectives, a coordinator on 127.0.0.1 at a free
port and its own cross-host transfer address. Output is streamed with a ``[i]``
prefix; if any process fails the others are stopped and the launcher exits with the
failing process's code. A script joins with :func:`init_distributed`.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "JAXDIST_DEVICES_PER_PROCESS"
ENV_TRANSFER_ADDRESS = "JAXDIST_TRANSFER_ADDRESS"


def init_distributed() -> None:
  """Joins the JAX cluster this process belongs to; call it before any computation.

  Under ``python -m jaxdist.launch`` it configures CPU devices, gloo collectives and
  cross-host transfers from what the launcher set, then calls
  ``jax.distributed.initialize`` with the coordinator and process id. With
  ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set (hosts
  started by hand, see ``jaxdist advise launch``) it uses those. Anywhere else (SLURM,
  Kubernetes, TPU pods) it defers to ``jax.distributed.initialize()``'s own detection.
  A second call does nothing.
  """
  import jax

  if jax.distributed.is_initialized():
    return
  env = os.environ
  if ENV_COORDINATOR not in env:
    explicit = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    if all(k in env for k in explicit):  # hosts set up by hand (jaxdist advise launch)
      jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                 num_processes=int(env["JAX_NUM_PROCESSES"]),
                                 process_id=int(env["JAX_PROCESS_ID"]))
    else:
      jax.distributed.initialize()
    return
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", int(env[ENV_DEVICES_PER_PROCESS]))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_cross_host_transfer_socket_address", env[ENV_TRANSFER_ADDRESS])
  jax.distributed.initialize(coordinator_address=env[ENV_COORDINATOR],
                             num_processes=int(env[ENV_NUM_PROCESSES]),
                             process_id=int(env[ENV_PROCESS_ID]))


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _stream(proc: subprocess.Popen, prefix: str) -> None:
  for line in proc.stdout:
    sys.stdout.write(prefix + line)
    sys.stdout.flush()


def launch(cmd: list[str], num_processes: int, devices_per_process: int,
           timeout_s: float | None = None) -> int:
  """Starts ``num_processes`` copies of ``cmd`` as one cluster; returns an exit code.

  0 if every process exits 0; otherwise the first failing process's code (124 on
  timeout), after stopping the others.
  """
  coordinator = f"127.0.0.1:{free_port()}"
  # A device count forced through XLA_FLAGS (as tests do) would override ours.
  xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                     os.environ.get("XLA_FLAGS", "")).strip()
  procs, threads = [], []
  for i in range(num_processes):
    env = dict(os.environ, XLA_FLAGS=xla_flags, PYTHONUNBUFFERED="1")
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                ENV_PROCESS_ID: str(i), ENV_DEVICES_PER_PROCESS: str(devices_per_process),
                ENV_TRANSFER_ADDRESS: f"127.0.0.1:{free_port()}"})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    thread = threading.Thread(target=_stream, args=(proc, f"[{i}] "), daemon=True)
    thread.start()
    procs.append(proc)
    threads.append(thread)

  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  code = 0
  while True:
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
      code = failed[0]
      break
    if all(c == 0 for c in codes):
      break
    if deadline is not None and time.monotonic() > deadline:
      sys.stdout.write(f"jaxdist.launch: timed out after {timeout_s} s\n")
      code = 124
      break
    time.sleep(0.05)
  for p in procs:
    if p.poll() is None:
      p.terminate()
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
  for t in threads:
    t.join(timeout=5)
  return code


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxdist.launch",
      description="Run N local processes as one JAX cluster on this machine.")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
  parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
  args = parser.parse_args(argv)
  cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  if not cmd:
    parser.error("give the command to run after --")
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num-processes and --devices-per-process must be >= 1")
  return launch(cmd, args.num_processes, args.devices_per_process, args.timeout)


if __name__ == "__main__":
  sys.exit(main())
