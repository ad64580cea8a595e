"""Running a suite as N JAX processes (``--processes=N``).

The parent re-runs the same command under ``python -m ficco_jax.launch -n N``
(one process per GPU group, or per virtual CPU device); each child joins the
job with ``ficco_jax.launch.initialize_from_env()`` before anything touches a
JAX backend, and process 0 writes the results. Every process issues the same
calls in the same order, so whatever a process decides alone (calls per
round, the time budget) is agreed on through `agree`.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Set by ficco_jax.launch in every process it starts.
CHILD_ENV = "FICCO_COORDINATOR"


def is_child() -> bool:
  return CHILD_ENV in os.environ


def init_if_child() -> None:
  """Joins the launcher's job; call first, before JAX starts a backend."""
  if is_child():
    from ficco_jax import launch  # pylint: disable=g-import-not-at-top
    launch.initialize_from_env()


def relaunch(num_processes: int) -> int:
  """This command again under ``ficco_jax.launch``; returns its exit code."""
  cmd = [sys.executable, "-m", "ficco_jax.launch", "-n", str(num_processes),
         os.path.abspath(sys.argv[0]), *sys.argv[1:]]
  print("launching:", " ".join(cmd), flush=True)
  return subprocess.run(cmd, check=False).returncode


def agree(value: int) -> int:
  """Process 0's ``value`` in every process (a no-op in one process)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return value
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def is_writer() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0
