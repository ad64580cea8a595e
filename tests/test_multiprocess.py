"""Several JAX processes on one machine, started by ficco_jax.launch.

On a host with >= 2 GPUs, one process per GPU; elsewhere 2 processes of 2
virtual CPU devices each.
"""

import os
import time

import pytest

from ficco_jax import launch
from ficco_jax._src import launch as launch_lib

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")
GPUS = launch_lib.count_gpus()
if GPUS >= 2:
  LAYOUT = dict(num_processes=GPUS, devices_per_process=1, gpus=GPUS)
  # Each worker is a fresh interpreter: it must not inherit this process's
  # 8-device flag.
  ENV = {"XLA_FLAGS": ""}
else:
  LAYOUT = dict(num_processes=2, devices_per_process=2, gpus=0)
  ENV = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def _launch(mode, env=None, **kw):
  return launch.launch([WORKER, mode], env=dict(ENV, **(env or {})),
                       **LAYOUT, **kw)


def test_ops_across_processes_with_comm_xla():
  assert _launch("ops", timeout_s=240) == 0


def test_dma_across_processes_matches_the_reference():
  # The window transport: every dataflow, both ops, repeated calls, and a
  # dp x tp mesh whose tp groups span the processes.
  assert _launch("dma", timeout_s=300) == 0


def test_flagged_reduce_scatter_pushes_across_processes():
  # mp_worker checks the results of two chunk counts over four calls of
  # fresh data, that the program pushes, and that asking for the rendezvous
  # transport is a clear error.
  assert _launch("push", timeout_s=300) == 0


def test_dma_across_hosts_is_refused_naming_comm_xla():
  # mp_worker exits 0 only if the ValueError names Schedule(comm='xla').
  assert _launch("otherhost", timeout_s=240) == 0


def test_a_stalled_peer_process_fails_the_others_by_timeout(tmp_path):
  # Process 0 exits 0 only if its call failed within bounds naming rank 1;
  # it then leaves a file that lets the stalled process 1 exit.
  start = time.monotonic()
  flag = str(tmp_path / "stalled")
  assert _launch("stall", env=dict(FICCO_TEST_STALL_FILE=flag),
                 timeout_s=240) == 0
  assert time.monotonic() - start < 150


def test_a_dead_process_does_not_hang_the_others():
  start = time.monotonic()
  assert _launch("die", timeout_s=240) == 7
  assert time.monotonic() - start < 120


def test_launch_checks_its_arguments():
  with pytest.raises(ValueError, match="num_processes=0 must be >= 1"):
    launch.launch([WORKER, "ops"], 0, gpus=0)
  with pytest.raises(ValueError, match="need more than the 2 GPUs"):
    launch.launch([WORKER, "ops"], 2, devices_per_process=2, gpus=2)
