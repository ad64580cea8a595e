"""Several JAX processes on one machine, started by ficco_jax.launch.

On a host with >= 2 GPUs, one process per GPU; on a one-GPU host, 2
processes sharing the GPU (``share_gpu``: the CUDA paths across processes
run, XLA's collectives across them cannot); elsewhere 2 processes of 2
virtual CPU devices each.
"""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ficco_jax import launch
from ficco_jax._src import launch as launch_lib

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")
GPUS = launch_lib.count_gpus()
SHARED = GPUS == 1
if GPUS >= 2:
  LAYOUT = dict(num_processes=GPUS, devices_per_process=1, gpus=GPUS)
  # Each worker is a fresh interpreter: it must not inherit this process's
  # 8-device flag.
  ENV = {"XLA_FLAGS": ""}
elif SHARED:
  LAYOUT = dict(num_processes=2, devices_per_process=1, gpus=1,
                share_gpu=True)
  ENV = {"XLA_FLAGS": ""}
else:
  LAYOUT = dict(num_processes=2, devices_per_process=2, gpus=0)
  ENV = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
# The launcher's command-line flags for that layout.
CLI = ([f"--devices_per_process={LAYOUT['devices_per_process']}"]
       + (["--share_gpu"] if SHARED else []))

# XLA's collectives across processes sharing one GPU: NCCL refuses them.
needs_nccl = pytest.mark.skipif(
    SHARED, reason="XLA's collectives across processes on one shared GPU")


def _launch(mode, env=None, **kw):
  return launch.launch([WORKER, mode], env=dict(ENV, **(env or {})),
                       **LAYOUT, **kw)


@needs_nccl
def test_ops_across_processes_with_comm_xla():
  assert _launch("ops", timeout_s=240) == 0


def test_dma_across_processes_matches_the_reference():
  # The window transport: every dataflow, both ops, repeated calls, and a
  # dp x tp mesh whose tp groups span the processes.
  assert _launch("dma", timeout_s=300) == 0


def test_flagged_ops_push_across_processes():
  # mp_worker checks the reduce-scatter's results at two chunk counts and
  # the push all-gather's, over four calls of fresh data each, that the
  # programs push, and that asking for the rendezvous transport is a clear
  # error.
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


@needs_nccl
def test_moe_layer_on_the_copy_engines_across_processes():
  # mp_worker checks three calls of a skewed-routing MoE layer (rows on
  # the window transport) against a float64 per-token reference. Its
  # counts still move on XLA's collectives (docs/moe.md), hence NCCL.
  assert _launch("moe", timeout_s=240) == 0


@needs_nccl
def test_a_dead_process_does_not_hang_the_others():
  start = time.monotonic()
  assert _launch("die", timeout_s=240) == 7
  assert time.monotonic() - start < 120


@needs_nccl
def test_a_raising_process_ends_the_job_at_once_naming_it(capfd):
  """Process 1 raises while process 0 waits in a collective: the job ends
  in seconds (not after the launcher's limit or a collective's timeout),
  with process 1's exit code, its id and its last lines."""
  start = time.monotonic()
  assert _launch("raise", timeout_s=240) == 1
  assert time.monotonic() - start < 90
  err = capfd.readouterr().err
  assert "ficco_jax.launch: process 1 exited with code 1" in err, err
  assert "RuntimeError: boom from process 1" in err


