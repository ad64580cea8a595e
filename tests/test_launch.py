"""The launcher as a supervisor: output, GPU slices, signals, leftovers.

No JAX in the launched scripts: each case is about the process tree and its
pipes, so they run in a second on any host.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from ficco_jax._src import launch as launch_lib


def _cli(*args, **kw):
  return subprocess.Popen([sys.executable, "-m", "ficco_jax.launch", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          **kw)


def _script(tmp_path, name, body):
  path = tmp_path / name
  path.write_text(body)
  return str(path)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie is gone for our purposes (its parent has not reaped it yet).
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return True


def _within(seconds: float, done) -> None:
  """Polls ``done()`` until it holds or ``seconds`` pass."""
  deadline = time.monotonic() + seconds
  while not done() and time.monotonic() < deadline:
    time.sleep(0.05)


def test_output_is_forwarded_whatever_the_bytes_and_stderr_stays_apart(
    tmp_path):
  """A byte that is not UTF-8 once stopped the forwarding and the job hung
  on a full pipe; every child's stderr went to the launcher's stdout."""
  script = _script(tmp_path, "out.py", (
      "import os, sys\n"
      "sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush()\n"
      "for i in range(20000): print('line', i)\n"
      "print('to stderr', file=sys.stderr)\n"
      "sys.stdout.write('no newline'); sys.stdout.flush()\n"))
  p = _cli("-n", "2", "--timeout_s=60", script)
  out, err = p.communicate(timeout=60)
  assert p.returncode == 0, err
  out, err = out.decode(), err.decode()
  assert out.count("line 19999") == 2 and "caf\ufffd" in out
  assert "[0] no newline\n" in out and "[1] no newline\n" in out
  assert "to stderr" not in out and err.count("to stderr") == 2


def test_a_reader_that_goes_away_does_not_hang_the_job(tmp_path):
  script = _script(tmp_path, "chatty.py",
                   "for i in range(200000): print('x' * 60, i)\n")
  start = time.monotonic()
  p = subprocess.run(
      f"{sys.executable} -m ficco_jax.launch -n 2 --timeout_s=60"
      f" {script} | head -2", shell=True, capture_output=True, text=True,
      timeout=90)
  assert time.monotonic() - start < 30, p.stderr
  assert len(p.stdout.splitlines()) == 2


def test_gpus_are_sliced_from_the_visible_ones(tmp_path, monkeypatch):
  """A shared host's allotment (CUDA_VISIBLE_DEVICES) is what is split,
  not the host's first GPUs."""
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(launch_lib, "count_gpus", lambda: 8)
  out = tmp_path / "cvd"
  out.mkdir()
  script = _script(tmp_path, "cvd.py", (
      "import os\n"
      f"open(os.path.join({str(out)!r}, os.environ['FICCO_PROCESS_ID']),"
      " 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n"))
  assert launch_lib.launch([script], 2, timeout_s=60) == 0
  assert {f: (out / f).read_text() for f in os.listdir(out)} == {
      "0": "4,5", "1": "6,7"}


def test_cpu_platforms_ignore_an_inherited_gpu_list(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert launch_lib._platforms_without_gpu()  # pylint: disable=protected-access
  assert launch_lib._on_cpu()  # pylint: disable=protected-access


@pytest.mark.parametrize("how", [signal.SIGHUP, signal.SIGKILL])
def test_a_launcher_that_dies_leaves_no_worker(tmp_path, how):
  """A closed terminal (SIGHUP) or a killed launcher (SIGKILL, which it
  cannot handle: the workers get the kernel's parent-death signal)."""
  pids = tmp_path / "pids"
  pids.mkdir()
  script = _script(tmp_path, "sleeper.py", (
      "import os, time\n"
      f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
      "time.sleep(120)\n"))
  p = _cli("-n", "2", "--timeout_s=100", script)
  _within(30, lambda: len(os.listdir(pids)) >= 2)
  workers = [int(f) for f in os.listdir(pids)]
  assert len(workers) == 2
  p.send_signal(how)
  p.communicate(timeout=30)
  _within(10, lambda: not any(map(_alive, workers)))
  assert not any(map(_alive, workers)), workers


def test_what_a_finished_worker_left_running_is_stopped(tmp_path):
  script = _script(tmp_path, "bg.py", (
      "import subprocess, sys\n"
      "p = subprocess.Popen(['sleep', '60'])\n"
      "print(p.pid, flush=True)\n"))
  start = time.monotonic()
  p = _cli("-n", "2", "--timeout_s=60", script)
  out, err = p.communicate(timeout=60)
  assert p.returncode == 0, err
  assert time.monotonic() - start < 20
  left = [int(line.split()[-1]) for line in out.decode().splitlines()]
  assert len(left) == 2
  _within(10, lambda: not any(map(_alive, left)))
  assert not any(map(_alive, left)), left


@pytest.mark.parametrize("args, says", [
    (["-n", "0"], "num_processes=0 must be >= 1"),
    (["-n", "1", "--timeout_s=nan"], "timeout_s=nan must be a positive"),
    (["-n", "1", "--timeout_s=-1"], "timeout_s=-1.0 must be a positive"),
])
def test_bad_arguments_are_usage_errors(args, says):
  p = _cli(*args, "script.py")
  _, err = p.communicate(timeout=60)
  assert p.returncode == 2 and says in err.decode(), err
  assert "Traceback" not in err.decode()
