"""Start N local JAX processes (one per GPU, or CPU groups) for tests and benchmarks.

Many clusters run one JAX process per GPU (`jax.distributed.initialize`). The
launcher reproduces that layout on one machine: it starts N copies of a
Python script with the coordinator address, process id and count in the
environment, gives each process its slice of the local GPUs, and, when one
process fails or the time limit passes, stops the others, so a dead peer
never leaves the rest hanging in a collective.

  python -m ficco_jax.launch --num_processes=4 my_script.py --flag=value

In the script, `initialize_from_env()` calls `jax.distributed.initialize`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

ENV_COORDINATOR = "FICCO_COORDINATOR"
ENV_PROCESS_ID = "FICCO_PROCESS_ID"
ENV_NUM_PROCESSES = "FICCO_NUM_PROCESSES"
ENV_LOCAL_DEVICES = "FICCO_LOCAL_DEVICES"


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(argv: Sequence[str], num_processes: int, *,
           devices_per_process: int | None = None, gpus: int | None = None,
           timeout_s: float = 600.0, env: dict[str, str] | None = None) -> int:
  """Runs ``python argv...`` in ``num_processes`` processes; returns an exit code.

  Args:
    argv: the script and its arguments.
    num_processes: processes to start, ``>= 1``.
    devices_per_process: GPUs per process (``CUDA_VISIBLE_DEVICES`` is split
      into consecutive groups); on CPU, the virtual devices of each process.
      None: ``gpus // num_processes`` on GPU hosts, 1 on CPU.
    gpus: GPUs on this host (None: count them with ``nvidia-smi``, 0 if it
      is missing).
    timeout_s: the whole run's limit; then every process is stopped.
    env: extra environment for every process.

  Returns:
    0 when every process exited 0; otherwise the first failure's code (124
    for the time limit). The others are stopped as soon as one fails.
  """
  if num_processes < 1:
    raise ValueError(f"{num_processes=} must be >= 1.")
  if gpus is None:
    gpus = count_gpus()
  if devices_per_process is None:
    devices_per_process = gpus // num_processes if gpus else 1
  if devices_per_process < 1:
    raise ValueError(f"{devices_per_process=} must be >= 1 ({gpus} GPUs for"
                     f" {num_processes} processes).")
  if gpus and devices_per_process * num_processes > gpus:
    raise ValueError(f"{num_processes} processes x {devices_per_process} GPUs"
                     f" need more than the {gpus} GPUs here.")
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = []
  for pid in range(num_processes):
    penv = dict(os.environ, **(env or {}))
    penv.update({ENV_COORDINATOR: coordinator, ENV_PROCESS_ID: str(pid),
                 ENV_NUM_PROCESSES: str(num_processes),
                 ENV_LOCAL_DEVICES: str(devices_per_process)})
    if gpus:
      first = pid * devices_per_process
      penv["CUDA_VISIBLE_DEVICES"] = ",".join(
          str(first + i) for i in range(devices_per_process))
    procs.append(subprocess.Popen([sys.executable, *argv], env=penv,
                                  start_new_session=True))
  return _supervise(procs, timeout_s)


def _supervise(procs, timeout_s: float) -> int:
  deadline = time.monotonic() + timeout_s
  code = 0
  while True:
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
      code = failed[0]
      break
    if all(c == 0 for c in codes):
      return 0
    if time.monotonic() > deadline:
      code = 124
      break
    time.sleep(0.05)
  # One process failed or time ran out: the rest would wait forever in
  # their next collective, so stop them (their whole process groups).
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  return code


def count_gpus() -> int:
  """GPUs on this host (``nvidia-smi -L``; 0 without it)."""
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def initialize_from_env() -> None:
  """`jax.distributed.initialize` from the launcher's environment.

  Must run before anything touches a JAX backend. On CPU it also gives the
  process its virtual devices and turns on the gloo collectives that
  cross-process CPU programs need.
  """
  import jax  # pylint: disable=g-import-not-at-top

  try:
    coordinator = os.environ[ENV_COORDINATOR]
    pid = int(os.environ[ENV_PROCESS_ID])
    n = int(os.environ[ENV_NUM_PROCESSES])
  except KeyError as e:
    raise RuntimeError(
        f"{e.args[0]} is not set: start this script with"
        " `python -m ficco_jax.launch --num_processes=N script.py`.") from e
  if not os.environ.get("CUDA_VISIBLE_DEVICES"):
    jax.config.update("jax_num_cpu_devices",
                      int(os.environ.get(ENV_LOCAL_DEVICES, "1")))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes=n, process_id=pid)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m ficco_jax.launch``: parses the command line, runs `launch`."""
  parser = argparse.ArgumentParser(
      prog="python -m ficco_jax.launch",
      description=(
          "Start N local JAX processes running one Python script, with the"
          " coordinator address, process id and count in their environment"
          " (the script calls ficco_jax.launch.initialize_from_env() first)."
          " Each process gets its slice of the local GPUs; when one fails or"
          " the time limit passes, the others are stopped."),
      epilog=("example: python -m ficco_jax.launch -n 4 train.py --steps=10;"
              " on CPUs: JAX_PLATFORMS=cpu python -m ficco_jax.launch -n 2"
              " --devices_per_process=2 examples/multiprocess_demo.py"))
  parser.add_argument(
      "--num_processes", "-n", type=int, required=True,
      help="processes to start (on a GPU host, usually one per GPU)")
  parser.add_argument(
      "--devices_per_process", type=int, default=None,
      help="GPUs per process, consecutive in CUDA_VISIBLE_DEVICES (default:"
      " the host's GPUs divided by N); on CPUs, the virtual devices of each"
      " process (default 1)")
  parser.add_argument(
      "--timeout_s", type=float, default=600.0,
      help="limit for the whole run in seconds, after which every process is"
      " stopped and the exit code is 124 (default 600)")
  parser.add_argument("script", nargs=argparse.REMAINDER,
                      help="the script to run, then its own arguments")
  args = parser.parse_args(argv)
  if not args.script:
    parser.error("give the script to run and its arguments")
  return launch(args.script, args.num_processes,
                devices_per_process=args.devices_per_process,
                timeout_s=args.timeout_s)