def test_an_interrupted_launcher_leaves_no_process_behind(tmp_path):
  """SIGINT to `python -m ficco_jax.launch` stops every worker, even ones
  that ignore SIGTERM, and exits 128 + SIGINT."""
  env = dict(os.environ, **ENV, FICCO_TEST_PID_DIR=str(tmp_path))
  n = LAYOUT["num_processes"]
  launcher = subprocess.Popen(
      [sys.executable, "-m", "ficco_jax.launch", "-n", str(n), *CLI, WORKER,
       "sleep"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 120
  while len(os.listdir(tmp_path)) < n and time.monotonic() < deadline:
    time.sleep(0.2)
  pids = [int(f) for f in os.listdir(tmp_path)]
  assert len(pids) == n
  launcher.send_signal(signal.SIGINT)
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 128 + signal.SIGINT, err
  assert "interrupted" in err
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


# Jobs of two processes, for the failure cases: one to fail, one to see it.
PER_PROCESS = 1 if GPUS else 2


def _launcher(mode, cwd, **env):
  """`python -m ficco_jax.launch` running mp_worker in `mode` in two
  processes, as typed on a command line."""
  return subprocess.Popen(
      [sys.executable, "-m", "ficco_jax.launch", "-n", "2",
       f"--devices_per_process={PER_PROCESS}",
       *(["--share_gpu"] if SHARED else []), "--timeout_s=120", WORKER,
       mode],
      env=dict(os.environ, **ENV, **env), cwd=cwd, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def _gone(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


def test_a_killed_process_ends_the_job_within_seconds(tmp_path):
  """SIGKILL to process 1 while every process runs copy-engine ops (the
  window transport): the launcher ends the job within seconds, long
  before the ops' 60 s timeout, exits 128 + SIGKILL naming process 1 and
  its last lines, and leaves no process behind."""
  launcher = _launcher("loop", tmp_path, FICCO_TEST_PID_DIR=str(tmp_path))
  deadline = time.monotonic() + 60
  while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  pids = {int(f): int((tmp_path / f).read_text()) for f in os.listdir(tmp_path)}
  assert len(pids) == 2, pids
  time.sleep(0.5)  # Mid-run: both are in their loops of calls.
  os.kill(pids[1], signal.SIGKILL)
  killed = time.monotonic()
  _, err = launcher.communicate(timeout=60)
  took = time.monotonic() - killed
  print(f"kill -> job end: {took:.2f} s")
  assert launcher.returncode == 128 + signal.SIGKILL, err
  assert took < 3, (took, err)
  assert "process 1 was killed by signal 9 (SIGKILL)" in err, err
  assert "Its last lines:\n  loop: process 1 running" in err, err
  assert all(_gone(pid) for pid in pids.values())
  # Window names are unlinked once mapped, so none is left either.
  assert not [p for pid in pids.values()
              for p in glob.glob(f"/dev/shm/ficco.*.{pid}.*")]


@pytest.mark.parametrize("schedule", ["window", "signalled"])
def test_a_stalled_process_fails_its_peers_ops_by_their_timeout(
    tmp_path, schedule):
  """Process 1 sleeps for good before a call: process 0's op raises its
  timeout error within timeout_s (3 s) and slack, naming the op, its rank
  and the ranks that never signalled; the launcher then ends the job with
  process 0's code and error. Also for the signalled all-gather, whose
  kernel waits on landing flags that the stalled peer's pieces never set
  (the watchdog's release must end that wait too)."""
  flag = tmp_path / "stalled"
  launcher = _launcher("hang", tmp_path, FICCO_TEST_STALL_FILE=str(flag),
                       FICCO_TEST_SCHEDULE=schedule)
  out, err = launcher.communicate(timeout=120)
  ended = time.time()
  stalled_at, stalled_pid = flag.read_text().split()
  took = ended - float(stalled_at)
  print(f"stall -> job end: {took:.2f} s")
  assert launcher.returncode == 1, err
  assert took < 3 + 7, (took, err)
  assert "process 0 exited with code 1" in err, err
  # Process 1 holds ranks [PER_PROCESS, 2 * PER_PROCESS).
  missing = ", ".join(rf"rank {r} \(device \d+\)"
                      for r in range(PER_PROCESS, 2 * PER_PROCESS))
  if GPUS:  # The CUDA watchdog reports it on the process's output.
    assert re.search(f"never signalled: {missing}", out + err), out + err
  else:  # The error that ended process 0, in its last lines.
    assert re.search(
        r"DEADLINE_EXCEEDED: ficco window \w+ of 'all_gather_matmul' .*"
        rf"\(rank \d of {2 * PER_PROCESS}\).*never signalled: {missing}",
        err), err
  assert _gone(int(stalled_pid))


@pytest.mark.parametrize("schedule", ["window", "flagged"])
def test_two_programs_alternate_across_processes(schedule):
  # mp_worker checks every result of 100 all-gather and 100 reduce-scatter
  # matmuls (window transport; or the signalled all-gather and the pushing
  # reduce-scatter), called in turn on changing inputs.
  assert _launch("alternate", env=dict(FICCO_TEST_CALLS="200",
                                       FICCO_TEST_SCHEDULE=schedule),
                 timeout_s=180) == 0


@pytest.mark.skipif(not GPUS, reason="XLA:CPU may run a program's"
                    " independent calls in different orders in different"
                    " processes (docs/protocol.md, \"Several runs of one"
                    " site\")")
def test_one_site_run_several_times_at_once_across_processes(capfd):
  # mp_worker checks every result of 20 rounds of a jitted layer called 4
  # times in one program and of its recomputation under jax.checkpoint.
  assert _launch("twice", timeout_s=240) == 0
  assert "twice: 20 rounds checked" in capfd.readouterr().out


@pytest.mark.parametrize("schedule", ["window", "push", "same"])
@pytest.mark.parametrize("per_process",
                         sorted({1, LAYOUT["devices_per_process"]}))
def test_two_threads_per_process_end_right_or_with_a_clear_error(
    capfd, schedule, per_process):
  # mp_worker counts each call of two threads per process as right or as
  # failed with an error that says what to do, exits 0 only if none is
  # anything else and both programs work from one thread afterwards; a hang
  # shows as the launcher's timeout. The push programs share a pooled
  # window, whose ranks could pair the two programs at one epoch. With one
  # device per process (every GPU layout) XLA runs each program on the
  # thread that dispatched it, so the two programs' handlers run at once on
  # one device: without Window::issue a queue got epoch e + 1's flags
  # before epoch e's pieces, and a reduce-scatter summed a half not yet
  # landed, in about 1 of 20 jobs of one round; 5 rounds per job here.
  # "same": one window program from both threads, whose executions are in
  # flight at once on one device; a start used to drop the other's pending
  # entries as an aborted execution's, and its wait failed as a misuse
  # without draining its copies.
  t0 = time.monotonic()
  layout = dict(LAYOUT, devices_per_process=per_process)
  assert launch.launch(
      [WORKER, "threads"], env=dict(ENV, FICCO_TEST_CALLS="60",
                                    FICCO_TEST_SCHEDULE=schedule,
                                    FICCO_TEST_ROUNDS="5"),
      timeout_s=300, **layout) == 0
  out = capfd.readouterr().out
  assert "right from one thread afterwards" in out, out[-4000:]
  print(f"two threads per process ({schedule}, {per_process} device(s)):"
        f" {time.monotonic() - t0:.1f} s;",
        re.findall(r"issue waits: \d+", out))


def test_two_programs_paired_at_one_epoch_fail_naming_the_cause(capfd):
  # Each process runs its own program on the pooled push window (same op
  # and data, another name): without the identity check (push_ident.h) the
  # ranks would pair them silently; mp_worker exits 0 only if every process
  # fails saying so.
  assert _launch("mismatch", timeout_s=120) == 0
  assert "ran another op at this epoch" in capfd.readouterr().out


def test_recovering_from_failures_across_processes_frees_windows(capfd):
  """A failure, clear_caches and lowering again, four times: every process
  is right again each time, and the failed families' windows are freed."""
  assert _launch("recover", timeout_s=240) == 0, capfd.readouterr().out
  out = capfd.readouterr().out
  assert out.count("recover: windows") == LAYOUT["num_processes"], out


def test_a_process_that_lowers_again_alone_pairs_once_the_others_do(capfd):
  # mp_worker exits 0 only if process 1's two lone lowerings time out and
  # the job, lowered again by both, is right.
  assert _launch("alone", timeout_s=240) == 0, capfd.readouterr().out
  out = capfd.readouterr().out
  assert out.count("lowering alone") == 2, out
  assert out.count("paired and right") == LAYOUT["num_processes"], out


def test_processes_lowering_different_shapes_fail_naming_it(capfd):
  # Their slots differ: pairing the windows would let copies overrun.
  assert _launch("shapes", timeout_s=240) == 0, capfd.readouterr().out
  out = capfd.readouterr().out
  assert out.count("made a window for start 0 of program") == LAYOUT[
      "num_processes"], out
  assert out.count("paired and right with the same shapes") == LAYOUT[
      "num_processes"], out


def test_a_process_whose_exchange_fails_late_pairs_on_its_retry(capfd):
  # Process 0 mapped process 1's windows just before process 1 gave up:
  # it maps process 1's next ones instead of waiting out its 20 s timeout.
  assert _launch("late", timeout_s=240) == 0, capfd.readouterr().out
  out = capfd.readouterr().out
  assert "process 0 paired after 0 failed" in out, out
  assert "process 1 paired after 1 failed" in out, out


def test_launch_checks_its_arguments():
  with pytest.raises(ValueError, match="num_processes=0 must be >= 1"):
    launch.launch([WORKER, "ops"], 0, gpus=0)
  with pytest.raises(ValueError, match="need more than the 2 GPUs"):
    launch.launch([WORKER, "ops"], 2, devices_per_process=2, gpus=2)
  with pytest.raises(ValueError, match="share_gpu=True needs a GPU"):
    launch.launch([WORKER, "ops"], 2, gpus=0, share_gpu=True)
  with pytest.raises(ValueError, match=r"\(shared\) need more than the 1 GPUs"):
    launch.launch([WORKER, "ops"], 2, devices_per_process=2, gpus=1,
                  share_gpu=True)
