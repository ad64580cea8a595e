"""Several JAX processes on one machine, started by ficco_jax.launch."""

import os
import time

import pytest

from ficco_jax import launch

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")
# Each worker is a fresh interpreter: it must not inherit this process's
# 8-device flag (the launcher sizes it).
ENV = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def _launch(mode, **kw):
  return launch.launch([WORKER, mode], 2, devices_per_process=2, gpus=0,
                       env=ENV, **kw)


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
  assert launch.launch([WORKER, "stall"], 2, devices_per_process=2, gpus=0,
                       env=dict(ENV, FICCO_TEST_STALL_FILE=flag),
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
