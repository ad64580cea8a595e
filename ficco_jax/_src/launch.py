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
import atexit
import collections
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Sequence

ENV_COORDINATOR = "FICCO_COORDINATOR"
ENV_PROCESS_ID = "FICCO_PROCESS_ID"
ENV_NUM_PROCESSES = "FICCO_NUM_PROCESSES"
ENV_LOCAL_DEVICES = "FICCO_LOCAL_DEVICES"
ENV_GPUS = "FICCO_LAUNCH_GPUS"  # "1": the launcher gave the process GPUs.


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# How long a stopped process may take to exit on SIGTERM before SIGKILL.
STOP_GRACE_S = 3.0
# Lines of each process's output kept to explain its failure.
TAIL_LINES = 20


class _Worker:
  """One launched process: its stdout and stderr are forwarded line by line
  to the launcher's (prefixed with its id when there are several) and its
  last lines are kept.

  Forwarding never stops reading: a child blocked on a full pipe would hang
  the job. Bytes that are not UTF-8 are replaced, and a closed launcher
  stdout (``| head``) ends the printing, not the draining.
  """

  def __init__(self, pid: int, proc: subprocess.Popen, prefix: str):
    self.pid = pid
    self.proc = proc
    self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    self._prefix = prefix
    self._pumps = [
        threading.Thread(target=self._forward, args=(pipe, out), daemon=True)
        for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for t in self._pumps:
      t.start()

  def _forward(self, pipe, out) -> None:
    printing = True
    for raw in pipe:
      line = raw.decode("utf-8", errors="replace")
      if not line.endswith("\n"):
        line += "\n"  # A last line without one stays on its own line.
      self.tail.append(line.rstrip("\n"))
      if printing:
        try:
          out.write(self._prefix + line)
          out.flush()
        except (OSError, ValueError):
          printing = False  # The reader went away; the child must not block.

  def drain(self, timeout_s: float = 5.0) -> None:
    """Waits, ``timeout_s`` at most, for the rest of the output: a process
    it started may still hold the pipes."""
    end = time.monotonic() + timeout_s
    for t in self._pumps:
      t.join(timeout=max(0.0, end - time.monotonic()))


# Run first in every launched process: the kernel kills it when the
# launcher dies, however it dies (SIGKILL, an OOM kill, a closed terminal),
# so no worker outlives its supervisor; then the script runs in its place
# (exec keeps the setting). Linux only; elsewhere the script just runs.
_EXEC_WITH_PARENT_DEATH_SIGNAL = """\
import os, signal, sys
try:
  import ctypes
  ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
  if os.getppid() != int(sys.argv[1]):
    os._exit(128 + int(signal.SIGKILL))  # The launcher died before prctl.
except (OSError, AttributeError):
  pass
os.execv(sys.executable, [sys.executable] + sys.argv[2:])
"""


def launch(argv: Sequence[str], num_processes: int, *,
           devices_per_process: int | None = None, gpus: int | None = None,
           timeout_s: float = 600.0, env: dict[str, str] | None = None,
           share_gpu: bool = False) -> int:
  """Runs ``python argv...`` in ``num_processes`` processes; returns an exit code.

  A supervisor: it forwards every process's stdout and stderr to its own
  (prefixed ``[i]``), and when one process fails, the time limit passes or
  the launcher itself gets SIGINT/SIGTERM/SIGHUP, it stops every process's
  group (SIGTERM, then SIGKILL after `STOP_GRACE_S`), says which process
  failed and shows its last lines. At the end it also stops what finished
  processes left running in their groups. On Linux a launcher that is
  killed outright takes its processes with it (the kernel's parent-death
  signal).

  Args:
    argv: the script and its arguments.
    num_processes: processes to start, ``>= 1``.
    devices_per_process: GPUs per process (``CUDA_VISIBLE_DEVICES``, or
      every GPU of the host where it is not set, is split into consecutive
      groups); on CPU, the virtual devices of each process. None: ``gpus //
      num_processes`` on GPU hosts, 1 on CPU.
    gpus: GPUs to use (None: those ``CUDA_VISIBLE_DEVICES`` names, else the
      host's, counted with ``nvidia-smi``; 0 if it is missing or
      ``JAX_PLATFORMS`` names no GPU platform).
    timeout_s: the whole run's limit; then every process is stopped.
    env: extra environment for every process.
    share_gpu: every process gets the same first ``devices_per_process``
      GPUs (default 1) instead of a slice of its own, so that multi-process
      code runs on a host with fewer GPUs than processes. For tests only: the
      processes time-slice the GPU, and NCCL refuses two ranks on one GPU,
      so XLA's collectives across the processes fail (ficco's ``comm="dma"``
      windows work). XLA's memory preallocation is turned off in the
      processes unless ``env`` or the environment sets it.

  Returns:
    0 when every process exited 0; otherwise the first failure's code (128
    + the signal for a process killed by one, 124 for the time limit, 128 +
    the signal for a launcher that was interrupted).
  """
  if num_processes < 1:
    raise ValueError(f"{num_processes=} must be >= 1.")
  if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
          and timeout_s > 0):
    raise ValueError(f"{timeout_s=} must be a positive number of seconds.")
  # The GPUs this launcher may hand out: the ones CUDA_VISIBLE_DEVICES
  # names where it is set (a shared host's allotment), else all of them.
  visible = [d.strip() for d in os.environ.get(
      "CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
  if gpus is None:
    gpus = 0 if _platforms_without_gpu() else count_gpus()
    if gpus and visible:
      gpus = len(visible)
  if not visible:
    visible = [str(i) for i in range(gpus)]
  if share_gpu and not gpus:
    raise ValueError("share_gpu=True needs a GPU; this host has none.")
  if devices_per_process is None:
    devices_per_process = (1 if share_gpu else
                           gpus // num_processes if gpus else 1)
  if devices_per_process < 1:
    raise ValueError(f"{devices_per_process=} must be >= 1 ({gpus} GPUs for"
                     f" {num_processes} processes).")
  # Processes sharing GPUs need only one slice.
  slices = 1 if share_gpu else num_processes
  if gpus and devices_per_process * slices > gpus:
    raise ValueError(
        f"{num_processes} processes x {devices_per_process} GPUs"
        f"{' (shared)' if share_gpu else ''} need more than the {gpus} GPUs"
        " here.")
  if share_gpu:
    # Several XLA clients on one GPU: each taking 75% up front would starve
    # the next.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get(
        "XLA_PYTHON_CLIENT_PREALLOCATE", "false"), **(env or {})}
  coordinator = f"127.0.0.1:{_free_port()}"
  workers: list[_Worker] = []
  interrupted: list[int] = []

  def on_signal(signum, frame):
    del frame
    interrupted.append(signum)

  handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {s: signal.signal(s, on_signal) for s in handled}
  try:
    for pid in range(num_processes):
      penv = dict(os.environ, **(env or {}))
      penv.update({ENV_COORDINATOR: coordinator, ENV_PROCESS_ID: str(pid),
                   ENV_NUM_PROCESSES: str(num_processes),
                   ENV_LOCAL_DEVICES: str(devices_per_process),
                   ENV_GPUS: "1" if gpus else "0",
                   "PYTHONUNBUFFERED": "1"})
      if gpus:
        first = 0 if share_gpu else pid * devices_per_process
        penv["CUDA_VISIBLE_DEVICES"] = ",".join(
            visible[first:first + devices_per_process])
      # Its own process group, so that stopping it stops what it started.
      proc = subprocess.Popen(
          [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL,
           str(os.getpid()), *argv], env=penv, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, start_new_session=True)
      workers.append(_Worker(pid, proc,
                             f"[{pid}] " if num_processes > 1 else ""))
    return _supervise(workers, timeout_s, interrupted)
  finally:
    _stop(workers)
    for s, h in previous.items():
      signal.signal(s, h)


def _supervise(workers: list[_Worker], timeout_s: float,
               interrupted: list[int]) -> int:
  deadline = time.monotonic() + timeout_s
  while True:
    codes = [w.proc.poll() for w in workers]
    failed = [(w, c) for w, c in zip(workers, codes) if c not in (None, 0)]
    if failed:
      w, code = failed[0]
      _stop(workers)
      w.drain()
      _say(f"process {w.pid} {_ending(code)}; stopped the others."
           + (" Its last lines:\n  " + "\n  ".join(w.tail) if w.tail else ""))
      # A shell's code for a process killed by a signal.
      return code if code > 0 else 128 - code
    if all(c == 0 for c in codes):
      # What they left running in their groups is stopped first: it may
      # hold the pipes open.
      _stop(workers)
      for w in workers:
        w.drain(timeout_s=1.0)
      return 0
    if interrupted:
      _say(f"interrupted (signal {interrupted[0]}); stopped every process.")
      return 128 + interrupted[0]
    if time.monotonic() > deadline:
      _say(f"the {timeout_s:g} s limit passed; stopped every process"
           f" (still running: {[w.pid for w, c in zip(workers, codes) if c is None]}).")
      return 124
    time.sleep(0.05)


def _ending(code: int) -> str:
  """How a process ended, from its `Popen.returncode`."""
  if code >= 0:
    return f"exited with code {code}"
  try:
    name = f" ({signal.Signals(-code).name})"
  except ValueError:
    name = ""
  return f"was killed by signal {-code}{name}"


def _stop(workers: list[_Worker]) -> None:
  """Stops every process's group: SIGTERM, then SIGKILL. The groups of
  processes that already exited too: what they started may still run."""
  running = [w for w in workers if w.proc.poll() is None]
  for w in workers:
    _signal_group(w.proc, signal.SIGTERM)
  end = time.monotonic() + STOP_GRACE_S
  for w in running:
    try:
      w.proc.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      _signal_group(w.proc, signal.SIGKILL)
      w.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass  # Gone (a group id is not reused while the reaped leader's is).


def _say(message: str) -> None:
  print(f"ficco_jax.launch: {message}", file=sys.stderr, flush=True)


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
  cross-process CPU programs need. It also makes the process fail fast: an
  uncaught exception prints its traceback and exits at once with code 1
  (without the distributed shutdown barrier, which would hold it until its
  peers leave, so the launcher would not see it fail), and a normal exit
  shuts the distributed client down. And SIGTERM ends it at once again:
  `jax.distributed.initialize` makes SIGTERM a preemption notice, which a
  process blocked in an op whose peer died never acts on, so the launcher
  stopping the job would wait for its SIGKILL; under the launcher SIGTERM
  only ever means that the job is being stopped.
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
  if _on_cpu():
    jax.config.update("jax_num_cpu_devices",
                      int(os.environ.get(ENV_LOCAL_DEVICES, "1")))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # The coordinator's key-value store on loopback only: the processes are
  # local, and it would otherwise listen on every interface.
  port = coordinator.rsplit(":", 1)[1]
  jax.distributed.initialize(coordinator, num_processes=n, process_id=pid,
                             coordinator_bind_address=f"127.0.0.1:{port}")
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

  def fail_fast(kind, value, tb):
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # pylint: disable=protected-access

  sys.excepthook = fail_fast
  atexit.register(jax.distributed.shutdown)


def _platforms_without_gpu() -> bool:
  """Whether JAX_PLATFORMS is set and names no GPU platform."""
  platforms = os.environ.get("JAX_PLATFORMS", "").lower()
  return bool(platforms) and not any(p in platforms
                                     for p in ("cuda", "gpu", "rocm"))


def _on_cpu() -> bool:
  """Whether this launched process runs on CPU devices: JAX_PLATFORMS
  names no GPU platform, or the launcher handed it no GPU."""
  if _platforms_without_gpu():
    return True
  return os.environ.get(ENV_GPUS, "1" if os.environ.get(
      "CUDA_VISIBLE_DEVICES") else "0") == "0"


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
      "--share_gpu", action="store_true",
      help="every process runs on the same first --devices_per_process GPUs"
      " (default 1): multi-process code on a one-GPU host, for tests only"
      " (XLA's collectives across the processes fail: NCCL refuses two ranks"
      " on one GPU)")
  parser.add_argument(
      "--timeout_s", type=float, default=600.0,
      help="limit for the whole run in seconds, after which every process is"
      " stopped and the exit code is 124 (default 600)")
  parser.add_argument("script", nargs=argparse.REMAINDER,
                      help="the script to run, then its own arguments")
  args = parser.parse_args(argv)
  if not args.script:
    parser.error("give the script to run and its arguments")
  try:
    return launch(args.script, args.num_processes,
                  devices_per_process=args.devices_per_process,
                  timeout_s=args.timeout_s, share_gpu=args.share_gpu)
  except ValueError as e:
    parser.error(str(e))  # A usage error (exit code 2), not a traceback.
